"""PROFILE.json format and the routing-event-log → profile conversion.

PROFILE.json (what ``python -m scheduler_model solve --profile`` reads)::

    {"models": ["slm", "llm"],                 # M model names = Triton model directory names
     "concurrency": 4,                          # N, closed population of requests
     "step_latency_s": {"slm": 0.006,           # L_i in s: a number, or a table by batch size b
                        "llm": {"1": 0.027, "2": 0.028}},
     "step_latency_model": {"llm": {…}},        # optional, fitted model; takes precedence over
                                                # step_latency_s for that model (see below)
     "transition": [[0.65, 0.35], [1.0, 0.0]],  # P = [p_ij], rows sum to 1, p_ii = stays
     "committed_tokens": [[1, 0], [1, 0]],      # C = [c_ij], tokens committed by a move i → j
     "quantum_s": 0.0001,                       # optional, δ of the DTMC (default 1e-4 s)
     "fixed_thresholds": {"slm": 1},            # optional, B_i held fixed in the B* search
     "max_batch_size": {"llm": 8},              # optional, cap of a step's batch (default N)
     "run_lengths": {"slm": {"3": 10, "40": 2}} # optional, steps per visit (simulator only)
    }

Routing event log (JSON Lines, written by the serving side)::

    {"event": "step", "model": "slm", "batch_size": 3, "latency_s": 0.0061, "tokens_committed": 3,
     "extend_tokens": 0, "t": …}
    {"event": "handoff", "request_id": "abc", "step": 17, "from": "slm", "to": "llm",
     "tokens_committed": 0, "t": …}

Estimators (:func:`profile_from_events`), with request-steps(i) = Σ batch_size over model i's steps
and handoffs(i→j) the number of handoff events i → j:

* p_ij = handoffs(i→j) / request-steps(i) for j ≠ i;  p_ii = 1 − Σ_{j≠i} p_ij.
* c_ij = mean tokens_committed of the handoffs i → j (0 if there were none: p_ij = 0 then);
  c_ii = (Σ step tokens_committed − Σ handoff tokens_committed from i) /
  (request-steps(i) − Σ_j handoffs(i→j)).
* Step latency: a :class:`scheduler_model.latency.StepLatencyModel` per model, a robust
  monotone non-negative least-squares fit of ``latency_s`` in rows (``batch_size``) and extend
  work (``extend_tokens``, 0 if absent), plus the workload's extend mix (q, x̄); written as
  ``step_latency_model`` {model: object} (format in :mod:`scheduler_model.latency`).
  ``step_latency_s`` is then its expected L̄_i(b) for b = 1 … N, for reading (a profile that
  has a model for a model uses the model, for every b up to the max batch, whatever N);
  ``step_latency_observed_s`` keeps the median latency by batch size (diagnostics only).
  Profiles with only numbers or tables (older ones) still load; tables grow beyond their
  largest key at their marginal cost (:mod:`scheduler_model.system`).
* run_lengths (optional, for the simulator): for each request, the difference of the ``step``
  fields of two consecutive handoffs (arrival at j, departure from j) is one visit of that many
  steps at j. ``step`` is read as the request's own decode-step counter. The first visit (start
  unknown) and the last (no departure) are censored, i.e. left out.

Unknown ``event`` kinds are skipped; malformed lines raise :class:`EventLogError` with the line
number.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Union

import numpy as np

from .errors import EventLogError, ProfileError
from .latency import calibration_points, contention_scale, fit_step_latency
from .system import DEFAULT_QUANTUM_S, System


def read_json(path: str, what: str) -> Any:
    """The JSON value in file ``path``; ``what`` names it in errors. Raises ProfileError."""
    try:
        with open(path, "r", encoding="utf-8") as fh:
            return json.load(fh)
    except OSError as exc:
        raise ProfileError(f"cannot read {what} {path}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ProfileError(f"{what} {path} is not valid JSON: {exc}") from None


def load_profile(path: str) -> Dict[str, Any]:
    """Read and validate PROFILE.json; returns the dict. Raises ProfileError."""
    prof = read_json(path, "profile")
    System.from_profile(prof)
    return prof


def read_events(path: str) -> List[Dict[str, Any]]:
    """Parse a JSON Lines event log (blank lines ignored). Raises EventLogError with the line number."""
    events = []
    try:
        fh = open(path, "r", encoding="utf-8")
    except OSError as exc:
        raise EventLogError(f"cannot read event log {path}: {exc}") from None
    with fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                ev = json.loads(line)
            except json.JSONDecodeError as exc:
                raise EventLogError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
            if not isinstance(ev, dict):
                raise EventLogError(f"{path}:{lineno}: an event must be a JSON object")
            ev.setdefault("_line", lineno)
            events.append(ev)
    return events


def _field(ev: Mapping[str, Any], name: str, kinds: tuple, where: str) -> Any:
    if name not in ev:
        raise EventLogError(f"{where}: {ev.get('event')} event lacks field {name!r}")
    v = ev[name]
    if isinstance(v, bool) or not isinstance(v, kinds):
        raise EventLogError(f"{where}: field {name!r} has bad type {type(v).__name__}")
    return v


def profile_from_events(events: Iterable[Union[Mapping[str, Any], str]], models: Sequence[str],
                        concurrency: int, quantum_s: float = DEFAULT_QUANTUM_S, *,
                        fixed_thresholds: Optional[Mapping[str, int]] = None,
                        run_lengths: bool = True, calibration: Optional[Mapping[str, Any]] = None,
                        _allow_missing: bool = False) -> Dict[str, Any]:
    """Estimate a PROFILE.json dict from routing events (estimators in the module docstring).

    Args:
        events: event dicts, or JSON strings (one event each).
        models: M model names; events naming another model raise EventLogError.
        concurrency: N for the profile.
        quantum_s: δ for the profile (s).
        fixed_thresholds: copied into the profile if given.
        run_lengths: derive the optional "run_lengths" field.
        calibration: a calibration object (``python -m tokenrouter.tools.admin calibrate``); its steps,
            scaled by κ (:func:`scheduler_model.latency.contention_scale`, recorded as
            ``fit.calibration_scale``), join the event steps in each model's latency fit (not
            in q and x̄).
    Returns:
        A profile dict accepted by :meth:`System.from_profile`.
    Raises:
        EventLogError: malformed event, unknown model, negative numbers.
        ProfileError: a model without step events (its P row and L_i cannot be estimated), or
            more handoffs than request-steps.
    """
    models = list(models)
    idx = {m: i for i, m in enumerate(models)}
    M = len(models)
    req_steps = np.zeros(M)
    step_tokens = np.zeros(M)
    hand = np.zeros((M, M))
    hand_tok = np.zeros((M, M))
    lat: List[Dict[int, List[float]]] = [defaultdict(list) for _ in range(M)]
    steps_obs: List[List[tuple]] = [[] for _ in range(M)]  # (batch_size, extend_tokens, latency_s)
    visits: Dict[Any, List[tuple]] = defaultdict(list)

    for n, ev in enumerate(events, 1):
        if isinstance(ev, str):
            try:
                ev = json.loads(ev)
            except json.JSONDecodeError as exc:
                raise EventLogError(f"event {n}: not valid JSON ({exc.msg})") from None
        if not isinstance(ev, Mapping):
            raise EventLogError(f"event {n}: must be a JSON object")
        where = f"line {ev['_line']}" if "_line" in ev else f"event {n}"
        kind = ev.get("event")
        if not isinstance(kind, str):
            raise EventLogError(f"{where}: an event needs a string field 'event'")
        if kind == "step":
            m = _field(ev, "model", (str,), where)
            if m not in idx:
                raise EventLogError(f"{where}: unknown model {m!r} (models: {models})")
            b = _field(ev, "batch_size", (int,), where)
            L = _field(ev, "latency_s", (int, float), where)
            tok = _field(ev, "tokens_committed", (int, float), where)
            if b < 1 or L <= 0 or tok < 0 or not math.isfinite(L):
                raise EventLogError(f"{where}: need batch_size >= 1, latency_s > 0, tokens_committed >= 0")
            ext = ev.get("extend_tokens", 0)
            if isinstance(ext, bool) or not isinstance(ext, (int, float)) or ext < 0:
                raise EventLogError(f"{where}: field 'extend_tokens' must be a number >= 0")
            i = idx[m]
            req_steps[i] += b
            step_tokens[i] += tok
            lat[i][b].append(float(L))
            steps_obs[i].append((b, float(ext), float(L)))
        elif kind == "handoff":
            src = _field(ev, "from", (str,), where)
            dst = _field(ev, "to", (str,), where)
            for m in (src, dst):
                if m not in idx:
                    raise EventLogError(f"{where}: unknown model {m!r} (models: {models})")
            tok = _field(ev, "tokens_committed", (int, float), where)
            if tok < 0:
                raise EventLogError(f"{where}: tokens_committed must be >= 0")
            rid = _field(ev, "request_id", (str, int), where)
            step = _field(ev, "step", (int,), where)
            i, j = idx[src], idx[dst]
            if i == j:
                raise EventLogError(f"{where}: handoff from {src!r} to itself")
            hand[i, j] += 1
            hand_tok[i, j] += tok
            visits[rid].append((step, ev.get("t", 0.0), i, j))
        # other kinds: skipped
    for i, m in enumerate(models):
        if req_steps[i] == 0 and _allow_missing:  # online.py fills this model from a previous profile
            continue
        if req_steps[i] == 0:
            raise ProfileError(f"no step events for model {m!r}: cannot estimate p_{i}j or L_{i}")
        if hand[i].sum() > req_steps[i]:
            raise ProfileError(f"model {m!r}: {int(hand[i].sum())} handoffs but only {int(req_steps[i])} request-steps")
    P = hand / np.maximum(req_steps, 1)[:, None]
    np.fill_diagonal(P, 0.0)
    np.fill_diagonal(P, 1.0 - P.sum(axis=1))
    C = np.divide(hand_tok, hand, out=np.zeros((M, M)), where=hand > 0)
    stays = req_steps - hand.sum(axis=1)
    diag = np.divide(step_tokens - hand_tok.sum(axis=1), stays, out=np.zeros(M), where=stays > 0)
    np.fill_diagonal(C, np.maximum(diag, 0.0))
    lat_models = {}
    for i, m in enumerate(models):
        if not steps_obs[i]:
            continue
        eb, ee, el = (list(c) for c in zip(*steps_obs[i]))
        cb, ce, cl = calibration_points(calibration, m) if calibration else ([], [], [])
        kappa = contention_scale((eb, ee, el), (cb, ce, cl))
        lat_models[m] = fit_step_latency(eb + cb, ee + ce, el + [x * kappa for x in cl], workload=(eb, ee),
                                         source_counts={"events": len(eb), "calibration": len(cb)})
        if cb:
            lat_models[m].fit["calibration_scale"] = round(kappa, 6)
    profile: Dict[str, Any] = {
        "models": models,
        "concurrency": int(concurrency),
        "step_latency_s": {m: {str(b): round(L, 6) for b, L in lat_models[m].table(int(concurrency)).items()}
                           for m in models if m in lat_models},
        "step_latency_model": {m: lm.to_json() for m, lm in lat_models.items()},
        "step_latency_observed_s": {m: {str(b): float(np.median(v)) for b, v in sorted(lat[i].items())}
                                    for i, m in enumerate(models) if lat[i]},
        "transition": P.tolist(),
        "committed_tokens": C.tolist(),
        "quantum_s": float(quantum_s),
    }
    if fixed_thresholds:
        profile["fixed_thresholds"] = dict(fixed_thresholds)
    if run_lengths:
        rl: List[Dict[int, int]] = [defaultdict(int) for _ in range(M)]
        for hs in visits.values():
            hs.sort(key=lambda x: (x[0], x[1]))
            for (s1, _, _, j1), (s2, _, i2, _) in zip(hs, hs[1:]):
                if i2 == j1 and s2 > s1:
                    rl[j1][s2 - s1] += 1
        rl_field = {m: {str(k): c for k, c in sorted(rl[i].items())} for i, m in enumerate(models) if rl[i]}
        if rl_field:
            profile["run_lengths"] = rl_field
    if not _allow_missing:
        System.from_profile(profile)
    return profile
