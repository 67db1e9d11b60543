"""Triton glue of the online B* adaptation (:mod:`tokenrouter.routing.online_bstar`): the adaptation's
metric families on Triton's metrics endpoint.  The router's ``online_*`` config parameters are read into
:class:`~tokenrouter.routing.online_bstar.OnlineSettings` by :func:`tokenrouter.triton.settings.online_settings`.
"""

from __future__ import annotations

from typing import List

from .metrics import Families, Family

__all__ = ["OnlineMetrics", "ONLINE_FAMILIES"]

#: the adaptation's metric families (labels: see :class:`OnlineMetrics`)
ONLINE_FAMILIES = {
    "B": Family("tokenrouter_batch_threshold", "gauge",
                "delayed-batching threshold B_i the model uses now (online B* adaptation)"),
    "solves": Family("tokenrouter_batch_threshold_solves_total", "counter", "B* re-solves of the online adaptation"),
    "changes": Family("tokenrouter_batch_threshold_changes_total", "counter",
                      "adaptation rounds that changed some model's threshold"),
    "T": Family("tokenrouter_batch_threshold_predicted_tokens_per_s", "gauge",
                "throughput the last B* solve predicts for the thresholds in use (tokens/s)"),
    "N": Family("tokenrouter_batch_threshold_concurrency", "gauge", "concurrency N the last B* solve used"),
}


class OnlineMetrics:
    """The adaptation's metric families (:data:`ONLINE_FAMILIES`; module docstring of
    :mod:`tokenrouter.routing.online_bstar`), created and used on the thread allowed to call pb_utils.

    Args:
        pb: ``triton_python_backend_utils``.
        router: the router's model name (label ``router``).
        models: the router's models (label ``model`` of ``tokenrouter_batch_threshold``).

    Raises:
        Whatever ``pb.MetricFamily`` raises (e.g. a server without metrics).
    """

    def __init__(self, pb, router: str, models: List[str]):
        self._families = Families(pb, ONLINE_FAMILIES, {"router": router})
        self.threshold = {m: self._families.series("B", model=m) for m in models}
        self.solves = self._families.series("solves")
        self.changes = self._families.series("changes")
        self.predicted = self._families.series("T")
        self.concurrency = self._families.series("N")

    def close(self) -> None:
        """Free the metric objects while the stub is alive (:meth:`~tokenrouter.triton.metrics.Families.close`)."""
        self.threshold.clear()
        self.solves = self.changes = self.predicted = self.concurrency = None
        self._families.close()
