"""Discrete-event simulator against the exact DTMC, and non-geometric run lengths."""


import numpy as np
import pytest

from scheduler_model import dtmc
from scheduler_model.errors import InfeasibleThresholdsError
from scheduler_model.simulate import geometric_run_lengths, simulate
from scheduler_model.system import System

CASES = {
    "r2r-N4": (System(models=("slm", "llm"), concurrency=4, latency=[{1: 0.006}, {1: 0.027, 2: 0.028}],
                      P=[[0.65, 0.35], [1.0, 0.0]], C=[[1, 0], [1, 0]]), (1, 2)),
    "m2-N8-table": (System(models=("a", "b"), concurrency=8, latency=[{1: 0.004, 8: 0.0075}, {1: 0.02, 8: 0.034}],
                           P=[[0.8, 0.2], [0.3, 0.7]], C=[[1, 1], [1, 0]], quantum_s=5e-4), (2, 3)),
    "m2-N7-cap": (System(models=("a", "b"), concurrency=7, latency=[{1: 0.005}, {1: 0.015, 4: 0.018}],
                         P=[[0.9, 0.1], [0.6, 0.4]], C=[[1, 2], [1, 1]], max_batch=(7, 4), quantum_s=1e-3), (1, 3)),
    "m3-N6": (System(models=("a", "b", "c"), concurrency=6, latency=[{1: 0.004}, {1: 0.012, 6: 0.015}, {1: 0.008}],
                     P=[[0.6, 0.3, 0.1], [0.5, 0.5, 0.0], [0.2, 0.2, 0.6]], C=np.ones((3, 3)), quantum_s=1e-3),
              (1, 2, 2)),
    "m3-N8": (System(models=("a", "b", "c"), concurrency=8, latency=[{1: 0.002, 8: 0.004}, {1: 0.01}, {1: 0.006}],
                     P=[[0.7, 0.2, 0.1], [0.4, 0.3, 0.3], [0.5, 0.0, 0.5]],
                     C=[[1, 0, 0], [2, 1, 1], [1, 1, 1]], quantum_s=1e-3), (2, 1, 3)),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_dtmc_within_one_percent_of_simulator(name):
    system, B = CASES[name]
    exact = dtmc.throughput(system, B, on_periodic="ignore").throughput_tokens_per_s
    sim = simulate(system, B, events=200_000, seed=1)
    # the check is meaningful only if the simulation is precise enough
    assert sim.stderr_tokens_per_s / sim.throughput_tokens_per_s < 0.0035
    assert abs(sim.throughput_tokens_per_s - exact) / exact < 0.01


def test_simulator_rejects_infeasible():
    system, _ = CASES["r2r-N4"]
    with pytest.raises(InfeasibleThresholdsError):
        simulate(system, (2, 4), events=10)


def test_geometric_run_lengths_reduce_to_dtmc():
    system, B = CASES["m2-N8-table"]
    rl = [geometric_run_lengths(system.P[i, i]) for i in range(2)]
    exact = dtmc.throughput(system, B).throughput_tokens_per_s
    sim = simulate(system, B, events=60_000, seed=2, run_lengths=rl)
    assert abs(sim.throughput_tokens_per_s - exact) / exact < 0.01


def test_deterministic_run_lengths_closed_form():
    # N = 2 requests start together at a, stay exactly 3 steps, go to b for one step, return:
    # per cycle 2 * (2 c_aa + c_ab + c_ba) tokens in 3 L_a(2) + L_b(2) seconds.
    C = np.array([[1.0, 0.5], [2.0, 0.0]])
    system = System(models=("a", "b"), concurrency=2, latency=[{1: 0.004, 2: 0.005}, {1: 0.02, 2: 0.022}],
                    P=[[2 / 3, 1 / 3], [1.0, 0.0]], C=C, quantum_s=1e-3,
                    run_lengths=[(np.array([3]), np.array([1.0])), None])
    sim = simulate(system, (1, 1), events=3000)
    expected = 2 * (2 * C[0, 0] + C[0, 1] + C[1, 0]) / (3 * 0.005 + 0.022)
    assert sim.throughput_tokens_per_s == pytest.approx(expected, rel=1e-9)
    # the DTMC (geometric run lengths with the same mean) desynchronises the two requests
    geo = dtmc.throughput(system, (1, 1)).throughput_tokens_per_s
    assert abs(geo - expected) / expected > 0.02


def test_simulator_conserves_population_and_batches():
    system, B = CASES["m3-N8"]
    sim = simulate(system, B, events=5000, seed=3)
    assert all(0 < mb <= system.N for mb in sim.mean_batch)
    assert sim.mean_batch[0] >= B[0] and sim.mean_batch[2] >= B[2]


def test_wait_bound_limits_the_delay():
    """The server's delayed_batch_max_wait_us: 0 makes any B behave as B = 1, an endless one changes nothing."""
    system = System(models=("a", "b"), concurrency=4, latency=[{1: 0.004, 4: 0.006}, {1: 0.02, 4: 0.024}],
                    P=[[0.8, 0.2], [0.6, 0.4]], C=[[1, 0], [1, 0]], quantum_s=1e-3)
    eager = simulate(system, (1, 1), events=3000, seed=5)
    zero = simulate(system, (1, 3), events=3000, seed=5, max_wait_s=[None, 0.0])
    assert zero.throughput_tokens_per_s == pytest.approx(eager.throughput_tokens_per_s, rel=1e-12)
    plain = simulate(system, (1, 3), events=3000, seed=5)
    endless = simulate(system, (1, 3), events=3000, seed=5, max_wait_s=[None, 1e6])
    assert endless.throughput_tokens_per_s == pytest.approx(plain.throughput_tokens_per_s, rel=1e-12)
    bounded = simulate(system, (1, 3), events=3000, seed=5, max_wait_s=[None, 0.01])
    assert bounded.mean_batch[1] < plain.mean_batch[1]
