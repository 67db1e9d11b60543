"""Per-request discrete-event simulator of the delayed-batching system.

Simulates the system of :mod:`scheduler_model.system` request by request — FIFO queues, running
batches, individual routing decisions — as an independent check of the DTMC
(:mod:`scheduler_model.dtmc`) and for what the DTMC cannot express (paper, "Known limits":
the DTMC assumes geometric run lengths).

Rules (identical to the DTMC's so the two must agree):

* Time runs in integer quanta: a batch of b at model i takes d_i(b) quanta of ``quantum_s``
  (:meth:`System.quanta`), so simultaneous completions happen at the same instant and are
  processed together: all completing batches route first, then every idle model with
  k_i ≥ B_i starts a batch of min(k_i, max_batch_i) requests from the head of its queue.
* Geometric model i (no run-length distribution): after each step every request of the batch
  moves to j with probability p_ij independently and commits c_ij tokens.
* Model i with an empirical run-length distribution R_i (steps per visit, ≥ 1): a request
  arriving at i draws R ~ R_i; after each step at i it stays (committing c_ii) until its R-th
  step, after which it moves to j ≠ i with probability p_ij / Σ_{l≠i} p_il (committing c_ij).
  With R_i geometric of mean 1/(1 − p_ii) this is the geometric rule again.
* Throughput = tokens committed / elapsed time after ``warmup_events`` completion instants, in
  tokens/s; its standard error comes from ``n_batches`` batch means.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections import deque
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .dtmc import check_feasible
from .errors import DeadlockError, ProfileError
from .system import System


@dataclasses.dataclass
class SimResult:
    """Result of :func:`simulate`.

    Attributes:
        B: {model: B_i}.
        throughput_tokens_per_s: tokens committed per second after warm-up.
        stderr_tokens_per_s: batch-means standard error of that estimate.
        events: completion instants simulated after warm-up.
        simulated_s: simulated seconds after warm-up.
        tokens: tokens committed after warm-up.
        mean_batch: (M,) mean batch size per model over measured steps.
    """

    B: Dict[str, int]
    throughput_tokens_per_s: float
    stderr_tokens_per_s: float
    events: int
    simulated_s: float
    tokens: float
    mean_batch: List[float]

    def to_json(self) -> Dict[str, Any]:
        """JSON-serialisable dict of the fields."""
        return dataclasses.asdict(self)


class _Uniforms:
    """Buffered U(0,1) draws as Python floats (fast in a per-request Python loop)."""

    def __init__(self, rng: np.random.Generator, chunk: int = 1 << 16) -> None:
        self.rng = rng
        self.chunk = chunk
        self.buf: List[float] = []
        self.pos = 0

    def __call__(self) -> float:
        if self.pos >= len(self.buf):
            self.buf = self.rng.random(self.chunk).tolist()
            self.pos = 0
        u = self.buf[self.pos]
        self.pos += 1
        return u


def simulate(system: System, B: Any, *, events: int = 100_000, warmup_events: Optional[int] = None,
             seed: int = 0, run_lengths: Optional[Sequence[Optional[Tuple[np.ndarray, np.ndarray]]]] = None,
             n_batches: int = 20, start_model: int = 0,
             emit_event: Optional[Callable[[Dict[str, Any]], None]] = None, t0_s: float = 0.0,
             max_wait_s: Optional[Sequence[Optional[float]]] = None) -> SimResult:
    """Simulate the closed system for thresholds B and estimate T(B) in tokens/s.

    Args:
        system: the modelled system; ``system.run_lengths`` is used unless ``run_lengths`` is given.
        B: thresholds, (M,) ints or {model: B_i}.
        events: completion instants measured after warm-up.
        warmup_events: completion instants discarded first (default max(1000, events // 20)).
        seed: random seed.
        run_lengths: per model None (geometric by P) or (lengths, probabilities).
        n_batches: batch means for the standard error.
        start_model: model holding every request at time 0.
        emit_event: if given, called with a routing event dict (the serving side's JSON Lines
            format, :mod:`scheduler_model.profile`) for every step and every handoff, warm-up
            included: ``step`` events carry the quantised latency, ``handoff`` events the request's
            own step counter; ``t`` = t0_s + simulated seconds.
        t0_s: time origin of emitted events (s).
        max_wait_s: per model None or the server's delayed-batching wait bound
            (``delayed_batch_max_wait_us`` / 1e6, s): an idle model also starts a batch of
            all its queued requests once the oldest has waited this long (rounded to quanta);
            the DTMC's ``max_wait_s`` is the same rule. None everywhere (default) is the
            paper's rule.
    Returns:
        :class:`SimResult`.
    Raises:
        InfeasibleThresholdsError, DeadlockError (cannot happen for feasible B), ProfileError (a
        run-length model whose row of P has no off-diagonal mass).
    """
    Bv = check_feasible(system, B, max_wait_s)
    M, N = system.M, system.N
    q = system.quanta()
    d = [di.tolist() for di in q.d]
    cap = list(system.max_batch)
    P, C = system.P, system.C
    rl = list(system.run_lengths or [None] * M) if run_lengths is None else list(run_lengths)
    rng = np.random.default_rng(seed)
    U = _Uniforms(rng)
    cumP = [np.cumsum(P[i]).tolist() for i in range(M)]
    for i in range(M):
        cumP[i][-1] = 1.0 + 1e-12
    cum_off: List[Optional[List[float]]] = [None] * M
    rl_cum: List[Optional[Tuple[List[int], List[float]]]] = [None] * M
    for i in range(M):
        if rl[i] is not None:
            off = P[i].copy()
            off[i] = 0.0
            if off.sum() <= 0:
                raise ProfileError(f"model {system.models[i]!r} has run lengths but p_ij = 0 for every j != i")
            c = np.cumsum(off / off.sum()).tolist()
            c[-1] = 1.0 + 1e-12
            cum_off[i] = c
            lengths, probs = rl[i]
            pc = np.cumsum(probs).tolist()
            pc[-1] = 1.0 + 1e-12
            rl_cum[i] = ([int(x) for x in lengths], pc)

    def draw_run(i: int) -> int:
        lens, pc = rl_cum[i]
        return lens[bisect.bisect_right(pc, U())]

    req_step = [0] * N  # per-request decode-step counter (for emitted handoff events)
    names = system.models
    rem = [0] * N  # remaining steps of the current visit (run-length models only)
    queues: List[deque] = [deque() for _ in range(M)]
    queues[start_model].extend(range(N))
    if rl_cum[start_model] is not None:
        for rid in range(N):
            rem[rid] = draw_run(start_model)
    running: List[Optional[List[int]]] = [None] * M
    finish = [None] * M
    INF = float("inf")
    t = 0
    tokens = 0.0
    steps = [0] * M
    batch_sum = [0] * M

    enq_t = [0] * N  # quantum at which each request joined its current queue (wait bound)
    wq: List[Optional[int]] = [None] * M
    if max_wait_s is not None:
        if len(max_wait_s) != M:
            raise ProfileError(f"max_wait_s needs one entry (or None) per model, got {len(max_wait_s)}")
        for i, w in enumerate(max_wait_s):
            if w is not None:
                if not w >= 0:
                    raise ProfileError(f"max_wait_s of {system.models[i]!r} must be >= 0 s, got {w!r}")
                wq[i] = int(round(w / q.quantum_s))

    def waited(i: int) -> bool:
        return wq[i] is not None and bool(queues[i]) and t - enq_t[queues[i][0]] >= wq[i]

    def start_idle() -> None:
        for i in range(M):
            if running[i] is None and (len(queues[i]) >= Bv[i] or waited(i)):
                nb = min(len(queues[i]), cap[i])
                qi = queues[i]
                running[i] = [qi.popleft() for _ in range(nb)]
                finish[i] = t + d[i][nb]

    start_idle()
    warm = max(1000, events // 20) if warmup_events is None else int(warmup_events)
    total = warm + int(events)
    n_batches = max(2, int(n_batches))
    per_batch = max(1, int(events) // n_batches)
    marks_t: List[int] = []
    marks_tok: List[float] = []
    for ev in range(total):
        if ev == warm:
            marks_t.append(t)
            marks_tok.append(tokens)
            steps = [0] * M
            batch_sum = [0] * M
        elif ev > warm and (ev - warm) % per_batch == 0:
            marks_t.append(t)
            marks_tok.append(tokens)
        tn = min((f for f in finish if f is not None), default=INF)
        while True:  # wait-bound starts before the next completion (not completion instants)
            tw = min((enq_t[queues[i][0]] + wq[i] for i in range(M)
                      if wq[i] is not None and running[i] is None and queues[i]), default=INF)
            if tw >= tn or tw == INF:
                break
            t = tw
            start_idle()
            tn = min((f for f in finish if f is not None), default=INF)
        if tn == INF:
            raise DeadlockError(f"deadlock in simulation: all models idle, queues "
                                f"{[len(x) for x in queues]} below B={Bv.tolist()}")
        t = tn
        moves: List[Tuple[int, int]] = []
        finish_now: List[Optional[List[int]]] = [None] * M
        for i in range(M):
            if finish[i] != tn:
                continue
            batch = running[i]
            finish_now[i] = batch
            running[i] = None
            finish[i] = None
            steps[i] += 1
            batch_sum[i] += len(batch)
            Ci = C[i]
            if rl_cum[i] is None:
                cp = cumP[i]
                for rid in batch:
                    j = bisect.bisect_right(cp, U())
                    tokens += Ci[j]
                    moves.append((rid, j))
                    if j != i and rl_cum[j] is not None:
                        rem[rid] = draw_run(j)
            else:
                co = cum_off[i]
                for rid in batch:
                    rem[rid] -= 1
                    if rem[rid] > 0:
                        j = i
                    else:
                        j = bisect.bisect_right(co, U())
                        if rl_cum[j] is not None:
                            rem[rid] = draw_run(j)
                    tokens += Ci[j]
                    moves.append((rid, j))
        if emit_event is not None:
            ts = t0_s + t * q.quantum_s
            done = {}
            for rid, j in moves:
                done[rid] = j
            # one step event per completing model, then one handoff per moving request
            for i in range(M):
                if finish_now[i]:
                    b = len(finish_now[i])
                    tok = sum(C[i][done[rid]] for rid in finish_now[i])
                    emit_event({"event": "step", "model": names[i], "batch_size": b,
                                "latency_s": d[i][b] * q.quantum_s, "tokens_committed": float(tok), "t": ts})
                    for rid in finish_now[i]:
                        req_step[rid] += 1
                        j = done[rid]
                        if j != i:
                            emit_event({"event": "handoff", "request_id": str(rid), "step": req_step[rid],
                                        "from": names[i], "to": names[j], "tokens_committed": float(C[i][j]),
                                        "t": ts})
        for rid, j in moves:
            queues[j].append(rid)
            enq_t[rid] = t
        start_idle()
    marks_t.append(t)
    marks_tok.append(tokens)
    mt = np.asarray(marks_t, dtype=np.float64) * q.quantum_s
    mk = np.asarray(marks_tok)
    elapsed = mt[-1] - mt[0]
    T = (mk[-1] - mk[0]) / elapsed if elapsed > 0 else float("nan")
    dt = np.diff(mt)
    dk = np.diff(mk)
    ok = dt > 0
    if ok.sum() >= 2:
        bm = dk[ok] / dt[ok]
        # ratio-estimator batch means, weighted by batch duration
        w = dt[ok] / dt[ok].sum()
        var = np.sum(w * (bm - T) ** 2) / (ok.sum() - 1)
        se = float(np.sqrt(var))
    else:
        se = float("nan")
    return SimResult(B=system.thresholds_dict(Bv), throughput_tokens_per_s=float(T), stderr_tokens_per_s=se,
                     events=int(events), simulated_s=float(elapsed), tokens=float(mk[-1] - mk[0]),
                     mean_batch=[batch_sum[i] / steps[i] if steps[i] else 0.0 for i in range(M)])


def geometric_run_lengths(p_stay: float, max_len: int = 10_000) -> Tuple[np.ndarray, np.ndarray]:
    """Geometric run-length pmf P(R = r) = p_stay^(r−1) (1 − p_stay), r = 1 … max_len (renormalised).

    Useful to check that the run-length path of :func:`simulate` reduces to the geometric one.
    """
    if not 0 <= p_stay < 1:
        raise ValueError("p_stay must be in [0, 1)")
    r = np.arange(1, max_len + 1)
    pmf = p_stay ** (r - 1) * (1 - p_stay)
    keep = pmf > 1e-300
    r, pmf = r[keep], pmf[keep]
    return r.astype(np.int64), pmf / pmf.sum()
