"""Triton glue of the online B* adaptation (:mod:`tokenrouter.routing.online_bstar`): the router's
``online_*`` config parameters read into :class:`~tokenrouter.routing.online_bstar.OnlineSettings`,
and the adaptation's metric families on Triton's metrics endpoint.
"""

from __future__ import annotations

import json
import math
from typing import List, Mapping

from ..routing.online_bstar import OnlineSettings
from .common import param

__all__ = ["online_settings", "OnlineMetrics"]


def online_settings(params: Mapping[str, str], models: List[str]) -> OnlineSettings:
    """Read and check the ``online_*`` parameters of a router config (module docstring of
    :mod:`tokenrouter.routing.online_bstar`).

    Args:
        params: the router's config parameters, ``{key: string_value}``.
        models: the router's models (``online_fixed_thresholds`` and the prior profile must name them).

    Returns:
        the settings (``enabled`` false when ``online_adaptation`` is off or unset).

    Raises:
        ValueError: a malformed value, naming the parameter (the router then fails to load).
    """
    s = OnlineSettings(enabled=param(params, "online_adaptation", False, bool),
                       interval_s=param(params, "online_interval_s", 2.0, float),
                       window_s=param(params, "online_window_s", 30.0, float),
                       min_gain=param(params, "online_min_gain", 0.02, float),
                       min_request_steps=param(params, "online_min_request_steps", 50, int))
    for key, v in (("online_interval_s", s.interval_s), ("online_window_s", s.window_s)):
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"config parameter {key!r} must be a number of seconds > 0, got {v}")
    if not (math.isfinite(s.min_gain) and s.min_gain >= 0):
        raise ValueError(f"config parameter 'online_min_gain' must be >= 0, got {s.min_gain}")
    if s.min_request_steps < 1:
        raise ValueError(f"config parameter 'online_min_request_steps' must be >= 1, got {s.min_request_steps}")
    q = param(params, "online_quantum_s", "auto")
    if str(q).strip().lower() != "auto":
        try:
            s.quantum_s = float(q)
        except ValueError:
            raise ValueError(f"config parameter 'online_quantum_s' must be 'auto' or seconds, got {q!r}") from None
        if not (math.isfinite(s.quantum_s) and s.quantum_s > 0):
            raise ValueError(f"config parameter 'online_quantum_s' must be > 0, got {q!r}")
    raw = param(params, "online_fixed_thresholds", "")
    if raw:
        try:
            fixed = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"config parameter 'online_fixed_thresholds' is not JSON: {e}") from None
        if not isinstance(fixed, dict) or any(
                m not in models or isinstance(b, bool) or not isinstance(b, int) or b < 1 for m, b in fixed.items()):
            raise ValueError("config parameter 'online_fixed_thresholds' must be a JSON object "
                             f"{{model: integer B >= 1}} over the router's models {models}, got {raw!r}")
        s.fixed_thresholds = fixed
    path = param(params, "online_prior_profile", "")
    if path:
        from scheduler_model.errors import ProfileError
        from scheduler_model.profile import load_profile

        try:
            prof = load_profile(path)
        except ProfileError as e:
            raise ValueError(f"config parameter 'online_prior_profile': {e}") from None
        missing = [m for m in models if m not in prof.get("models", [])]
        if missing:
            raise ValueError(f"config parameter 'online_prior_profile': {path} lacks the models {missing}")
        s.prior_profile = prof
    return s


class OnlineMetrics:
    """The adaptation's metric families (module docstring of :mod:`tokenrouter.routing.online_bstar`),
    created and used on the thread allowed to call pb_utils.

    Args:
        pb: ``triton_python_backend_utils``.
        router: the router's model name (label ``router``).
        models: the router's models (label ``model`` of ``tokenrouter_batch_threshold``).
    """

    def __init__(self, pb, router: str, models: List[str]):
        G, C = pb.MetricFamily.GAUGE, pb.MetricFamily.COUNTER
        fam = {
            "B": ("tokenrouter_batch_threshold", "delayed-batching threshold B_i the model uses now "
                  "(online B* adaptation)", G),
            "solves": ("tokenrouter_batch_threshold_solves_total", "B* re-solves of the online adaptation", C),
            "changes": ("tokenrouter_batch_threshold_changes_total", "adaptation rounds that changed some "
                        "model's threshold", C),
            "T": ("tokenrouter_batch_threshold_predicted_tokens_per_s", "throughput the last B* solve predicts "
                  "for the thresholds in use (tokens/s)", G),
            "N": ("tokenrouter_batch_threshold_concurrency", "concurrency N the last B* solve used", G),
        }
        self._families = {k: pb.MetricFamily(name=n, description=d, kind=kind) for k, (n, d, kind) in fam.items()}
        self.threshold = {m: self._families["B"].Metric(labels={"model": m, "router": router}) for m in models}
        self.solves = self._families["solves"].Metric(labels={"router": router})
        self.changes = self._families["changes"].Metric(labels={"router": router})
        self.predicted = self._families["T"].Metric(labels={"router": router})
        self.concurrency = self._families["N"].Metric(labels={"router": router})

    def close(self) -> None:
        """Free the metric objects while the stub is alive (see triton_llm.finalize)."""
        self.threshold.clear()
        self.solves = self.changes = self.predicted = self.concurrency = None
        self._families.clear()
