"""The router's policy for models that are down: detection, refusal or fallback, recovery
(:class:`PeerFailure`; a dead model must not take routed requests down with it).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Dict, Iterable, List, Optional

from ..protocol import Ping
from ..routing.peer import PeerDownError, advert_path, read_advert
from . import model_control
from .metrics import Families, Family

__all__ = ["PeerFailure", "PEER_FAMILIES"]

logger = logging.getLogger(__name__)

#: the policy's metric families (labels: see :class:`PeerFailure`)
PEER_FAMILIES = {
    "up": Family("tokenrouter_peer_up", "gauge", "1 while the router can reach the model, 0 while it is down"),
    "restarts": Family("tokenrouter_peer_restarts_total", "counter", "times a model was found down and brought back"),
    "degraded": Family("tokenrouter_degraded_requests_total", "counter",
                       "requests that went on without a model that was down (on_peer_failure fallback)"),
}


class PeerFailure:
    """What the router does about models that are down.

    * **Detection**: :class:`~tokenrouter.routing.peer.PeerClient` watches each model's
      stub process (pid and start time from its advert or endpoint answer, checked
      every 0.25 s); when it exits, requests waiting on it end at once with
      :class:`~tokenrouter.routing.peer.PeerDownError` and :meth:`on_down` runs.
    * ``on_peer_failure = "fail"`` (default): those requests get an error naming the
      model, and new requests are refused at once (:meth:`refusal`) until it is back.
    * ``on_peer_failure = "fallback"``: requests go on on a live model (SLM-only),
      ``routing_summary`` gets ``"degraded": [model]`` and
      ``tokenrouter_degraded_requests_total`` counts them.
    * **Remote models** (``remote_models``: served by other tritonservers): the
      PeerClient pings each replica; one silent for ``heartbeat_timeout_s`` is down
      (its requests end with the error above; new requests go to the other replicas);
      with none left the model is down as above.  Nothing is restarted (that is the
      other server's job): the model is up again (:meth:`on_up`) when a replica answers.
    * **Recovery** (a thread): every ``restart_s`` seconds a Triton request is sent to
      the dead model (the Python backend restarts a dead stub when a request reaches
      it), or, where the server runs with ``--model-control-mode=explicit``, the
      model is loaded again; the restarted stub writes a fresh advert, the router
      checks it answers a ``ping`` and uses its new endpoint.
    * Metrics (:data:`PEER_FAMILIES`): ``tokenrouter_peer_up`` (1/0, labels ``model`` and ``router``),
      ``tokenrouter_peer_restarts_total`` (same labels) and
      ``tokenrouter_degraded_requests_total`` (label ``model``: the router).

    Every call into the Python backend (metrics, the restart request) runs on the router's
    client I/O thread, through ``on_io``.  The models' client is given with :meth:`attach`
    (it is built with this object's :meth:`on_down` and :meth:`on_up`).

    Args:
        pb_utils: the ``triton_python_backend_utils`` module.
        router: the router model's name (label ``router``; several routers may share a server).
        models: the router's models, in deployment order.
        mode: ``fail`` or ``fallback`` (:data:`~tokenrouter.triton.settings.ON_PEER_FAILURE`; the
            router's settings checked it).
        restart_s: seconds between two restart attempts of a dead model (> 0).
        on_io: runs a callable on the client I/O thread.
        closing: set once the router is shutting down.
        poke: sends ``model`` a Triton request (it raises while the model is down).
        remote: names of the remote models (never restarted from here).

    Raises:
        Whatever ``pb_utils.MetricFamily`` raises (e.g. a server without metrics).
    """

    def __init__(self, pb_utils, router: str, models: List[str], mode: str, restart_s: float,
                 on_io: Callable[[Callable[[], object]], None], closing: threading.Event,
                 poke: Callable[[str], object], remote: Iterable[str] = ()):
        self._pb_utils = pb_utils
        self.mode = mode
        self.fallback = mode == "fallback"
        self.restart_s = float(restart_s)
        self.remote = frozenset(remote)
        self.peers = None  # the models' client (PeerClient or TritonTransport): attach()
        self._on_io = on_io
        self._closing = closing
        self._poke_fn = poke
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._dead: Dict[str, float] = {}  # model -> time it was found down
        self._explicit: Optional[bool] = None  # does the model-control API work (explicit mode)?
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._recover_loop, name="router-recovery", daemon=True)
        self._families = Families(pb_utils, PEER_FAMILIES)
        self._up = {m: self._families.series("up", model=m, router=router) for m in models}
        self._restarts = {m: self._families.series("restarts", model=m, router=router) for m in models}
        self._degraded = self._families.series("degraded", model=router)
        for m in self._up.values():
            m.set(1.0)

    def attach(self, peers) -> None:
        """The models' client (``down``, ``mark_up``, ``mark_down``, ``call``) this policy acts on."""
        self.peers = peers

    def count_degraded(self) -> None:
        """Count one request that finished degraded."""
        self._on_io(lambda: self._degraded.increment(1.0))

    def drop_metrics(self) -> None:
        """Free the metric objects while the stub is alive (:meth:`~tokenrouter.triton.metrics.Families.close`)."""
        self._up.clear()
        self._restarts.clear()
        self._degraded = None
        self._families.close()

    # ------------------------------------------------------------ state
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)

    def on_down(self, model: str, reason: str) -> None:
        """Called by the PeerClient when ``model`` went down: note it, start its recovery."""
        with self._lock:
            self._dead.setdefault(model, time.monotonic())
        if model in self._up:
            self._on_io(lambda: self._up[model].set(0.0))
        self._wake.set()

    def on_up(self, model: str) -> None:
        """Called by the PeerClient when remote ``model`` answers again after it was down."""
        with self._lock:
            self._dead.pop(model, None)
        if model in self._up:
            self._on_io(lambda: (self._up[model].set(1.0), self._restarts[model].increment(1.0)))

    def _hint(self, models) -> str:
        if all(m in self.remote for m in models):
            return "a remote model: it is back when one of its servers answers again"
        return "the model is being restarted"

    def refusal(self) -> Optional[str]:
        """The reason to refuse a new request now (fail mode with a model down), else None."""
        if self._closing.is_set():
            return "token_router is shutting down: request refused"
        if self.fallback:
            return None
        down = self.peers.down()
        if not down:
            return None
        return ("token_router is not ready: " + "; ".join(sorted(down.values())) +
                f" (on_peer_failure=fail; {self._hint(down)}, retry later)")

    def describe(self, err: PeerDownError) -> str:
        """Client-facing message for a request that failed because a model went down.

        A local model without an advert was unloaded on purpose (its finalize withdraws the
        advert before it drains): at a server stop, once ``drain_timeout_s`` ran out. It is not
        restarted, so the message says so instead of "retry later"."""
        if err.model not in self.remote and self._unloaded_on_purpose(err.model):
            return (f"server is shutting down: model {err.model} was unloaded while the request ran "
                    f"(a server stop, or an explicit unload)")
        return f"{err} (on_peer_failure={self.mode}; {self._hint([err.model])}, retry later)"

    @staticmethod
    def _unloaded_on_purpose(model: str) -> bool:
        """True when local ``model`` has no advert, not even a stale one: its finalize withdrew it
        (a server stop or an explicit unload), where a dead stub leaves its advert behind."""
        return read_advert(model, alive_only=False) is None

    # ------------------------------------------------------------ recovery
    def _recover_loop(self) -> None:
        kicked: Dict[str, float] = {}
        while not self._stop.is_set():
            self._wake.wait(0.5)
            self._wake.clear()
            with self._lock:
                dead = [m for m in self._dead if m not in self.remote]  # remote: back by heartbeat
            for model in dead:
                if self._stop.is_set():
                    return
                if self._try_reconnect(model):
                    with self._lock:
                        self._dead.pop(model, None)
                    kicked.pop(model, None)
                    if model in self._up:
                        self._on_io(lambda m=model: (self._up[m].set(1.0), self._restarts[m].increment(1.0)))
                    continue
                now = time.monotonic()
                # the first reload starts at once; later attempts are restart_s apart
                if now - kicked.setdefault(model, now - self.restart_s) >= self.restart_s:
                    self._restart(model)
                    kicked[model] = time.monotonic()

    def _try_reconnect(self, model: str) -> bool:
        """Use the model's new advert if its process is alive and it answers a ping."""
        adv = read_advert(model)
        if adv is None:
            return False
        try:
            self.peers.mark_up(model, adv)
            self.peers.call(model, Ping(), timeout_s=10)
            return True
        except Exception as e:  # noqa: BLE001 - not back yet
            logger.info("model %s not back yet: %s", model, e)
            self.peers.mark_down(model, f"model {model} is down: no answer after its restart")
            return False

    def _restart(self, model: str) -> None:
        """Get a dead model's stub restarted.

        Where the server runs with ``--model-control-mode=explicit`` (as
        ``deploy/serve`` does), the model is unloaded and loaded again through the
        model-control API (:func:`tokenrouter.triton.model_control.reload`: over the
        server's HTTP endpoint, so this stub's responses keep flowing), on this
        thread (a load takes as long as the model's initialisation).  Several
        routers of one server may find the same model down: one reloads it (the
        one holding the lock file next to the model's advert), the others find its
        new advert.  In other modes that API refuses; then a Triton request is
        sent to the model on the client I/O thread (a dead stub answers it at once
        with "Stub process ... is not healthy"; Python backends that restart an
        unhealthy stub on a request do so then).
        """
        import fcntl

        if self._unloaded_on_purpose(model):
            return  # not restarted
        if self._explicit is not False:
            try:
                with open(advert_path(model) + ".lock", "a") as lock:
                    try:
                        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except OSError:
                        return  # another router is reloading it
                    if read_advert(model) is not None:
                        return  # someone (another router) already brought it back
                    model_control.reload(model, fallback=self._pb_utils)
                self._explicit = True
                logger.warning("model %s loaded again (model-control API)", model)
                return
            except Exception as e:  # noqa: BLE001
                logger.warning("model-control reload of %s failed: %s", model, e)
                if "not allowed" not in str(e):
                    return  # e.g. the new stub died while loading: the next attempt retries
                self._explicit = False  # no explicit model control on this server
        self._on_io(lambda: self._poke(model))

    def _poke(self, model: str) -> None:
        try:
            self._poke_fn(model)
        except Exception as e:  # noqa: BLE001 - expected while it is down
            logger.info("restart request to %s: %s", model, e)
