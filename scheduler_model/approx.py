"""B* for large N: simulation-based search with common random numbers (CRN racing).

Beyond the paper (its Markov solver was validated up to N = 4): the exact chain grows roughly
like N^(2M−1) states (see ``perf/bench_scheduler.py``), so for large N we search B* by
simulating the *same* system as the DTMC (:mod:`scheduler_model.dtmc`: integer quanta,
simultaneous completions processed together, geometric run lengths) for every candidate B at
once, vectorised in numpy over candidates.

Common random numbers: model i's n-th request-step (counting every request of every batch it
completes, in order) routes by the n-th uniform U_i[n] of a stream shared by all candidates,
j = min{j : U_i[n] < Σ_{l≤j} p_il}. A completing batch of b requests at stream position q moves
counts_j = #{n ∈ [q, q+b) : dest_i(n) = j}, read in O(1) from prefix counts. Candidates therefore
see the same routing decisions and their throughput estimates are strongly positively
correlated, so differences — what the search ranks — have far smaller variance than the
estimates themselves. (Streams are ``stream_length`` long and wrap around.)

Racing (successive halving): all feasible B are simulated for ``first_events`` completion
instants after ``warmup_events``; the best ``keep_fraction`` (at least ``keep_min``) continue
with ``growth`` × more events, until one round with ≤ ``final_max`` survivors has run
``final_events``; the winner's T is then re-estimated on independent streams. The estimate of a candidate is its tokens committed / elapsed time since the
end of warm-up, in tokens/s — the same ratio T(B) as the DTMC's.

Accuracy against the exact chain (where both run) is measured by ``perf/bench_scheduler.py``
and ``tests/test_scheduler_search.py``: the loss T_exact(B*_exact) − T_exact(B*_race), relative.
"""

from __future__ import annotations

import math
import time
from typing import Optional, Sequence

import numpy as np

from .dtmc import check_feasible, wait_quanta
from .feasible import SearchResult, feasible_thresholds
from .system import System


class CRNSimulator:
    """Vectorised count-based simulator of the DTMC's system for many thresholds B at once.

    Args:
        system: the modelled system (geometric run lengths, P and C as in the DTMC).
        Bs: (n, M) int thresholds, each feasible.
        seed: seed of the shared uniform streams.
        stream_length: length of each model's routing stream (wraps around).
        start_model: model holding every request initially.
        max_wait_s: None, or per model None or the server's wait bound in seconds: the chain's
            timer rule (:mod:`scheduler_model.dtmc`, ``w_i``), for the candidates with B_i > 1.
    """

    def __init__(self, system: System, Bs: np.ndarray, *, seed: int = 0, stream_length: int = 1 << 21,
                 start_model: int = 0, max_wait_s: Optional[Sequence[Optional[float]]] = None) -> None:
        self.system = system
        Bs = np.asarray(Bs, dtype=np.int64)
        M, N = system.M, system.N
        q = system.quanta()
        self.d = [di.astype(np.int32) for di in q.d]
        self.quantum_s = q.quantum_s
        self.cap = np.asarray(system.max_batch, dtype=np.int64)
        self.C = system.C
        self.L = int(stream_length)
        rng = np.random.default_rng(seed)
        cum_p = np.cumsum(system.P, axis=1)
        cum_p[:, -1] = 1.0
        self.cum = []
        for i in range(M):
            u = rng.random(self.L)
            dest = np.minimum(np.searchsorted(cum_p[i], u, side="right"), M - 1)
            # prefix counts, (L+1, M) so one stream position is one cache line
            counts = np.zeros((self.L + 1, M), dtype=np.int32)
            for j in range(M):
                np.cumsum(dest == j, out=counts[1:, j])
            self.cum.append(counts)
        n = Bs.shape[0]
        # model-major (M, n) layout: every per-model row is contiguous
        # int32 state (halves memory traffic); time stays int64
        self.B = np.ascontiguousarray(Bs.T).astype(np.int32)
        # W_i in quanta per candidate, −1 where unbounded or B_i = 1 (dtmc.wait_quanta's rule)
        self.W = np.stack([wait_quanta(system, row, max_wait_s, q.quantum_s) for row in Bs], axis=1) \
            .astype(np.int32) if n else np.zeros((M, 0), dtype=np.int32)
        self.w = np.zeros((M, n), dtype=np.int32)
        self.k = np.zeros((M, n), dtype=np.int32)
        self.k[start_model] = N
        self.b = np.zeros((M, n), dtype=np.int32)
        self.r = np.zeros((M, n), dtype=np.int32)
        self.pos = np.zeros((M, n), dtype=np.int32)
        self.t = np.zeros(n, dtype=np.int64)
        self.tokens = np.zeros(n, dtype=np.float64)
        self.events = 0
        self.t0 = np.zeros(n, dtype=np.int64)
        self.tokens0 = np.zeros(n, dtype=np.float64)
        self._start_all()

    def _start_all(self) -> None:
        for i in range(self.system.M):
            idle = self.b[i] == 0
            st = idle & ((self.k[i] >= self.B[i]) | ((self.W[i] >= 0) & (self.k[i] > 0) & (self.w[i] >= self.W[i])))
            nb = np.minimum(self.k[i], self.cap[i])
            self.b[i] = np.where(st, nb, self.b[i])
            self.k[i] = np.where(st, self.k[i] - nb, self.k[i])
            self.r[i] = np.where(st, self.d[i][nb], self.r[i])
            self.w[i] = np.where(self.k[i] > 0, self.w[i], 0)

    def select(self, rows: np.ndarray) -> None:
        """Keep only candidates ``rows`` (state arrays are sliced; streams are shared)."""
        for name in ("B", "W", "w", "k", "b", "r", "pos"):
            setattr(self, name, np.ascontiguousarray(getattr(self, name)[:, rows]))
        for name in ("t", "tokens", "t0", "tokens0"):
            setattr(self, name, getattr(self, name)[rows])

    def mark(self) -> None:
        """Start measuring from now (end of warm-up)."""
        self.t0 = self.t.copy()
        self.tokens0 = self.tokens.copy()

    def run(self, events: int) -> None:
        """Advance every candidate by ``events`` embedded instants (completions and, with a wait
        bound, its expiries)."""
        M = self.system.M
        big = np.int32(np.iinfo(np.int32).max)
        L = self.L
        timers = bool((self.W >= 0).any())
        for _ in range(int(events)):
            b, r = self.b, self.r
            running = b > 0
            delta = np.where(running[0], r[0], big)
            for i in range(1, M):
                np.minimum(delta, np.where(running[i], r[i], big), out=delta)
            if timers:
                timed = ~running & (self.k > 0) & (self.W >= 0)
                for i in range(M):
                    np.minimum(delta, np.where(timed[i], self.W[i] - self.w[i], big), out=delta)
                aged = (self.k > 0) & (self.W >= 0)  # before this instant's arrivals join
                self.w = np.where(aged, np.minimum(self.w + delta, np.maximum(self.W, 0)), 0).astype(np.int32)
            self.t += delta
            fin = running & (r == delta)
            self.r = np.where(running & ~fin, r - delta, 0)
            for i in range(M):
                rows = np.flatnonzero(fin[i])
                if rows.size == 0:
                    continue
                p = self.pos[i, rows]
                end = p + b[i, rows]  # int32: L < 2**22, b <= N
                cum = self.cum[i]
                wrap = end > L
                cnt = cum[np.minimum(end, L)] - cum[p]
                if wrap.any():
                    cnt[wrap] += cum[end[wrap] - L]
                    end = np.where(wrap, end - L, end)
                for j in range(M):
                    self.k[j, rows] += cnt[:, j]
                self.tokens[rows] += cnt @ self.C[i]  # int32 @ float64 -> float64
                self.pos[i, rows] = end
            self.b = np.where(fin, 0, b)
            self._start_all()
        self.events += int(events)

    def throughput(self) -> np.ndarray:
        """(n,) float64 tokens/s since :meth:`mark`."""
        dt = (self.t - self.t0) * self.quantum_s
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(dt > 0, (self.tokens - self.tokens0) / dt, np.nan)


def crn_race(system: System, candidates: Optional[Sequence[Sequence[int]]] = None, *, seed: int = 0,
             warmup_events: Optional[int] = None, first_events: int = 100, growth: float = 3.0,
             keep_fraction: float = 0.125, keep_min: int = 4, final_max: int = 16, final_events: int = 6000,
             round_budget: int = 1_000_000,
             reestimate_events: Optional[int] = None,
             max_wait_s: Optional[Sequence[Optional[float]]] = None):
    """Simulation-based B* search with common random numbers (module docstring).

    Args:
        system: the modelled system (``fixed_thresholds`` held fixed when candidates is None).
        candidates: feasible thresholds to race (default: all feasible B).
        seed: seed of the shared streams.
        warmup_events: completion instants discarded first (default 100 + N).
        first_events, growth, keep_fraction, keep_min, final_max, final_events: racing schedule —
            each round keeps the best max(keep_min, ⌈keep_fraction · n⌉) and runs growth × more
            events; once ≤ final_max remain, one final round of final_events decides. A round
            runs at least min(final_events, round_budget / candidates) events, so small candidate
            sets are not culled on short, noisy runs.
        reestimate_events: the winner's reported T(B*) comes from a fresh run with independent
            streams (seed + 1) of this many events (default 2 × final_events), which removes
            the upward selection bias of the racing estimate ("winner's curse"); 0 keeps the
            racing estimate.
        max_wait_s: the server's wait bound per model in seconds (None: the paper's rule);
            :class:`CRNSimulator`.
    Returns:
        :class:`scheduler_model.feasible.SearchResult` with method "crn-racing"; its table lists every
        candidate with the estimate of the last round it ran and the events it ran ("events").
    Raises:
        InfeasibleThresholdsError: a given candidate is infeasible.
    """
    t_start = time.perf_counter()
    if candidates is None:
        cands = np.asarray(list(feasible_thresholds(system, max_wait_s=max_wait_s)), dtype=np.int64)
    else:
        cands = np.asarray([check_feasible(system, B, max_wait_s) for B in candidates], dtype=np.int64)
    n = cands.shape[0]
    warm = int(100 + system.N if warmup_events is None else warmup_events)
    # every request-step consumes one uniform; bound the stream by the total request-steps
    sim = CRNSimulator(system, cands, seed=seed, max_wait_s=max_wait_s,
                       stream_length=int(min(1 << 21, max(1 << 14, system.N * (warm + final_events * 2)))))
    sim.run(warm)
    sim.mark()
    ids = np.arange(n)
    est = np.full(n, np.nan)
    ev = np.zeros(n, dtype=np.int64)
    events = first_events
    rounds = 0
    while True:
        final = len(ids) <= final_max
        # small candidate sets get longer rounds: at least round_budget candidate-events per round
        run_ev = final_events if final else int(max(events, min(final_events, round_budget // len(ids))))
        sim.run(run_ev)
        rounds += 1
        T = sim.throughput()
        est[ids] = T
        ev[ids] = sim.events - warm
        if final:
            break
        keep = max(keep_min, int(math.ceil(len(ids) * keep_fraction)))
        order = np.argsort(-T, kind="stable")[:keep]
        order.sort()
        sim.select(order)
        ids = ids[order]
        events = int(min(final_events, events * growth))
    T = sim.throughput()
    best_local = int(np.argmax(T))
    best = ids[best_local]
    T_best = float(T[best_local])
    se = 0.0  # unknown when the racing estimate is kept (reestimate_events=0)
    re_ev = 2 * final_events if reestimate_events is None else int(reestimate_events)
    if re_ev > 0:
        fresh = CRNSimulator(system, cands[best][None, :], seed=seed + 1, max_wait_s=max_wait_s,
                             stream_length=int(min(1 << 21, max(1 << 14, system.N * (warm + re_ev)))))
        fresh.run(warm)
        fresh.mark()
        marks = [(int(fresh.t[0]), float(fresh.tokens[0]))]
        for _ in range(10):
            fresh.run(max(1, re_ev // 10))
            marks.append((int(fresh.t[0]), float(fresh.tokens[0])))
        T_best = float(fresh.throughput()[0])
        mt = np.array([m[0] for m in marks], dtype=float) * fresh.quantum_s
        mk = np.array([m[1] for m in marks])
        dt, dk = np.diff(mt), np.diff(mk)
        w = dt / dt.sum()
        se = float(np.sqrt(np.sum(w * (dk / dt - T_best) ** 2) / (len(dt) - 1)))
    table = [{"B": system.thresholds_dict(cands[j]), "throughput_tokens_per_s": float(est[j]),
              "events": int(ev[j])} for j in range(n)]
    notes = [f"crn-racing: {n} candidates, {rounds} rounds, warm-up {warm} events, "
             f"{int(ev[best])} measured events for the winner, seed {seed}; "
             f"T(B*) re-estimated on {re_ev} events with fresh streams, standard error {se:.3g} tokens/s"
             if re_ev else "T(B*) is the racing estimate"]
    return SearchResult(B_star=system.thresholds_dict(cands[best]), throughput_tokens_per_s=T_best,
                        method="crn-racing", states=0, table=table, seconds=time.perf_counter() - t_start,
                        notes=notes, throughput_stderr_tokens_per_s=se)
