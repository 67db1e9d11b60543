"""Step-latency calibration against a running server: ``python -m tokenrouter.tools.admin calibrate``.

Each LLM model (Triton models ``slm``, ``llm``, …) runs its ``calibrate`` admin op
(:meth:`tokenrouter.engine.subserver.Subserver.calibrate`): on its decode-loop thread it builds b
synthetic sequences of ``context`` tokens, prefills them, times ``decode_steps`` decode steps
of b rows and one resume step (one row back from a peer with 2 new tokens, one extend forward
of b rows), and releases every KV row. It refuses while the model holds requests and fails
if its KV pool cannot hold the largest batch.

Calibration file (JSON; ``profile --calibration`` and ``solve --calibration`` read it)::

    {"url": "localhost:8001", "context": 256, "decode_steps": 8, "batch_sizes": [1, 2, 4, 8],
     "models": {"slm": {"model": "slm", "context": 256, "decode_steps": 8, "seconds": 12.3,
                        "table": [{"batch_size": 1, "decode_latency_s": [0.05, …],   # s, one per step
                                   "decode_median_s": 0.05, "resume_latency_s": 0.06,
                                   "resume_extend_tokens": 2,
                                   "prefill": [{"rows": 1, "extend_tokens": 256, "latency_s": 0.4}]},
                                  …],
                        "kv_tokens_in_use_after": 0, "kv_rows_in_use_after": 0}, …}}

Its points enter the fit of :mod:`scheduler_model.latency` as steps (b, 0, L) for decode,
(b, resume_extend_tokens, L) for the resume step and (rows, extend_tokens, L) for prefill.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Dict, Mapping, Sequence

from .errors import ProfileError
from .latency import StepLatencyModel, calibration_points, fit_step_latency

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32)


def run_calibration(url: str, models: Sequence[str], batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
                    context: int = 256, decode_steps: int = 8, timeout_s: float = 3600.0, *,
                    calibrate: Callable[..., Dict[str, Any]]) -> Dict[str, Any]:
    """Calibrate each model in turn over Triton gRPC at ``url`` (host:port); returns the calibration file dict.

    Args:
        calibrate: the client call that runs one model's ``calibrate`` op,
            ``calibrate(url, model, batch_sizes=, context=, decode_steps=, timeout_s=)`` → its
            answer (:func:`tokenrouter.tools.admin.calibrate`; this package imports nothing of
            tokenrouter).

    Raises:
        RuntimeError: a model refused or failed (busy, KV pool too small, bad arguments).
    """
    out: Dict[str, Any] = {"url": url, "context": int(context), "decode_steps": int(decode_steps),
                           "batch_sizes": [int(b) for b in batch_sizes], "models": {}}
    for m in models:
        res = calibrate(url, m, batch_sizes=batch_sizes, context=context, decode_steps=decode_steps,
                        timeout_s=timeout_s)
        res.pop("kind", None)
        out["models"][m] = res
    return out


def apply_calibration(profile: Mapping[str, Any], calib: Mapping[str, Any]) -> Dict[str, Any]:
    """A copy of ``profile`` whose step-latency model of every calibrated model is fitted to the calibration.

    For ``solve --calibration`` (the profile's raw events are gone): the fit uses the
    calibration points only, scaled by the κ the profile recorded for that model
    (``fit.calibration_scale``, :func:`scheduler_model.latency.contention_scale`; 1 if none);
    the workload's extend mix (q, x̄) is kept from the profile's model for that model, else 0
    (pure decode). ``step_latency_s`` is rewritten as L̄(b), b = 1 … N.
    (``profile --calibration`` instead fits events and calibration points together.)

    Raises:
        ProfileError: malformed calibration.
    """
    prof = copy.deepcopy(dict(profile))
    models_field = prof.setdefault("step_latency_model", {})
    for m in prof.get("models", []):
        b, e, L = calibration_points(calib, m)
        if not b:
            continue
        old = models_field.get(m)
        q = xbar = 0.0
        kappa = 1.0
        if old is not None:
            lm_old = StepLatencyModel.from_json(old, m)
            q, xbar = lm_old.extend_row_rate, lm_old.extra_extend_tokens_per_row
            kappa = float(lm_old.fit.get("calibration_scale", 1.0))
        lm = fit_step_latency(b, e, [x * kappa for x in L], workload=([], []), source_counts={"calibration": len(b)})
        if kappa != 1.0:
            lm.fit["calibration_scale"] = kappa
        lm.extend_row_rate, lm.extra_extend_tokens_per_row = q, xbar
        models_field[m] = lm.to_json()
        n = prof.get("concurrency")
        if isinstance(n, int) and not isinstance(n, bool) and n >= 1:
            prof.setdefault("step_latency_s", {})[m] = {str(k): round(v, 6) for k, v in lm.table(n).items()}
    if not models_field:
        prof.pop("step_latency_model")
    return prof


def load_calibration(path: str) -> Dict[str, Any]:
    """Read a calibration file. Raises ProfileError if unreadable or malformed."""
    from .profile import read_json

    calib = read_json(path, "calibration")
    if not isinstance(calib, dict) or not isinstance(calib.get("models"), dict):
        raise ProfileError(f"calibration {path} must be an object with a 'models' object")
    for m in calib["models"]:
        calibration_points(calib, m)
    return calib
