"""``token_router``: the client-facing decoupled BLS model.

It tokenises the prompt (chat template on request), drives each request
through the model subservers with the routing algorithm's handoffs (the paper's
inter-model loop: the PeerReq of a handing-off model is forwarded, with the
token suffix the peer has not seen, to the peer), streams detokenised text back
and releases every model's state at the end.

Client interface (Triton vllm_backend conventions)

Inputs
    ``text_input`` BYTES [1]              prompt (UTF-8)
    ``stream`` BOOL [1]                   stream text deltas (default false)
    ``sampling_parameters`` BYTES [1]     JSON: max_tokens, temperature, top_p, top_k,
                                          seed, stop, ignore_eos, routing_threshold,
                                          repetition_penalty, presence_penalty,
                                          frequency_penalty, min_tokens, stop_token_ids,
                                          include_stop_str_in_output, skip_special_tokens,
                                          logprobs, guided_decoding (vLLM's structured
                                          output: json, regex, choice, grammar, json_object;
                                          also guided_json, guided_regex, ...)
                                          (vllm_backend value forms: "32",
                                          "true", null = default; see tokenrouter.engine.sampling).
                                          Absent: the request's parameters are read instead
                                          (HTTP generate "parameters", gRPC parameters).
    ``exclude_input_in_output`` BOOL [1]  non-streaming only: omit the prompt (default false)
    ``apply_chat_template`` BOOL [1]      wrap the prompt as a user turn (default false)
    ``return_routing_trace`` BOOL [1]     add the per-token model trace (default false)
    ``return_finish_reason``, ``return_num_input_tokens``, ``return_num_output_tokens``
                     BOOL [1]             vllm_backend's output switches; default true here
                                          (these outputs were always sent), false omits them
    ``return_logprobs`` BOOL [1]          add ``logprobs`` (default false)

Outputs
    ``text_output`` BYTES, ``finish_reason`` BYTES, ``num_input_tokens`` INT32,
    ``num_output_tokens`` INT32, ``routing_summary`` BYTES (JSON:
    tokens_by_model, handoffs, handoffs_by_pair, algorithm, params and
    handoff_gap_s: seconds from each handoff to the peer's first response; with speculative
    decoding and draft-verify ``speculative``: rounds, drafted, accepted, acceptance_rate,
    tokens_per_llm_pass),
    ``logprobs`` BYTES (JSON list, one float per output token: its logprob
    under the model that wrote it; on the final response, streaming too) when
    asked (``return_logprobs`` or the ``logprobs`` sampling key),
    ``routing_trace``
    BYTES (JSON: models, per-output-token model index ``trace``, output
    ``token_ids``, per-output-token router ``scores`` -- the score the writing
    model's rule compared with its threshold at that step, null where none --
    and ``handoffs``: one ``{"pos", "from", "to", "committed", "score"}`` per
    handoff, ``pos`` = output tokens committed when it happened, ``score`` =
    the handoff step's score; with ``committed`` false that step's token was
    discarded; with speculative decoding ``drafts``: one ``{"pos", "drafted", "accepted"}`` per
    verification) when asked.

Config parameters (read once, at load, into :class:`~tokenrouter.triton.settings.RouterSettings`,
whose docstring gives each one's unit and default): ``models`` (comma-separated, deployment order;
model 0 is the SLM), ``algorithm``, ``algorithm_params`` (JSON), ``tokenizer_path``,
``max_concurrent_requests``, ``default_max_tokens``, ``context_length``,
``peer_timeout_s`` (a model silent this long fails the request; 0 = never: the backstop for a
hung model -- a dead one is found by its process or heartbeat, and a request waiting for KV
ends at its queue timeout, as "busy", long before), the limits of
:class:`~tokenrouter.triton.settings.RequestLimits`
(``max_input_bytes``, ``max_queued_requests``, ``queue_timeout_s``) and of
:class:`~tokenrouter.engine.sampling.InputLimits` (``max_sampling_parameters_bytes``,
``max_json_depth``, ``max_stop_strings``, ``max_stop_string_bytes``, ``max_stop_token_ids``,
``max_grammar_bytes``, ``max_schema_depth``, ``grammar_compile_timeout_ms``),
``on_peer_failure`` (``fail`` or ``fallback``: what a request does when a model
it needs is down; see :class:`_PeerFailure`), ``peer_restart_s`` (seconds between
two attempts to get a dead model restarted), ``transport`` (below),
``online_adaptation`` and the other ``online_*`` parameters (B* adapted while
serving: :mod:`tokenrouter.routing.online_bstar`), ``remote_models`` (models served by
other tritonservers: JSON ``{"llm": "tcp://host:port"}``, or a list of endpoints
for replicas ``{"llm": ["tcp://h1:p", "tcp://h2:p"]}``), ``heartbeat_interval_s``
and ``heartbeat_timeout_s`` (remote replicas are pinged every 0.5 s and are down
after 2 s without an answer), ``curve`` (``on`` default / ``off``),
``curve_secret_key_file`` and ``curve_server_public_keys`` (CURVE on TCP: see
:mod:`tokenrouter.routing.curve`).

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
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional

import numpy as np
import triton_python_backend_utils as pb_utils

from ..algorithms import get_algorithm
from ..engine.detok import IncrementalDetokenizer, stop_token_ids
from ..engine.grammar import GrammarCompiler
from ..engine.sampling import InputLimits, SamplingParams, check_json_text, parse_sampling_parameters
from ..engine.subserver import BUSY_PREFIX
from ..routing.curve import CurveClient
from ..routing.peer import PeerClient, PeerDownError, advert_path, read_advert, remove_advert, write_advert
from ..protocol import FinishReason, Ping
from ..routing.router_core import PromptTooLong, drive, encode_prompt, make_header
from . import model_control
from .common import model_parameters
from .messages import (BusyCount, BusyReply, EndpointQuery, ErrorReply, FinalOutputs, IOCall, RequestMetrics,
                       TextChunk)
from .metrics import RouterMetrics, observe_request
from .settings import RequestLimits, RouterSettings
from .transport import TritonTransport

logger = logging.getLogger(__name__)

_FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class ClientError(ValueError):
    """Bad input from the client: reported to that client only."""


def longest_token_bytes(tokenizer) -> int:
    """UTF-8 bytes of the longest token of ``tokenizer`` as text (special tokens included).

    A prompt of n tokens has at most n times this many bytes, so a text longer than
    ``context_length`` times it cannot fit the context (the default ``max_input_bytes``).
    Fast tokenizers decode each id (about 0.1 s for 50k ids); others fall back to the
    vocabulary's strings (an upper bound: byte-level BPE spells one byte with up to 2).
    """
    n = len(tokenizer)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        try:
            # + 1: SentencePiece-style decoders drop the leading space of a text's first token
            return 1 + max(len(backend.decode([i], skip_special_tokens=False).encode("utf-8")) for i in range(n))
        except Exception:  # noqa: BLE001 - fall back to the vocabulary's strings
            pass
    return max(1, max((len(t.encode("utf-8")) for t in tokenizer.get_vocab()), default=16))


def _opt_input(request, name: str):
    t = pb_utils.get_input_tensor_by_name(request, name)
    return None if t is None else t.as_numpy().reshape(-1)


def _bool_input(request, name: str, default: bool) -> bool:
    v = _opt_input(request, name)
    if v is None or v.size == 0:
        return default
    if v.size != 1:
        raise ClientError(f"{name} must hold exactly one value")
    return bool(v[0])


def _bytes_input(request, name: str, limit: Optional[int] = None, key: str = "") -> Optional[bytes]:
    """The one value of BYTES input ``name``; ``limit``: its most bytes (``key``: the limit's config key).

    Raises:
        ClientError: not one value, or longer than ``limit`` (checked before any decoding).
    """
    v = _opt_input(request, name)
    if v is None or v.size == 0:
        return None
    if v.size != 1:
        raise ClientError(f"{name} must hold exactly one value, got {v.size}")
    x = v[0]
    x = x if isinstance(x, bytes) else str(x).encode("utf-8")
    if limit is not None and len(x) > limit:
        raise ClientError(f"{name} is {len(x)} bytes; the limit is {limit} ({key})")
    return x


@dataclass
class _Job:
    rid: str
    sender: Any
    request: Any
    prompt: str
    prompt_ids: List[int]
    sp: SamplingParams
    stream: bool
    exclude_input: bool
    want_trace: bool
    params: Dict[str, Any]
    cancelled: bool = False
    arrival_t: float = 0.0
    worker_start_t: Optional[float] = None
    outputs: Dict[str, bool] = None  # vllm_backend's return_* switches
    queue_deadline: Optional[float] = None  # time.monotonic() past which waiting makes it busy
    expired: bool = False  # ended as busy while it waited for a worker


#: vllm_backend's opt-in output switches: input name → (output name, default here)
OUTPUT_SWITCHES = {"return_finish_reason": ("finish_reason", True),
                   "return_num_input_tokens": ("num_input_tokens", True),
                   "return_num_output_tokens": ("num_output_tokens", True),
                   "return_logprobs": ("logprobs", False)}


#: request parameters Triton itself defines (KServe / Triton protocol), never sampling keys
_TRITON_RESERVED_PARAMETERS = frozenset({"sequence_id", "sequence_start", "sequence_end", "priority",
                                         "timeout", "binary_data_output", "binary_data_size", "headers"})


def _request_parameters(request, limits: Optional[InputLimits] = None) -> Optional[Dict[str, Any]]:
    """The request's parameters (HTTP generate ``"parameters"``, gRPC parameters) as a dict, or None.

    Read as sampling parameters when the ``sampling_parameters`` input is absent,
    as vllm_backend does.

    Raises:
        ClientError: the parameters are not a JSON object, or exceed ``limits`` (size, depth).
    """
    try:
        raw = request.parameters()
    except Exception:  # noqa: BLE001 - a stub without request parameters
        return None
    if not raw:
        return None
    if isinstance(raw, (str, bytes)):
        try:
            check_json_text(raw if isinstance(raw, str) else raw.decode("utf-8", "replace"), "parameters",
                            limits or InputLimits())
        except ValueError as e:
            raise ClientError(str(e)) from None
    try:
        d = json.loads(raw) if isinstance(raw, (str, bytes)) else dict(raw)
    except (ValueError, TypeError) as e:
        raise ClientError(f"request parameters are not a JSON object: {e}") from None
    if not isinstance(d, dict):
        raise ClientError("request parameters must be a JSON object")
    # Triton's own request parameters (set by clients and frontends, e.g. tritonclient's
    # enable_empty_final_response) are not sampling parameters
    d = {k: v for k, v in d.items() if not k.startswith("triton_") and k not in _TRITON_RESERVED_PARAMETERS}
    return d or None


#: seconds between two cancellation sweeps of the client I/O loop (each check
#: of a request is an IPC round trip to the server: at 0.05 s, 32 streams cost
#: 640 round trips a second, a few % of a core on a 2-core host)
CANCEL_CHECK_INTERVAL_S = 0.2

#: seconds between two ticks of a request waiting for a model (its stall deadline
#: check); a cancellation found by the sweep wakes the waiting requests at once
#: (``peers.interrupt``), so they do not poll
WAIT_TICK_S = 1.0


class TritonPythonModel:
    """The router (see module docstring)."""

    def initialize(self, args: Dict[str, Any]) -> None:
        """Triton's model load, one ``init_*`` step after the other: read the config parameters,
        load the tokenizer and the algorithm, connect to the models, start the threads.

        Raises:
            pb_utils.TritonModelException: a bad config (the load fails; the message names the parameter).
        """
        self.init_settings(args)
        self.init_tokenizer()
        self.init_algorithm()
        self.init_limits()
        self.init_workers()
        self.init_peers()
        self.init_metrics(args)
        self.init_online()
        self.init_threads()

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
        from transformers import AutoTokenizer  # after the stub's locale fix

        self.tokenizer = AutoTokenizer.from_pretrained(self.settings.tokenizer_path)
        self.context_length = self.settings.context_length or int(
            getattr(self.tokenizer, "model_max_length", 8192) if
            getattr(self.tokenizer, "model_max_length", 0) < 10**7 else 8192)
        self.stop_token_ids = stop_token_ids(self.tokenizer)
        self.vocab_size = len(self.tokenizer)  # ids >= this are no token (added tokens included)
        # guided decoding: every new grammar is compiled here first, within grammar_compile_timeout_ms
        self.grammar = GrammarCompiler(self.tokenizer, self.vocab_size, self.stop_token_ids).start()

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

    def init_workers(self) -> None:
        """The worker pool (``max_concurrent_requests`` threads), the table of active requests and
        the client I/O queue."""
        self.pool = ThreadPoolExecutor(max_workers=self.settings.max_concurrent_requests,
                                       thread_name_prefix="router")
        self._closing = threading.Event()
        # the client I/O loop: the only thread that sends responses and checks cancellation
        self._out: "queue.Queue" = queue.Queue()  # tokenrouter.triton.messages
        self._active: Dict[str, _Job] = {}
        self._active_lock = threading.Lock()
        self._running = 0  # jobs a worker is driving (the rest of _active wait for one)

    def init_peers(self) -> None:
        """How the models are reached: the failure policy (:class:`_PeerFailure`: ``on_peer_failure``,
        ``peer_restart_s``) and the transport (``zmq``: a :class:`PeerClient`, which waits up to a
        heartbeat timeout for the remote models; ``triton``: a :class:`TritonTransport`).

        Raises:
            pb_utils.TritonModelException: CURVE keys missing or unreadable (naming the parameter).
        """
        s = self.settings
        self.failure = _PeerFailure(self, s.on_peer_failure, s.peer_restart_s, remote=self.remote)
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

    # ------------------------------------------------------------ validation
    def _parse(self, request) -> _Job:
        """Validate one request; every size is checked before the work that grows with it
        (decoding, JSON parsing, tokenising).  Raises ClientError naming the input and limit."""
        lim = self.limits
        raw = _bytes_input(request, "text_input", lim.max_input_bytes, "max_input_bytes")
        if raw is None:
            raise ClientError("text_input is required")
        try:
            prompt = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ClientError(f"text_input is not valid UTF-8: {e}") from None
        if not prompt.strip():
            raise ClientError("text_input is empty")
        sp_raw = _bytes_input(request, "sampling_parameters", lim.sampling.max_sampling_parameters_bytes,
                              "max_sampling_parameters_bytes")
        source = "sampling_parameters" if sp_raw is not None else "parameters"  # named in errors
        try:
            if sp_raw is not None:
                sp = parse_sampling_parameters(sp_raw.decode("utf-8"), self.default_max_tokens,
                                               limits=lim.sampling)
            else:
                sp = parse_sampling_parameters(_request_parameters(request, lim.sampling), self.default_max_tokens,
                                               source=source, limits=lim.sampling)
        except UnicodeDecodeError:
            raise ClientError("sampling_parameters is not valid UTF-8") from None
        except ValueError as e:
            raise ClientError(str(e)) from None
        if sp.guided is not None:  # a 400 naming the field for a grammar that does not compile in time
            try:
                self.grammar.compile(sp.guided, timeout_s=lim.sampling.grammar_compile_timeout_ms / 1000)
            except (ValueError, RuntimeError) as e:
                raise ClientError(str(e).replace("sampling_parameters", source)) from None
        oov = [t for t in sp.stop_token_ids if t >= self.vocab_size]
        if oov:
            raise ClientError(f"{source}.stop_token_ids {oov} are not token ids of this tokenizer "
                              f"(vocabulary size {self.vocab_size})")
        params = dict(self.base_params)
        if sp.routing_threshold is not None:
            if not self.algo_cls.threshold_param:
                raise ClientError(f"algorithm {self.algorithm!r} has no threshold to override")
            try:
                params = self.algo_cls.validate_params(
                    {**params, self.algo_cls.threshold_param: sp.routing_threshold}, len(self.models))
            except ValueError as e:
                raise ClientError(f"{source}.routing_threshold: {e}") from None
        try:
            ids = encode_prompt(self.tokenizer, prompt, _bool_input(request, "apply_chat_template", False),
                                max_prompt_tokens=self.context_length - 1)
        except PromptTooLong as e:
            raise ClientError(f"{e}; the context length is {self.context_length}") from None
        if len(ids) >= self.context_length:
            raise ClientError(f"prompt has {len(ids)} tokens; the context length is {self.context_length}")
        if len(ids) + sp.max_tokens > self.context_length:
            budget = (f"max_tokens ({sp.max_tokens})" if sp.max_tokens_given else
                      f"the default max_tokens ({sp.max_tokens}; the request set none)")
            raise ClientError(f"prompt ({len(ids)} tokens) + {budget} exceeds the context length "
                              f"{self.context_length}: set max_tokens to at most "
                              f"{self.context_length - len(ids)}")
        outputs = {out: _bool_input(request, name, dflt) for name, (out, dflt) in OUTPUT_SWITCHES.items()}
        if outputs["logprobs"] and sp.logprobs is None:
            sp.logprobs = 0  # return_logprobs alone: the sampled token's logprob
        return _Job(rid=uuid.uuid4().hex, sender=request.get_response_sender(), request=request,
                    prompt=prompt, prompt_ids=ids, sp=sp,
                    stream=_bool_input(request, "stream", False),
                    exclude_input=_bool_input(request, "exclude_input_in_output", False),
                    want_trace=_bool_input(request, "return_routing_trace", False), params=params,
                    outputs=outputs)

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
                job = self._parse(request)
            except ClientError as e:
                self._out.put(RequestMetrics("invalid"))
                self._out.put(ErrorReply(request.get_response_sender(), str(e)))
                continue
            except Exception as e:  # noqa: BLE001
                logger.exception("router: bad request")
                self._out.put(RequestMetrics("invalid"))
                self._out.put(ErrorReply(request.get_response_sender(), f"invalid request: {e}"))
                continue
            job.arrival_t = arrival
            job.queue_deadline = self._queue_deadline(request, arrival)
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

    def _queue_timeout_s(self, request) -> float:
        """The request's queue timeout in seconds: ``queue_timeout_s``, lowered by Triton's per-request
        ``timeout`` parameter (microseconds; 0 or absent = none); 0 = no limit."""
        t = self.limits.queue_timeout_s
        try:
            us = int(request.timeout())
        except Exception:  # noqa: BLE001 - a stub without request timeouts
            us = 0
        if us > 0:
            t = min(t, us / 1e6) if t else us / 1e6
        return t

    def _queue_deadline(self, request, arrival: float) -> Optional[float]:
        t = self._queue_timeout_s(request)
        return arrival + t if t else None

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

    @staticmethod
    def _bls_endpoint(model: str) -> Dict[str, Any]:
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
                        answer.set_result(self._bls_endpoint(model))
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
                case TextChunk(sender=sender, text=text):
                    sender.send(self._chunk(text))
                case FinalOutputs(sender=sender, outputs=outputs):
                    sender.send(pb_utils.InferenceResponse(output_tensors=[
                        pb_utils.Tensor(k, v) for k, v in outputs.items()]), flags=_FINAL)
                case BusyReply(sender=sender, message=message):
                    # UNAVAILABLE (Triton 2.51's HTTP generate still answers 400)
                    sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                        message, pb_utils.TritonError.UNAVAILABLE)), flags=_FINAL)
                case ErrorReply(sender=sender, message=message):
                    sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message)), flags=_FINAL)
        except Exception:  # noqa: BLE001 - e.g. the client has gone
            logger.debug("router: response not delivered", exc_info=True)

    # --------------------------------------------------------------- request
    def _run_guarded(self, job: _Job) -> None:
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

    def _run(self, job: _Job) -> None:
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
                  on_delta=(lambda d: self._out.put(TextChunk(job.sender, d))) if job.stream else None,
                  cancelled=lambda: job.cancelled or self._closing.is_set(), fallback=fallback)
        if r.finish == FinishReason.CANCELLED.value:
            self._out.put(RequestMetrics("cancelled"))
            self._out.put(ErrorReply(job.sender, "server is shutting down"
                                     if self._closing.is_set() and not job.cancelled else "request cancelled"))
            return
        tail = detok.flush()
        summary = {"algorithm": self.algorithm, "params": job.params,
                   "tokens_by_model": {m: r.tokens_by_model.get(m, 0) for m in self.models},
                   "handoffs": r.handoffs, "handoffs_by_pair": r.pairs,
                   "handoff_gap_s": [round(g, 6) for g in r.handoff_gaps_s]}
        if r.degraded:
            summary["degraded"] = r.degraded
            self.failure.count_degraded()
        if r.spec_rounds:  # speculative decoding, draft-verify: drafts verified and accepted
            summary["speculative"] = {"rounds": len(r.spec_rounds), "drafted": r.drafted,
                                      "accepted": r.accepted,
                                      "acceptance_rate": round(r.accepted / r.drafted, 4) if r.drafted else None,
                                      "tokens_per_llm_pass": round(r.spec_tokens / len(r.spec_rounds), 4)}
        if job.stream:
            text = tail
        else:
            text = detok.text
            if not job.exclude_input:
                text = job.prompt + text
        outputs = {
            "text_output": np.asarray([text.encode("utf-8")], dtype=np.object_),
            "finish_reason": np.asarray([r.finish.encode()], dtype=np.object_),
            "num_input_tokens": np.asarray([r.n_prompt], dtype=np.int32),
            "num_output_tokens": np.asarray([len(r.output_ids)], dtype=np.int32),
            "routing_summary": np.asarray([json.dumps(summary).encode()], dtype=np.object_),
        }
        self._apply_output_switches(job, r, outputs)
        if job.want_trace:
            trace = {"models": self.models, "trace": r.trace, "token_ids": r.output_ids,
                     "scores": r.scores, "handoffs": r.handoff_log}
            if r.spec_rounds:
                trace["drafts"] = r.spec_rounds
            tr = json.dumps(trace)
            outputs["routing_trace"] = np.asarray([tr.encode()], dtype=np.object_)
        # metrics first: a client that has its answer finds them published
        self._out.put(RequestMetrics(observe_request(job.arrival_t, time.monotonic(), r, self.models,
                                                     job.worker_start_t)))
        self._out.put(FinalOutputs(job.sender, outputs))

    @staticmethod
    def _apply_output_switches(job: _Job, r, outputs: Dict[str, Any]) -> None:
        """vllm_backend's return_* inputs: drop switched-off outputs, add ``logprobs`` when asked."""
        for name, on in job.outputs.items():
            if name != "logprobs" and not on:
                outputs.pop(name, None)
        if job.outputs.get("logprobs") or job.sp.logprobs is not None:
            outputs["logprobs"] = np.asarray([json.dumps(r.logprobs).encode()], dtype=np.object_)

    @staticmethod
    def _chunk(text: str):
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("text_output", np.asarray([text.encode("utf-8")], dtype=np.object_))])

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


class _PeerFailure:
    """What the router does about models that are down (issue: a dead model must not take
    routed requests down with it).

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
    * Metrics: ``tokenrouter_peer_up`` (1/0, labels ``model`` and ``router``),
      ``tokenrouter_peer_restarts_total`` (same labels) and
      ``tokenrouter_degraded_requests_total`` (label ``model``: the router).

    Args:
        router: the :class:`TritonPythonModel` (its client I/O queue and peers).
        mode: ``fail`` or ``fallback`` (:data:`~tokenrouter.triton.settings.ON_PEER_FAILURE`; the
            router's settings checked it).
        restart_s: seconds between two restart attempts of a dead model (> 0).
        remote: names of the remote models (never restarted from here).
    """

    def __init__(self, router, mode: str, restart_s: float, remote=()):
        self.router = router
        self.mode = mode
        self.fallback = mode == "fallback"
        self.restart_s = float(restart_s)
        self.remote = frozenset(remote)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._dead: Dict[str, float] = {}  # model -> time it was found down
        self._explicit: Optional[bool] = None  # does the model-control API work (explicit mode)?
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._recover_loop, name="router-recovery", daemon=True)
        self._init_metrics()

    # ------------------------------------------------------------ metrics
    def _init_metrics(self) -> None:
        G = pb_utils.MetricFamily.GAUGE
        self._families = [
            pb_utils.MetricFamily(name="tokenrouter_peer_up", description="1 while the router can reach the "
                                  "model, 0 while it is down", kind=G),
            pb_utils.MetricFamily(name="tokenrouter_peer_restarts_total", description="times a model was found "
                                  "down and brought back", kind=pb_utils.MetricFamily.COUNTER),
            pb_utils.MetricFamily(name="tokenrouter_degraded_requests_total", description="requests that went on "
                                  "without a model that was down (on_peer_failure fallback)",
                                  kind=pb_utils.MetricFamily.COUNTER),
        ]
        up, restarts, degraded = self._families
        me = str(self.router.model_config.get("name", "token_router"))  # several routers may share a server
        self._up = {m: up.Metric(labels={"model": m, "router": me}) for m in self.router.models}
        self._restarts = {m: restarts.Metric(labels={"model": m, "router": me}) for m in self.router.models}
        self._degraded = degraded.Metric(labels={"model": me})
        for m in self._up.values():
            m.set(1.0)

    def _on_io(self, fn) -> None:
        """Run ``fn`` on the client I/O thread (the only thread that calls into the backend)."""
        self.router._out.put(IOCall(fn))

    def count_degraded(self) -> None:
        """Count one request that finished degraded."""
        self._on_io(lambda: self._degraded.increment(1.0))

    def drop_metrics(self) -> None:
        """Free the metric objects while the stub is alive (see triton_llm.finalize)."""
        self._up.clear()
        self._restarts.clear()
        self._degraded = None
        self._families.clear()

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
        if self.router._closing.is_set():
            return "token_router is shutting down: request refused"
        if self.fallback:
            return None
        down = self.router.peers.down()
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
            self.router.peers.mark_up(model, adv)
            self.router.peers.call(model, Ping(), timeout_s=10)
            return True
        except Exception as e:  # noqa: BLE001 - not back yet
            logger.info("model %s not back yet: %s", model, e)
            self.router.peers.mark_down(model, f"model {model} is down: no answer after its restart")
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
                    model_control.reload(model, fallback=pb_utils)
                self._explicit = True
                logger.warning("model %s loaded again (model-control API)", model)
                return
            except Exception as e:  # noqa: BLE001
                logger.warning("model-control reload of %s failed: %s", model, e)
                if "not allowed" not in str(e):
                    return  # e.g. the new stub died while loading: the next attempt retries
                self._explicit = False  # no explicit model control on this server
        self._on_io(lambda: self._poke(model))

    @staticmethod
    def _poke(model: str) -> None:
        try:
            TritonPythonModel._bls_endpoint(model)
        except Exception as e:  # noqa: BLE001 - expected while it is down
            logger.info("restart request to %s: %s", model, e)
