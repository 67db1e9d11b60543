"""The Triton models' settings: their config.pbtxt ``parameters``, read once into typed objects.

Each model reads its parameters at the top of ``initialize``, in one call:
:meth:`RouterSettings.from_parameters` for ``token_router`` (and any other router model) and
:meth:`LLMSettings.from_parameters` for an LLM model (``slm``, ``llm``, …).  That call reads every
value, applies the defaults and checks them; a bad value is a ``ValueError`` naming the parameter,
and the model fails to load with it.  The layers below (``routing``, ``algorithms``, ``engine``)
receive these objects, or plain values taken from them, never the raw parameters.

A parameter that is absent, empty or an unexpanded ``${…}`` placeholder takes its default.
Booleans are ``true``/``false`` (also ``1``/``0``, ``yes``/``no``, ``on``/``off``).
An LLM model's parameters are declared once, on the fields of the engine's configs
(:class:`~tokenrouter.engine.config.EngineConfig`, :class:`~tokenrouter.engine.config.SubserverConfig`)
and of :class:`LLMSettings` (:mod:`tokenrouter.engine.parameters`), and read from those
declarations (:func:`read_declared`); docs/configuration.md lists them with their defaults, and a
test holds it to the declarations (:func:`llm_parameters`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple

from ..algorithms import configure as configure_algorithm
from ..engine.sampling import InputLimits
from ..engine.config import EngineConfig, SubserverConfig
from ..engine.parameters import NOTHING, Param, check_ranges, declarations, param
from ..routing.curve import CurveSettings, curve_enabled
from ..routing.online_bstar import OnlineSettings
from ..routing.peer import parse_remote_models
from .common import resolve_model_path

__all__ = ["DEFAULT_CHECKPOINT", "ON_PEER_FAILURE", "TRANSPORTS", "LLMSettings", "RequestLimits", "RouterSettings",
           "llm_parameters", "read_declared", "read_parameter"]

#: default ``model_path`` of an LLM model and ``tokenizer_path`` of a router (a folder under the
#: weights folder, :func:`tokenrouter.triton.common.weights_dir`)
DEFAULT_CHECKPOINT = "smollm2-135m-instruct"

#: values of the router's ``transport`` parameter: how the router reaches the models
TRANSPORTS = ("zmq", "triton")

#: values of the router's ``on_peer_failure`` parameter
ON_PEER_FAILURE = ("fail", "fallback")

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
        init_timeout_s: seconds the router's load may take before its stub writes every thread's
            stack to Triton's log and ends (:class:`~tokenrouter.triton.init_watchdog.InitWatchdog`);
            0 = no bound. Default 900.
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
    init_timeout_s: float = 900.0
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
        init_timeout_s = get("init_timeout_s", cls.init_timeout_s, float)
        if init_timeout_s < 0:
            raise ValueError(f"config parameter 'init_timeout_s' must be >= 0, got {init_timeout_s}")
        curve = CurveSettings(enabled=curve_enabled(get("curve", "")),
                              secret_key_file=get("curve_secret_key_file", ""),
                              server_public_keys=get("curve_server_public_keys", ""))
        return cls(models=models, algorithm=algorithm, algorithm_params=algorithm_params,
                   default_max_tokens=default_max_tokens, tokenizer_path=tokenizer_path,
                   context_length=context_length, max_concurrent_requests=workers, limits=limits,
                   remote_models=remote, on_peer_failure=mode, peer_restart_s=restart_s, transport=transport,
                   peer_timeout_s=get("peer_timeout_s", cls.peer_timeout_s, float), heartbeat_interval_s=heartbeat_s,
                   heartbeat_timeout_s=heartbeat_timeout_s, init_timeout_s=init_timeout_s, curve=curve,
                   online=online)


# ------------------------------------------------------------------------------------------ LLM
def read_declared(cls: type, params: Mapping[str, str], **given: Any) -> Any:
    """An instance of the dataclass ``cls`` whose declared fields are read from config parameters.

    Each field declared with a config parameter (:class:`~tokenrouter.engine.parameters.Param`)
    is read as its ``kind`` (:func:`read_parameter`; absent: the field's default), ``unset``
    read as None, divided by ``scale``, and raised to ``ge`` where it ``clamp``-s; ``cls`` then
    checks the ranges.  Fields in ``given`` are taken as given, undeclared ones keep their defaults.

    Raises:
        ValueError: a malformed value or one out of range, naming it.
    """
    values = dict(given)
    for name, p, default in declarations(cls):
        key = p.parameter(name)
        if key is None or name in given:
            continue
        kind = p.value_kind(default)
        fallback = p.unset if default is None and p.unset is not NOTHING else default
        if p.scale != 1 and fallback is not None:
            fallback = kind(round(fallback * p.scale))
        v = read_parameter(params, key, fallback, kind)
        if p.unset is not NOTHING and v == p.unset:
            v = None
        elif p.scale != 1:
            v = v / p.scale
        if p.clamp and v is not None and v < p.ge:
            v = kind(p.ge)
        values[name] = v
    return cls(**values)


@dataclass(frozen=True)
class LLMSettings:
    """Every config parameter of an LLM model (:mod:`tokenrouter.triton.llm_model`), read and checked.

    The engine's and the decode loop's settings are their own configs, read from their declarations;
    the model process's are declared here (the ``curve*`` parameters are
    :class:`~tokenrouter.routing.curve.CurveSettings`').

    Attributes:
        engine: :class:`~tokenrouter.engine.config.EngineConfig` (``model_path`` resolved to an
            absolute checkpoint folder; default :data:`DEFAULT_CHECKPOINT`).
        subserver: :class:`~tokenrouter.engine.config.SubserverConfig`.
        curve: CURVE on a TCP endpoint (``curve`` on by default, ``curve_secret_key_file``,
            ``curve_authorized_keys_dir``; :class:`~tokenrouter.routing.curve.CurveSettings`).
    """

    engine: EngineConfig
    subserver: SubserverConfig = dataclasses.field(default_factory=SubserverConfig)
    drain_timeout_s: float = param(30.0, unit="s", ge=0, doc=(
        "an unload (a stop, an explicit unload) waits this long for the requests the model holds"))
    lockstep_group: str = param("", doc="the lock-step baseline: comma-separated models that step in turn")
    event_log: str = param("", doc=(
        "JSON Lines file of ``step`` / ``handoff`` events (``{model}`` is replaced by the model's name), "
        "the format ``python -m scheduler_model profile`` reads"))
    peer_endpoint: Optional[str] = param(None, unset="", shown="a fresh `ipc://` path in the temp folder", doc=(
        "the inter-model channel; ``tcp://0.0.0.0:PORT`` serves routers of other servers"))
    router_timeout_s: float = param(10.0, unit="s", ge=0, doc=(
        "a router silent this long (TCP; routers ping every 0.5 s) has its requests released"))
    init_timeout_s: float = param(900.0, unit="s", ge=0, doc=(
        "bound on the model's load (weights included): past it, every thread's stack goes to "
        "Triton's log and the stub process ends, so the load fails instead of hanging; 0: no bound "
        "(:class:`~tokenrouter.triton.init_watchdog.InitWatchdog`)"))
    curve: CurveSettings = CurveSettings()

    def __post_init__(self) -> None:
        check_ranges(self)

    def engine_kwargs(self) -> Dict[str, Any]:
        """Keyword arguments of :class:`~tokenrouter.engine.config.EngineConfig` (a plain,
        picklable dict; ``gpu_id`` is the caller's to set: the Triton instance's device)."""
        return dataclasses.asdict(self.engine)

    def subserver_kwargs(self) -> Dict[str, Any]:
        """Keyword arguments of :class:`~tokenrouter.engine.config.SubserverConfig` (a plain,
        picklable dict; ``lockstep`` is the caller's to set: it opens the turn ring)."""
        return dataclasses.asdict(self.subserver)

    @classmethod
    def from_parameters(cls, params: Mapping[str, str]) -> "LLMSettings":
        """Read and check an LLM model's parameters (``{key: string_value}``).

        Raises:
            ValueError: a malformed value or one out of range, naming the parameter.
            FileNotFoundError: ``model_path`` is no checkpoint folder.
        """
        model_path = resolve_model_path(read_parameter(params, "model_path", DEFAULT_CHECKPOINT))
        return read_declared(cls, params, engine=read_declared(EngineConfig, params, model_path=model_path),
                             subserver=read_declared(SubserverConfig, params),
                             curve=CurveSettings(enabled=curve_enabled(read_parameter(params, "curve", "")),
                                                 secret_key_file=read_parameter(params, "curve_secret_key_file", ""),
                                                 authorized_keys_dir=read_parameter(params, "curve_authorized_keys_dir",
                                                                                    "")))


#: the config parameters a running model's ``configure`` op may change that are its decode loop's
#: (declared on :class:`~tokenrouter.engine.config.SubserverConfig`); ``lockstep_group`` and
#: ``prefix_cache`` are the model's own to apply
RUNTIME_SCHEDULING = ("delayed_batch_size", "delayed_batch_max_wait_us", "stream_interval", "readmit_on_resume",
                      "prefill_chunk_tokens")


def _runtime_value(key: str, v: Any, p: Param, kind: type) -> Any:
    """A ``configure`` value (JSON) as ``kind``, in the parameter's units and range: a bool only as a
    bool (or "true"/"false"), a number never as a bool, an int only whole (or its digits in a string).

    Raises:
        ValueError: "configure: KEY must be <kind> <range>, got V".
    """
    what = {bool: "true or false", int: "an integer", float: "a number"}[kind] + (
        f" >= {p.ge * p.scale:g}" if p.ge is not None else "")
    bad = ValueError(f"configure: {key} must be {what}, got {v!r}")
    if isinstance(v, str):
        try:
            v = read_parameter({key: v}, key, None, kind)
        except ValueError:
            raise bad from None
    if kind is bool:
        if isinstance(v, bool):
            return v
        raise bad
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise bad
    if kind is int and not float(v).is_integer():
        raise bad
    v = kind(v)
    if p.ge is not None and v < p.ge * p.scale:
        raise bad
    return v


def scheduling_changes(config: SubserverConfig, cfg: Mapping[str, Any]) -> Dict[str, Any]:
    """The decode-loop settings a ``configure`` op changes, read from their declarations as at load.

    Args:
        config: the loop's current settings (the changes are checked against its ranges on top of it).
        cfg: ``{config parameter: JSON value}``; the keys of :data:`RUNTIME_SCHEDULING` are read,
            the others ignored.

    Returns:
        ``{SubserverConfig field: value}`` in the field's units (``delayed_batch_max_wait_us`` µs ->
        ``max_wait_s`` s).

    Raises:
        ValueError: a value of the wrong kind or out of its declared range (no clamping at run
            time), naming the parameter.
    """
    fields = {p.parameter(name): (name, p, default) for name, p, default in declarations(SubserverConfig)}
    out: Dict[str, Any] = {}
    for key in RUNTIME_SCHEDULING:
        if key in cfg:
            name, p, default = fields[key]
            v = _runtime_value(key, cfg[key], p, p.value_kind(default))
            out[name] = v / p.scale if p.scale != 1 else v
    try:
        dataclasses.replace(config, **out)  # __post_init__ checks the declared ranges
    except ValueError as e:
        raise ValueError(f"configure: {e}") from None
    return out


def llm_parameters() -> List[Tuple[str, str, Param, Any]]:
    """Every declared config parameter of an LLM model: ``(parameter, field, declaration, default)``,
    engine first, then the decode loop and the model process (``model_path``'s default is
    :data:`DEFAULT_CHECKPOINT`).  What docs/configuration.md is checked against."""
    out = []
    for cls in (EngineConfig, SubserverConfig, LLMSettings):
        for name, p, default in declarations(cls):
            if p.parameter(name) is not None:
                out.append((p.parameter(name), name, p,
                            DEFAULT_CHECKPOINT if (cls, name) == (EngineConfig, "model_path") else default))
    return out
