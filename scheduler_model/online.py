"""Online adaptation of B*: re-estimate P, C, L_i from a sliding window and re-solve.

Beyond the paper, which computes B* once for a fixed N ("Known limits": bursty real traffic
calls for online adaptation). The serving side feeds the same routing events it logs
(:mod:`scheduler_model.profile`: ``step`` and ``handoff``), plus optional
``{"event": "concurrency", "n": <live requests>, "t": …}`` samples, and asks for a
recommendation now and then.

Design for bursty arrivals:

* Sliding window: only events with ``t`` ≥ t_latest − ``window_s`` count. P, C and L_i(b) are
  the estimators of :func:`scheduler_model.profile.profile_from_events` on the window. A model with
  fewer than ``min_request_steps`` request-steps in the window keeps its previous row of P and C
  and its previous latency table (or the prior profile's), so a quiet model does not produce
  noise or a hole.
* Concurrency: N_eff = the ``concurrency_quantile`` (default 0.25) quantile of the window's
  concurrency samples (falling back to ``default_concurrency``). A low quantile keeps B*
  feasible (Σ (B_i − 1) < N) through the lulls between bursts; during a burst, queues exceed
  B*_i and batches simply grow (a model starts with *all* queued requests).
* Hysteresis: the current B is replaced only if it became infeasible or the best predicted T
  exceeds T(current B) — both under the new profile — by more than ``min_gain`` (relative,
  default 2 %), so noise does not make thresholds flap. It is replaced by B*, the B with the
  least waiting within ``min_gain`` of that best (the search's tie rule,
  :mod:`scheduler_model.search`, with the same ``min_gain``).
* Rate limiting: at most one re-solve per ``min_interval_s`` of event time; solutions are
  cached by the rounded profile.

All times are the events' ``t`` in seconds.
"""

from __future__ import annotations

import dataclasses
import json
from collections import deque
from typing import Any, Deque, Dict, Mapping, Optional, Sequence

import numpy as np

from .errors import ProfileError
from .profile import profile_from_events
from .search import SearchResult, compared_rows, find_B_star
from .system import DEFAULT_QUANTUM_S, System


@dataclasses.dataclass
class Recommendation:
    """Result of :meth:`OnlineAdapter.recommend`.

    Attributes:
        B_star: {model: B_i} to use now (may equal the previous one).
        changed: whether B_star differs from the previous recommendation.
        reason: why it changed or not ("initial", "infeasible", "gain 3.1 %", "gain below …").
        throughput_tokens_per_s: predicted T(B_star) under the current profile (tokens/s).
        current_throughput_tokens_per_s: predicted T of the previous B under it (None if infeasible).
        concurrency: N_eff used.
        profile: the window's profile dict (PROFILE.json format).
        method: search method ("exact-dtmc" or "crn-racing").
    """

    B_star: Dict[str, int]
    changed: bool
    reason: str
    throughput_tokens_per_s: float
    current_throughput_tokens_per_s: Optional[float]
    concurrency: int
    profile: Dict[str, Any]
    method: str


class OnlineAdapter:
    """Sliding-window re-estimation of P, C, L_i and N, and B* with hysteresis (module docstring).

    Args:
        models: M model names.
        default_concurrency: N when the window has no concurrency samples.
        window_s: window length in seconds of event time.
        quantum_s: δ of the DTMC (s).
        fixed_thresholds: {model: B_i} held fixed (e.g. {"slm": 1}).
        prior_profile: PROFILE.json dict used for models without enough data yet.
        min_request_steps: request-steps a model needs in the window to be re-estimated.
        concurrency_quantile: quantile of the window's concurrency samples used as N.
        min_gain: relative throughput gain needed to switch B.
        min_interval_s: minimum event time between two re-solves.
        search_kwargs: passed to :func:`scheduler_model.search.find_B_star` (e.g. method, max_states).
    """

    def __init__(self, models: Sequence[str], default_concurrency: int, *, window_s: float = 30.0,
                 quantum_s: float = DEFAULT_QUANTUM_S, fixed_thresholds: Optional[Mapping[str, int]] = None,
                 prior_profile: Optional[Mapping[str, Any]] = None, min_request_steps: int = 50,
                 concurrency_quantile: float = 0.25, min_gain: float = 0.02, min_interval_s: float = 1.0,
                 search_kwargs: Optional[Mapping[str, Any]] = None) -> None:
        self.models = list(models)
        self.default_concurrency = int(default_concurrency)
        self.window_s = float(window_s)
        self.quantum_s = float(quantum_s)
        self.fixed = dict(fixed_thresholds or {})
        self.last_profile: Optional[Dict[str, Any]] = dict(prior_profile) if prior_profile else None
        if self.last_profile is not None:
            System.from_profile(self.last_profile)
        self.min_request_steps = int(min_request_steps)
        self.q = float(concurrency_quantile)
        self.min_gain = float(min_gain)
        self.min_interval_s = float(min_interval_s)
        self.search_kwargs = dict(search_kwargs or {"method": "auto", "max_states": 200_000, "time_budget_s": 5.0})
        self.events: Deque[Dict[str, Any]] = deque()
        self.conc: Deque[tuple] = deque()
        self.t_latest = -np.inf
        self.current: Optional[Dict[str, int]] = None
        self.last_solve_t = -np.inf
        self.last_rec: Optional[Recommendation] = None
        self._cache: Dict[str, SearchResult] = {}

    # ------------------------------------------------------------------ ingestion
    def observe(self, event: Mapping[str, Any]) -> None:
        """Add one routing event (dict). Events need a numeric ``t``; unknown kinds are ignored.

        Raises:
            ProfileError: the event has no numeric ``t``.
        """
        kind = event.get("event")
        if kind not in ("step", "handoff", "concurrency"):
            return
        t = event.get("t")
        if isinstance(t, bool) or not isinstance(t, (int, float)):
            raise ProfileError(f"online events need a numeric 't' (seconds), got {event!r}")
        self.t_latest = max(self.t_latest, float(t))
        if kind == "concurrency":
            n = event.get("n")
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ProfileError(f"concurrency event needs an integer n >= 0, got {event!r}")
            self.conc.append((float(t), n))
        else:
            self.events.append(dict(event))
        self._evict()

    def observe_many(self, events: Sequence[Mapping[str, Any]]) -> None:
        """:meth:`observe` each event in order."""
        for ev in events:
            self.observe(ev)

    def set_concurrency(self, n: int, t: float) -> None:
        """Record a live-concurrency sample n at time t (same as a ``concurrency`` event)."""
        self.observe({"event": "concurrency", "n": int(n), "t": float(t)})

    def _evict(self) -> None:
        lo = self.t_latest - self.window_s
        while self.events and self.events[0]["t"] < lo:
            self.events.popleft()
        while self.conc and self.conc[0][0] < lo:
            self.conc.popleft()

    # ------------------------------------------------------------------ estimation
    def concurrency(self) -> int:
        """N_eff: the configured quantile of the window's concurrency samples (≥ 1)."""
        if not self.conc:
            return self.default_concurrency
        vals = np.array([n for _, n in self.conc], dtype=float)
        return max(1, int(np.floor(np.quantile(vals, self.q))))

    def window_profile(self) -> Dict[str, Any]:
        """PROFILE.json dict from the window, with fallbacks for quiet models.

        Raises:
            ProfileError: a model has neither window data nor a previous/prior profile.
        """
        M = len(self.models)
        steps = {m: 0 for m in self.models}
        for ev in self.events:
            if ev.get("event") == "step" and ev.get("model") in steps:
                steps[ev["model"]] += int(ev.get("batch_size", 0))
        enough = [steps[m] >= self.min_request_steps for m in self.models]
        N = self.concurrency()
        prev = self.last_profile
        if not any(enough):
            if prev is None:
                raise ProfileError("no model has enough events in the window and there is no prior profile")
            prof = dict(prev)
        else:
            # estimate on the window, only with models that have data; others from prev
            have = [m for m, e in zip(self.models, enough) if e]
            sel = [e for e in self.events
                   if (e.get("event") == "step" and e.get("model") in have)
                   or (e.get("event") == "handoff" and e.get("from") in have)]
            win = profile_from_events(sel,
                                      self.models, N, quantum_s=self.quantum_s, run_lengths=False,
                                      _allow_missing=True)
            prof = win
            if not all(enough):
                if prev is None:
                    missing = [m for m, e in zip(self.models, enough) if not e]
                    raise ProfileError(f"models {missing} lack data in the window and there is no prior profile")
                P = np.array(prof["transition"])
                C = np.array(prof["committed_tokens"])
                pidx = {m: i for i, m in enumerate(prev["models"])}
                Pp, Cp = np.array(prev["transition"]), np.array(prev["committed_tokens"])
                for i, m in enumerate(self.models):
                    if not enough[i]:
                        P[i] = [Pp[pidx[m], pidx[x]] for x in self.models]
                        C[i] = [Cp[pidx[m], pidx[x]] for x in self.models]
                        prof["step_latency_s"][m] = prev["step_latency_s"][m]
                        prev_model = (prev.get("step_latency_model") or {}).get(m)
                        if prev_model is not None:
                            prof.setdefault("step_latency_model", {})[m] = prev_model
                prof["transition"] = P.tolist()
                prof["committed_tokens"] = C.tolist()
        prof = dict(prof)
        prof["models"] = list(self.models)
        prof["concurrency"] = N
        prof["quantum_s"] = self.quantum_s
        if self.fixed:
            prof["fixed_thresholds"] = dict(self.fixed)
        else:
            prof.pop("fixed_thresholds", None)
        prof.pop("run_lengths", None)
        System.from_profile(prof)
        return prof

    # ------------------------------------------------------------------ decisions
    def _solve(self, prof: Dict[str, Any]) -> SearchResult:
        key = json.dumps(_rounded(prof), sort_keys=True)
        if key not in self._cache:
            if len(self._cache) > 64:
                self._cache.clear()
            kw = {"min_gain": self.min_gain, **self.search_kwargs}  # its tie rule: the same gain as the hysteresis
            self._cache[key] = find_B_star(System.from_profile(prof), **kw)
        return self._cache[key]

    def recommend(self, force: bool = False) -> Recommendation:
        """Re-estimate the profile on the window and return the thresholds to use now.

        Within ``min_interval_s`` of the previous solve (event time) the previous recommendation
        is returned unchanged unless ``force``.

        Raises:
            ProfileError: not enough data and no prior profile.
        """
        if (not force and self.last_rec is not None
                and self.t_latest - self.last_solve_t < self.min_interval_s):
            return dataclasses.replace(self.last_rec, changed=False, reason="rate-limited")
        prof = self.window_profile()
        res = self._solve(prof)
        self.last_solve_t = self.t_latest
        self.last_profile = prof
        table = {json.dumps(r["B"], sort_keys=True): r["throughput_tokens_per_s"] for r in res.table}
        cur_T = None
        if self.current is None:
            new, reason = res.B_star, "initial"
        else:
            cur_T = table.get(json.dumps(self.current, sort_keys=True))
            if cur_T is None:
                new, reason = res.B_star, "previous B infeasible for the current concurrency"
            else:
                # the predicted gain of the best B over the current one; B* itself is the least
                # waiting B within min_gain of that best (the search's tie rule), so it may gain less
                best_T = max(r["throughput_tokens_per_s"] for r in compared_rows(res))
                gain = best_T / cur_T - 1 if cur_T > 0 else np.inf
                if gain > self.min_gain:
                    new, reason = res.B_star, f"gain {100 * gain:.1f} %"
                else:
                    new, reason = self.current, f"gain {100 * gain:.1f} % below {100 * self.min_gain:.1f} %"
        changed = new != self.current
        self.current = dict(new)
        T_new = table.get(json.dumps(new, sort_keys=True), res.throughput_tokens_per_s)
        rec = Recommendation(B_star=dict(new), changed=changed, reason=reason, throughput_tokens_per_s=T_new,
                             current_throughput_tokens_per_s=cur_T, concurrency=prof["concurrency"],
                             profile=prof, method=res.method)
        self.last_rec = rec
        return rec


def _rounded(prof: Mapping[str, Any]) -> Dict[str, Any]:
    """Profile with P, C rounded to 0.005 and latencies to 0.1 ms (cache key; small noise hits)."""
    out = dict(prof)
    out["transition"] = np.round(np.array(prof["transition"]) / 0.005).astype(int).tolist()
    out["committed_tokens"] = np.round(np.array(prof["committed_tokens"]), 2).tolist()
    out["step_latency_s"] = {m: (round(v, 4) if isinstance(v, (int, float)) else {b: round(x, 4) for b, x in v.items()})
                             for m, v in prof["step_latency_s"].items()}
    return out
