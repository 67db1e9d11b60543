"""B* search over the feasible set: enumeration, exact search, CRN racing against the exact chain."""

import math

import numpy as np
import pytest

from scheduler_model import approx, dtmc, search
from scheduler_model.errors import InfeasibleThresholdsError
from scheduler_model.system import System


def two(N=4, **kw):
    base = dict(models=("slm", "llm"), concurrency=N, latency=[{1: 0.006}, {1: 0.027, 2: 0.028}],
                P=[[0.65, 0.35], [1.0, 0.0]], C=[[1, 0], [1, 0]])
    base.update(kw)
    return System(**base)


def three(N=4, **kw):
    base = dict(models=("a", "b", "c"), concurrency=N, latency=[{1: 0.004}, {1: 0.012, 8: 0.016}, {1: 0.008}],
                P=[[0.6, 0.3, 0.1], [0.5, 0.5, 0.0], [0.2, 0.2, 0.6]], C=np.ones((3, 3)), quantum_s=1e-3)
    base.update(kw)
    return System(**base)


@pytest.mark.parametrize("N", [1, 2, 5, 9])
def test_feasible_set_sizes(N):
    # number of x >= 0 with sum(x) <= N - 1 over M coordinates: C(N - 1 + M, M)
    Bs2 = list(search.feasible_thresholds(two(N)))
    assert len(Bs2) == math.comb(N + 1, 2)
    Bs3 = list(search.feasible_thresholds(three(N)))
    assert len(Bs3) == math.comb(N + 2, 3)
    for B in Bs3:
        assert np.sum(B - 1) < N and B.min() >= 1
    fixed = list(search.feasible_thresholds(two(N, fixed_thresholds={"slm": 1})))
    assert [int(B[1]) for B in fixed] == list(range(1, N + 1))


def test_fixed_thresholds_infeasible():
    with pytest.raises(InfeasibleThresholdsError):
        list(search.feasible_thresholds(two(3, fixed_thresholds={"slm": 4})))


def test_exact_search_is_argmax_and_respects_fixed():
    s = two(5, fixed_thresholds={"slm": 1})
    res = search.find_B_star(s, method="exact")
    assert res.method == "exact-dtmc"
    assert all(row["B"]["slm"] == 1 for row in res.table)
    values = {row["B"]["llm"]: row["throughput_tokens_per_s"] for row in res.table}
    assert len(values) == 5
    assert res.throughput_tokens_per_s == max(values.values())
    assert values[res.B_star["llm"]] == res.throughput_tokens_per_s
    assert res.states == dtmc.throughput(s, res.B_star).states


def test_auto_uses_exact_for_small_N():
    res = search.find_B_star(three(3), method="auto")
    assert res.method == "exact-dtmc"
    assert len(res.table) == math.comb(5, 3)


def test_auto_switches_to_racing_when_chain_too_large():
    res = search.find_B_star(two(12, fixed_thresholds={"slm": 1}), method="auto", max_states=20)
    assert res.method == "crn-racing"
    assert any("switched" in n for n in res.notes)


def test_crn_identical_candidates_identical_estimates():
    # common random numbers: the same B simulated twice sees exactly the same routing
    s = three(6)
    sim = approx.CRNSimulator(s, np.array([[1, 2, 2], [1, 2, 2], [2, 1, 1]]), seed=5)
    sim.run(300)
    sim.mark()
    sim.run(2000)
    T = sim.throughput()
    assert T[0] == T[1]
    assert T[0] != T[2]


@pytest.mark.slow
@pytest.mark.parametrize("system", [two(6, P=[[0.8, 0.2], [0.3, 0.7]], C=[[1, 1], [1, 0]]), three(5)],
                         ids=["M2-N6", "M3-N5"])
def test_crn_simulator_matches_exact(system):
    Bs = list(search.feasible_thresholds(system))[:6]
    sim = approx.CRNSimulator(system, np.array(Bs), seed=0)
    sim.run(500)
    sim.mark()
    sim.run(25_000)
    T = sim.throughput()
    for B, t in zip(Bs, T):
        exact = dtmc.throughput(system, B, on_periodic="ignore").throughput_tokens_per_s
        assert abs(t - exact) / exact < 0.02


@pytest.mark.slow
@pytest.mark.parametrize("system", [two(8, P=[[0.8, 0.2], [0.3, 0.7]], C=[[1, 1], [1, 0]]), three(6)],
                         ids=["M2-N8", "M3-N6"])
def test_racing_finds_near_optimal_B(system):
    ex = search.find_B_star(system, method="exact")
    race = search.find_B_star(system, method="crn-racing", seed=0)
    T_race_exact = dtmc.throughput(system, race.B_star, on_periodic="ignore").throughput_tokens_per_s
    loss = 1 - T_race_exact / ex.throughput_tokens_per_s
    assert 0 <= loss < 0.01 + 1e-12
    assert len(race.table) == len(ex.table)


@pytest.mark.slow
def test_crn_simulator_with_a_wait_bound_matches_the_exact_chain():
    """The CRN simulator's timer rule is the chain's (dtmc ``w_i``): the same T with the wait
    bound, where the bound moves T well away from the unbounded value."""
    s = two(6, P=[[0.85, 0.15], [0.6, 0.4]], C=[[1, 1], [1, 0]])
    Bs = np.array([[1, 4], [3, 1], [1, 6]])
    wait = [0.003, 0.010]
    sim = approx.CRNSimulator(s, Bs, seed=0, max_wait_s=wait)
    sim.run(500)
    sim.mark()
    sim.run(30_000)
    for B, t in zip(Bs, sim.throughput()):
        bounded = dtmc.throughput(s, B, on_periodic="ignore", max_wait_s=wait).throughput_tokens_per_s
        free = dtmc.throughput(s, B, on_periodic="ignore").throughput_tokens_per_s
        assert abs(t - bounded) / bounded < 0.02, (B, t, bounded)
        assert abs(free - bounded) / bounded > 0.05, (B, free, bounded)


@pytest.mark.slow
def test_search_with_a_wait_bound_ranks_long_waits_as_serving_does():
    """Without the bound a large B_llm is predicted to wait for B_llm requests however long that
    takes; with it, B_llm = N waits at most the bound, and both methods say so."""
    s = two(6, P=[[0.9, 0.1], [0.7, 0.3]], C=[[1, 1], [1, 0]], fixed_thresholds={"slm": 1})
    wait = [None, 0.02]
    free = search.find_B_star(s, method="exact", min_gain=0)
    bounded = search.find_B_star(s, method="exact", min_gain=0, max_wait_s=wait)
    raced = search.find_B_star(s, method="crn-racing", min_gain=0, max_wait_s=wait, seed=0)
    t = {tuple(r["B"].values()): r["throughput_tokens_per_s"] for r in free.table}
    tb = {tuple(r["B"].values()): r["throughput_tokens_per_s"] for r in bounded.table}
    assert tb[(1, 6)] > 1.1 * t[(1, 6)], (tb, t)
    assert any("wait bound modelled" in n for n in bounded.notes)
    T_raced = dtmc.throughput(s, raced.B_star, max_wait_s=wait).throughput_tokens_per_s
    assert 1 - T_raced / bounded.throughput_tokens_per_s < 0.01
