"""``token_router``: the client-facing decoupled BLS model.

It tokenises the prompt (chat template on request), drives each request
through the model subservers with the routing algorithm's handoffs (the paper's
inter-model loop: the PeerReq of a handing-off model is forwarded, with the
token suffix the peer has not seen, to the peer), streams detokenised text back
and releases every model's state at the end.

The client interface (inputs and outputs, vllm_backend conventions) and the reading and
checking of a request's inputs: :mod:`tokenrouter.triton.request`.  What happens when a model
is down: :mod:`tokenrouter.triton.peer_failure`.

Config parameters: read once, at load, into :class:`~tokenrouter.triton.settings.RouterSettings`.
Each is declared once, with its unit, range, default and doc, on the object that holds it:
:class:`~tokenrouter.triton.settings.RouterSettings` (``models``, ``algorithm``, ``algorithm_params``,
``tokenizer_path``, ``context_length``, ``default_max_tokens``, ``max_concurrent_requests``,
``transport`` (below), ``remote_models``, ``on_peer_failure``
(:class:`~tokenrouter.triton.peer_failure.PeerFailure`), ``peer_restart_s``, ``peer_timeout_s``
(the backstop for a hung model -- a dead one is found by its process or heartbeat, and a request
waiting for KV ends at its queue timeout, as "busy", long before), ``heartbeat_interval_s``,
``heartbeat_timeout_s``, ``init_timeout_s``), :class:`~tokenrouter.triton.settings.RequestLimits`
and :class:`~tokenrouter.engine.sampling.InputLimits` (the limits on a request and its sampling
parameters), :class:`~tokenrouter.routing.curve.CurveSettings` (``curve``,
``curve_secret_key_file``, ``curve_server_public_keys``) and
:class:`~tokenrouter.routing.online_bstar.OnlineSettings` (``online_*``: B* adapted while serving);
:func:`~tokenrouter.triton.settings.router_parameters` lists them all.

Models are reached over the ZeroMQ channel of :mod:`tokenrouter.routing.peer`:
a model of ``remote_models`` at its listed endpoints (new requests spread over its
replicas, each request staying on the replica that holds its state); any other
model's endpoint is read from its advert file or asked once with a BLS call
(op ``endpoint``).  That is ``transport: zmq`` (default); with ``transport:
triton`` every visit of a request to a model is a decoupled BLS request to it
(:mod:`tokenrouter.triton.transport`), so handoffs pass Triton's scheduler and
dynamic batcher (models in this server only: no ``remote_models``).

LLM-serving metrics (TTFT, time per output token, end-to-end, queue and
handoff latency histograms; token, request and handoff counters; running and
waiting gauges) go to Triton's metrics endpoint: see :mod:`tokenrouter.triton.metrics`.

Threads (paper §Design, three decoupled loops): ``execute`` parses and queues;
one worker per request runs the inter-model loop (:func:`router_core.drive`);
one *client I/O* thread sends every response, checks cancellation, updates the
metrics and makes the endpoint BLS calls, so no two threads of this stub call
into the Python backend's response or metrics API at once (besides ``execute``
reading its requests).  With ``transport: triton`` the BLS streams of the
segments run on their own *pump* threads, which only make BLS calls and read
their responses; why that is safe in the Triton 2.51 stub, and the fence the
client I/O thread runs for them, is explained in :mod:`tokenrouter.triton.transport`.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import replace
from typing import Any, Dict, List, Optional

import numpy as np
import triton_python_backend_utils as pb_utils

from ..algorithms import get_algorithm
from ..engine.detok import IncrementalDetokenizer, TokenStrings, load_tokenizer, stop_token_ids
from ..engine.grammar import GrammarCompiler
from ..engine.subserver import BUSY_PREFIX
from ..routing.curve import CurveClient
from ..routing.peer import PeerClient, PeerDownError, read_advert, remove_advert, write_advert
from ..routing.segments import RequestRefused
from ..protocol import FinishReason
from ..routing.router_core import drive, make_header
from .common import model_parameters
from .init_watchdog import InitWatchdog
from .messages import (BusyCount, BusyReply, EndpointQuery, ErrorReply, FinalOutputs, IOCall, RequestMetrics,
                       TextChunk)
from .metrics import RouterMetrics, observe_request
from .peer_failure import PeerFailure
from .request import (ClientError, ClientRequest, RequestParser, logprobs_json, longest_token_bytes, output_tensors,
                      routing_summary, wants_logprobs)
from .settings import RequestLimits, RouterSettings
from .transport import TritonTransport

logger = logging.getLogger(__name__)

_FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


#: seconds between two cancellation sweeps of the client I/O loop (each check
#: of a request is an IPC round trip to the server: at 0.05 s, 32 streams cost
#: 640 round trips a second, a few % of a core on a 2-core host)
CANCEL_CHECK_INTERVAL_S = 0.2

#: seconds between two ticks of a request waiting for a model (its stall deadline
#: check); a cancellation found by the sweep wakes the waiting requests at once
#: (``peers.interrupt``), so they do not poll
WAIT_TICK_S = 1.0


def bls_endpoint(model: str) -> Dict[str, Any]:
    """Ask ``model`` for its inter-model endpoint with a BLS request (op ``endpoint``).

    Call it from the router's client I/O thread only (see :meth:`TritonPythonModel._discover_endpoint`).

    Returns:
        ``{"endpoint": str, "pid": int, "start": int | None}``.

    Raises:
        RuntimeError: the model answered with an error (a dead stub: "not healthy"), or gave no endpoint.
    """
    req = pb_utils.InferenceRequest(
        model_name=model, requested_output_names=["event"],
        inputs=[pb_utils.Tensor("request_id", np.asarray([[b""]], dtype=np.object_)),
                pb_utils.Tensor("op", np.asarray([[b"endpoint"]], dtype=np.object_)),
                pb_utils.Tensor("input_ids", np.zeros((1, 0), dtype=np.int64)),
                pb_utils.Tensor("peer_req", np.asarray([[b"{}"]], dtype=np.object_))])
    for resp in req.exec(decoupled=True):
        if resp.has_error():
            raise RuntimeError(f"model {model}: {resp.error().message()}")
        ev_t = pb_utils.get_output_tensor_by_name(resp, "event")
        if ev_t is not None:
            ev = json.loads(ev_t.as_numpy().reshape(-1)[0])
            if ev.get("endpoint"):
                return {"endpoint": str(ev["endpoint"]), "pid": ev.get("pid"), "start": ev.get("start")}
    raise RuntimeError(f"model {model} has no inter-model endpoint (is it a tokenrouter LLM model?)")


class TritonPythonModel:
    """The router (see module docstring)."""

    def initialize(self, args: Dict[str, Any]) -> None:
        """Triton's model load, one ``init_*`` step after the other: read the config parameters,
        load the tokenizer and the algorithm, connect to the models, start the threads; each step
        after the settings logged as it starts, the load bounded by ``init_timeout_s``
        (:class:`~tokenrouter.triton.init_watchdog.InitWatchdog`).

        Raises:
            pb_utils.TritonModelException: a bad config (the load fails; the message names the parameter).
        """
        self.init_settings(args)
        with InitWatchdog(self._name, self.settings.init_timeout_s, log=pb_utils.Logger.log_info) as watch:
            watch.run(self.init_tokenizer)
            watch.run(self.init_algorithm)
            watch.run(self.init_limits)
            watch.run(self.init_parser)
            watch.run(self.init_workers)
            watch.run(self.init_peers)
            watch.run(self.init_metrics, args)
            watch.run(self.init_online)
            watch.run(self.init_threads)

    def init_settings(self, args: Dict[str, Any]) -> None:
        """Read the model config once: ``self.settings``
        (:class:`~tokenrouter.triton.settings.RouterSettings`), checked before anything starts.

        Raises:
            pb_utils.TritonModelException: the model is not decoupled, a parameter is malformed or
                out of range (naming it), or ``tokenizer_path`` is no checkpoint folder.
        """
        self.model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(self.model_config):
            raise pb_utils.TritonModelException("token_router must be decoupled")
        self._name = str(self.model_config.get("name", "token_router"))
        try:
            self.settings = RouterSettings.from_parameters(model_parameters(self.model_config))
        except (ValueError, OSError) as e:
            raise pb_utils.TritonModelException(str(e)) from None
        self.models: List[str] = list(self.settings.models)
        self.remote = self.settings.remote_models
        self.transport = self.settings.transport
        self.default_max_tokens = self.settings.default_max_tokens

    def init_tokenizer(self) -> None:
        """Load the tokenizer (``tokenizer_path``); the context length (``context_length``, else the
        tokenizer's ``model_max_length``, 8192 where it has none), stop tokens and vocabulary size."""
        self.tokenizer = load_tokenizer(self.settings.tokenizer_path)  # after the stub's locale fix
        self.context_length = self.settings.context_length or int(
            getattr(self.tokenizer, "model_max_length", 8192) if
            getattr(self.tokenizer, "model_max_length", 0) < 10**7 else 8192)
        self.stop_token_ids = stop_token_ids(self.tokenizer)
        self.token_strings = TokenStrings(self.tokenizer)  # logprobs' decoded_token
        # guided decoding: every new grammar is compiled here first, within grammar_compile_timeout_ms
        self.grammar = GrammarCompiler(self.tokenizer, len(self.tokenizer), self.stop_token_ids).start()

    def init_algorithm(self) -> None:
        """The routing algorithm (``algorithm``) and its checked parameters (``algorithm_params``),
        the base of every request's parameters."""
        self.algorithm = self.settings.algorithm
        self.algo_cls = get_algorithm(self.algorithm)
        self.base_params = dict(self.settings.algorithm_params)

    def init_limits(self) -> None:
        """The request and queue limits (:class:`~tokenrouter.triton.settings.RequestLimits`);
        ``max_input_bytes`` defaults to ``context_length`` × the longest token in bytes."""
        lim = self.settings.limits
        if lim.max_input_bytes is None:
            lim = replace(lim, max_input_bytes=self.context_length * longest_token_bytes(self.tokenizer))
        self.limits: RequestLimits = lim

    def init_parser(self) -> None:
        """The reader of the requests' inputs (:class:`~tokenrouter.triton.request.RequestParser`)."""
        self.parser = RequestParser(tokenizer=self.tokenizer, limits=self.limits, context_length=self.context_length,
                                    default_max_tokens=self.default_max_tokens, algorithm=self.algorithm,
                                    algo_cls=self.algo_cls, base_params=self.base_params, n_models=len(self.models),
                                    vocab_size=len(self.tokenizer), grammar=self.grammar)

    def init_workers(self) -> None:
        """The worker pool (``max_concurrent_requests`` threads), the table of active requests and
        the client I/O queue."""
        self.pool = ThreadPoolExecutor(max_workers=self.settings.max_concurrent_requests,
                                       thread_name_prefix="router")
        self._closing = threading.Event()
        # the client I/O loop: the only thread that sends responses and checks cancellation
        self._out: "queue.Queue" = queue.Queue()  # tokenrouter.triton.messages
        self._active: Dict[str, ClientRequest] = {}
        self._active_lock = threading.Lock()
        self._running = 0  # jobs a worker is driving (the rest of _active wait for one)

    def init_peers(self) -> None:
        """How the models are reached: the failure policy (:class:`PeerFailure`: ``on_peer_failure``,
        ``peer_restart_s``) and the transport (``zmq``: a :class:`PeerClient`, which waits up to a
        heartbeat timeout for the remote models; ``triton``: a :class:`TritonTransport`).

        Raises:
            pb_utils.TritonModelException: CURVE keys missing or unreadable (naming the parameter).
        """
        s = self.settings
        self.failure = PeerFailure(pb_utils, self._name, self.models, s.on_peer_failure, s.peer_restart_s,
                                   on_io=lambda fn: self._out.put(IOCall(fn)), closing=self._closing,
                                   poke=bls_endpoint, remote=self.remote)
        if self.transport == "zmq":
            try:
                curve = CurveClient.from_settings(s.curve, self.remote)
            except ValueError as e:
                raise pb_utils.TritonModelException(str(e)) from None
            self.peers = PeerClient(self._discover_endpoint, stall_timeout_s=s.peer_timeout_s, tick_s=WAIT_TICK_S,
                                    on_down=self.failure.on_down, on_up=self.failure.on_up, remote=self.remote,
                                    curve=curve, heartbeat_s=s.heartbeat_interval_s,
                                    heartbeat_timeout_s=s.heartbeat_timeout_s)
            silent = self.peers.wait_connected(self.peers.heartbeat_timeout_s) if self.remote else []
            if silent:
                logger.warning("router: no answer yet from %s (requests to a model none of whose replicas "
                               "answers are refused until one does)", "; ".join(silent))
        else:  # "triton" (RouterSettings allows no other value, and no remote_models with it)
            self.peers = TritonTransport(self._discover_process, stall_timeout_s=s.peer_timeout_s,
                                         tick_s=WAIT_TICK_S, on_down=self.failure.on_down, pb_utils=pb_utils)
        self.failure.attach(self.peers)
        #: the Triton transport's finished BLS streams are freed after a cancellation check (its fence)
        self._fence = self.peers if self.transport == "triton" else None

    def init_threads(self) -> None:
        """Start the client I/O thread, the failure policy's recovery thread and the online B* thread;
        advertise this router (the models restart a dead one) and install the stub guard."""
        self._io_done = threading.Event()
        self._io = threading.Thread(target=self._client_io, name="router-client-io", daemon=True)
        self._io.start()
        self.failure.start()
        if self.online is not None:
            self.online.start()
        from . import stub_guard  # no orphan if tritonserver goes away without finalising this stub

        write_advert(self._name, "", kind="router")  # the models restart a dead router
        stub_guard.install(self._cleanup_files)

    def _cleanup_files(self) -> None:
        """(tritonserver gone) Remove this router's advert and ipc socket."""
        remove_advert(self._name, kind="router")
        self.peers.close()

    # --------------------------------------------------------------- metrics
    def init_metrics(self, args: Dict[str, Any]) -> None:
        """``self.metrics``: the router's metric families (None, logged, where the server offers no metrics)."""
        try:
            self.metrics: Optional[RouterMetrics] = RouterMetrics(
                pb_utils, args.get("model_name", "token_router"), str(args.get("model_version", "1")), self.models)
        except Exception:  # noqa: BLE001 - metrics must never stop serving
            logger.warning("router: metrics unavailable", exc_info=True)
            self.metrics = None

    def init_online(self) -> None:
        """``self.online``: the online B* adaptation (:mod:`tokenrouter.routing.online_bstar`) if
        ``online_adaptation`` is on, else None."""
        from ..routing.online_bstar import OnlineBStar
        from .online import OnlineMetrics

        self.online = None
        settings = self.settings.online
        if not settings.enabled:
            return

        def live() -> int:
            with self._active_lock:
                return self._running

        name = str(self.model_config.get("name", "token_router"))
        self.online = OnlineBStar(settings, self.models, name, self.peers, live,
                                  lambda fn: self._out.put(IOCall(fn)),
                                  metrics=OnlineMetrics(pb_utils, name, self.models))

    def _io_metrics(self, payload) -> None:
        """Record one request's metrics (client I/O thread only: every update is an IPC)."""
        if self.metrics is None:
            return
        try:
            if isinstance(payload, str):
                self.metrics.record_failure(payload)
            else:
                self.metrics.record(payload)
        except Exception:  # noqa: BLE001
            logger.debug("router: metrics update failed", exc_info=True)

    def _io_busy(self, reason: str) -> None:
        """Count one request answered "busy" (client I/O thread only)."""
        if self.metrics is None:
            return
        try:
            self.metrics.record_busy(reason)
        except Exception:  # noqa: BLE001
            logger.debug("router: metrics update failed", exc_info=True)

    def _io_load_gauges(self) -> None:
        if self.metrics is None:
            return
        with self._active_lock:
            total, running = len(self._active), self._running
        try:
            self.metrics.set_load(running, max(0, total - running))
        except Exception:  # noqa: BLE001
            logger.debug("router: metrics update failed", exc_info=True)

    def execute(self, requests: List[Any]) -> None:
        """Triton's request entry (decoupled): validate each request and hand it to a worker thread;
        its responses are sent from there. A bad request gets its error response alone."""
        for request in requests:
            arrival = time.monotonic()
            refusal = self.failure.refusal()
            if refusal:
                self._out.put(RequestMetrics("refused"))
                self._out.put(ErrorReply(request.get_response_sender(), refusal))
                continue
            busy = self._queue_full()
            if busy:
                self._out.put(BusyCount("queue_full"))
                self._out.put(BusyReply(request.get_response_sender(), busy))
                continue
            try:
                job = self.parser.parse(request, arrival)
            except ClientError as e:
                self._out.put(RequestMetrics("invalid"))
                self._out.put(ErrorReply(request.get_response_sender(), str(e), invalid=True))
                continue
            except Exception as e:  # noqa: BLE001
                logger.exception("router: bad request")
                self._out.put(RequestMetrics("invalid"))
                self._out.put(ErrorReply(request.get_response_sender(), f"invalid request: {e}", invalid=True))
                continue
            with self._active_lock:
                self._active[job.rid] = job
            self.pool.submit(self._run_guarded, job)
        return None

    # ------------------------------------------------------------------ queue
    def _queue_full(self) -> Optional[str]:
        """The busy message when ``max_queued_requests`` requests already wait for a worker, else None."""
        with self._active_lock:
            waiting = len(self._active) - self._running
        if waiting < self.limits.max_queued_requests:
            return None
        return (f"{BUSY_PREFIX}token_router has {waiting} requests waiting for one of its "
                f"{self.pool._max_workers} workers; the limit is {self.limits.max_queued_requests} "
                f"(max_queued_requests); retry later")

    def _expire_queued(self, now: float) -> None:
        """(client I/O thread) End as busy every request that waited for a worker past its deadline."""
        expired = []
        with self._active_lock:
            for job in list(self._active.values()):
                if job.worker_start_t is None and job.queue_deadline is not None and now > job.queue_deadline:
                    job.expired = True
                    del self._active[job.rid]
                    expired.append(job)
        for job in expired:
            self._io_busy("queue_timeout")
            self._out.put(BusyReply(job.sender, f"{BUSY_PREFIX}token_router: the request waited "
                                                f"{now - job.arrival_t:.1f} s for a worker (all "
                                                f"{self.pool._max_workers} busy); its queue timeout is "
                                                f"{job.queue_deadline - job.arrival_t:g} s (queue_timeout_s, "
                                                f"or the request's timeout); retry later"))

    # ------------------------------------------------------- model endpoints
    def _discover_endpoint(self, model: str) -> str:
        """The ZeroMQ endpoint of ``model`` (called by the PeerClient once per model).

        The model's advert file (``routing.peer.read_advert``: endpoint, pid and
        start time of its live stub) is used when there is one; else a BLS call
        asks the model.  The BLS call runs on the client I/O thread, the only
        thread of this stub that calls into the Python backend (concurrent calls
        from several threads have corrupted the Triton 2.51 stub's heap).

        A model whose advert is left but whose process is gone died before this
        router first reached it: it is marked down (``on_down`` starts its
        recovery, as for a model that dies later) and :class:`PeerDownError` is
        raised, so the request fails or degrades with the usual reason.

        Returns:
            ``{"endpoint": str, "pid": int, "start": int | None}``.

        Raises:
            PeerDownError: the model's stub died (its advert outlived its process).
            RuntimeError: the model gave no endpoint (not a tokenrouter LLM model, no answer).
        """
        adv = read_advert(model)
        if adv is not None:
            return adv
        answer: "Future[Dict[str, Any]]" = Future()
        self._out.put(EndpointQuery(model, answer))
        try:
            return answer.result(timeout=120)
        except FutureTimeout:
            raise RuntimeError(f"model {model}: no answer to the endpoint query") from None
        except Exception as e:  # noqa: BLE001 - the BLS call's error
            stale = read_advert(model, alive_only=False)
            if stale is not None and read_advert(model) is None:
                reason = f"model {model} is down: its process (pid {stale.get('pid')}) exited"
                self.peers.mark_down(model, reason)
                raise PeerDownError(model, reason) from None
            raise RuntimeError(str(e)) from None

    def _discover_process(self, model: str) -> Dict[str, Any]:
        """The stub process of ``model`` (``transport: triton``: for the liveness watch).

        Its advert when there is one, else ``{}`` (no watch; a dead stub is then found
        by the "not healthy" answer of a BLS call).
        """
        return read_advert(model) or {}

    # -------------------------------------------------------- client I/O loop
    def _client_io(self) -> None:
        """Send queued responses in order and sweep cancellation (one thread for all requests)."""
        next_sweep = 0.0
        while not (self._io_done.is_set() and self._out.empty()):
            try:
                msg = self._out.get(timeout=CANCEL_CHECK_INTERVAL_S)
            except queue.Empty:
                msg = None
            match msg:
                case EndpointQuery(model=model, answer=answer):
                    try:
                        answer.set_result(bls_endpoint(model))
                    except Exception as e:  # noqa: BLE001
                        answer.set_exception(e)
                case RequestMetrics(observed=observed):
                    self._io_metrics(observed)
                case BusyCount(reason=reason):
                    self._io_busy(reason)
                case IOCall(fn=fn):  # work that must run on this thread (metrics, restart kicks)
                    try:
                        fn()
                    except Exception:  # noqa: BLE001
                        logger.debug("router: I/O-thread call failed", exc_info=True)
                case TextChunk() | FinalOutputs() | BusyReply() | ErrorReply():
                    self._io_reply(msg)
            now = time.monotonic()
            if now >= next_sweep:
                next_sweep = now + CANCEL_CHECK_INTERVAL_S
                self._expire_queued(now)
                with self._active_lock:
                    jobs = list(self._active.values())
                self._io_load_gauges()
                mark = self._fence.fence_mark() if self._fence is not None else None
                asked = newly = 0
                for job in jobs:
                    if not job.cancelled:
                        try:
                            job.cancelled = bool(job.request.is_cancelled())
                            asked += 1  # not cancelled before: this check went to the server
                            newly += job.cancelled
                        except Exception:  # noqa: BLE001
                            pass
                if newly:  # its worker may be waiting for a model: it checks at its next tick
                    self.peers.interrupt()
                if asked and mark:
                    self._fence.fence_passed(mark)

    def _io_reply(self, msg) -> None:
        """Send one response to a client (client I/O thread only)."""
        try:
            match msg:
                case TextChunk(sender=sender, text=text, logprobs=logprobs):
                    tensors = [pb_utils.Tensor("text_output", np.asarray([text.encode("utf-8")], dtype=np.object_))]
                    if logprobs is not None:
                        tensors.append(pb_utils.Tensor("logprobs", np.asarray([logprobs.encode("utf-8")],
                                                                              dtype=np.object_)))
                    sender.send(pb_utils.InferenceResponse(output_tensors=tensors))
                case FinalOutputs(sender=sender, outputs=outputs):
                    sender.send(pb_utils.InferenceResponse(output_tensors=[
                        pb_utils.Tensor(k, v) for k, v in outputs.items()]), flags=_FINAL)
                case BusyReply(sender=sender, message=message):
                    # UNAVAILABLE: HTTP 503 where tritonserver runs on jemalloc (docs/api.md, "Errors")
                    sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                        message, pb_utils.TritonError.UNAVAILABLE)), flags=_FINAL)
                case ErrorReply(sender=sender) as reply:
                    sender.send(pb_utils.InferenceResponse(error=reply.triton_error(pb_utils)), flags=_FINAL)
        except Exception:  # noqa: BLE001 - e.g. the client has gone
            logger.debug("router: response not delivered", exc_info=True)

    # --------------------------------------------------------------- request
    def _run_guarded(self, job: ClientRequest) -> None:
        with self._active_lock:
            if job.expired:  # answered as busy by the client I/O thread while it waited
                return
            job.worker_start_t = time.monotonic()
            self._running += 1
        try:
            self._run(job)
        except PeerDownError as e:  # a model died: this client gets the reason, naming the model
            logger.error("router: request %s failed: %s", job.rid, e)
            self._out.put(RequestMetrics("error"))
            self._out.put(ErrorReply(job.sender, self.failure.describe(e)))
        except RequestRefused as e:  # a model refused the input: the client's error
            self._out.put(RequestMetrics("invalid"))
            self._out.put(ErrorReply(job.sender, str(e), invalid=True))
        except Exception as e:  # noqa: BLE001 - error to this client only
            if str(e).startswith(BUSY_PREFIX):  # a model's KV queue was full or its wait ran out
                self._out.put(BusyCount("queue_timeout" if "queue timeout" in str(e) else "queue_full"))
                self._out.put(BusyReply(job.sender, str(e)))
                return
            logger.exception("router: request %s failed", job.rid)
            self._out.put(RequestMetrics("error"))
            self._out.put(ErrorReply(job.sender, str(e)))
        finally:
            with self._active_lock:
                self._active.pop(job.rid, None)
                self._running -= 1

    def _run(self, job: ClientRequest) -> None:
        detok = IncrementalDetokenizer(self.tokenizer, job.sp.stop,
                                       include_stop_str=job.sp.include_stop_str_in_output,
                                       skip_special_tokens=job.sp.skip_special_tokens)
        header = make_header(job.rid, job.sp, self.algorithm, job.params, self.models, self.stop_token_ids)
        if job.queue_deadline is not None:  # each model's KV queue waits at most this long for it
            header.extras["queue_timeout_s"] = round(job.queue_deadline - job.arrival_t, 3)
        first = self.algo_cls.first_model(job.params, rid=job.rid, sampling=header.sampling)
        fallback = self.failure.fallback
        if fallback:
            header.down_models = sorted(self.peers.down())
        r = drive(self.peers, header, job.prompt_ids, first, detok,
                  on_delta=(lambda d, routed: self._out.put(self._text_chunk(job, d, routed))) if job.stream else None,
                  cancelled=lambda: job.cancelled or self._closing.is_set(), fallback=fallback)
        if r.finish == FinishReason.CANCELLED.value:
            self._out.put(RequestMetrics("cancelled"))
            self._out.put(ErrorReply(job.sender, "server is shutting down"
                                     if self._closing.is_set() and not job.cancelled else "request cancelled"))
            return
        tail = detok.flush()
        summary = routing_summary(r, self.algorithm, job.params, self.models)
        if r.degraded:
            self.failure.count_degraded()
        if job.stream:
            text = tail
        else:
            text = detok.text
            if not job.exclude_input:
                text = job.prompt + text
        outputs = output_tensors(job, r, text, summary, self.models, self.token_strings)
        # metrics first: a client that has its answer finds them published
        self._out.put(RequestMetrics(observe_request(job.arrival_t, time.monotonic(), r, self.models,
                                                     job.worker_start_t)))
        self._out.put(FinalOutputs(job.sender, outputs))

    def _text_chunk(self, job: ClientRequest, delta: str, routed) -> TextChunk:
        """A streamed response: the text delta, and (a request that asks for them) the logprobs of
        the output tokens that reached the router since the previous response (vllm_backend's
        convention; text held back for a stop string or a split character comes later)."""
        if not wants_logprobs(job):
            return TextChunk(job.sender, delta)
        start, end = job.logprobs_sent, len(routed.logprobs)
        job.logprobs_sent = end
        ids = routed.output_ids[start:end]
        return TextChunk(job.sender, delta, logprobs_json(ids, routed.logprobs[start:end],
                                                          routed.top_logprobs[start:end], self.token_strings))

    def finalize(self) -> None:
        """Unload: end every request still in flight with "server is shutting down", then stop.

        Triton calls this after its ``exit_timeout`` wait for in-flight requests
        (or at an explicit unload); the worker threads must not outlive it, or
        the stub process cannot exit.
        """
        remove_advert(self._name, kind="router")  # unloaded on purpose: not to be restarted
        self._closing.set()
        if self.online is not None:
            self.online.stop()  # before the channel closes; frees its metrics on the I/O thread
        self.failure.stop()
        self.peers.fail_all("server is shutting down")
        self.pool.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + 10
        for t in list(getattr(self.pool, "_threads", ())):  # fail_all above ended their segments
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        self._io_done.set()  # the client I/O loop sends what the workers queued, then ends
        self._io.join(timeout=5)
        self.peers.close()
        self._io.join(timeout=2)
        # free the metric families while the stub's shared memory is alive (as triton_llm does)
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        self.failure.drop_metrics()
