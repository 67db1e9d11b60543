"""The feasible thresholds B a search ranges over, and a search's result (:class:`SearchResult`).

Feasible ⇔ 1 ≤ B_i ≤ max_batch_i and Σ_i (B_i − 1) < N (paper, "DTMC for B*"), with any
thresholds in ``system.fixed_thresholds`` held fixed.  Shared by the exact search
(:mod:`scheduler_model.search`) and the simulation-based one (:mod:`scheduler_model.approx`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, Iterator, List, Optional, Sequence

import numpy as np

from . import dtmc
from .errors import InfeasibleThresholdsError
from .system import System

__all__ = ["SearchResult", "feasible_thresholds"]


@dataclasses.dataclass
class SearchResult:
    """Outcome of a B* search.

    Attributes:
        B_star: {model: B*_i}.
        throughput_tokens_per_s: T(B*) in tokens/s (exact, or simulated estimate for crn-racing).
        method: "exact-dtmc" or "crn-racing".
        states: reachable states of the chain at B* (exact), else 0.
        table: [{"B": {model: B_i}, "throughput_tokens_per_s": T, ...}] for every B evaluated, in
            lexicographic order of B; exact entries add "states", racing entries "events".
        seconds: wall time of the search.
        max_states: largest chain built (exact), else 0.
        notes: human-readable remarks (method switch, periodic chains, discretisation error).
        throughput_stderr_tokens_per_s: standard error of T(B*) (0 for the exact method).
    """

    B_star: Dict[str, int]
    throughput_tokens_per_s: float
    method: str
    states: int
    table: List[Dict[str, Any]]
    seconds: float
    max_states: int = 0
    notes: List[str] = dataclasses.field(default_factory=list)
    throughput_stderr_tokens_per_s: float = 0.0

    def to_json(self) -> Dict[str, Any]:
        """The CLI's ``--json`` object: B_star, throughput_tokens_per_s, method, states, table, …"""
        return {
            "B_star": self.B_star,
            "throughput_tokens_per_s": self.throughput_tokens_per_s,
            "method": self.method,
            "states": self.states,
            "table": self.table,
            "seconds": self.seconds,
            "max_states": self.max_states,
            "notes": self.notes,
            # None (JSON null) when unknown: a crn-racing row chosen by the tie rule
            "throughput_stderr_tokens_per_s": (self.throughput_stderr_tokens_per_s
                                               if math.isfinite(self.throughput_stderr_tokens_per_s) else None),
        }


def feasible_thresholds(system: System, fixed: Optional[Dict[str, int]] = None,
                        max_wait_s: Optional[Sequence[Optional[float]]] = None) -> Iterator[np.ndarray]:
    """Yield every feasible B as an (M,) int64 array, lexicographically.

    Args:
        system: the modelled system.
        fixed: {model: B_i} held fixed (default ``system.fixed_thresholds``).
        max_wait_s: None, or per model None or its wait bound (s): models with a bound do not
            count in Σ (B_i − 1) < N (:func:`scheduler_model.dtmc.check_feasible`), so they
            range over 1 … max_batch_i.
    Raises:
        InfeasibleThresholdsError: the fixed thresholds alone are infeasible.
    """
    fixed = dict(system.fixed_thresholds if fixed is None else fixed)
    M, N = system.M, system.N
    cap = system.max_batch
    fixed_idx = {system.index(k): int(v) for k, v in fixed.items()}
    for i, v in fixed_idx.items():
        if v < 1 or v > cap[i]:
            raise InfeasibleThresholdsError(f"fixed threshold {system.models[i]}={v} outside 1..{cap[i]}")
    free_of_bound = dtmc.unbounded(system, max_wait_s)
    base = sum(v - 1 for i, v in fixed_idx.items() if free_of_bound[i])
    if base >= N:
        raise InfeasibleThresholdsError(f"fixed thresholds {fixed} alone give sum(B_i - 1) = {base} >= N = {N}")
    B = np.ones(M, dtype=np.int64)
    for i, v in fixed_idx.items():
        B[i] = v
    free = [i for i in range(M) if i not in fixed_idx]

    def rec(pos: int, slack: int) -> Iterator[np.ndarray]:
        if pos == len(free):
            yield B.copy()
            return
        i = free[pos]
        counts = bool(free_of_bound[i])
        for v in range(1, (min(cap[i], slack + 1) if counts else cap[i]) + 1):
            B[i] = v
            yield from rec(pos + 1, slack - (v - 1) if counts else slack)
        B[i] = 1

    yield from rec(0, N - 1 - base)
