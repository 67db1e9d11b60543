"""The Triton models' settings: their config.pbtxt ``parameters``, read once into typed objects.

Each model reads its parameters at the top of ``initialize``, in one call:
:meth:`RouterSettings.from_parameters` for ``token_router`` (and any other router model) and
:meth:`LLMSettings.from_parameters` for an LLM model (``slm``, ``llm``, …).  That call reads every
value, applies the defaults and checks them; a bad value is a ``ValueError`` naming the parameter,
and the model fails to load with it.  The layers below (``routing``, ``algorithms``, ``engine``)
receive these objects, or plain values taken from them, never the raw parameters.

A parameter that is absent, empty or an unexpanded ``${…}`` placeholder takes its default.
Booleans are ``true``/``false`` (also ``1``/``0``, ``yes``/``no``, ``on``/``off``).

Every parameter is declared once, with its unit, range, default and doc, on a field of the object
that holds it (:func:`~tokenrouter.engine.parameters.param`):

* an LLM model's on the engine's configs (:class:`~tokenrouter.engine.config.EngineConfig`,
  :class:`~tokenrouter.engine.config.SubserverConfig`) and on :class:`LLMSettings`;
* a router's on :class:`RouterSettings`, :class:`RequestLimits`, the sampling limits
  (:class:`~tokenrouter.engine.sampling.InputLimits`) and the online adaptation
  (:class:`~tokenrouter.routing.online_bstar.OnlineSettings`);
* both kinds' ``curve*`` keys on :class:`~tokenrouter.routing.curve.CurveSettings`, and ``role``
  on :class:`ModelRole`.

They are read from those declarations (:func:`read_declared`), except the few whose reading is
their own code's (a list, JSON, a path, a profile to load, ``auto``), which still take their
default from the declaration.  docs/configuration.md lists them with their defaults, and a test
holds it to the declarations (:func:`llm_parameters`, :func:`router_parameters`).
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
from ..engine.parameters import NOTHING, Param, check_ranges, declarations, documented, param
from ..routing.curve import CurveSettings, curve_enabled
from ..routing.online_bstar import OnlineSettings
from ..routing.peer import parse_remote_models
from .common import resolve_model_path

__all__ = ["DEFAULT_CHECKPOINT", "ON_PEER_FAILURE", "ROLES", "TRANSPORTS", "LLMSettings", "ModelRole", "RequestLimits",
           "RouterSettings", "curve_settings", "declared_raw", "llm_parameters", "online_settings", "read_declared",
           "read_parameter", "router_parameters"]

#: default ``model_path`` of an LLM model and ``tokenizer_path`` of a router (a folder under the
#: weights folder, :func:`tokenrouter.triton.common.weights_dir`)
DEFAULT_CHECKPOINT = "smollm2-135m-instruct"

#: values of the router's ``transport`` parameter: how the router reaches the models
TRANSPORTS = ("zmq", "triton")

#: values of the router's ``on_peer_failure`` parameter
ON_PEER_FAILURE = ("fail", "fallback")

#: values of ``role``: the kind of model the ``tokenrouter`` backend serves
ROLES = ("llm", "router")

#: the CURVE parameter of :class:`~tokenrouter.routing.curve.CurveSettings` each kind of model does
#: not read (it is the other kind's)
_CURVE_NOT_READ = {"llm": "server_public_keys", "router": "authorized_keys_dir"}

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


def read_declared(cls: type, params: Mapping[str, str], **given: Any) -> Any:
    """An instance of the dataclass ``cls`` whose declared fields are read from config parameters.

    Each field declared with a config parameter (:class:`~tokenrouter.engine.parameters.Param`)
    is read as its ``kind`` (:func:`read_parameter`; absent: the field's default), stripped and
    lower-cased where it ``fold_case``-s, ``unset`` read as None, divided by ``scale``, and raised
    to ``ge`` where it ``clamp``-s; ``cls`` then checks the ranges.  Fields in ``given`` are taken
    as given (the parameters whose reading is the caller's), undeclared ones keep their defaults.

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
        if p.fold_case and isinstance(v, str):
            v = v.strip().lower()
        if p.unset is not NOTHING and v == p.unset:
            v = None
        elif p.scale != 1:
            v = v / p.scale
        if p.clamp and v is not None and v < p.ge:
            v = kind(p.ge)
        values[name] = v
    return cls(**values)


def declared_raw(cls: type, name: str, params: Mapping[str, str]) -> Optional[str]:
    """The text of the config parameter declared on the field ``name`` of the dataclass ``cls``, for
    a parameter whose reading is the caller's own code; None where it is absent, empty or a ``${…}``
    placeholder (the declared default applies).

    Raises:
        KeyError: ``name`` is not a declared field of ``cls`` with a config parameter.
    """
    key = {n: p.parameter(n) for n, p, _ in declarations(cls)}[name]
    if key is None:
        raise KeyError(f"{cls.__name__}.{name} has no config parameter")
    return read_parameter(params, key, None)


def curve_settings(params: Mapping[str, str], role: str) -> CurveSettings:
    """The CURVE parameters of a model of kind ``role`` (``llm``: ``curve``, ``curve_secret_key_file``,
    ``curve_authorized_keys_dir``; ``router``: ``curve_server_public_keys`` instead of the last),
    as declared on :class:`~tokenrouter.routing.curve.CurveSettings`; ``curve`` is read by
    :func:`~tokenrouter.routing.curve.curve_enabled`.

    Raises:
        ValueError: ``curve`` neither on nor off.
    """
    raw = declared_raw(CurveSettings, "enabled", params)
    enabled = CurveSettings.enabled if raw is None else curve_enabled(raw)
    return read_declared(CurveSettings, params, enabled=enabled, **{_CURVE_NOT_READ[role]: ""})


@documented
@dataclass(frozen=True)
class ModelRole:
    """The parameter every model of the ``tokenrouter`` backend reads first: which kind of model it
    is (``backends/tokenrouter/model.py`` dispatches on it).

    Raises:
        ValueError: a role not in :data:`ROLES` (naming ``role``).
    """

    role: str = param("llm", choices=ROLES, doc=(
        "``llm``: a model subserver (:mod:`tokenrouter.triton.llm_model`); ``router``: the BLS router "
        "(:mod:`tokenrouter.triton.router_model`)"))

    def __post_init__(self) -> None:
        check_ranges(self)

    @classmethod
    def from_parameters(cls, params: Mapping[str, str]) -> "ModelRole":
        """Read ``role`` from a model's parameters (``{key: string_value}``).

        Raises:
            ValueError: a role not in :data:`ROLES`.
        """
        return read_declared(cls, params)


# ------------------------------------------------------------------------------------------ router
@documented
@dataclass(frozen=True)
class RequestLimits:
    """The router's bounds on one request and on its queue, declared here, and (``sampling``) the
    limits of the sampling parameters, declared on :class:`~tokenrouter.engine.sampling.InputLimits`.

    Raises:
        ValueError: a value out of its declared range (naming it).
    """

    max_input_bytes: Optional[int] = param(None, unit="bytes", ge=1, kind=int,
                                           shown="`context_length` × the longest token in bytes", doc=(
        "UTF-8 bytes of ``text_input``, checked before decoding and tokenising; None (unset) until the "
        "router has its tokenizer, then ``context_length`` × the longest token of the vocabulary in "
        "bytes, a bound no prompt that fits the context can exceed"))
    max_queued_requests: int = param(64, unit="requests", ge=0, doc=(
        "requests accepted but waiting for one of the ``max_concurrent_requests`` workers; one more is "
        "refused at once as busy"))
    queue_timeout_s: float = param(60.0, unit="s", ge=0, doc=(
        "a request may wait this long for a worker, and for KV on each model it visits (sent to the "
        "models; they also have their own ``queue_timeout_s``); Triton's per-request ``timeout`` "
        "parameter (µs) lowers it; past it the request ends as busy; 0: no limit"))
    sampling: InputLimits = InputLimits()

    def __post_init__(self) -> None:
        check_ranges(self)

    @classmethod
    def from_parameters(cls, params: Mapping[str, str]) -> "RequestLimits":
        """Read the limits and the sampling limits from a router's parameters, by their declarations.

        Raises:
            ValueError: a value that is not a number, or out of range (naming it).
        """
        return read_declared(cls, params, sampling=read_declared(InputLimits, params))


def online_settings(params: Mapping[str, str], models: List[str]) -> OnlineSettings:
    """Read and check a router's ``online_*`` parameters (declared on
    :class:`~tokenrouter.routing.online_bstar.OnlineSettings`).

    The numbers and the switch are read from their declarations; ``online_quantum_s`` (``auto`` or
    seconds), ``online_fixed_thresholds`` (JSON over the router's models) and
    ``online_prior_profile`` (a PROFILE.json, loaded here) by this function.

    Args:
        params: the router's parameters, ``{key: string_value}``.
        models: the router's models (``online_fixed_thresholds`` and the prior profile must name them).

    Returns:
        the settings (``enabled`` false when ``online_adaptation`` is off or unset).

    Raises:
        ValueError: a malformed value, naming the parameter; ``online_prior_profile`` is loaded
            here, so a missing or malformed profile fails too.
    """
    own = ("quantum_s", "fixed_thresholds", "prior_profile")  # read below; their declared defaults until then
    base = read_declared(OnlineSettings, params, **{n: d for n, _, d in declarations(OnlineSettings) if n in own})
    quantum_s = None
    q = declared_raw(OnlineSettings, "quantum_s", params)
    if q is not None and q.strip().lower() != "auto":
        try:
            quantum_s = float(q)
        except ValueError:
            raise ValueError(f"config parameter 'online_quantum_s' must be 'auto' or seconds, got {q!r}") from None
    fixed: Dict[str, int] = {}
    raw = declared_raw(OnlineSettings, "fixed_thresholds", params)
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
    path = declared_raw(OnlineSettings, "prior_profile", params)
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
    # replace() checks the declared ranges again (online_quantum_s > 0)
    return dataclasses.replace(base, fixed_thresholds=fixed, prior_profile=prior, quantum_s=quantum_s)


@documented
@dataclass(frozen=True)
class RouterSettings:
    """Every config parameter of a router model (:mod:`tokenrouter.triton.router_model`), read and checked.

    The router's own parameters are declared on the fields below; ``limits``
    (:class:`RequestLimits`, with the sampling limits), ``curve``
    (:class:`~tokenrouter.routing.curve.CurveSettings`: ``curve``, ``curve_secret_key_file``,
    ``curve_server_public_keys``) and ``online``
    (:class:`~tokenrouter.routing.online_bstar.OnlineSettings`: the ``online_*`` parameters) hold the
    others, declared there.  :meth:`from_parameters` reads ``models`` (a list), ``algorithm`` and
    ``algorithm_params`` (checked by the algorithm), ``tokenizer_path`` (resolved) and
    ``remote_models`` (JSON) by its own code, the others from their declarations.

    Raises:
        ValueError: a value out of its declared range, ``remote_models`` naming a model not in
            ``models`` or given with ``transport: triton``, or, with ``transport: zmq``, not
            0 < ``heartbeat_interval_s`` < ``heartbeat_timeout_s``.
    """

    models: Tuple[str, ...] = param(("slm", "llm"), kind=str, shown="`slm,llm`", doc=(
        "the models, comma-separated, in deployment order; model 0 writes first (the SLM)"))
    algorithm: str = param("rstitch", doc="the routing algorithm, a key of :data:`tokenrouter.algorithms.ALGORITHMS`")
    algorithm_params: Mapping[str, Any] = param(default_factory=dict, kind=str, doc=(
        "JSON object: the algorithm's parameters; the field holds them as the algorithm validated them "
        "(``RoutingAlgorithm.validate_params``: its defaults filled in)"))
    default_max_tokens: int = param(16, unit="tokens", ge=1, doc="``max_tokens`` of a request that sets none")
    tokenizer_path: str = param(DEFAULT_CHECKPOINT, doc=(
        "the models' tokenizer folder, absolute or under the weights folder; the field holds it "
        "resolved to an absolute folder (:func:`~tokenrouter.triton.common.resolve_model_path`)"))
    context_length: int = param(0, unit="tokens", ge=0, shown="the tokenizer's `model_max_length`", doc=(
        "longest prompt + output a request may reach; 0: the tokenizer's ``model_max_length`` (8192 "
        "where it has none or a huge one)"))
    max_concurrent_requests: int = param(16, unit="requests", ge=1, doc=(
        "worker threads: requests driven at once; the others wait in the queue"))
    limits: RequestLimits = RequestLimits()
    remote_models: Mapping[str, List[str]] = param(default_factory=dict, kind=str, shown="none", doc=(
        "models served by other tritonservers: JSON ``{\"llm\": \"tcp://host:port\"}`` or, for replicas, a "
        "list of endpoints; the field holds ``{model: [endpoint, …]}``, every model one of ``models`` "
        "(:func:`tokenrouter.routing.peer.parse_remote_models`)"))
    on_peer_failure: str = param("fail", choices=ON_PEER_FAILURE, fold_case=True, doc=(
        "what a request does when a model it needs is down: ``fail`` (an error naming it) or "
        "``fallback`` (go on without it); case-insensitive"))
    peer_restart_s: float = param(5.0, unit="s", gt=0, doc="time between two attempts to get a dead model restarted")
    transport: str = param("zmq", choices=TRANSPORTS, fold_case=True, doc=(
        "how the router reaches the models: ``zmq`` (the ZeroMQ channel) or ``triton`` (every visit of a "
        "request to a model is a BLS request; no ``remote_models``); case-insensitive"))
    peer_timeout_s: float = param(600.0, unit="s", ge=0, doc="a model silent this long fails the request; 0: never")
    heartbeat_interval_s: float = param(0.5, unit="s", doc=(
        "time between two pings of a remote replica (with ``transport: zmq``, > 0 and < "
        "``heartbeat_timeout_s``)"))
    heartbeat_timeout_s: float = param(2.0, unit="s", doc="a remote replica silent this long is down")
    init_timeout_s: float = param(900.0, unit="s", ge=0, doc=(
        "bound on the router's load: past it, its stub writes every thread's stack to Triton's log and "
        "ends (:class:`~tokenrouter.triton.init_watchdog.InitWatchdog`); 0: no bound"))
    curve: CurveSettings = CurveSettings()
    online: OnlineSettings = OnlineSettings()

    def __post_init__(self) -> None:
        check_ranges(self)
        unknown = sorted(set(self.remote_models) - set(self.models))
        if unknown:
            raise ValueError(f"remote_models names {unknown}, not in models {list(self.models)}")
        if self.transport == "triton" and self.remote_models:
            raise ValueError("remote_models needs transport zmq (the Triton transport reaches models of this "
                             "server only)")
        if self.transport == "zmq" and not 0 < self.heartbeat_interval_s < self.heartbeat_timeout_s:
            raise ValueError(f"config parameters heartbeat_interval_s ({self.heartbeat_interval_s}) and "
                             f"heartbeat_timeout_s ({self.heartbeat_timeout_s}) need 0 < heartbeat_interval_s "
                             "< heartbeat_timeout_s")

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
        def raw(name: str) -> Optional[str]:
            return declared_raw(cls, name, params)

        listed = raw("models")
        models = cls.models if listed is None else tuple(m.strip() for m in listed.split(",") if m.strip())
        online = online_settings(params, list(models))
        algorithm = raw("algorithm") or cls.algorithm
        _, algorithm_params = configure_algorithm(algorithm, raw("algorithm_params"), len(models))
        return read_declared(cls, params, models=models, online=online, algorithm=algorithm,
                             algorithm_params=algorithm_params,
                             tokenizer_path=resolve_model_path(raw("tokenizer_path") or cls.tokenizer_path),
                             limits=RequestLimits.from_parameters(params),
                             remote_models=parse_remote_models(raw("remote_models")),
                             curve=curve_settings(params, "router"))


# ------------------------------------------------------------------------------------------ LLM
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
                             curve=curve_settings(params, "llm"))


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


def _parameters(*classes: type, skip: Tuple[str, ...] = ()) -> List[Tuple[str, str, Param, Any]]:
    """``(parameter, field, declaration, default)`` of the declared fields with a config parameter of
    ``classes``, in order, less the fields named in ``skip``."""
    return [(p.parameter(name), name, p, default) for cls in classes for name, p, default in declarations(cls)
            if p.parameter(name) is not None and name not in skip]


def llm_parameters() -> List[Tuple[str, str, Param, Any]]:
    """Every declared config parameter of an LLM model: ``(parameter, field, declaration, default)``,
    engine first, then the decode loop, the model process and its CURVE keys (``model_path``'s
    default is :data:`DEFAULT_CHECKPOINT`).  What docs/configuration.md is checked against."""
    out = _parameters(EngineConfig, SubserverConfig, LLMSettings) + _parameters(
        CurveSettings, skip=(_CURVE_NOT_READ["llm"],))
    return [(key, name, p, DEFAULT_CHECKPOINT if (key, default) == ("model_path", dataclasses.MISSING) else default)
            for key, name, p, default in out]


def router_parameters() -> List[Tuple[str, str, Param, Any]]:
    """Every declared config parameter of a router: ``(parameter, field, declaration, default)``:
    ``role`` (:class:`ModelRole`, which makes a model the router), the router's own
    (:class:`RouterSettings`), the limits (:class:`RequestLimits`,
    :class:`~tokenrouter.engine.sampling.InputLimits`), its CURVE keys and the online adaptation
    (:class:`~tokenrouter.routing.online_bstar.OnlineSettings`).  What docs/configuration.md is
    checked against."""
    return (_parameters(ModelRole, RouterSettings, RequestLimits, InputLimits)
            + _parameters(CurveSettings, skip=(_CURVE_NOT_READ["router"],)) + _parameters(OnlineSettings))
