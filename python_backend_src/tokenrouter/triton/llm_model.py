"""Triton model for one LLM subserver (``slm``, ``llm``, …): decoupled Python backend.

A router with ``transport: zmq`` reaches the model over the ZeroMQ inter-model
channel (:mod:`tokenrouter.routing.peer`: a ROUTER socket at ``peer_endpoint``,
default a fresh ``ipc://`` path, which op ``endpoint`` reports).  The same
operations are served as Triton requests: a router with ``transport: triton``
(:mod:`tokenrouter.triton.transport`) sends every segment that way, and admin
tools and tests use them.  Both ways, the ops (:mod:`tokenrouter.protocol`) go
to the model's one :class:`~tokenrouter.engine.op_dispatch.OpDispatcher`.  The
``run`` requests of one ``execute`` call — the arrivals Triton's dynamic batcher
grouped — enter the decode loop as one group, so they share a step
(docs/transport.md: how the batcher and the loop's own delayed batching divide
the work).  One *Triton I/O* thread sends every
response and publishes the metrics; ``execute`` only reads its requests.

Triton wire protocol (clients normally talk to ``token_router``):

Inputs
    ``request_id`` BYTES [1]   request id
    ``op`` BYTES [1]           ``run`` (default), ``release``, ``stats``, ``endpoint``, ``ping``
                               (answers ``{"kind": "pong", "pid", "instance", "model"}``), ``configure``
                               (``peer_req`` then holds scheduling settings to change
                               at run time, e.g. {"delayed_batch_size": B}: see _configure),
                               ``events`` (``peer_req``: {"since": cursor, "limit": n}; the
                               routing events after the cursor: see _events)
                               or ``calibrate`` (``peer_req``: {"batch_sizes", "context",
                               "decode_steps"}; times synthetic steps on an idle model:
                               see :class:`~tokenrouter.engine.op_dispatch.OpDispatcher`), ``flush``
                               (empties the prefix cache: answers {"kind": "flushed", "flushed_tokens",
                               "prefix_cache_tokens"}); the ops of :mod:`tokenrouter.protocol`
    ``input_ids`` INT64 [-1]   the token suffix this model has not seen (ragged)
    ``peer_req`` BYTES [1]     PeerReq header JSON (:class:`tokenrouter.protocol.PeerReq`)

Outputs (a stream of responses per ``run``; the last carries the FINAL flag)
    ``output_ids`` INT64 [-1]  tokens committed by this model in this chunk
    ``event`` BYTES [1]        JSON ``{"kind": "tokens"|"handoff"|"finished"|"cancelled", …}`` (an event
                               of :mod:`tokenrouter.protocol`; an op's failure is the request's error)

Config parameters (config.pbtxt ``parameters``; read once, at load, into
:class:`~tokenrouter.triton.settings.LLMSettings`, whose docstring gives each one's unit and
default): ``model_path``, ``dtype``,
``kv_pool_tokens``, ``max_running_requests``, ``context_length``,
``torch_threads``, ``load_format``, ``random_seed``, ``delayed_batch_size``,
``delayed_batch_max_wait_us``, ``stream_interval``, ``readmit_on_resume`` (std-serving baseline),
``drain_timeout_s`` (an unload waits this long for the requests the model holds; default 30),
``peer_endpoint`` (the inter-model channel's endpoint: default a fresh ``ipc://`` path;
``tcp://0.0.0.0:PORT`` serves routers of other servers, see ``remote_models`` in
:mod:`tokenrouter.triton.router_model`), ``curve`` (``on`` default / ``off``: CURVE on a TCP
endpoint), ``curve_secret_key_file`` and ``curve_authorized_keys_dir`` (see
:mod:`tokenrouter.routing.curve`), ``router_timeout_s`` (TCP: a router silent this long has its
requests released; default 10), ``lockstep_group`` (lock-step baseline: comma-separated
models stepping in turn), ``event_log`` (JSON Lines of routing events; ``{model}``
is replaced by the model name), ``capture_hidden`` (return the last hidden
state of every step to the routing algorithm: needed on model 0 by the learned
routers of CITER, R2R and Co-LLM), ``cpu_linear_weights`` (CPU hosts: ``dual``
default, ``packed`` or ``rowmajor``; see :class:`tokenrouter.engine.config.EngineConfig`);
GPU hosts: ``device`` (``auto`` default, ``cuda``, ``cpu``), ``attention_backend``
(SGLang's; empty: its default), ``cuda_graph`` (``true`` default), ``cuda_graph_max_bs``,
``mem_fraction_static`` (see :class:`tokenrouter.engine.config.EngineConfig`),
``prefix_cache`` (``true``/``false``: reuse the KV of cached prompt prefixes across requests,
:mod:`tokenrouter.engine.prefix_cache`; op ``configure`` switches it at run time); a ``KIND_GPU``
instance runs on the GPU Triton gives it (``instance_group { kind: KIND_GPU gpus: [i] }``).
Custom metrics on Triton's metrics endpoint (KV in use, tokens run through extend and decode,
handoffs, the prefix cache's; label ``model``): declared in :data:`tokenrouter.triton.metrics.MODEL_FAMILIES`.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from typing import Any, Dict, List

import numpy as np
import triton_python_backend_utils as pb_utils

from ..algorithms import configure as configure_algorithm
from ..engine.config import EngineConfig, SubserverConfig
from ..engine.event_ring import EventRing
from ..engine.lockstep import TurnRing, default_ring_path
from ..engine.op_dispatch import OpDispatcher
from ..engine.sglang_engine import SGLangEngine
from ..engine.subserver import Subserver
from ..routing.curve import CurveServer
from ..proc import process_start_time, server_pid
from ..routing.peer import PeerServer, dead_routers, remove_advert, write_advert
from ..protocol import Failed, ModelEvent, OpWire, encode_event, is_final
from . import model_control
from .messages import CloseIO, ErrorReply, TokensReply
from .common import model_parameters
from .init_watchdog import InitWatchdog
from .metrics import ModelMetrics
from .settings import RUNTIME_SCHEDULING, LLMSettings, scheduling_changes

logger = logging.getLogger(__name__)

_FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
#: seconds between two publications of the custom metrics
METRICS_INTERVAL_S = 0.1


def _str_input(request, name: str, default: str = "") -> str:
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return default
    v = t.as_numpy().reshape(-1)
    if v.size == 0:
        return default
    x = v[0]
    return x.decode("utf-8") if isinstance(x, bytes) else str(x)


class _EventLog:
    """Append-only JSON Lines writer for routing events (thread-safe)."""

    def __init__(self, path: str):
        self._f = open(path, "a", buffering=1, encoding="utf-8")
        self._lock = threading.Lock()

    def __call__(self, event: dict) -> None:
        with self._lock:
            self._f.write(json.dumps(event, separators=(",", ":")) + "\n")


class TritonPythonModel:
    """One model's subserver inside Triton (see module docstring)."""

    def initialize(self, args: Dict[str, Any]) -> None:
        """Triton's model load, one ``init_*`` step after the other: read the config parameters, build
        the engine (weights, KV pool) and the subserver, open the inter-model channel, advertise its
        endpoint and start the Triton I/O thread.

        Each step after the settings is logged as it starts and the whole load is bounded by
        ``init_timeout_s`` (:class:`~tokenrouter.triton.init_watchdog.InitWatchdog`: past it, every
        thread's stack goes to Triton's log and the stub ends, failing the load).

        Raises:
            pb_utils.TritonModelException: a bad config (the load fails; the message names the parameter).
        """
        self.init_settings(args)
        with InitWatchdog(self.name, self.settings.init_timeout_s, log=pb_utils.Logger.log_info) as watch:
            watch.run(self.init_scheduling)
            watch.run(self.init_engine, args)
            watch.run(self.init_events)
            watch.run(self.init_metrics)
            watch.run(self.init_subserver)
            watch.run(self.init_channel)
            watch.run(self._start_liveness)
            watch.run(self.init_io_thread)

    def init_settings(self, args: Dict[str, Any]) -> None:
        """Read the model config once: ``self.settings`` (:class:`~tokenrouter.triton.settings.LLMSettings`).

        Raises:
            pb_utils.TritonModelException: the model is not decoupled, a parameter is malformed or
                out of range (naming it), or ``model_path`` is no checkpoint folder.
        """
        self.model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(self.model_config):
            raise pb_utils.TritonModelException(
                "tokenrouter LLM models must be decoupled (model_transaction_policy { decoupled: true })")
        self.name = args["model_name"]
        try:
            self.settings = LLMSettings.from_parameters(model_parameters(self.model_config))
        except (ValueError, OSError) as e:
            raise pb_utils.TritonModelException(str(e)) from None
        # seconds an unload waits for the requests this model holds (Triton's default exit_timeout)
        self.drain_timeout_s = self.settings.drain_timeout_s

    def init_scheduling(self) -> None:
        """The decode loop's settings (:class:`SubserverConfig`) and, with ``lockstep_group``, the
        lock-step turn ring; before the engine loads, so that a bad group fails the load at once.

        Raises:
            pb_utils.TritonModelException: ``lockstep_group`` does not list this model.
        """
        self._ring_paths: set = set()  # lock-step turn files this model opened (removed at finalize)
        self._sched = SubserverConfig(**self.settings.subserver_kwargs())
        if self.settings.lockstep_group:
            try:
                self._sched.lockstep = self._ring(self.settings.lockstep_group)
            except ValueError as e:
                raise pb_utils.TritonModelException(str(e)) from None

    def init_engine(self, args: Dict[str, Any]) -> None:
        """Load the engine (weights, KV pool) on the device Triton gives this instance."""
        engine_kwargs = self.settings.engine_kwargs()
        if args.get("model_instance_kind") == "GPU":  # instance_group { kind: KIND_GPU gpus: [i] }
            engine_kwargs["gpu_id"] = int(args.get("model_instance_device_id") or 0)
        self.engine_config = EngineConfig(**engine_kwargs)
        t0 = time.time()
        self.engine = SGLangEngine(self.engine_config)
        # Triton's own log (tritonserver.log): which dtype "auto" chose, and where
        pb_utils.Logger.log_info(f"model {self.name} loaded in {time.time() - t0:.1f}s ({self.engine.dtype} on the "
                                 f"{'GPU' if self.engine.device == 'cuda' else 'CPU'})")

    def init_events(self) -> None:
        """Where routing events go: the ``event_log`` file (if set; ``{model}`` = this model's name)
        and the ring op ``events`` reads (online B*)."""
        event_log = self.settings.event_log
        self._event_log = _EventLog(event_log.replace("{model}", self.name)) if event_log else None
        self._events_ring = EventRing()  # recent routing events for op "events" (online B*)

    def init_subserver(self) -> None:
        """The subserver (admission and the decode loop) and the queue of the Triton I/O thread."""
        self._closing = threading.Event()
        # the Triton I/O thread: the only thread that sends responses and publishes metrics
        self._io_q: "queue.Queue" = queue.Queue()  # TokensReply, ErrorReply, CloseIO (triton.messages)
        self.subserver = Subserver(self.engine, self.name, self._sched, event_sink=self._on_event,
                                   on_pass=self._snapshot_metrics, configure_algorithm=configure_algorithm)

    def init_channel(self) -> None:
        """The inter-model channel's server at ``peer_endpoint`` (default a fresh ``ipc://`` path),
        with CURVE on a TCP endpoint.

        Raises:
            pb_utils.TritonModelException: a TCP endpoint with CURVE on and its keys missing or bad.
        """
        s = self.settings
        try:
            curve = CurveServer.from_settings(s.curve, s.peer_endpoint or "", self.name)
        except ValueError as e:
            raise pb_utils.TritonModelException(str(e)) from None
        # the ops of both ways in (Triton requests, the channel) go to one dispatcher
        self.dispatcher = OpDispatcher(self.subserver, configure=self._configure, events=self._events,
                                       endpoint=self._endpoint)
        self.peer_server = PeerServer(self.dispatcher, s.peer_endpoint, curve=curve,
                                      router_timeout_s=s.router_timeout_s)
        logger.info("model %s: inter-model channel on %s", self.name, self.peer_server.endpoint)

    def init_io_thread(self) -> None:
        """Start the Triton I/O thread (:meth:`_io_loop`)."""
        self._io_thread = threading.Thread(target=self._io_loop, name=f"triton-io-{self.name}", daemon=True)
        self._io_thread.start()

    # --------------------------------------------------------------- metrics
    def init_metrics(self) -> None:
        """The model's metric families (:class:`~tokenrouter.triton.metrics.ModelMetrics`) and the
        snapshot the loop thread fills."""
        self._metrics_snapshot = None
        self._next_snapshot = 0.0  # monotonic s
        self._metrics_dirty = threading.Event()
        self._metrics = ModelMetrics(pb_utils, self.name)

    def _snapshot_metrics(self) -> None:
        # on the loop thread after each pass: snapshot the counters (cheap), at most every
        # METRICS_INTERVAL_S while requests are ready and always when none is (the last state
        # before the loop waits); the I/O thread publishes the newest snapshot (an IPC per metric)
        s = self.subserver
        now = time.monotonic()
        if s.ready and now < self._next_snapshot:
            return
        self._next_snapshot = now + METRICS_INTERVAL_S
        self._metrics_snapshot = {
            "kv_tokens_in_use": self.engine.kv_tokens_in_use(), "kv_rows_in_use": self.engine.rows_in_use(),
            "active": len(s.requests), "extend_tokens": s.counters["extend_tokens"],
            "decode_tokens": s.counters["decode_tokens"], "handoffs_out": s.counters["handoffs_out"]}
        pc = self.engine.prefix_cache_stats()
        for key in ("prefix_cache_queries", "prefix_cache_hits", "prefix_cache_tokens",
                    "prefix_cache_evictable_tokens", "prefix_cache_evicted_tokens"):
            self._metrics_snapshot[key] = pc[key]
        self._metrics_dirty.set()

    def _publish_metrics(self, published):
        """Publish the newest snapshot if it changed; returns the snapshot now published."""
        snap = self._metrics_snapshot
        if snap is not None and snap != published:
            try:
                self._metrics.publish(snap)
                return snap
            except Exception:  # noqa: BLE001 - metrics must never stop serving
                logger.debug("metrics update failed", exc_info=True)
        return published

    def _io_loop(self) -> None:
        """Send queued responses in order; publish the metrics at most every METRICS_INTERVAL_S.

        The only thread of this stub that sends Triton responses or updates metrics
        (``execute`` only reads its requests), so no two threads call into the Python
        backend's response or metrics API at once.  Messages (:mod:`tokenrouter.triton.messages`):
        :class:`TokensReply`, :class:`ErrorReply`; :class:`CloseIO` ends the loop.
        """
        published, next_pub = None, 0.0
        while True:
            try:
                msg = self._io_q.get(timeout=METRICS_INTERVAL_S)
            except queue.Empty:
                msg = None
            try:
                match msg:
                    case CloseIO():
                        break
                    case TokensReply(sender=sender, tokens=tokens, event=event, final=final):
                        sender.send(self._response(tokens, event), flags=_FINAL if final else 0)
                    case ErrorReply(sender=sender) as reply:
                        sender.send(pb_utils.InferenceResponse(output_tensors=[], error=reply.triton_error(pb_utils)),
                                    flags=_FINAL)
            except Exception:  # noqa: BLE001 - e.g. the caller has gone
                logger.debug("model %s: response not delivered", self.name, exc_info=True)
            now = time.monotonic()
            if now >= next_pub and self._metrics_dirty.is_set():
                self._metrics_dirty.clear()
                published = self._publish_metrics(published)
                next_pub = now + METRICS_INTERVAL_S
        self._publish_metrics(published)

    def _reply(self, sender):
        """The reply of one Triton request (any thread): its events as responses through the I/O
        thread, a :class:`~tokenrouter.protocol.Failed` as the request's error."""
        def reply(event: ModelEvent, tokens=()) -> None:
            if isinstance(event, Failed):
                self._io_q.put(ErrorReply(sender, event.message, invalid=event.refused))
            else:
                self._io_q.put(TokensReply(sender, list(tokens), event, is_final(event)))
        return reply

    def _configure(self, cfg: Dict[str, Any]) -> None:
        """Apply a ``configure`` op: the config parameters of :data:`RUNTIME_SCHEDULING` (read from their
        declarations, :func:`~tokenrouter.triton.settings.scheduling_changes`), ``lockstep_group``
        ("" turns lock-step off) and ``prefix_cache`` (true/false; off only while no request reads a
        cached prefix).

        Raises:
            ValueError: an unknown key, or a value of the wrong kind or out of range (naming it).
        """
        unknown = sorted(set(cfg) - {*RUNTIME_SCHEDULING, "lockstep_group", "prefix_cache"})
        if unknown:
            raise ValueError(f"unknown configure key {unknown[0]!r}; allowed: "
                             f"{sorted([*RUNTIME_SCHEDULING, 'lockstep_group', 'prefix_cache'])}")
        if "prefix_cache" in cfg and not isinstance(cfg["prefix_cache"], bool):
            raise ValueError(f"configure: prefix_cache must be true or false, got {cfg['prefix_cache']!r}")
        changes = scheduling_changes(self.subserver.config, cfg)
        if "lockstep_group" in cfg:
            changes["lockstep"] = self._ring(str(cfg["lockstep_group"])) if cfg["lockstep_group"] else None
        self.subserver.reconfigure(**changes)
        if "prefix_cache" in cfg:
            self.subserver.call(lambda: self.engine.set_prefix_cache(cfg["prefix_cache"]))

    def _on_event(self, event: Dict[str, Any]) -> None:
        """The Subserver's event sink: keep the event for op ``events``; log it if configured."""
        self._events_ring(event)
        if self._event_log is not None:
            self._event_log(event)

    def _events(self, req: Any) -> Dict[str, Any]:
        """Op ``events``: routing events after a cursor, and the model's current batching settings.

        ``req`` is ``{"since": cursor, "limit": n}`` (both optional; see
        :meth:`tokenrouter.engine.event_ring.EventRing.answer`).

        Returns:
            ``{"model", "events": [step/handoff events, oldest first; t = time.time() in s],
            "cursor" (the next ``since``), "dropped", "reset", "delayed_batch_size",
            "delayed_batch_max_wait_us"}``.

        Raises:
            ValueError: malformed ``req`` (answered as that request's error).
        """
        out = self._events_ring.answer(req)
        cfg = self.subserver.config
        return {"model": self.name, **out, "delayed_batch_size": int(cfg.delayed_batch_size),
                "delayed_batch_max_wait_us": int(round(cfg.max_wait_s * 1e6))}

    def _endpoint(self) -> Dict[str, Any]:
        """Op ``endpoint``: ``{"endpoint"`` (the channel's), ``"pid", "start"}`` of this stub process."""
        return {"endpoint": self.peer_server.endpoint, "pid": os.getpid(), "start": process_start_time(os.getpid())}

    def _ring(self, group: str):
        members = [m.strip() for m in group.split(",") if m.strip()]
        if self.name not in members:
            raise ValueError(f"lockstep_group {group!r} does not list this model ({self.name!r})")
        path = default_ring_path(group)
        self._ring_paths.add(path)
        return TurnRing(path, members.index(self.name), len(members))

    # --------------------------------------------------------------- execute
    def execute(self, requests: List[Any]) -> None:
        """Hand the requests of one call to the dispatcher as one batch; its ``run`` ops enter the
        decode loop as one group.

        With ``dynamic_batching`` the requests of one call are the arrivals Triton's
        batcher grouped (router ``transport: triton``): submitting them together makes
        them join the same step (:meth:`Subserver.submit_group`).
        """
        batch = []
        for request in requests:
            reply = self._reply(request.get_response_sender())
            try:
                ids_t = pb_utils.get_input_tensor_by_name(request, "input_ids")
                ids = [] if ids_t is None else ids_t.as_numpy().reshape(-1).astype(np.int64).tolist()
                batch.append((OpWire(_str_input(request, "op", "run"), _str_input(request, "request_id"),
                                     _str_input(request, "peer_req", "{}"), ids), reply))
            except Exception as e:  # noqa: BLE001 - unreadable inputs fail this request only
                reply(Failed(message=f"model {self.name}: {e}"))
        self.dispatcher.handle(batch)
        return None

    @staticmethod
    def _response(tokens: List[int], event: ModelEvent):
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("output_ids", np.asarray(tokens, dtype=np.int64)),
            pb_utils.Tensor("event", np.asarray([encode_event(event)], dtype=np.object_)),
        ])

    # -------------------------------------------------------------- liveness
    def _start_liveness(self) -> None:
        """Advertise the endpoint and this process to the router (``routing.peer.write_advert``:
        the router watches the process and finds a restarted model's new endpoint there) and
        clean up if tritonserver goes away without finalising this stub (``stub_guard``)."""
        from . import stub_guard

        self._advert = write_advert(self.name, self.peer_server.endpoint)
        stub_guard.install(self._cleanup_files)
        threading.Thread(target=self._router_guardian, name=f"router-guardian-{self.name}", daemon=True).start()

    def _router_guardian(self, interval_s: float = 1.0) -> None:
        """Reload a router whose stub died (its advert names a dead process).

        The Triton 2.51 Python backend does not restart a dead stub of a decoupled
        model; with ``--model-control-mode=explicit`` the router is unloaded and
        loaded again through the model-control API.  One model does it: the one
        that holds the advert's lock file.  Without explicit mode the API refuses
        and the router stays down (logged once).
        """
        import fcntl

        from ..routing.peer import advert_path

        refused = set()
        while not self._closing.wait(interval_s):
            for router in dead_routers():
                if router in refused:
                    continue
                try:
                    with open(advert_path(router, kind="router") + ".lock", "a") as lock:
                        try:
                            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        except OSError:
                            continue  # another model is reloading it
                        if router not in dead_routers():
                            continue
                        logger.error("router %s is down (its stub exited): reloading it", router)
                        try:
                            model_control.reload(router, fallback=pb_utils)
                        except Exception as e:  # noqa: BLE001
                            logger.error("reload of router %s failed: %s", router, e)
                            if "not allowed" in str(e):
                                refused.add(router)  # no explicit model control: do not ask again
                except OSError:
                    continue

    def _cleanup_files(self) -> None:
        """Remove what this model created outside its process: advert, ipc socket, turn files."""
        self._closing.set()  # the router guardian stops first: no reload against a dead server
        remove_advert(self.name)
        self._remove_reload_locks()
        ep = self.peer_server.endpoint
        if ep.startswith("ipc://"):
            try:
                os.unlink(ep[len("ipc://"):])
            except OSError:
                pass
        for path in self._ring_paths:
            try:
                os.unlink(path)
            except OSError:
                pass

    @staticmethod
    def _remove_reload_locks() -> None:
        """Remove the lock files of reloads (of routers by models, of models by routers; re-created
        when needed)."""
        import glob
        import tempfile

        for lock in glob.glob(os.path.join(tempfile.gettempdir(), f"tokenrouter-{server_pid()}-*.json.lock")):
            try:
                os.unlink(lock)
            except OSError:
                pass

    def _drain(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s`` seconds) until this model holds no request.

        Triton waits for a model's own in-flight requests before it unloads it, but
        routed requests reach this model over ZeroMQ, not through Triton: without
        this wait a SIGTERM would unload the models under the router's streams."""
        deadline = time.monotonic() + timeout_s
        while self.subserver.requests and time.monotonic() < deadline:
            time.sleep(0.1)

    def finalize(self) -> None:
        """Triton's unload: withdraw the advert, drain the requests in flight (``drain_timeout_s``),
        stop the channel, the subserver's loops and the I/O thread, free the metric families and
        remove the lock-step turn files."""
        remove_advert(self.name)  # unloaded on purpose: the router does not restart it
        self._drain(self.drain_timeout_s)
        self._remove_reload_locks()
        self._closing.set()
        self.peer_server.close()
        self.subserver.stop()
        self._io_q.put(CloseIO())  # the I/O thread sends what is queued (the loop's last answers), then ends
        self._io_thread.join(timeout=5)
        # free the metric families now, while the stub's shared memory is alive: left to the
        # interpreter's final garbage collection, their destructors crash the stub on exit
        self._metrics.close()
        for path in self._ring_paths:  # lock-step turn files (/dev/shm)
            try:
                os.unlink(path)
            except OSError:
                pass  # the other member removed it first
