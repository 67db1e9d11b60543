"""B* adapted while serving: the router's online adaptation of the delayed-batching thresholds.

The paper computes the thresholds B* once, for a fixed concurrency N ("Known limits":
bursty real traffic calls for online adaptation).  With ``online_adaptation: true`` on a
router (``token_router``), one thread of the router (:class:`OnlineBStar`):

1. every ``online_interval_s`` seconds pulls each model's new routing events (``step`` and
   ``handoff``; op ``events`` of the models, :mod:`tokenrouter.engine.event_ring`) over the ZeroMQ
   channel, and samples the router's live requests every :data:`SAMPLE_S` seconds;
2. feeds both to :class:`scheduler_model.online.OnlineAdapter` (sliding window of
   ``online_window_s`` seconds, N = a low quantile of the live-request samples, hysteresis,
   at most one solve per round) and asks it for B*;
3. applies a B_i that differs from the model's current one with the model's ``configure``
   op: ``delayed_batch_size`` B_i and ``delayed_batch_max_wait_us`` the DTMC's wait bound
   (:func:`scheduler_model.config_writer.max_wait_us`);
4. publishes the thresholds and the solves as Triton metrics (on the router's client-I/O
   thread, the only one that calls into the Python backend):
   ``tokenrouter_batch_threshold{model,router}`` (gauge, the model's B_i),
   ``tokenrouter_batch_threshold_solves_total{router}`` and
   ``tokenrouter_batch_threshold_changes_total{router}`` (counters: solves, and rounds that
   changed some model's B), ``tokenrouter_batch_threshold_predicted_tokens_per_s{router}``
   and ``tokenrouter_batch_threshold_concurrency{router}`` (gauges: T(B) predicted by the
   last solve, tokens/s, and the N it used).

Rules:

* An idle router (no live request since the previous round) leaves the models' B alone;
  when it becomes busy again it starts from the models' current B (whatever set them:
  their configs, an operator's ``configure``, another router).  Enable it on one router
  per set of models: two adapting routers would overwrite each other's B.
* Before the window has enough data for a model the adapter uses ``online_prior_profile``
  (a PROFILE.json, see docs/scheduler.md) if given; without one no B is recommended until
  every model has enough data (the configured B stays).
* The DTMC's quantum δ is chosen from the observed step times (a tenth of the fastest
  model's median step, rounded down to 0.1 ms × a power of two) unless
  ``online_quantum_s`` sets it: the chain stays small for 50-300 ms CPU steps and exact
  enough for millisecond GPU steps.
* The solves run on this thread, at a lower CPU priority (nice +10), never on the client-I/O
  thread, and take at most :data:`SOLVE_CPU_SHARE` of a core: a solve of d seconds (up to
  ~5 s where the exact chain is too large and the search races simulations, e.g. N ≥ 16 on
  CPU step times) defers the next one by 3 d.

Config parameters of the router (``parameters`` in its config.pbtxt): ``online_adaptation``,
``online_interval_s``, ``online_window_s``, ``online_fixed_thresholds``, ``online_prior_profile``,
``online_quantum_s``, ``online_min_gain`` and ``online_min_request_steps``, declared with their
units, ranges and defaults on :class:`OnlineSettings` and read into it by
:mod:`tokenrouter.triton.settings`; the metric families are the Triton glue
:mod:`tokenrouter.triton.online`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import threading
import time
from typing import Any, Callable, Dict, List, Mapping, Optional

from ..engine.parameters import check_ranges, documented, param
from ..protocol import Configure, EventsQuery

logger = logging.getLogger(__name__)

__all__ = ["OnlineSettings", "OnlineBStar", "SAMPLE_S", "auto_quantum_s"]

#: seconds between two samples of the router's live requests
SAMPLE_S = 0.25
#: most ``events`` calls per model and round (each answer holds at most 5000 events)
MAX_PULLS_PER_ROUND = 8
#: largest share of one CPU core the solves may take: after a solve of d seconds the next one
#: waits d × (1 / SOLVE_CPU_SHARE − 1) seconds (a CPU host has few cores to spare)
SOLVE_CPU_SHARE = 0.25


@documented
@dataclasses.dataclass(frozen=True)
class OnlineSettings:
    """The router's ``online_*`` config parameters (module docstring), each declared here once
    (:func:`~tokenrouter.engine.parameters.param`); read by
    :func:`tokenrouter.triton.settings.online_settings` (``online_fixed_thresholds``,
    ``online_prior_profile`` and ``online_quantum_s``'s ``auto`` by its own code).

    Raises:
        ValueError: a value out of its declared range (naming it and its config parameter).
    """

    enabled: bool = param(False, key="online_adaptation", doc="``true`` turns the online adaptation of B* on")
    interval_s: float = param(2.0, unit="s", gt=0, finite=True, key="online_interval_s",
                              doc="time between two adaptation rounds")
    window_s: float = param(30.0, unit="s", gt=0, finite=True, key="online_window_s",
                            doc="the sliding window of routing events the adapter estimates from")
    fixed_thresholds: Dict[str, int] = param(default_factory=dict, key="online_fixed_thresholds", shown="none", doc=(
        "JSON ``{model: B}``: thresholds held fixed in the search, e.g. ``{\"slm\": 1}`` (each model one "
        "of the router's, each B an integer >= 1)"))
    prior_profile: Optional[Dict[str, Any]] = param(None, key="online_prior_profile", kind=str, shown="none", doc=(
        "path of a PROFILE.json (``python -m scheduler_model profile``) used until the window has data; "
        "the field holds the loaded profile (it must list the router's models)"))
    quantum_s: Optional[float] = param(None, unit="s", gt=0, finite=True, key="online_quantum_s", kind=str,
                                       shown="`auto`", doc=(
        "the DTMC's time quantum δ; ``auto`` (None): a tenth of the fastest model's median step "
        "(:func:`auto_quantum_s`)"))
    min_gain: float = param(0.02, ge=0, finite=True, key="online_min_gain",
                            doc="relative predicted throughput gain needed to switch B")
    min_request_steps: int = param(50, unit="request-steps", ge=1, key="online_min_request_steps",
                                   doc="request-steps a model needs in the window before its P, C and L_i are re-estimated")

    def __post_init__(self) -> None:
        check_ranges(self)


def auto_quantum_s(step_latencies: Mapping[str, List[float]]) -> Optional[float]:
    """δ for the DTMC from observed step latencies (s): a tenth of the smallest per-model median,
    rounded down to 1e-4 s × a power of two (so small changes keep the solver's cache), within
    [1e-4, 0.0512] s; None without observations."""
    meds = []
    for lat in step_latencies.values():
        if lat:
            v = sorted(lat)
            meds.append(v[len(v) // 2])
    if not meds:
        return None
    x = max(1e-4, min(0.0512, min(meds) / 10))
    return 1e-4 * 2 ** math.floor(math.log2(x / 1e-4) + 1e-9)


class OnlineBStar:
    """The router's adaptation thread (module docstring).

    Args:
        settings: :class:`OnlineSettings` (``enabled`` must be true).
        models: the router's models, deployment order.
        router: the router's model name (metric label).
        peers: the router's :class:`~tokenrouter.routing.peer.PeerClient` (``call`` is thread-safe).
        live_requests: callable → number of requests the router is driving now.
        on_io: callable(fn) running ``fn`` on the router's client-I/O thread.
        metrics: the adaptation's metrics (:class:`tokenrouter.triton.online.OnlineMetrics`:
            ``threshold[model]``, ``solves``, ``changes``, ``predicted``, ``concurrency``, ``close()``;
            used on the client-I/O thread only), or None for no metrics.
    """

    def __init__(self, settings: OnlineSettings, models: List[str], router: str, peers,
                 live_requests: Callable[[], int], on_io: Callable[[Callable[[], None]], None], metrics=None):
        from scheduler_model.online import OnlineAdapter

        self.settings = settings
        self.models = list(models)
        self.router = router
        self.peers = peers
        self.live_requests = live_requests
        self.on_io = on_io
        self.adapter = OnlineAdapter(self.models, default_concurrency=1, window_s=settings.window_s,
                                     quantum_s=settings.quantum_s or 1e-4,
                                     fixed_thresholds=settings.fixed_thresholds or None,
                                     prior_profile=settings.prior_profile, min_gain=settings.min_gain,
                                     min_request_steps=settings.min_request_steps,
                                     min_interval_s=0.5 * settings.interval_s)
        self.cursors: Dict[str, int] = {}
        self.current: Dict[str, int] = {}  # each model's B as last read or applied
        self.last_recommendation = None  # scheduler_model.online.Recommendation
        self.solves = 0
        self.changes = 0
        self._latencies: Dict[str, List[float]] = {m: [] for m in self.models}  # recent step latencies (s)
        self._was_busy = False
        self._next_solve = 0.0  # monotonic time before which no solve starts (SOLVE_CPU_SHARE)
        self._published: Dict[str, int] = {}  # thresholds the gauges show
        self._errors_logged: set = set()
        self._metrics = metrics
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="router-online-bstar", daemon=True)

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the adaptation thread."""
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the thread (a solve in progress finishes first, up to ``timeout_s``) and free the metrics
        (on the client-I/O thread, after anything the thread queued there)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)
        metrics, self._metrics = self._metrics, None
        if metrics is not None:
            self.on_io(metrics.close)

    # ------------------------------------------------------------ the loop
    def _loop(self) -> None:
        try:  # solves are CPU work: let the serving threads of this host go first (Linux, per thread)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        except (AttributeError, OSError):
            pass
        next_round = time.monotonic() + self.settings.interval_s
        busy = False
        while not self._stop.wait(min(SAMPLE_S, self.settings.interval_s)):
            n = int(self.live_requests())
            busy = busy or n > 0
            self.adapter.set_concurrency(n, time.time())
            if time.monotonic() >= next_round:
                try:
                    self.round(busy)
                except Exception:  # noqa: BLE001 - adaptation must never stop serving
                    logger.exception("online B*: adaptation round failed")
                busy = False
                next_round = time.monotonic() + self.settings.interval_s

    def round(self, busy: bool) -> None:
        """One adaptation round: pull events; when ``busy``, solve and apply (module docstring)."""
        actual = self._pull()
        self.current.update(actual)
        try:
            if not busy:
                self._was_busy = False
                return
            if not self._was_busy or self.adapter.current is None:
                if len(actual) == len(self.models):  # a busy period starts from the models' current B
                    self.adapter.current = dict(actual)
            self._was_busy = True
            if self.settings.quantum_s is None:
                q = auto_quantum_s(self._latencies)
                if q is not None:
                    self.adapter.quantum_s = q
            if time.monotonic() < self._next_solve:
                return
            t0 = time.monotonic()
            rec = self._recommend()
            spent = time.monotonic() - t0
            self._next_solve = time.monotonic() + spent * (1.0 / SOLVE_CPU_SHARE - 1.0)
            if rec is not None:
                self._apply(rec, actual)
        finally:
            self._publish_thresholds()

    # ------------------------------------------------------------ steps
    def _pull(self) -> Dict[str, int]:
        """New events of every reachable model into the adapter; returns {model: its current B}."""
        from ..engine.event_ring import MAX_EVENTS_PER_ANSWER

        events: List[Dict[str, Any]] = []
        actual: Dict[str, int] = {}
        for m in self.models:
            try:
                for _ in range(MAX_PULLS_PER_ROUND):
                    ans = self.peers.call(m, EventsQuery(args={"since": self.cursors.get(m, 0)}), timeout_s=10.0)
                    if ans.get("reset"):
                        logger.info("online B*: model %s restarted; reading its events from the start", m)
                    self.cursors[m] = int(ans["cursor"])
                    actual[m] = int(ans["delayed_batch_size"])
                    batch = ans.get("events") or []
                    events.extend(batch)
                    if len(batch) < MAX_EVENTS_PER_ANSWER:
                        break
            except Exception as e:  # noqa: BLE001 - a model down or busy: skip it this round
                logger.debug("online B*: no events from %s: %s", m, e)
        events.sort(key=lambda ev: ev.get("t", 0.0))
        for ev in events:
            if ev.get("event") == "step" and ev.get("model") in self._latencies:
                lat = self._latencies[ev["model"]]
                lat.append(float(ev.get("latency_s", 0.0)))
                del lat[:-2000]
            try:
                self.adapter.observe(ev)
            except Exception as e:  # noqa: BLE001 - one malformed event is skipped
                logger.debug("online B*: event skipped: %s", e)
        return actual

    def _recommend(self):
        """The adapter's recommendation, or None (not enough data yet, or the solve failed)."""
        from scheduler_model.errors import ProfileError

        try:
            rec = self.adapter.recommend()
        except ProfileError as e:  # not enough data in the window and no prior profile
            logger.debug("online B*: no recommendation yet: %s", e)
            return None
        except Exception as e:  # noqa: BLE001 - e.g. a solver limit: keep the current B
            msg = f"{type(e).__name__}: {e}"
            if msg not in self._errors_logged:
                self._errors_logged.add(msg)
                logger.warning("online B*: solve failed, keeping the current thresholds: %s", msg)
            return None
        if rec.reason != "rate-limited":
            self.solves += 1
            self.last_recommendation = rec
            T, N = float(rec.throughput_tokens_per_s), float(rec.concurrency)
            self._io(lambda mt: (mt.solves.increment(1.0), mt.predicted.set(T), mt.concurrency.set(N)))
        return rec

    def _apply(self, rec, actual: Mapping[str, int]) -> None:
        """Configure every reachable model whose B differs from ``rec.B_star``; update the gauges."""
        B = {m: int(rec.B_star[m]) for m in self.models}
        wait = self._wait_bounds(rec)
        changed = []
        for m in self.models:
            if m not in actual or actual[m] == B[m]:
                continue
            settings = {"delayed_batch_size": B[m]}
            if wait is not None:
                settings["delayed_batch_max_wait_us"] = int(wait[m])
            try:
                self.peers.call(m, Configure(args=settings), timeout_s=30.0)
            except Exception as e:  # noqa: BLE001 - retried next round
                logger.warning("online B*: configure %s on %s failed: %s", settings, m, e)
                continue
            self.current[m] = B[m]
            changed.append(m)
        if changed:
            self.changes += 1
            logger.warning("online B*: B = %s (%s; predicted %.1f tokens/s at N = %d; applied to %s)",
                        B, rec.reason, rec.throughput_tokens_per_s, rec.concurrency, ", ".join(changed))
        if changed:
            self._io(lambda mt: mt.changes.increment(1.0))

    def _publish_thresholds(self) -> None:
        """Set the ``tokenrouter_batch_threshold`` gauges to the models' B when they changed."""
        now = dict(self.current)
        if now == self._published:
            return
        self._published = now

        def publish(mt) -> None:
            for m, b in now.items():
                mt.threshold[m].set(float(b))

        self._io(publish)

    @staticmethod
    def _wait_bounds(rec) -> Optional[Dict[str, int]]:
        """The DTMC's delayed-batching wait bound per model (µs), or None if it cannot be derived."""
        from scheduler_model.config_writer import max_wait_us
        from scheduler_model.system import System

        try:
            return max_wait_us(System.from_profile(rec.profile), rec.B_star, rec.throughput_tokens_per_s)
        except Exception as e:  # noqa: BLE001 - keep the configured wait bound
            logger.debug("online B*: no wait bound: %s", e)
            return None

    def _io(self, fn: Callable[[Any], Any]) -> None:
        """Run ``fn(metrics)`` on the client-I/O thread (nothing without metrics)."""
        if self._metrics is None:
            return
        metrics = self._metrics
        self.on_io(lambda: fn(metrics) if metrics.solves is not None else None)
