"""Triton glue of the online B* adaptation (:mod:`tokenrouter.routing.online_bstar`): the adaptation's
metric families on Triton's metrics endpoint.  The router's ``online_*`` config parameters are read into
:class:`~tokenrouter.routing.online_bstar.OnlineSettings` by :func:`tokenrouter.triton.settings.online_settings`.
"""

from __future__ import annotations

from typing import List

__all__ = ["OnlineMetrics"]


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
