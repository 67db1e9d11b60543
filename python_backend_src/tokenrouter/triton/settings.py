"""The Triton models' settings: their config.pbtxt ``parameters``, read once into typed objects.

Each model reads its parameters at the top of ``initialize``, in one call:
:meth:`RouterSettings.from_parameters` for ``token_router`` (and any other router model) and
:meth:`LLMSettings.from_parameters` for an LLM model (``slm``, ``llm``, …).  That call reads every
value, applies the defaults and checks them; a bad value is a ``ValueError`` naming the parameter,
and the model fails to load with it.  The layers below (``routing``, ``algorithms``, ``engine``)
receive these objects, or plain values taken from them, never the raw parameters.

A parameter that is absent, empty or an unexpanded ``${…}`` placeholder takes its default.
Booleans are ``true``/``false`` (also ``1``/``0``, ``yes``/``no``, ``on``/``off``).
docs/configuration.md lists the parameters with their defaults, as the docstrings below do.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple

from ..algorithms import configure as configure_algorithm
from ..engine.sampling import InputLimits
from ..engine.subserver import SubserverConfig
from ..routing.curve import CurveSettings, curve_enabled
from ..routing.online_bstar import OnlineSettings
from ..routing.peer import parse_remote_models
from .common import resolve_model_path

__all__ = ["DEFAULT_CHECKPOINT", "ON_PEER_FAILURE", "PREFIX_CACHE_DEFAULT", "TRANSPORTS", "LLMSettings",
           "RequestLimits", "RouterSettings", "read_parameter"]

#: default ``model_path`` of an LLM model and ``tokenizer_path`` of a router (a folder under the
#: weights folder, :func:`tokenrouter.triton.common.weights_dir`)
DEFAULT_CHECKPOINT = "smollm2-135m-instruct"

#: values of the router's ``transport`` parameter: how the router reaches the models
TRANSPORTS = ("zmq", "triton")

#: values of the router's ``on_peer_failure`` parameter
ON_PEER_FAILURE = ("fail", "fallback")

#: default of the LLM models' ``prefix_cache`` parameter (docs/performance.md, "Prefix caching")
PREFIX_CACHE_DEFAULT = True

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def read_parameter(params: Mapping[str, str], key: str, default: Any, kind=str) -> Any:
    """One config parameter as ``kind`` (``str``, ``int``, ``float`` or ``bool``), or ``default``.

    Args:
        params: the model's parameters, ``{key: string_value}``.
        key: the parameter's name.
        default: returned when the parameter is absent, empty or a ``${…}`` placeholder.
        kind: the type to read it as.

    Raises:
        ValueError: a value that is not a ``kind`` (the message names ``key``).
    """
    raw = params.get(key, "")
    if raw is None or str(raw).strip() == "" or str(raw).startswith("${"):
        return default
    try:
        if kind is bool:
            if str(raw).lower() in _TRUE:
                return True
            if str(raw).lower() in _FALSE:
                return False
            raise ValueError(raw)
        return kind(raw)
    except ValueError:
        raise ValueError(f"config parameter {key!r}: cannot read {raw!r} as {kind.__name__}") from None


# ------------------------------------------------------------------------------------------ router
@dataclass(frozen=True)
class RequestLimits:
    """The router's bounds on one request and on its queue (config parameters of the same names).

    Attributes:
        max_input_bytes: UTF-8 bytes of ``text_input``, checked before decoding and
            tokenising.  None (the default) until the router has its tokenizer: then
            ``context_length`` × the longest token of the vocabulary in bytes, a bound no prompt
            that fits the context can exceed.
        max_queued_requests: requests accepted but waiting for one of the
            ``max_concurrent_requests`` workers; beyond it a request is refused at once as busy.
            Default 64.
        queue_timeout_s: seconds a request may wait for a worker, and for KV on each model
            it visits (sent to the models; they also have their own ``queue_timeout_s``);
            Triton's per-request ``timeout`` parameter (microseconds) lowers it.  Past it the
            request ends as busy.  0 = no limit.  Default 60.
        sampling: limits of the sampling parameters (:class:`~tokenrouter.engine.sampling.InputLimits`:
            ``max_sampling_parameters_bytes``, ``max_json_depth``, ``max_stop_strings``,
            ``max_stop_string_bytes``, ``max_stop_token_ids``; each an integer >= 1).

    Raises:
        ValueError: ``max_input_bytes`` < 1, ``max_queued_requests`` < 0 or ``queue_timeout_s`` < 0.
    """

    max_input_bytes: Optional[int] = None
    max_queued_requests: int = 64
    queue_timeout_s: float = 60.0
    sampling: InputLimits = InputLimits()

    def __post_init__(self) -> None:
        if ((self.max_input_bytes is not None and self.max_input_bytes < 1) or self.max_queued_requests < 0
                or not self.queue_timeout_s >= 0):
            raise ValueError(f"max_input_bytes must be >= 1, max_queued_requests >= 0 and queue_timeout_s "
                             f">= 0; got {self.max_input_bytes}, {self.max_queued_requests}, {self.queue_timeout_s}")

    @classmethod
    def from_parameters(cls, params: Mapping[str, str]) -> "RequestLimits":
        """Read the limits from a router's parameters (defaults: the attributes' defaults).

        Raises:
            ValueError: a value that is not a number, or out of range (naming it).
        """
        d = InputLimits()
        sampling = InputLimits(**{k: read_parameter(params, k, getattr(d, k), int)
                                  for k in InputLimits.__dataclass_fields__})
        return cls(max_input_bytes=read_parameter(params, "max_input_bytes", None, int),
                   max_queued_requests=read_parameter(params, "max_queued_requests", cls.max_queued_requests, int),
                   queue_timeout_s=read_parameter(params, "queue_timeout_s", cls.queue_timeout_s, float),
                   sampling=sampling)


def online_settings(params: Mapping[str, str], models: List[str]) -> OnlineSettings:
    """Read and check a router's ``online_*`` parameters (module docstring of
    :mod:`tokenrouter.routing.online_bstar`).

    Args:
        params: the router's parameters, ``{key: string_value}``.
        models: the router's models (``online_fixed_thresholds`` and the prior profile must name them).

    Returns:
        the settings (``enabled`` false when ``online_adaptation`` is off or unset).

    Raises:
        ValueError: a malformed value, naming the parameter; ``online_prior_profile`` is loaded
            here, so a missing or malformed profile fails too.
    """
    enabled = read_parameter(params, "online_adaptation", OnlineSettings.enabled, bool)
    interval_s = read_parameter(params, "online_interval_s", OnlineSettings.interval_s, float)
    window_s = read_parameter(params, "online_window_s", OnlineSettings.window_s, float)
    min_gain = read_parameter(params, "online_min_gain", OnlineSettings.min_gain, float)
    min_request_steps = read_parameter(params, "online_min_request_steps", OnlineSettings.min_request_steps, int)
    for key, v in (("online_interval_s", interval_s), ("online_window_s", window_s)):
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"config parameter {key!r} must be a number of seconds > 0, got {v}")
    if not (math.isfinite(min_gain) and min_gain >= 0):
        raise ValueError(f"config parameter 'online_min_gain' must be >= 0, got {min_gain}")
    if min_request_steps < 1:
        raise ValueError(f"config parameter 'online_min_request_steps' must be >= 1, got {min_request_steps}")
    quantum_s = None
    q = read_parameter(params, "online_quantum_s", "auto")
    if str(q).strip().lower() != "auto":
        try:
            quantum_s = float(q)
        except ValueError:
            raise ValueError(f"config parameter 'online_quantum_s' must be 'auto' or seconds, got {q!r}") from None
        if not (math.isfinite(quantum_s) and quantum_s > 0):
            raise ValueError(f"config parameter 'online_quantum_s' must be > 0, got {q!r}")
    fixed: Dict[str, int] = {}
    raw = read_parameter(params, "online_fixed_thresholds", "")
    if raw:
        try:
            fixed = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"config parameter 'online_fixed_thresholds' is not JSON: {e}") from None
        if not isinstance(fixed, dict) or any(
                m not in models or isinstance(b, bool) or not isinstance(b, int) or b < 1 for m, b in fixed.items()):
            raise ValueError("config parameter 'online_fixed_thresholds' must be a JSON object "
                             f"{{model: integer B >= 1}} over the router's models {models}, got {raw!r}")
    prior = None
    path = read_parameter(params, "online_prior_profile", "")
    if path:
        from scheduler_model.errors import ProfileError
        from scheduler_model.profile import load_profile

        try:
            prior = load_profile(path)
        except ProfileError as e:
            raise ValueError(f"config parameter 'online_prior_profile': {e}") from None
        missing = [m for m in models if m not in prior.get("models", [])]
        if missing:
            raise ValueError(f"config parameter 'online_prior_profile': {path} lacks the models {missing}")
    return OnlineSettings(enabled=enabled, interval_s=interval_s, window_s=window_s, fixed_thresholds=fixed,
                          prior_profile=prior, quantum_s=quantum_s, min_gain=min_gain,
                          min_request_steps=min_request_steps)


@dataclass(frozen=True)
class RouterSettings:
    """Every config parameter of a router model (:mod:`tokenrouter.triton.router_model`), read and checked.

    Attributes:
        models: ``models``, comma-separated, in deployment order; model 0 is the SLM.
            Default ``slm,llm``.
        algorithm: ``algorithm``, a key of :data:`tokenrouter.algorithms.ALGORITHMS`. Default ``rstitch``.
        algorithm_params: ``algorithm_params`` (a JSON object), as the algorithm validated it
            (``RoutingAlgorithm.validate_params``: its defaults filled in). Default ``{}``.
        default_max_tokens: output tokens of a request that sets no ``max_tokens``. Default 16.
        tokenizer_path: ``tokenizer_path`` resolved to an absolute checkpoint folder
            (:func:`~tokenrouter.triton.common.resolve_model_path`). Default :data:`DEFAULT_CHECKPOINT`.
        context_length: tokens of prompt + output a request may reach; 0 (default) = the
            tokenizer's ``model_max_length`` (8192 where it has none).
        max_concurrent_requests: worker threads, i.e. requests driven at once (>= 1). Default 16.
        limits: ``max_input_bytes``, ``max_queued_requests``, ``queue_timeout_s`` and the
            sampling-parameter limits (:class:`RequestLimits`).
        remote_models: ``remote_models``, models served by other tritonservers:
            ``{model: [endpoint, …]}`` (one endpoint per replica), every model one of ``models``
            (:func:`tokenrouter.routing.peer.parse_remote_models`). Default none.
        on_peer_failure: what a request does when a model it needs is down: ``fail`` (default)
            or ``fallback``.
        peer_restart_s: seconds between two attempts to get a dead model restarted (> 0). Default 5.
        transport: ``zmq`` (default: the ZeroMQ channel) or ``triton`` (every visit of a request
            to a model is a BLS request; no ``remote_models``). One of :data:`TRANSPORTS`.
        peer_timeout_s: seconds a model may stay silent before the request fails; 0 = never.
            Default 600.
        heartbeat_interval_s: seconds between two pings of a remote replica. Default 0.5.
        heartbeat_timeout_s: seconds without an answer after which a remote replica is down
            (> ``heartbeat_interval_s`` with ``transport: zmq``). Default 2.
        curve: CURVE on TCP (``curve`` on by default, ``curve_secret_key_file``,
            ``curve_server_public_keys``; :class:`~tokenrouter.routing.curve.CurveSettings`).
        online: the ``online_*`` parameters (:class:`~tokenrouter.routing.online_bstar.OnlineSettings`;
            :func:`online_settings`).
    """

    models: Tuple[str, ...] = ("slm", "llm")
    algorithm: str = "rstitch"
    algorithm_params: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    default_max_tokens: int = 16
    tokenizer_path: str = DEFAULT_CHECKPOINT
    context_length: int = 0
    max_concurrent_requests: int = 16
    limits: RequestLimits = RequestLimits()
    remote_models: Mapping[str, List[str]] = dataclasses.field(default_factory=dict)
    on_peer_failure: str = "fail"
    peer_restart_s: float = 5.0
    transport: str = "zmq"
    peer_timeout_s: float = 600.0
    heartbeat_interval_s: float = 0.5
    heartbeat_timeout_s: float = 2.0
    curve: CurveSettings = CurveSettings()
    online: OnlineSettings = OnlineSettings()

    @classmethod
    def from_parameters(cls, params: Mapping[str, str]) -> "RouterSettings":
        """Read and check a router's parameters (``{key: string_value}``, see
        :func:`~tokenrouter.triton.common.model_parameters`).

        Raises:
            ValueError: a malformed or out-of-range value, an unknown algorithm or parameters it
                does not accept, ``remote_models`` naming a model not in ``models`` or with
                ``transport: triton`` (each message names the parameter).
            FileNotFoundError: ``tokenizer_path`` is no checkpoint folder.
        """
        def get(key: str, default: Any, kind=str) -> Any:
            return read_parameter(params, key, default, kind)

        models = tuple(m.strip() for m in get("models", ",".join(cls.models)).split(",") if m.strip())
        online = online_settings(params, list(models))
        algorithm = get("algorithm", cls.algorithm)
        _, algorithm_params = configure_algorithm(algorithm, get("algorithm_params", "{}"), len(models))
        default_max_tokens = get("default_max_tokens", cls.default_max_tokens, int)
        tokenizer_path = resolve_model_path(get("tokenizer_path", cls.tokenizer_path))
        context_length = get("context_length", cls.context_length, int)
        limits = RequestLimits.from_parameters(params)
        workers = get("max_concurrent_requests", cls.max_concurrent_requests, int)
        if workers < 1:
            raise ValueError(f"config parameter 'max_concurrent_requests' must be >= 1, got {workers}")
        remote = parse_remote_models(get("remote_models", ""))
        unknown = sorted(set(remote) - set(models))
        if unknown:
            raise ValueError(f"remote_models names {unknown}, not in models {list(models)}")
        mode = str(get("on_peer_failure", cls.on_peer_failure)).strip().lower()
        if mode not in ON_PEER_FAILURE:
            raise ValueError(f"on_peer_failure must be one of {ON_PEER_FAILURE}, got {mode!r}")
        restart_s = get("peer_restart_s", cls.peer_restart_s, float)
        if not restart_s > 0:
            raise ValueError(f"peer_restart_s must be > 0, got {restart_s}")
        transport = get("transport", cls.transport).strip().lower()
        if transport not in TRANSPORTS:
            raise ValueError(f"config parameter transport must be one of {TRANSPORTS}, got {transport!r}")
        if transport == "triton" and remote:
            raise ValueError("remote_models needs transport zmq (the Triton transport reaches models of this "
                             "server only)")
        heartbeat_s = get("heartbeat_interval_s", cls.heartbeat_interval_s, float)
        heartbeat_timeout_s = get("heartbeat_timeout_s", cls.heartbeat_timeout_s, float)
        if transport == "zmq" and not 0 < heartbeat_s < heartbeat_timeout_s:
            raise ValueError(f"config parameters heartbeat_interval_s ({heartbeat_s}) and heartbeat_timeout_s "
                             f"({heartbeat_timeout_s}) need 0 < heartbeat_interval_s < heartbeat_timeout_s")
        curve = CurveSettings(enabled=curve_enabled(get("curve", "")),
                              secret_key_file=get("curve_secret_key_file", ""),
                              server_public_keys=get("curve_server_public_keys", ""))
        return cls(models=models, algorithm=algorithm, algorithm_params=algorithm_params,
                   default_max_tokens=default_max_tokens, tokenizer_path=tokenizer_path,
                   context_length=context_length, max_concurrent_requests=workers, limits=limits,
                   remote_models=remote, on_peer_failure=mode, peer_restart_s=restart_s, transport=transport,
                   peer_timeout_s=get("peer_timeout_s", cls.peer_timeout_s, float), heartbeat_interval_s=heartbeat_s,
                   heartbeat_timeout_s=heartbeat_timeout_s, curve=curve, online=online)


# ------------------------------------------------------------------------------------------ LLM
@dataclass(frozen=True)
class LLMSettings:
    """Every config parameter of an LLM model (:mod:`tokenrouter.triton.llm_model`), read and checked.

    Engine (:class:`tokenrouter.engine.sglang_engine.EngineConfig`, whose docstring details each):

    Attributes:
        model_path: ``model_path`` resolved to an absolute checkpoint folder. Default
            :data:`DEFAULT_CHECKPOINT`.
        dtype: ``float32`` (default), ``bfloat16``, ``float16`` or ``auto``.
        kv_pool_tokens: size of the model's KV pool in tokens. Default 16384.
        max_running_requests: request rows of the KV pool (running + pending). Default 32.
        context_length: tokens of prompt + output; None (parameter 0 or unset) = the model's own.
        torch_threads: intra-op threads of the model's process; 0 (default) leaves torch's.
        load_format: ``auto`` (default: real weights) or ``dummy`` (random weights of the
            checkpoint's shape, size-realistic benchmarks).
        random_seed: seed of dummy weights. Default 0.
        capture_hidden: return every step's last hidden state to the routing algorithm (learned
            routers read model 0's). Default false.
        cpu_linear_weights: CPU hosts: ``dual`` (default), ``packed`` or ``rowmajor``.
        device: ``auto`` (default), ``cuda`` or ``cpu``.
        attention_backend: SGLang's attention backend; None (empty) = its default.
        cuda_graph: CUDA graphs for decode steps (GPU). Default true.
        cuda_graph_max_bs: largest decode batch captured as a CUDA graph; 0 (default) = SGLang's.
        mem_fraction_static: share of the GPU's memory for weights and KV; 0 (default) = SGLang's.
        prefix_cache: reuse the KV of cached prompt prefixes. Default :data:`PREFIX_CACHE_DEFAULT`.

    Decode loop (:class:`tokenrouter.engine.subserver.SubserverConfig`):

    Attributes:
        delayed_batch_size: B_i, ready requests needed to start a step (values < 1 read as 1). Default 1.
        max_wait_s: bound on the delayed-batching wait in seconds (parameter
            ``delayed_batch_max_wait_us``, microseconds, default 5000).
        stream_interval: committed tokens per streamed chunk (values < 1 read as 1). Default 1.
        readmit_on_resume: std-serving baseline: a returning request is re-prefilled. Default false.
        prefill_chunk_tokens: most new prefill/extend tokens in one step; 0 = no chunking. Default 512.
        queue_timeout_s: seconds a new request may wait for KV; 0 = no limit. Default 60.
        max_queued_requests: most requests waiting for KV. Default 256.

    The model process:

    Attributes:
        drain_timeout_s: seconds an unload waits for the requests the model holds. Default 30.
        lockstep_group: lock-step baseline: comma-separated models stepping in turn; "" = off.
        event_log: JSON Lines file of routing events (``{model}`` = the model's name); "" = none.
        peer_endpoint: the inter-model channel's endpoint; None (default) = a fresh ``ipc://``
            path; ``tcp://0.0.0.0:PORT`` serves routers of other servers.
        router_timeout_s: TCP: seconds of silence after which a router's requests are released.
            Default 10.
        curve: CURVE on a TCP endpoint (``curve`` on by default, ``curve_secret_key_file``,
            ``curve_authorized_keys_dir``; :class:`~tokenrouter.routing.curve.CurveSettings`).
    """

    model_path: str = DEFAULT_CHECKPOINT
    dtype: str = "float32"
    kv_pool_tokens: int = 16384
    max_running_requests: int = 32
    context_length: Optional[int] = None
    torch_threads: int = 0
    load_format: str = "auto"
    random_seed: int = 0
    capture_hidden: bool = False
    cpu_linear_weights: str = "dual"
    device: str = "auto"
    attention_backend: Optional[str] = None
    cuda_graph: bool = True
    cuda_graph_max_bs: int = 0
    mem_fraction_static: float = 0.0
    prefix_cache: bool = PREFIX_CACHE_DEFAULT
    delayed_batch_size: int = 1
    max_wait_s: float = 0.005
    stream_interval: int = 1
    readmit_on_resume: bool = False
    prefill_chunk_tokens: int = 512
    queue_timeout_s: float = 60.0
    max_queued_requests: int = 256
    drain_timeout_s: float = 30.0
    lockstep_group: str = ""
    event_log: str = ""
    peer_endpoint: Optional[str] = None
    router_timeout_s: float = 10.0
    curve: CurveSettings = CurveSettings()

    #: the fields that are EngineConfig's keyword arguments, and SubserverConfig's
    _ENGINE = ("model_path", "dtype", "kv_pool_tokens", "max_running_requests", "context_length", "torch_threads",
               "load_format", "random_seed", "capture_hidden", "cpu_linear_weights", "device", "attention_backend",
               "cuda_graph", "cuda_graph_max_bs", "mem_fraction_static", "prefix_cache")
    _SUBSERVER = ("delayed_batch_size", "max_wait_s", "stream_interval", "readmit_on_resume",
                  "prefill_chunk_tokens", "queue_timeout_s", "max_queued_requests")

    def engine_kwargs(self) -> Dict[str, Any]:
        """Keyword arguments of :class:`~tokenrouter.engine.sglang_engine.EngineConfig` (a plain,
        picklable dict; ``gpu_id`` is left to the caller: the Triton instance's device)."""
        return {k: getattr(self, k) for k in self._ENGINE}

    def subserver_kwargs(self) -> Dict[str, Any]:
        """Keyword arguments of :class:`~tokenrouter.engine.subserver.SubserverConfig` (a plain,
        picklable dict; ``lockstep`` is left to the caller: it opens the turn ring)."""
        return {k: getattr(self, k) for k in self._SUBSERVER}

    @classmethod
    def from_parameters(cls, params: Mapping[str, str]) -> "LLMSettings":
        """Read and check an LLM model's parameters (``{key: string_value}``).

        Raises:
            ValueError: a malformed value, naming the parameter, or a decode-loop setting out of
                range (:class:`~tokenrouter.engine.subserver.SubserverConfig`'s check).
            FileNotFoundError: ``model_path`` is no checkpoint folder.
        """
        def get(key: str, default: Any, kind=str) -> Any:
            return read_parameter(params, key, default, kind)

        s = cls(
            model_path=resolve_model_path(get("model_path", cls.model_path)),
            dtype=get("dtype", cls.dtype),
            kv_pool_tokens=get("kv_pool_tokens", cls.kv_pool_tokens, int),
            max_running_requests=get("max_running_requests", cls.max_running_requests, int),
            context_length=get("context_length", 0, int) or None,
            torch_threads=get("torch_threads", cls.torch_threads, int),
            load_format=get("load_format", cls.load_format),
            random_seed=get("random_seed", cls.random_seed, int),
            capture_hidden=get("capture_hidden", cls.capture_hidden, bool),
            cpu_linear_weights=get("cpu_linear_weights", cls.cpu_linear_weights),
            device=get("device", cls.device),
            attention_backend=get("attention_backend", "") or None,
            cuda_graph=get("cuda_graph", cls.cuda_graph, bool),
            cuda_graph_max_bs=get("cuda_graph_max_bs", cls.cuda_graph_max_bs, int),
            mem_fraction_static=get("mem_fraction_static", cls.mem_fraction_static, float),
            prefix_cache=get("prefix_cache", cls.prefix_cache, bool),
            delayed_batch_size=max(1, get("delayed_batch_size", cls.delayed_batch_size, int)),
            max_wait_s=get("delayed_batch_max_wait_us", round(cls.max_wait_s * 1e6), int) / 1e6,
            stream_interval=max(1, get("stream_interval", cls.stream_interval, int)),
            readmit_on_resume=get("readmit_on_resume", cls.readmit_on_resume, bool),
            prefill_chunk_tokens=get("prefill_chunk_tokens", cls.prefill_chunk_tokens, int),
            queue_timeout_s=get("queue_timeout_s", cls.queue_timeout_s, float),
            max_queued_requests=get("max_queued_requests", cls.max_queued_requests, int),
            drain_timeout_s=get("drain_timeout_s", cls.drain_timeout_s, float),
            lockstep_group=get("lockstep_group", cls.lockstep_group),
            event_log=get("event_log", cls.event_log),
            peer_endpoint=get("peer_endpoint", "") or None,
            router_timeout_s=get("router_timeout_s", cls.router_timeout_s, float),
            curve=CurveSettings(enabled=curve_enabled(get("curve", "")),
                                secret_key_file=get("curve_secret_key_file", ""),
                                authorized_keys_dir=get("curve_authorized_keys_dir", "")),
        )
        SubserverConfig(**s.subserver_kwargs())  # its range checks, before the model loads
        return s
