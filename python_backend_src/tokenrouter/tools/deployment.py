"""Model repositories for deployments: which models one server hosts, where its peers are, what it runs on.

A deployment splits TokenRouter's models over servers (Triton processes, containers, pods):

* **roles** — a server hosts a subset of the repository's models (``--models``): the
  router with its SLM (``slm,token_router``), an LLM alone (``llm``), or all of them;
* **remote peers** — the router reaches models hosted elsewhere over TCP (``--remote
  llm=tcp://host:port``; several endpoints are replicas), and a hosted LLM listens on a
  TCP port (``--peer-port``) instead of its default local ``ipc://`` endpoint;
* **CURVE keys** — TCP peers authenticate and encrypt with ZeroMQ CURVE, keys read from
  a directory (``--keys``; layout in :data:`KEY_FILES`);
* **targets** — ``cpu`` (the repository as is: CPU instances, fp32 or the pair's dtype)
  or ``gpu`` (``KIND_GPU`` instances on one GPU each, ``device: cuda``, CUDA graphs on,
  bfloat16; see :data:`GPU_PARAMETERS`).

Every config-parameter name a deployment sets is defined once here
(:data:`PARAM`), so they can follow the names the models read.

The configs are read and written with Triton's model-config protobuf
(:func:`tokenrouter.tools.repository.read_config`), never with regular expressions.

CLI (``deploy/docker/entrypoint.sh`` calls it; it prints a JSON summary)::

    python -m tokenrouter.tools.deployment render --src model_repository --out RUN_DIR \\
        --target gpu --models slm,token_router --remote llm=tcp://llm-0.llm-peer:7000 --keys /keys
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from typing import Dict, Iterable, List, Mapping, Optional, Sequence

from .repository import PAIRS, read_config, write_config

__all__ = ["PARAM", "KEY_FILES", "GPU_PARAMETERS", "TARGETS", "DeploymentError", "parse_remote",
           "load_remote_file", "render", "main"]

#: config-parameter names this module sets (model parameters unless marked "router")
PARAM: Dict[str, str] = {
    "peer_endpoint": "peer_endpoint",                # model: where its PeerServer binds
    "remote_models": "remote_models",                # router: JSON {model: endpoint | [endpoints]}
    "curve": "curve",                                # both: "on" / "off" (on by default for tcp://)
    "curve_secret_key_file": "curve_secret_key_file",          # both: own secret key file
    "curve_authorized_keys_dir": "curve_authorized_keys_dir",  # model: folder of client public keys
    "curve_server_public_keys": "curve_server_public_keys",    # router: JSON {model: public key file}
    "model_path": "model_path",                      # model: checkpoint folder
    "tokenizer_path": "tokenizer_path",              # router: tokenizer folder
    "role": "role",                                  # "router" marks the router model
}

#: files of a CURVE key folder (``--keys DIR``): the LLM servers' key pair and the routers' key
#: pair, in ZeroMQ's certificate format (``zmq.auth.create_certificates``). A hosted model reads
#: ``server.key_secret`` and accepts every public key (``*.key``) in the folder; a router reads
#: ``router.key_secret`` and checks its peers against ``server.key``. A server needs only
#: ``server.key_secret`` and ``router.key``; a router only ``router.key_secret`` and ``server.key``.
KEY_FILES: Dict[str, str] = {
    "server_secret": "server.key_secret",
    "server_public": "server.key",
    "client_secret": "router.key_secret",
    "client_public": "router.key",
}

#: parameters of every LLM model on the ``gpu`` target (a KIND_GPU instance is also set)
GPU_PARAMETERS: Dict[str, str] = {
    "device": "cuda",            # refuse to start without a GPU instead of falling back to the CPU
    "cuda_graph": "true",        # decode steps replay captured CUDA graphs
    "dtype": "bfloat16",
    "cpu_linear_weights": "rowmajor",  # CPU-only option: leave SGLang's weights as loaded
}

TARGETS = ("cpu", "gpu")


class DeploymentError(ValueError):
    """A deployment setting that cannot be rendered (the message names it)."""


def _split_list(text: str) -> List[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def parse_remote(specs: Iterable[str]) -> Dict[str, List[str]]:
    """``["llm=tcp://a:7000,tcp://b:7000", …]`` → ``{"llm": ["tcp://a:7000", "tcp://b:7000"]}``.

    A model named twice gets the endpoints of both. Raises :class:`DeploymentError` on a spec
    without ``=``, without endpoints, or with an endpoint that is not ``tcp://host:port``.
    """
    out: Dict[str, List[str]] = {}
    for spec in specs:
        model, sep, eps = spec.partition("=")
        if not sep or not model.strip():
            raise DeploymentError(f"--remote takes MODEL=tcp://HOST:PORT[,…], got {spec!r}")
        endpoints = _split_list(eps)
        if not endpoints:
            raise DeploymentError(f"--remote {spec!r}: no endpoint")
        out.setdefault(model.strip(), []).extend(_check_endpoint(e) for e in endpoints)
    return out


def _check_endpoint(ep: str) -> str:
    if not ep.startswith("tcp://"):
        raise DeploymentError(f"remote endpoint {ep!r}: only tcp://HOST:PORT reaches another server")
    host, sep, port = ep[len("tcp://"):].rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DeploymentError(f"remote endpoint {ep!r} is not tcp://HOST:PORT")
    return ep


def load_remote_file(path: str) -> Dict[str, List[str]]:
    """Read a remote-models map file: JSON ``{model: endpoint | [endpoints]}`` (a ConfigMap key).

    Raises:
        DeploymentError: not a JSON object of endpoints or lists of endpoints.
        OSError: the file cannot be read.
    """
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise DeploymentError(f"{path}: not JSON ({e})") from None
    if not isinstance(data, dict):
        raise DeploymentError(f"{path}: expected a JSON object {{model: endpoint or [endpoints]}}")
    out: Dict[str, List[str]] = {}
    for model, eps in data.items():
        eps = [eps] if isinstance(eps, str) else eps
        if not isinstance(eps, list) or not eps or not all(isinstance(e, str) for e in eps):
            raise DeploymentError(f"{path}: {model!r} needs an endpoint or a non-empty list of endpoints")
        out[model] = [_check_endpoint(e) for e in eps]
    return out


def _parse_assignments(specs: Iterable[str], what: str) -> Dict[str, str]:
    out: Dict[str, str] = {}
    for spec in specs:
        key, sep, value = spec.partition("=")
        if not sep or not key.strip():
            raise DeploymentError(f"{what} takes KEY=VALUE, got {spec!r}")
        out[key.strip()] = value.strip()
    return out


def _is_router(cfg) -> bool:
    return PARAM["role"] in cfg.parameters and cfg.parameters[PARAM["role"]].string_value == "router"


def render(src: str, out: str, *, target: str = "cpu", pair: str = "demo",
           models: Optional[Sequence[str]] = None,
           remote: Optional[Mapping[str, Sequence[str]]] = None,
           peer_port: int = 0, peer_host: str = "0.0.0.0",
           keys_dir: Optional[str] = None, curve: bool = True,
           gpus: Optional[Mapping[str, int]] = None,
           model_paths: Optional[Mapping[str, str]] = None,
           params: Optional[Mapping[str, Mapping[str, str]]] = None) -> Dict[str, object]:
    """Write the model repository one server of a deployment serves.

    Args:
        src: the project's model repository (one folder per model with config.pbtxt).
        out: destination: a new or empty folder, or one a previous render wrote (replaced).
        target: ``"cpu"`` (configs as they are) or ``"gpu"`` (every LLM model gets a
            ``KIND_GPU`` instance on its GPU and :data:`GPU_PARAMETERS`; the router stays
            on the CPU).
        pair: a key of :data:`tokenrouter.tools.repository.PAIRS` applied first.
        models: the models this server hosts (default: every model of ``src``).
        remote: models hosted elsewhere, ``{model: [tcp endpoints]}``; the router gets them
            as ``remote_models``. A remote model must not be hosted here too.
        peer_port: > 0: hosted LLM models listen on ``tcp://peer_host:peer_port`` (the
            second on ``peer_port + 1``, …, in the order of ``models``).
        peer_host: address the TCP peer endpoints bind to.
        keys_dir: CURVE key folder (:data:`KEY_FILES`); required when TCP is used and
            ``curve`` is on. The files must exist when the server starts, not now.
        curve: False turns CURVE off on every TCP endpoint (traffic in clear: a trusted
            network only).
        gpus: ``{model: GPU index}`` for the gpu target (default 0 for every model).
        model_paths: ``{model: checkpoint folder}`` (absolute, or relative to
            ``$TOKENROUTER_WEIGHTS``); the router's tokenizer follows the ``slm`` path
            unless ``params`` sets it.
        params: further ``{model: {parameter: value}}`` overrides, applied last.

    Returns:
        ``{"out", "target", "models": [hosted models in load order], "remote": {model:
        [endpoints]}, "peer_endpoints": {model: endpoint}}``.

    Raises:
        DeploymentError: unknown target/pair/model, a remote model also hosted, a remote
            model no router lists, TCP without keys while CURVE is on, a bad port, or an
            ``out`` that may not be replaced (:func:`_prepare_out`). Nothing is written
            before every check passed.
    """
    if target not in TARGETS:
        raise DeploymentError(f"target must be one of {TARGETS}, not {target!r}")
    if pair not in PAIRS:
        raise DeploymentError(f"unknown pair {pair!r}; known: {sorted(PAIRS)}")
    if not 0 <= int(peer_port) < 65536:
        raise DeploymentError(f"peer port {peer_port} out of range")
    available = sorted(d for d in os.listdir(src) if os.path.isfile(os.path.join(src, d, "config.pbtxt")))
    hosted = list(models) if models else list(available)
    remote = {m: list(eps) for m, eps in (remote or {}).items()}
    for m in hosted:
        if m not in available:
            raise DeploymentError(f"model {m!r} is not in the repository {src} ({', '.join(available)})")
    for m in remote:
        if m in hosted:
            raise DeploymentError(f"model {m!r} is both hosted here and remote")
    overrides: Dict[str, Dict[str, str]] = {}

    def put(model: str, key: str, value: object) -> None:
        overrides.setdefault(model, {})[key] = str(value).lower() if isinstance(value, bool) else str(value)

    for m, p in PAIRS[pair].items():
        if m in hosted:
            for k, v in p.items():
                put(m, k, v)
    cfgs = {m: read_config(os.path.join(src, m, "config.pbtxt")) for m in hosted}
    routers = [m for m in hosted if _is_router(cfgs[m])]
    llms = [m for m in hosted if m not in routers]
    tcp = bool(remote) or peer_port > 0
    if tcp and curve and not keys_dir:
        raise DeploymentError("TCP peers authenticate with CURVE keys: give --keys DIR "
                              "(or turn CURVE off with --no-curve on a trusted network)")
    if remote:
        if not routers:
            raise DeploymentError("remote models need a router hosted here (token_router)")
        for r in routers:
            listed = _split_list(cfgs[r].parameters["models"].string_value) if "models" in cfgs[r].parameters else []
            missing = [m for m in remote if m not in listed]
            if missing:
                raise DeploymentError(f"router {r!r} does not route to {missing} (its models: {listed})")
            put(r, PARAM["remote_models"], json.dumps(remote, separators=(",", ":")))
            if curve:
                put(r, PARAM["curve"], "on")
                put(r, PARAM["curve_secret_key_file"], os.path.join(keys_dir, KEY_FILES["client_secret"]))
                put(r, PARAM["curve_server_public_keys"], json.dumps(
                    {m: os.path.join(keys_dir, KEY_FILES["server_public"]) for m in remote}, separators=(",", ":")))
            else:
                put(r, PARAM["curve"], "off")
    peer_endpoints: Dict[str, str] = {}
    if peer_port > 0:
        for i, m in enumerate(llms):
            port = int(peer_port) + i
            if port >= 65536:
                raise DeploymentError(f"peer port {port} for {m!r} out of range")
            peer_endpoints[m] = f"tcp://{peer_host}:{port}"
            put(m, PARAM["peer_endpoint"], peer_endpoints[m])
            if curve:
                put(m, PARAM["curve"], "on")
                put(m, PARAM["curve_secret_key_file"], os.path.join(keys_dir, KEY_FILES["server_secret"]))
                put(m, PARAM["curve_authorized_keys_dir"], keys_dir)
            else:
                put(m, PARAM["curve"], "off")
    for m, path in (model_paths or {}).items():
        if m in llms:
            put(m, PARAM["model_path"], path)
    if "slm" in (model_paths or {}):
        for r in routers:
            put(r, PARAM["tokenizer_path"], model_paths["slm"])
    if target == "gpu":
        for m in llms:
            for k, v in GPU_PARAMETERS.items():
                put(m, k, v)
            cfg = cfgs[m]
            mrr = cfg.parameters["max_running_requests"].string_value if "max_running_requests" in cfg.parameters else ""
            if mrr:
                put(m, "cuda_graph_max_bs", mrr)  # every batch the model may run replays a graph
    for m, p in (params or {}).items():
        if m not in hosted:
            raise DeploymentError(f"--param for {m!r}, which this server does not host ({', '.join(hosted)})")
        for k, v in p.items():
            put(m, k, v)
    for m in hosted:  # only hosted routers: a router's models must exist here or be remote
        if m in routers:
            listed = _split_list(cfgs[m].parameters["models"].string_value) if "models" in cfgs[m].parameters else []
            unreachable = [x for x in listed if x not in hosted and x not in remote]
            if unreachable:
                raise DeploymentError(f"router {m!r} routes to {unreachable}, which are neither hosted "
                                      f"here nor given with --remote")
    _prepare_out(src, out)  # everything is checked: only now is anything written
    for m in hosted:
        shutil.copytree(os.path.join(src, m), os.path.join(out, m),
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        path = os.path.join(out, m, "config.pbtxt")
        cfg = cfgs[m]
        if target == "gpu" and m in llms:
            gpu = int((gpus or {}).get(m, 0))
            del cfg.instance_group[:]
            group = cfg.instance_group.add()
            group.count = 1
            group.kind = group.KIND_GPU
            group.gpus.append(gpu)
        for k, v in overrides.get(m, {}).items():
            cfg.parameters[k].string_value = v
        write_config(path, cfg, f"generated by tokenrouter.tools.deployment (target {target}, pair {pair}) "
                                f"from {os.path.basename(os.path.normpath(src))}/{m}")
    # load order: models before the routers that call them
    order = llms + routers
    return {"out": out, "target": target, "pair": pair, "models": order, "remote": remote,
            "peer_endpoints": peer_endpoints}


#: file that marks a folder as written by :func:`render` (only such a folder is replaced)
RENDER_MARK = ".tokenrouter-rendered"


def _prepare_out(src: str, out: str) -> None:
    """Make ``out`` an empty folder for a rendered repository.

    An existing ``out`` is replaced only when :func:`render` wrote it (it holds
    :data:`RENDER_MARK`) or it is empty.

    Raises:
        DeploymentError: ``out`` is ``src``, inside it or contains it, or is a non-empty
            folder (or a file) that :func:`render` did not write.
    """
    s, o = os.path.realpath(src), os.path.realpath(out)
    if o == s or o.startswith(s + os.sep) or s.startswith(o + os.sep):
        raise DeploymentError(f"--out {out} must be outside the source repository {src} (and not contain it)")
    if os.path.lexists(out):
        if not os.path.isdir(out) or os.path.islink(out):
            raise DeploymentError(f"--out {out} exists and is not a folder")
        if os.listdir(out) and not os.path.exists(os.path.join(out, RENDER_MARK)):
            raise DeploymentError(f"--out {out} is a non-empty folder this command did not write; "
                                  "give a new or empty folder")
        shutil.rmtree(out)
    os.makedirs(out)
    with open(os.path.join(out, RENDER_MARK), "w", encoding="utf-8") as f:
        f.write("written by python -m tokenrouter.tools.deployment render; replaced by the next render\n")


def _parse_gpus(text: str) -> Dict[str, int]:
    out: Dict[str, int] = {}
    for k, v in _parse_assignments(_split_list(text), "--gpus").items():
        if not v.isdigit():
            raise DeploymentError(f"--gpus {k}={v}: the GPU index must be a number")
        out[k] = int(v)
    return out


def _parse_params(specs: Iterable[str]) -> Dict[str, Dict[str, str]]:
    out: Dict[str, Dict[str, str]] = {}
    for key, value in _parse_assignments(specs, "--param").items():
        model, dot, name = key.partition(".")
        if not dot or not model or not name:
            raise DeploymentError(f"--param takes MODEL.PARAMETER=VALUE, got {key!r}")
        out.setdefault(model, {})[name] = value
    return out


def main(argv: Optional[Iterable[str]] = None) -> int:
    """CLI: ``render`` (see module docstring); prints the summary as JSON, exit 2 on a bad setting."""
    ap = argparse.ArgumentParser(prog="python -m tokenrouter.tools.deployment",
                                 description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("render", help="write the model repository of one server")
    r.add_argument("--src", default="model_repository", help="the project's model repository")
    r.add_argument("--out", required=True, help="destination folder: new, empty, or written by a previous "
                   "render (then replaced); never the source repository")
    r.add_argument("--target", default="cpu", choices=TARGETS)
    r.add_argument("--pair", default="demo", choices=sorted(PAIRS))
    r.add_argument("--models", default="", help="comma-separated models this server hosts (default: all)")
    r.add_argument("--remote", action="append", default=[], metavar="MODEL=tcp://HOST:PORT[,…]",
                   help="a model hosted elsewhere; several endpoints are replicas (repeatable)")
    r.add_argument("--remote-models-file", default="",
                   help="JSON {model: endpoint | [endpoints]} (merged with --remote)")
    r.add_argument("--peer-port", type=int, default=0, help="hosted LLM models listen on this TCP port (+1, …)")
    r.add_argument("--peer-host", default="0.0.0.0", help="address the peer port binds to")
    r.add_argument("--keys", default="", help="CURVE key folder (server.key_secret, router.key, …)")
    r.add_argument("--no-curve", action="store_true", help="TCP peers without CURVE (trusted networks only)")
    r.add_argument("--gpus", default="", help="gpu target: MODEL=INDEX,… (default 0)")
    r.add_argument("--model-path", action="append", default=[], metavar="MODEL=PATH",
                   help="checkpoint folder of a model (repeatable)")
    r.add_argument("--param", action="append", default=[], metavar="MODEL.PARAMETER=VALUE",
                   help="any other config parameter (repeatable)")
    a = ap.parse_args(list(argv) if argv is not None else None)
    try:
        remote = load_remote_file(a.remote_models_file) if a.remote_models_file else {}
        for m, eps in parse_remote(a.remote).items():
            remote.setdefault(m, []).extend(eps)
        summary = render(a.src, a.out, target=a.target, pair=a.pair, models=_split_list(a.models) or None,
                         remote=remote, peer_port=a.peer_port, peer_host=a.peer_host,
                         keys_dir=a.keys or None, curve=not a.no_curve, gpus=_parse_gpus(a.gpus),
                         model_paths={k: v for k, v in _parse_assignments(a.model_path, "--model-path").items() if v},
                         params=_parse_params(a.param))
    except (DeploymentError, OSError) as e:
        print(f"tokenrouter.tools.deployment: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
