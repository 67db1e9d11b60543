"""B* search: maximise T(B) over the feasible thresholds (paper, "DTMC for B*").

B* = argmax_{B feasible} T(B),  feasible ⇔ 1 ≤ B_i ≤ max_batch_i and Σ_i (B_i − 1) < N,
with any thresholds in ``system.fixed_thresholds`` held fixed (the paper fixes the SLM's at 1).

Methods:

* ``"exact-dtmc"`` — T(B) from the exact chain (:mod:`scheduler_model.dtmc`) for every feasible B.
* ``"crn-racing"`` — simulation-based search with common random numbers
  (:func:`scheduler_model.approx.crn_race`), for N where the exact chains are too big or too many.
* ``"auto"`` (default) — exact if the first chain has at most ``probe_max_states`` states, every
  chain stays within ``max_states`` and the estimated total time (first chain's time × number of
  feasible B) is within ``time_budget_s``; else crn-racing. The JSON's ``method`` and ``notes``
  say which ran and why.

Ties (|ΔT| ≤ 1e-9 relative) go to the earlier B in lexicographic order, i.e. the smaller
thresholds. :func:`find_B_star` then applies a wider tie rule, ``min_gain`` (default 2 %):
waiting must be predicted to pay. Among the evaluated B whose T is within a factor
1 + min_gain of the best, it returns the one with the least delay, the smallest
Σ_i (B_i − 1) (then lexicographic). The chain leaves out costs of waiting that serving
has: arrivals that miss a step, clients' jitter, and, unless ``max_wait_s`` is given, the
wait bound's timer. The
crn-racing estimates carry noise. On the size-realistic pair the plain argmax picked
B_slm = 2 at N = 8 and B_slm = 17 at N = 32 on predicted gains of 0.02 % and 0.01 %
(docs/performance.md). The online adapter's hysteresis uses the same 2 %
(:mod:`scheduler_model.online`).
"""

from __future__ import annotations

import math
import time
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from . import approx, dtmc
from .errors import StateSpaceTooLargeError
from .feasible import SearchResult, feasible_thresholds
from .system import System

__all__ = ["SearchResult", "feasible_thresholds", "search_exact", "compared_rows", "prefer_less_waiting",
           "find_B_star"]


def _argmax(values: List[float]) -> int:
    best = 0
    for j, v in enumerate(values):
        if v > values[best] * (1 + 1e-9) + 1e-12:
            best = j
    return best


def search_exact(system: System, *, max_states: int = dtmc.DEFAULT_MAX_STATES,
                 on_periodic: str = "ignore", candidates: Optional[List[np.ndarray]] = None,
                 max_wait_s: Optional[Sequence[Optional[float]]] = None) -> SearchResult:
    """B* by evaluating the exact T(B) for every feasible B (with the server's wait bound per
    model in seconds when ``max_wait_s`` is given; :func:`scheduler_model.dtmc.build_chain`).

    Raises:
        StateSpaceTooLargeError, ReducibleChainError, PeriodicChainError (``on_periodic='error'``).
    """
    t0 = time.perf_counter()
    cands = list(feasible_thresholds(system, max_wait_s=max_wait_s)) if candidates is None else candidates
    table, values, states = [], [], []
    periodic = []
    disc = 0.0
    for B in cands:
        r = dtmc.throughput(system, B, max_states=max_states, on_periodic=on_periodic, max_wait_s=max_wait_s)
        values.append(r.throughput_tokens_per_s)
        states.append(r.states)
        disc = max(disc, r.discretisation_error)
        if r.period > 1:
            periodic.append((r.B, r.period))
        table.append({"B": r.B, "throughput_tokens_per_s": r.throughput_tokens_per_s, "states": r.states,
                      "period": r.period})
    j = _argmax(values)
    notes = [f"latency discretisation error {disc:.2e} (relative, quantum {system.quantum_s:g} s)"]
    if periodic:
        notes.append(f"{len(periodic)} of {len(cands)} chains are periodic (T is their exact long-run average), "
                     f"e.g. B={periodic[0][0]} period {periodic[0][1]}")
    return SearchResult(B_star=system.thresholds_dict(cands[j]), throughput_tokens_per_s=values[j],
                        method="exact-dtmc", states=states[j], table=table,
                        seconds=time.perf_counter() - t0, max_states=max(states), notes=notes)


def compared_rows(res: SearchResult) -> List[Dict[str, Any]]:
    """The rows of ``res.table`` whose T can be compared: finite T; for crn-racing only the
    final round's survivors (the rows with the most events, estimated on shared streams)."""
    rows = [r for r in res.table if np.isfinite(r.get("throughput_tokens_per_s", np.nan))]
    if res.method == "crn-racing" and rows:
        most = max(int(r.get("events", 0)) for r in rows)
        rows = [r for r in rows if int(r.get("events", 0)) == most]
    return rows


def prefer_less_waiting(res: SearchResult, system: System, min_gain: float) -> SearchResult:
    """Apply the ``min_gain`` tie rule (module docstring) to a search result, in place.

    The candidates compared are the rows of ``res.table`` with a finite T; for crn-racing only
    the final round's survivors (the rows with the most events), whose estimates share their
    streams, since a candidate dropped early carries a rough estimate.

    Args:
        res: a result whose ``table`` holds the evaluated B with their T (tokens/s).
        system: the system searched (model order for Σ (B_i − 1)).
        min_gain: finite relative gain ≥ 0 that a B with more delay needs over one with less.
    Returns:
        ``res``; if the chosen B differs from the argmax, ``B_star`` and
        ``throughput_tokens_per_s`` (and ``states`` when the table has them) are the chosen
        row's, a note says so, and for crn-racing ``throughput_stderr_tokens_per_s`` becomes
        NaN (the final round's estimate is not re-estimated on fresh streams).
    Raises:
        ValueError: ``min_gain`` not finite or < 0.
    """
    if not (math.isfinite(min_gain) and min_gain >= 0):
        raise ValueError(f"min_gain must be a finite number >= 0, got {min_gain}")
    rows = compared_rows(res)
    if not rows or min_gain == 0:
        return res
    best = max(rows, key=lambda r: r["throughput_tokens_per_s"])
    near = [r for r in rows if r["throughput_tokens_per_s"] * (1 + min_gain) >= best["throughput_tokens_per_s"]]
    pick = min(near, key=lambda r: (sum(int(r["B"][m]) - 1 for m in system.models),
                                    [int(r["B"][m]) for m in system.models]))
    if dict(pick["B"]) != dict(res.B_star):
        res.notes.append(f"B* = {dict(pick['B'])} (T {pick['throughput_tokens_per_s']:.4g} tokens/s) instead of "
                         f"the argmax {dict(best['B'])} (T {best['throughput_tokens_per_s']:.4g} tokens/s): within "
                         f"{100 * min_gain:g} % of it with less waiting")
        res.B_star = {m: int(pick["B"][m]) for m in system.models}
        res.throughput_tokens_per_s = float(pick["throughput_tokens_per_s"])
        if "states" in pick:
            res.states = int(pick["states"])
        if res.method == "crn-racing":
            res.throughput_stderr_tokens_per_s = float("nan")
    return res


def find_B_star(system: System, *, method: str = "auto", max_states: int = 500_000,
                time_budget_s: float = 20.0, seed: int = 0, probe_max_states: int = 10_000,
                min_gain: float = 0.02, max_wait_s: Optional[Sequence[Optional[float]]] = None,
                **race_kwargs: Any) -> SearchResult:
    """Find B* = argmax over feasible B of T(B), with the ``min_gain`` tie rule (module docstring).

    Args:
        system: the modelled system (its ``fixed_thresholds`` are held fixed).
        method: "auto", "exact" or "crn-racing" (module docstring).
        max_states: per-chain state limit for the exact method.
        time_budget_s: auto only — exact is used if (first chain's time × #candidates) fits.
        probe_max_states: auto only — if the first chain has more states than this (and there
            is more than one candidate), crn-racing is used without solving it (the stationary
            solve of a chain of ~45 000 states can take minutes).
        seed: random seed of crn-racing.
        min_gain: relative predicted gain a B with more waiting needs (default 0.02; 0 = plain argmax).
        max_wait_s: the server's delayed-batching wait bound per model in seconds, None where
            it has none (default None: the paper's chain, which waits for B_i however long it
            takes). Both methods model it (the chain's ``w_i``, :mod:`scheduler_model.dtmc`).
        race_kwargs: passed to :func:`scheduler_model.approx.crn_race`.
    Returns:
        :class:`SearchResult`.
    Raises:
        ValueError: unknown method, or ``min_gain`` not finite or < 0; the errors of :func:`search_exact` when
            method="exact".
    """
    if not (math.isfinite(min_gain) and min_gain >= 0):
        raise ValueError(f"min_gain must be a finite number >= 0, got {min_gain}")
    res = _search(system, method, max_states, time_budget_s, seed, probe_max_states, max_wait_s, race_kwargs)
    if max_wait_s is not None:
        res.notes.append("wait bound modelled: " + ", ".join(
            f"{m} {'none' if w is None else f'{1e3 * w:g} ms'}" for m, w in zip(system.models, max_wait_s)))
    return prefer_less_waiting(res, system, min_gain)


def _search(system: System, method: str, max_states: int, time_budget_s: float, seed: int,
            probe_max_states: int, wait: Optional[Sequence[Optional[float]]],
            race_kwargs: Dict[str, Any]) -> SearchResult:
    if method not in ("auto", "exact", "exact-dtmc", "crn-racing", "racing"):
        raise ValueError(f"unknown method {method!r} (auto, exact, crn-racing)")
    cands = list(feasible_thresholds(system, max_wait_s=wait))
    if method in ("exact", "exact-dtmc"):
        return search_exact(system, max_states=max_states, candidates=cands, max_wait_s=wait)
    notes = []
    if method == "auto":
        t0 = time.perf_counter()
        try:
            probe = dtmc.build_chain(system, cands[0], max_states=max_states, max_wait_s=wait)
            if probe.n_states > probe_max_states and len(cands) > 1:
                notes.append(f"exact chain at B={system.thresholds_dict(cands[0])} has {probe.n_states} states "
                             f"(> {probe_max_states}) for {len(cands)} candidates; switched to crn-racing")
                res = approx.crn_race(system, candidates=cands, seed=seed, max_wait_s=wait, **race_kwargs)
                res.notes = notes + res.notes
                return res
            first = dtmc.solve(probe, on_periodic="ignore")
            est = (time.perf_counter() - t0) * len(cands)
            if est <= time_budget_s:
                try:
                    return search_exact(system, max_states=max_states, candidates=cands, max_wait_s=wait)
                except StateSpaceTooLargeError as exc:
                    notes.append(f"exact chain too large ({exc}); switched to crn-racing")
            else:
                notes.append(f"exact search estimated at {est:.0f} s for {len(cands)} candidates "
                             f"({first.states} states at B={first.B}) > budget {time_budget_s:g} s; "
                             "switched to crn-racing")
        except StateSpaceTooLargeError as exc:
            notes.append(f"exact chain too large ({exc}); switched to crn-racing")
    res = approx.crn_race(system, candidates=cands, seed=seed, max_wait_s=wait, **race_kwargs)
    res.notes = notes + res.notes
    return res
