"""Exact DTMC of delayed batching: closed forms, feasibility, chain pathologies, solver."""


import numpy as np
import pytest

from scheduler_model import dtmc
from scheduler_model.errors import (
    DeadlockError,
    InfeasibleThresholdsError,
    PeriodicChainError,
    ReducibleChainError,
    StateSpaceTooLargeError,
)
from scheduler_model.system import System


def r2r(N=4, **kw):
    base = dict(models=("slm", "llm"), concurrency=N, latency=[{1: 0.006}, {1: 0.027, 2: 0.028}],
                P=[[0.65, 0.35], [1.0, 0.0]], C=[[1, 0], [1, 0]])
    base.update(kw)
    return System(**base)


def test_single_model_closed_form():
    # M = 1: every step carries all N requests: T = N c / L(N)
    for N in (1, 3, 5):
        s = System(models=("m",), concurrency=N, latency=[{1: 0.01, 5: 0.014}], P=[[1.0]], C=[[2.0]])
        L = s.latency_s(0, N)
        for B in range(1, N + 1):
            r = dtmc.throughput(s, (B,))
            assert r.throughput_tokens_per_s == pytest.approx(N * 2.0 / L, rel=1e-9)
            assert r.states == 1


@pytest.mark.parametrize("P", [[[0.9, 0.1], [0.4, 0.6]], [[0.5, 0.5], [1.0, 0.0]]])
def test_single_request_renewal_reward(P):
    # N = 1: the request's location is a Markov chain with stationary v (v P = v);
    # T = sum_i v_i sum_j p_ij c_ij / sum_i v_i L_i(1)
    P = np.asarray(P)
    C = np.array([[1.0, 0.5], [2.0, 1.0]])
    s = System(models=("a", "b"), concurrency=1, latency=[{1: 0.004}, {1: 0.010}], P=P, C=C)
    w, V = np.linalg.eig(P.T)
    v = np.real(V[:, np.argmin(np.abs(w - 1))])
    v /= v.sum()
    expected = v @ (P * C).sum(axis=1) / (v @ np.array([0.004, 0.010]))
    assert dtmc.throughput(s, (1, 1)).throughput_tokens_per_s == pytest.approx(expected, rel=1e-9)


def test_single_request_three_models():
    P = np.array([[0.7, 0.2, 0.1], [0.5, 0.5, 0.0], [0.3, 0.3, 0.4]])
    C = np.array([[1, 0, 0], [1, 1, 0], [2, 1, 1]], dtype=float)
    L = np.array([0.003, 0.02, 0.009])
    s = System(models=("a", "b", "c"), concurrency=1, latency=[{1: x} for x in L], P=P, C=C)
    w, V = np.linalg.eig(P.T)
    v = np.real(V[:, np.argmin(np.abs(w - 1))])
    v /= v.sum()
    expected = v @ (P * C).sum(axis=1) / (v @ L)
    assert dtmc.throughput(s, (1, 1, 1)).throughput_tokens_per_s == pytest.approx(expected, rel=1e-9)


def test_deterministic_alternation_is_periodic_and_exact():
    # N requests move together 0 -> 1 -> 0: T = N (c01 + c10) / (L0(N) + L1(N)); chain period 2
    s = System(models=("a", "b"), concurrency=2, latency=[{1: 0.005, 2: 0.006}, {1: 0.02, 2: 0.025}],
               P=[[0, 1], [1, 0]], C=[[0, 1], [3, 0]])
    with pytest.warns(dtmc.PeriodicChainWarning):
        r = dtmc.throughput(s, (1, 1))
    assert r.period == 2
    assert r.throughput_tokens_per_s == pytest.approx(2 * (1 + 3) / (0.006 + 0.025), rel=1e-9)
    with pytest.raises(PeriodicChainError):
        dtmc.throughput(s, (1, 1), on_periodic="error")


def test_feasibility_condition():
    s = r2r(N=4)
    assert dtmc.check_feasible(s, (1, 4)).tolist() == [1, 4]
    assert dtmc.check_feasible(s, (2, 3)).tolist() == [2, 3]   # sum(B-1) = 3 < 4
    for bad in [(2, 4), (3, 3), (5, 1), (0, 1), (1, 5)]:
        with pytest.raises(InfeasibleThresholdsError):
            dtmc.throughput(s, bad)
    with pytest.raises(InfeasibleThresholdsError):
        dtmc.throughput(s, {"slm": 2, "llm": 4})


def test_max_batch_bounds_thresholds():
    s = r2r(N=4, max_batch=(4, 2))
    with pytest.raises(InfeasibleThresholdsError):
        dtmc.check_feasible(s, (1, 3))
    r = dtmc.throughput(s, (1, 2), keep_pi=True)
    ch = dtmc.build_chain(s, (1, 2))
    assert ch.states[:, 3].max() <= 2  # b_llm never above its cap


def test_deadlock_detected_when_feasibility_skipped():
    # sum(B-1) = 2 >= N = 2: the split 1/1 deadlocks
    s = System(models=("a", "b"), concurrency=2, latency=[{1: 0.005}, {1: 0.01}],
               P=[[0.5, 0.5], [0.5, 0.5]], C=[[1, 1], [1, 1]])
    with pytest.raises(InfeasibleThresholdsError):
        dtmc.build_chain(s, (2, 2))
    with pytest.raises(DeadlockError):
        dtmc.build_chain(s, (2, 2), check=False)


def test_reducible_chain_rejected():
    # requests leave model a for good to b or c: several closed classes
    s = System(models=("a", "b", "c"), concurrency=2, latency=[{1: 0.005}, {1: 0.01}, {1: 0.01}],
               P=[[0, 0.5, 0.5], [0, 1, 0], [0, 0, 1]], C=np.ones((3, 3)))
    with pytest.raises(ReducibleChainError):
        dtmc.throughput(s, (1, 1, 1))


def test_transient_start_is_fine():
    # all requests start at a; a is left for good, single closed class at b
    s = System(models=("a", "b"), concurrency=3, latency=[{1: 0.005}, {1: 0.01}],
               P=[[0.5, 0.5], [0, 1]], C=[[1, 1], [0, 2]])
    r = dtmc.throughput(s, (1, 1))
    assert r.recurrent_states < r.states
    assert r.throughput_tokens_per_s == pytest.approx(3 * 2 / 0.01, rel=1e-9)


def test_stationary_matches_dense_solution():
    s = r2r(N=6, P=[[0.8, 0.2], [0.3, 0.7]], C=[[1, 1], [1, 1]])
    ch = dtmc.build_chain(s, (1, 2))
    P = ch.P.toarray()
    np.testing.assert_allclose(P.sum(axis=1), 1.0, atol=1e-12)
    r = dtmc.solve(ch, keep_pi=True)
    Q = P[np.ix_(r.recurrent_index, r.recurrent_index)]
    w, V = np.linalg.eig(Q.T)
    v = np.real(V[:, np.argmin(np.abs(w - 1))])
    v /= v.sum()
    np.testing.assert_allclose(r.pi, v, atol=1e-10)
    T = v @ ch.reward[r.recurrent_index] / (v @ ch.sojourn[r.recurrent_index] * ch.quantum_s)
    assert r.throughput_tokens_per_s == pytest.approx(T, rel=1e-10)


def test_iterative_solver_path_agrees_with_direct():
    # > 2000 states uses the iterative cascade (BiCGSTAB, lazy power, ILU-GMRES); compare with a direct LU
    import scipy.sparse as sp
    import scipy.sparse.linalg as spla

    s = r2r(N=20, P=[[0.8, 0.2], [0.3, 0.7]], C=[[1, 1], [1, 1]])
    ch = dtmc.build_chain(s, (1, 1))
    rec = dtmc.recurrent_class(ch.P)
    Q = ch.P[rec][:, rec].tocsr()
    assert Q.shape[0] > 2000
    pi = dtmc.stationary_distribution(Q)
    n = Q.shape[0]
    A = sp.vstack([sp.csr_matrix(np.ones((1, n))), (Q.T - sp.identity(n)).tocsr()[1:]]).tocsc()
    rhs = np.zeros(n)
    rhs[0] = 1
    direct = spla.spsolve(A, rhs)
    np.testing.assert_allclose(pi, direct, atol=1e-10)


def test_quantum_rescaling_is_exact():
    # latencies are exact multiples of both quanta: identical chains after gcd reduction
    a = dtmc.throughput(r2r(N=4, quantum_s=1e-4), (1, 2))
    b = dtmc.throughput(r2r(N=4, quantum_s=1e-3), (1, 2))
    assert a.states == b.states
    assert a.throughput_tokens_per_s == pytest.approx(b.throughput_tokens_per_s, rel=1e-12)
    assert a.discretisation_error < 1e-9


def test_latency_table_lookup():
    s = System(models=("m",), concurrency=16, latency=[{1: 0.01, 3: 0.03, 8: 0.05}], P=[[1.0]], C=[[1.0]])
    assert s.latency_s(0, 1) == 0.01
    assert s.latency_s(0, 2) == pytest.approx(0.02)      # linear between keys
    assert s.latency_s(0, 8) == 0.05
    # beyond the table: grows at max(last segment's slope 0.004, mean slope 0.04/7) per row, never flat
    assert s.latency_s(0, 12) == pytest.approx(0.05 + 4 * 0.04 / 7)
    flat = System(models=("m",), concurrency=16, latency=[{1: 0.01, 2: 0.01}], P=[[1.0]], C=[[1.0]])
    assert flat.latency_s(0, 12) == pytest.approx(0.01 + 10 * 0.01 * 0.01)   # floor: 1 % of L per row
    const = System(models=("m",), concurrency=16, latency=[{1: 0.01}], P=[[1.0]], C=[[1.0]])
    assert const.latency_s(0, 12) == 0.01                # one key = a constant L, as a number


def test_state_limit():
    with pytest.raises(StateSpaceTooLargeError):
        dtmc.build_chain(r2r(N=12), (1, 1), max_states=50)


def test_state_invariants():
    s = System(models=("a", "b", "c"), concurrency=5, latency=[{1: 0.004}, {1: 0.012, 5: 0.015}, {1: 0.008}],
               P=[[0.6, 0.3, 0.1], [0.5, 0.5, 0.0], [0.2, 0.2, 0.6]], C=np.ones((3, 3)))
    B = np.array([1, 2, 2])
    ch = dtmc.build_chain(s, B)
    k, b, r, w = ch.states[:, :3], ch.states[:, 3:6], ch.states[:, 6:9], ch.states[:, 9:]
    assert np.all(w == 0)                                       # no wait bound: no timer
    assert np.all(k.sum(axis=1) + b.sum(axis=1) == 5)          # closed population
    assert np.all((b == 0) == (r == 0))                         # idle <=> no remaining time
    assert np.all(~((b == 0) & (k >= B)))                       # idle models are below threshold
    assert np.all((b > 0).any(axis=1))                          # no deadlock
    np.testing.assert_allclose(np.asarray(ch.P.sum(axis=1)).ravel(), 1.0, atol=1e-12)


# ---------------------------------------------------------------------------- wait bound
def _wait_system(N=4):
    return System(models=("slm", "llm"), concurrency=N, latency=[{1: 0.010, 4: 0.013}, {1: 0.030, 4: 0.036}],
                  P=[[0.8, 0.2], [0.7, 0.3]], C=[[1, 0], [1, 0.5]], quantum_s=0.001)


def test_wait_bound_none_or_unused_is_the_papers_chain():
    """No bound, or a bound on a model with B_i = 1 (it starts at once anyway): the same chain."""
    s = _wait_system()
    plain = dtmc.throughput(s, (1, 3))
    unused = dtmc.throughput(s, (1, 3), max_wait_s=[0.005, None])
    assert unused.states == plain.states
    assert unused.throughput_tokens_per_s == pytest.approx(plain.throughput_tokens_per_s, rel=1e-12)


def test_wait_bound_zero_is_eager_and_a_long_one_is_no_bound():
    s = _wait_system()
    eager = dtmc.throughput(s, (1, 1)).throughput_tokens_per_s
    assert dtmc.throughput(s, (2, 3), max_wait_s=[0.0, 0.0]).throughput_tokens_per_s == pytest.approx(eager, rel=1e-9)
    plain = dtmc.throughput(s, (1, 3)).throughput_tokens_per_s
    # a bound longer than any wait the chain can reach changes nothing
    long = dtmc.throughput(s, (1, 3), max_wait_s=[None, 10.0]).throughput_tokens_per_s
    assert long == pytest.approx(plain, rel=1e-9)


def test_wait_bound_state_invariants():
    s = _wait_system()
    ch = dtmc.build_chain(s, (1, 3), max_wait_s=[None, 0.025])
    W = ch.wait_quanta
    assert W.tolist() == [-1, 25]
    k, b, r, w = (ch.states[:, i * 2:(i + 1) * 2] for i in range(4))
    assert np.all(w[:, 0] == 0) and np.all(w[:, 1] <= 25)
    assert np.all(w[k == 0] == 0)                                # no queue, no age
    assert np.all(~((b[:, 1] == 0) & (k[:, 1] > 0) & (w[:, 1] >= 25)))  # an expired idle queue starts
    assert np.all(~((b == 0) & (k >= np.array([1, 3]))))
    np.testing.assert_allclose(np.asarray(ch.P.sum(axis=1)).ravel(), 1.0, atol=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("wait_s", [0.004, 0.025])
def test_wait_bound_chain_matches_the_simulator(wait_s):
    """The exact chain with a wait bound against the discrete-event simulator with the same bound
    (geometric routing, the chain's assumptions): equal within the simulator's error, and the
    bound moves T away from the unbounded chain's value (so the comparison can fail)."""
    from scheduler_model.simulate import simulate

    s = _wait_system()
    exact = dtmc.throughput(s, (1, 3), max_wait_s=[None, wait_s]).throughput_tokens_per_s
    unbounded = dtmc.throughput(s, (1, 3)).throughput_tokens_per_s
    sim = simulate(s, (1, 3), events=300_000, seed=3, max_wait_s=[None, wait_s])
    assert abs(exact - sim.throughput_tokens_per_s) <= 4 * sim.stderr_tokens_per_s + 1e-3 * exact, (exact, sim)
    assert abs(exact - unbounded) > 8 * sim.stderr_tokens_per_s, (exact, unbounded, sim.stderr_tokens_per_s)


def test_wait_bound_rejects_bad_values():
    s = _wait_system()
    with pytest.raises(InfeasibleThresholdsError):
        dtmc.throughput(s, (1, 3), max_wait_s=[None, -1.0])
    with pytest.raises(InfeasibleThresholdsError):
        dtmc.throughput(s, (1, 3), max_wait_s=[0.01])
