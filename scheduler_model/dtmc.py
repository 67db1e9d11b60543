"""The exact discrete-time Markov chain of delayed batching and its long-run throughput T(B).

Follows the TokenRouter paper, section "DTMC for B*" (design of delayed batching).

State (embedded at batch-completion instants and wait-bound expiries, taken right after the
models that may start a batch have started it)::

    s = (k_0, …, k_{M-1}, b_0, …, b_{M-1}, r_0, …, r_{M-1}, w_0, …, w_{M-1})

k_i = requests queued at model i, b_i = size of its running batch (0 = idle), r_i = quanta left
until that batch completes (0 when idle), w_i = quanta the oldest of the k_i queued requests has
waited, capped at W_i (0 when k_i = 0). Σ_i (k_i + b_i) = N.

The wait bound W_i (quanta; the server's ``delayed_batch_max_wait_us``, optional, not in the
paper's chain): an idle model also starts a batch once its oldest queued request has waited
W_i, whatever k_i. Without a bound (the paper's chain), or with B_i = 1 (a batch starts the
moment a request is queued at an idle model, so the timer never decides), w_i is held at 0.

One transition from s:

1. Δ(s) = min( min_{i: b_i>0} r_i , min_{i: b_i=0, k_i>0, W_i bounded} (W_i − w_i) ) quanta pass
   (the sojourn); A(s) = {i : b_i > 0, r_i = Δ(s)} complete.
2. Every request of a completing batch i moves independently to j with probability p_ij and
   commits c_ij tokens, so the arrivals from i are Multinomial(b_i, p_i·); batches of several
   completing models are convolved. Arrivals join the queues at the end of the sojourn (age 0).
3. Running models keep r_i − Δ(s); w_i += Δ(s) (capped at W_i) where k_i > 0 before the
   arrivals, else w_i = 0. Every idle model with k_i ≥ B_i, or with k_i > 0 and w_i ≥ W_i, starts
   a batch b_i = min(k_i, max_batch_i), k_i −= b_i, r_i = d_i(b_i), and w_i = 0 if its queue is
   empty (else w_i is kept: an upper bound on the age of the oldest request left, when k_i
   exceeded max_batch_i).

This is the rule of :func:`scheduler_model.simulate.simulate` with ``max_wait_s``, whose
geometric-run estimate the exact chain reproduces (tests/test_scheduler_dtmc.py).

Reward and sojourn of a state (tokens and quanta)::

    R(s) = Σ_{i∈A(s)} Σ_j b_i c_ij p_ij          τ(s) = min_{i: b_i>0} r_i

and by the renewal-reward theorem the long-run throughput in tokens/s is (paper's T(B))::

    T(B) = Σ_s π(s) R(s) / (δ · Σ_s π(s) τ(s))

with π the stationary distribution of the embedded chain; a wait-bound expiry with no completion
adds its sojourn and no reward. Feasibility (no deadlock): a state with every model idle needs
k_i ≤ B_i − 1 for all i, impossible iff Σ_i (B_i − 1) < N; with wait bounds only the models
without one count (:func:`check_feasible`).

Chain construction: level-synchronous breadth-first search, vectorised in numpy; states are
encoded as mixed-radix int64 keys. π: strongly connected components
(``scipy.sparse.csgraph.connected_components``); exactly one closed class is required (else
:class:`ReducibleChainError`); on it ``π (I − Q) = 0`` with one balance equation replaced by
``Σ π = 1``, solved by a sparse direct LU (``scipy.sparse.linalg.spsolve``).

Periodicity: the period of the closed class is computed and reported. For an irreducible
finite chain π is unique whatever the period and T(B) above is the exact long-run (Cesàro)
average, so by default a periodic chain gives its correct number *and* a
:class:`PeriodicChainWarning`; ``on_periodic="error"`` raises :class:`PeriodicChainError`.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
import warnings
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import scipy.sparse as sp
import scipy.sparse.linalg as spla
from scipy.sparse.csgraph import connected_components, shortest_path

from .errors import (
    DeadlockError,
    InfeasibleThresholdsError,
    PeriodicChainError,
    ReducibleChainError,
    StateSpaceTooLargeError,
)
from .system import System

DEFAULT_MAX_STATES = 3_000_000


class PeriodicChainWarning(UserWarning):
    """The recurrent class of the chain is periodic (T(B) is still the exact long-run average)."""


# ---------------------------------------------------------------------------- feasibility
def unbounded(system: System, max_wait_s: Optional[Sequence[Optional[float]]]) -> np.ndarray:
    """(M,) bool: the models without a wait bound (all of them when ``max_wait_s`` is None).

    Raises:
        InfeasibleThresholdsError: ``max_wait_s`` has the wrong length.
    """
    if max_wait_s is None:
        return np.ones(system.M, dtype=bool)
    if len(max_wait_s) != system.M:
        raise InfeasibleThresholdsError(f"max_wait_s needs one entry (or None) per model, got {len(max_wait_s)}")
    return np.asarray([w is None for w in max_wait_s], dtype=bool)


def check_feasible(system: System, B: Sequence[int],
                   max_wait_s: Optional[Sequence[Optional[float]]] = None) -> np.ndarray:
    """Validate thresholds B against the paper's feasibility condition Σ_i (B_i − 1) < N.

    With a wait bound (``max_wait_s``, :func:`build_chain`) a bounded model never holds a queue
    forever, so only the models without one count: Σ_{i unbounded} (B_i − 1) < N (a deadlock
    needs all N requests queued below threshold at idle unbounded models).

    Args:
        system: the modelled system.
        B: (M,) ints or {model: B_i}.
        max_wait_s: None, or per model None or its wait bound in seconds.
    Returns:
        (M,) int64 array of B.
    Raises:
        InfeasibleThresholdsError: some B_i < 1, B_i > max_batch_i, or that sum ≥ N.
    """
    Bv = system.thresholds_vector(B)
    if np.any(Bv < 1):
        raise InfeasibleThresholdsError(f"thresholds must be >= 1, got {Bv.tolist()}")
    cap = np.asarray(system.max_batch)
    if np.any(Bv > cap):
        raise InfeasibleThresholdsError(
            f"threshold above max batch size: B={Bv.tolist()}, max_batch={cap.tolist()} "
            "(a model could never start a batch)")
    free = unbounded(system, max_wait_s)
    if int(np.sum((Bv - 1)[free])) >= system.N:
        which = "" if free.all() else " over the models without a wait bound"
        raise InfeasibleThresholdsError(
            f"infeasible thresholds B={Bv.tolist()}: sum(B_i - 1){which} = {int(np.sum((Bv - 1)[free]))} "
            f">= N = {system.N} (the state with every queue just below its threshold deadlocks)")
    return Bv


# ---------------------------------------------------------------------------- multinomials
def _compositions(n: int, parts: int) -> np.ndarray:
    """All (parts,) non-negative int vectors summing to n, as an (count, parts) int64 array."""
    if parts == 1:
        return np.array([[n]], dtype=np.int64)
    rows = []
    for bars in itertools.combinations(range(n + parts - 1), parts - 1):
        prev = -1
        row = []
        for bpos in bars:
            row.append(bpos - prev - 1)
            prev = bpos
        row.append(n + parts - 1 - prev - 1)
        rows.append(row)
    return np.asarray(rows, dtype=np.int64)


@dataclasses.dataclass
class OutcomeTable:
    """Multinomial(b, p_i·) outcomes of a completing batch of model i for b = 0 … cap.

    ``arrivals[start[b]:start[b]+count[b]]`` are (M,) arrival vectors and ``prob`` their
    probabilities; destinations with p_ij = 0 are left out, so every listed outcome has prob > 0.
    """

    arrivals: np.ndarray  # (total, M) int64
    prob: np.ndarray  # (total,) float64
    start: np.ndarray  # (cap+1,) int64
    count: np.ndarray  # (cap+1,) int64


def outcome_table(p_row: np.ndarray, cap: int) -> OutcomeTable:
    """Build the :class:`OutcomeTable` of one row p_i· of P for batch sizes 0 … cap."""
    M = len(p_row)
    dests = np.flatnonzero(p_row > 0)
    logp = np.log(p_row[dests])
    arrs, probs, start, count = [], [], [], []
    pos = 0
    for b in range(cap + 1):
        comp = _compositions(b, len(dests))
        logpr = (math.lgamma(b + 1) - np.sum([[math.lgamma(x + 1) for x in row] for row in comp], axis=1)
                 + comp @ logp)
        pr = np.exp(logpr)
        keep = pr > 0
        comp, pr = comp[keep], pr[keep]
        full = np.zeros((len(comp), M), dtype=np.int64)
        full[:, dests] = comp
        arrs.append(full)
        probs.append(pr / pr.sum())
        start.append(pos)
        count.append(len(comp))
        pos += len(comp)
    return OutcomeTable(np.concatenate(arrs), np.concatenate(probs),
                        np.asarray(start, dtype=np.int64), np.asarray(count, dtype=np.int64))


# ---------------------------------------------------------------------------- the chain
@dataclasses.dataclass
class Chain:
    """The reachable embedded chain for thresholds B.

    Attributes:
        system: the modelled system.
        B: (M,) int64 thresholds.
        states: (n, 4M) int64 rows (k_0…k_{M-1}, b_0…, r_0…, w_0…), r and w in quanta of
            ``quantum_s``.
        P: (n, n) CSR float64 transition matrix (rows sum to 1).
        reward: (n,) float64 R(s), expected tokens committed at the end of the sojourn in s.
        sojourn: (n,) int64 τ(s) in quanta.
        quantum_s: seconds per quantum (after gcd reduction).
        discretisation_error: max relative error of d_i(b)·quantum_s against L_i(b).
        build_seconds: wall time of the construction.
        wait_quanta: (M,) int64 W_i in quanta; −1 where model i has no wait bound (or B_i = 1).
    """

    system: System
    B: np.ndarray
    states: np.ndarray
    P: sp.csr_matrix
    reward: np.ndarray
    sojourn: np.ndarray
    quantum_s: float
    discretisation_error: float
    build_seconds: float
    wait_quanta: Optional[np.ndarray] = None

    @property
    def n_states(self) -> int:
        """Number of reachable states."""
        return int(self.states.shape[0])

    @property
    def n_transitions(self) -> int:
        """Number of non-zero entries of P."""
        return int(self.P.nnz)


def _start_batches(k: np.ndarray, b: np.ndarray, r: np.ndarray, w: np.ndarray, B: np.ndarray,
                   W: np.ndarray, cap: np.ndarray, d: List[np.ndarray]) -> None:
    """In place: every idle model with k_i ≥ B_i, or with a wait bound (W_i ≥ 0), k_i > 0 and
    w_i ≥ W_i, starts a batch of min(k_i, cap_i); w_i = 0 where its queue is left empty."""
    for i in range(k.shape[1]):
        st = (b[:, i] == 0) & (k[:, i] >= B[i])
        if W[i] >= 0:
            st |= (b[:, i] == 0) & (k[:, i] > 0) & (w[:, i] >= W[i])
        if np.any(st):
            nb = np.minimum(k[st, i], cap[i])
            b[st, i] = nb
            k[st, i] -= nb
            r[st, i] = d[i][nb]
            w[st, i] = np.where(k[st, i] > 0, w[st, i], 0)


def _expand(rows: np.ndarray, M: int, B: np.ndarray, W: np.ndarray, cap: np.ndarray, d: List[np.ndarray],
            tables: List[OutcomeTable], ctok: np.ndarray):
    """Successors of a block of states (the transition in the module docstring).

    Returns (src (E,) int64 local row index, nxt (E, 4M) int64, prob (E,), reward (n,), sojourn (n,)).
    Raises DeadlockError if a state has no running batch and no wait bound to expire.
    """
    n = rows.shape[0]
    k, b, r, w = rows[:, :M], rows[:, M:2 * M], rows[:, 2 * M:3 * M], rows[:, 3 * M:]
    running = b > 0
    big = np.iinfo(np.int64).max
    timed = ~running & (k > 0) & (W >= 0)[None, :]
    delta = np.minimum(np.where(running, r, big).min(axis=1),
                       np.where(timed, W[None, :] - w, big).min(axis=1))
    dead = delta == big
    if np.any(dead):
        s = rows[np.flatnonzero(dead)[0]]
        raise DeadlockError(
            f"deadlock: reachable state with every model idle, queues k={s[:M].tolist()} "
            f"below thresholds B={B.tolist()}")
    fin = running & (r == delta[:, None])
    reward = (np.where(fin, b, 0) * ctok[None, :]).sum(axis=1).astype(np.float64)

    idx = np.arange(n, dtype=np.int64)
    arr = np.zeros((n, M), dtype=np.int64)
    prob = np.ones(n, dtype=np.float64)
    for i in range(M):
        t = tables[i]
        bb = np.where(fin[idx, i], b[idx, i], 0)
        cnt = t.count[bb]
        if np.all(cnt == 1):
            off = t.start[bb]
        else:
            rep = np.repeat(np.arange(len(idx)), cnt)
            first = np.cumsum(cnt) - cnt
            off = t.start[bb][rep] + (np.arange(len(rep)) - first[rep])
            idx, arr, prob = idx[rep], arr[rep], prob[rep]
        arr = arr + t.arrivals[off]
        prob = prob * t.prob[off]
    still = running & ~fin
    k2 = k[idx] + arr
    b2 = np.where(still[idx], b[idx], 0)
    r2 = np.where(still[idx], r[idx] - delta[idx, None], 0)
    aged = (k > 0) & (W >= 0)[None, :]
    w2 = np.where(aged, np.minimum(w + delta[:, None], np.maximum(W, 0)[None, :]), 0)[idx]
    _start_batches(k2, b2, r2, w2, B, W, cap, d)
    nxt = np.concatenate([k2, b2, r2, w2], axis=1)
    return idx, nxt, prob, reward, delta


def wait_quanta(system: System, B: Sequence[int], max_wait_s: Optional[Sequence[Optional[float]]],
                quantum_s: float) -> np.ndarray:
    """W_i in quanta, round(max_wait_s_i / quantum_s) as :func:`scheduler_model.simulate.simulate`
    rounds it, or −1 where model i has no bound (None) or B_i = 1 (the timer never decides).

    Args:
        system: the modelled system.
        B: (M,) thresholds.
        max_wait_s: None, or per model None or the wait bound in seconds (≥ 0).
        quantum_s: seconds per quantum of the chain.
    Raises:
        InfeasibleThresholdsError: wrong length or a negative / non-finite bound.
    """
    W = np.full(system.M, -1, dtype=np.int64)
    if max_wait_s is None:
        return W
    if len(max_wait_s) != system.M:
        raise InfeasibleThresholdsError(f"max_wait_s needs one entry (or None) per model, got {len(max_wait_s)}")
    for i, ws in enumerate(max_wait_s):
        if ws is None:
            continue
        if not (math.isfinite(ws) and ws >= 0):
            raise InfeasibleThresholdsError(f"max_wait_s of {system.models[i]!r} must be >= 0 s, got {ws!r}")
        if int(B[i]) > 1:
            W[i] = int(round(ws / quantum_s))
    return W


def build_chain(system: System, B: Sequence[int], *, max_states: int = DEFAULT_MAX_STATES,
                start_model: int = 0, check: bool = True,
                max_wait_s: Optional[Sequence[Optional[float]]] = None) -> Chain:
    """Enumerate the reachable states of the DTMC for thresholds B and its transition matrix.

    The initial state has all N requests queued at ``start_model`` (then the start rule applies);
    π does not depend on it when the chain has a single closed class (checked by :func:`solve`).

    Args:
        system: the modelled system.
        B: thresholds, (M,) ints or {model: B_i}.
        max_states: raise StateSpaceTooLargeError beyond this many reachable states.
        start_model: index of the model holding every request initially.
        check: check feasibility first (``False`` only to exercise deadlock detection).
        max_wait_s: None (the paper's chain), or per model None or the server's wait bound in
            seconds (``delayed_batch_max_wait_us`` / 1e6), rounded to quanta (:func:`wait_quanta`).
            Each bounded model with B_i > 1 multiplies the state space by up to W_i + 1; a
            coarser ``system.quantum_s`` keeps it small.
    Returns:
        :class:`Chain`.
    Raises:
        InfeasibleThresholdsError, DeadlockError, StateSpaceTooLargeError.
    """
    t0 = time.perf_counter()
    Bv = check_feasible(system, B, max_wait_s) if check else system.thresholds_vector(B)
    M, N = system.M, system.N
    q = system.quanta()
    d = q.d
    Wq = wait_quanta(system, Bv, max_wait_s, q.quantum_s)
    cap = np.asarray(system.max_batch, dtype=np.int64)
    ctok = system.expected_tokens_per_request_step()
    tables = [outcome_table(system.P[i], int(cap[i])) for i in range(M)]

    radix = ([N + 1] * M + [int(c) + 1 for c in cap] + [int(di.max()) + 1 for di in d]
             + [max(int(x), 0) + 1 for x in Wq])
    mult = []
    acc = 1
    for rad in radix:
        mult.append(acc)
        acc *= rad
    if acc >= 2 ** 63:
        raise StateSpaceTooLargeError(f"state key needs {acc.bit_length()} bits (> 63); chain too large")
    mult_arr = np.asarray(mult, dtype=np.int64)

    def encode(rows: np.ndarray) -> np.ndarray:
        return rows @ mult_arr

    k0 = np.zeros((1, M), dtype=np.int64)
    k0[0, start_model] = N
    b0 = np.zeros((1, M), dtype=np.int64)
    r0 = np.zeros((1, M), dtype=np.int64)
    w0 = np.zeros((1, M), dtype=np.int64)
    _start_batches(k0, b0, r0, w0, Bv, Wq, cap, d)
    init = np.concatenate([k0, b0, r0, w0], axis=1)

    level_rows = [init]
    known = encode(init)
    frontier = init
    offset = 0
    srcs, dsts, probs, rewards, sojourns = [], [], [], [], []
    total = 1
    while frontier.shape[0]:
        # process large frontiers in blocks to bound memory
        new_parts = []
        for lo in range(0, frontier.shape[0], 200_000):
            blk = frontier[lo:lo + 200_000]
            src, nxt, pr, rew, soj = _expand(blk, M, Bv, Wq, cap, d, tables, ctok)
            keys = encode(nxt)
            srcs.append(src + offset + lo)
            dsts.append(keys)
            probs.append(pr)
            rewards.append(rew)
            sojourns.append(soj)
            uk, first = np.unique(keys, return_index=True)
            pos = np.searchsorted(known, uk)
            pos_c = np.minimum(pos, len(known) - 1)
            is_new = known[pos_c] != uk
            if np.any(is_new):
                new_parts.append((uk[is_new], nxt[first[is_new]]))
                known = np.concatenate([known, uk[is_new]])
                known.sort(kind="mergesort")
        offset += frontier.shape[0]
        if new_parts:
            frontier = np.concatenate([p[1] for p in new_parts])
            total += frontier.shape[0]
            level_rows.append(frontier)
            if total > max_states:
                raise StateSpaceTooLargeError(
                    f"more than max_states={max_states} reachable states (N={N}, M={M}, B={Bv.tolist()})")
        else:
            frontier = frontier[:0]
    states = np.concatenate(level_rows)
    all_keys = encode(states)
    order = np.argsort(all_keys, kind="mergesort")
    sorted_keys = all_keys[order]
    dst_keys = np.concatenate(dsts)
    dst = order[np.searchsorted(sorted_keys, dst_keys)]
    src = np.concatenate(srcs)
    n = states.shape[0]
    Pm = sp.csr_matrix((np.concatenate(probs), (src, dst)), shape=(n, n))
    Pm.sum_duplicates()
    return Chain(system=system, B=Bv, states=states, P=Pm, reward=np.concatenate(rewards),
                 sojourn=np.concatenate(sojourns), quantum_s=q.quantum_s,
                 discretisation_error=q.max_rel_error, build_seconds=time.perf_counter() - t0, wait_quanta=Wq)


# ---------------------------------------------------------------------------- solving
@dataclasses.dataclass
class DTMCResult:
    """T(B) from the exact chain.

    Attributes:
        B: {model: B_i}.
        throughput_tokens_per_s: T(B) in tokens/s.
        states: reachable states; recurrent_states: size of the closed class solved.
        transitions: non-zeros of the transition matrix.
        period: period of the recurrent class (1 = aperiodic).
        mean_cycle_s: Σ π τ · δ, mean time between completion instants (s).
        discretisation_error: relative error of the quantised latencies.
        seconds: wall time (build + solve).
        pi: (recurrent_states,) stationary distribution (only with ``keep_pi``).
    """

    B: Dict[str, int]
    throughput_tokens_per_s: float
    states: int
    recurrent_states: int
    transitions: int
    period: int
    mean_cycle_s: float
    discretisation_error: float
    seconds: float
    pi: Optional[np.ndarray] = None
    recurrent_index: Optional[np.ndarray] = None


def recurrent_class(P: sp.csr_matrix) -> np.ndarray:
    """Indices of the unique closed communicating class of P.

    Raises:
        ReducibleChainError: more than one closed class (T would depend on the start state).
    """
    ncomp, labels = connected_components(P, directed=True, connection="strong")
    coo = P.tocoo()
    cross = (labels[coo.row] != labels[coo.col]) & (coo.data > 0)
    leaves = np.zeros(ncomp, dtype=bool)
    leaves[labels[coo.row[cross]]] = True
    closed = np.flatnonzero(~leaves)
    if len(closed) != 1:
        raise ReducibleChainError(
            f"chain has {len(closed)} closed classes (sizes "
            f"{[int(np.sum(labels == c)) for c in closed[:10]]}); long-run throughput depends on the start")
    return np.flatnonzero(labels == closed[0])


def chain_period(Q: sp.csr_matrix) -> int:
    """Period of an irreducible chain Q: gcd over edges u→v of level(u) + 1 − level(v) (BFS levels)."""
    lvl = shortest_path(Q, method="D", unweighted=True, indices=0)
    lvl = lvl.astype(np.int64)
    coo = Q.tocoo()
    diffs = np.abs(lvl[coo.row] + 1 - lvl[coo.col])
    g = int(np.gcd.reduce(diffs)) if len(diffs) else 1
    return g if g > 0 else 1


def stationary_distribution(Q: sp.csr_matrix, *, tol: float = 1e-10) -> np.ndarray:
    """Stationary π of an irreducible stochastic matrix Q (n × n CSR): π Q = π, Σ π = 1.

    Solves A π = e_0, A = (Q^T − I) with its first row replaced by ones (normalisation).
    Solver cascade, each step accepted only if the relative residual
    ‖Q^T π − π‖_1 / ‖π‖_1 ≤ ``tol`` and π ≥ 0 (up to rounding):

    1. n ≤ 2000: sparse direct LU (SuperLU).
    2. BiCGSTAB on A, no preconditioner (0.4 s at 95 000 states where an incomplete LU took 25 s
       and the direct LU fills in badly).
    3. Power iteration on the lazy chain (Q + I)/2 (aperiodic whatever Q's period), warm-started.
    4. GMRES with an incomplete-LU preconditioner, then the direct LU.

    Raises:
        ArithmeticError: no step reached the tolerance.
    """
    n = Q.shape[0]
    if n == 1:
        return np.ones(1)
    QT = Q.T.tocsr()
    A = (QT - sp.identity(n, format="csr")).tocsr()
    A = sp.vstack([sp.csr_matrix(np.ones((1, n))), A[1:]]).tocsc()
    rhs = np.zeros(n)
    rhs[0] = 1.0

    def residual(x: np.ndarray) -> float:
        if x is None or not np.all(np.isfinite(x)) or x.sum() <= 0:
            return np.inf
        if x.min() < -1e-9 * np.abs(x).max():
            return np.inf
        return float(np.abs(QT @ x - x).sum() / np.abs(x).sum())

    candidates = []
    if n <= 2000:
        x = spla.spsolve(A, rhs, permc_spec="MMD_AT_PLUS_A")
        if residual(x) <= tol:
            return _normalise(x)
        candidates.append(x)
    x, _ = spla.bicgstab(A, rhs, rtol=tol * 1e-2, atol=0.0, maxiter=20_000)
    if residual(x) <= tol:
        return _normalise(x)
    candidates.append(x)
    # lazy power iteration, warm start from the clipped iterate
    y = np.clip(x, 0, None) if np.all(np.isfinite(x)) and x.sum() > 0 else np.full(n, 1.0 / n)
    y = y / y.sum()
    for _ in range(50_000):
        z = 0.5 * (QT @ y + y)
        if np.abs(z - y).sum() < tol * 0.1:
            y = z
            break
        y = z
    if residual(y) <= tol:
        return _normalise(y)
    candidates.append(y)
    try:
        ilu = spla.spilu(A, drop_tol=1e-5, fill_factor=20, permc_spec="MMD_AT_PLUS_A")
        x, _ = spla.gmres(A, rhs, M=spla.LinearOperator(A.shape, ilu.solve), rtol=tol * 1e-2, atol=0.0,
                          restart=60, maxiter=300)
        if residual(x) <= tol:
            return _normalise(x)
    except (RuntimeError, ValueError):
        pass
    x = spla.spsolve(A, rhs, permc_spec="MMD_AT_PLUS_A")
    if residual(x) <= tol:
        return _normalise(x)
    raise ArithmeticError(f"stationary distribution not found (best relative residual "
                          f"{min(residual(c) for c in candidates + [x]):.2e})")


def _normalise(x: np.ndarray) -> np.ndarray:
    x = np.clip(x, 0.0, None)
    return x / x.sum()


def solve(chain: Chain, *, on_periodic: str = "warn", keep_pi: bool = False) -> DTMCResult:
    """Stationary distribution and T(B) of a built chain (equations in the module docstring).

    Args:
        chain: from :func:`build_chain`.
        on_periodic: "warn" (default), "ignore" or "error" for a periodic recurrent class.
        keep_pi: keep π and the recurrent state indices in the result.
    Raises:
        ReducibleChainError, PeriodicChainError.
    """
    t0 = time.perf_counter()
    rec = recurrent_class(chain.P)
    Q = chain.P[rec][:, rec].tocsr()
    period = chain_period(Q)
    if period > 1:
        msg = (f"recurrent class of the chain for B={chain.B.tolist()} is periodic (period {period}); "
               "T(B) is the exact long-run average, but state probabilities at a given instant oscillate")
        if on_periodic == "error":
            raise PeriodicChainError(msg)
        if on_periodic == "warn":
            warnings.warn(msg, PeriodicChainWarning, stacklevel=2)
    pi = stationary_distribution(Q)
    tokens = float(pi @ chain.reward[rec])
    quanta = float(pi @ chain.sojourn[rec])
    T = tokens / (quanta * chain.quantum_s)
    return DTMCResult(
        B=chain.system.thresholds_dict(chain.B), throughput_tokens_per_s=T, states=chain.n_states,
        recurrent_states=int(len(rec)), transitions=chain.n_transitions, period=period,
        mean_cycle_s=quanta * chain.quantum_s, discretisation_error=chain.discretisation_error,
        seconds=chain.build_seconds + time.perf_counter() - t0,
        pi=pi if keep_pi else None, recurrent_index=rec if keep_pi else None)


def throughput(system: System, B: Any, *, max_states: int = DEFAULT_MAX_STATES,
               on_periodic: str = "warn", keep_pi: bool = False,
               max_wait_s: Optional[Sequence[Optional[float]]] = None) -> DTMCResult:
    """T(B) in tokens/s from the exact DTMC (paper's formula; module docstring).

    Args:
        system: the modelled system.
        B: thresholds, (M,) ints or {model: B_i}.
        max_wait_s: the server's wait bound per model in seconds (None: the paper's chain);
            see :func:`build_chain`.
    Raises:
        InfeasibleThresholdsError, DeadlockError, ReducibleChainError, PeriodicChainError
        (``on_periodic='error'``), StateSpaceTooLargeError.
    """
    return solve(build_chain(system, B, max_states=max_states, max_wait_s=max_wait_s),
                 on_periodic=on_periodic, keep_pi=keep_pi)
