"""Model-repository variants: the size-realistic pair, extra routers, baseline switches.

Configs are read and written with Triton's model-config protobuf in text
format (``tritonclient.grpc.model_config_pb2``), never with regular
expressions, so every other setting in a file is kept.

CLI::

    python -m tokenrouter.repository --src model_repository --out RUN_DIR --pair size-realistic
    python -m tokenrouter.repository --src model_repository --out RUN_DIR \
        --set 'token_router.remote_models={"llm": "tcp://10.0.0.2:5555"}' --set llm.peer_endpoint=tcp://0.0.0.0:5555
"""

from __future__ import annotations

import argparse
import os
import shutil
from typing import Dict, Iterable, Mapping, Optional

__all__ = ["PAIRS", "read_config", "write_config", "set_parameters", "make_variant", "add_router",
           "parse_settings"]

#: parameter overrides per demo pair (model name -> config parameters)
PAIRS: Dict[str, Dict[str, Dict[str, str]]] = {
    # SmolLM2-135M-Instruct (real weights) in both roles
    "demo": {},
    # real SLM + a larger Llama-shaped LLM with the same tokenizer and RANDOM weights;
    # random weights are never confident, so R-Stitch's hand-back is capped at one token.
    # tau 0.4: ~9 % of the tokens go to the LLM (8.5 handoffs per 48-token request at
    # N = 8), the paper's operating regime (R2R: ~5 %).  Lower tau feeds back: every
    # random LLM token makes the SLM less sure, and at 0.3 the LLM writes 30-40 %.
    # Both models in bfloat16 with oneDNN-packed linear weights for every step size: decode is
    # memory-bound here and bf16 halves the bytes per step (CPUs with avx512_bf16 / AMX).
    "size-realistic": {"slm": {"dtype": "bfloat16", "cpu_linear_weights": "packed"},
                       "llm": {"model_path": "llama-size-realistic", "load_format": "dummy",
                               "dtype": "bfloat16", "cpu_linear_weights": "packed"},
                       "token_router": {"algorithm_params": '{"tau": 0.4, "max_llm_run": 1}'}},
}


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


def add_router(repo: str, name: str, params: Mapping[str, object], src: str = "token_router") -> None:
    """Add a router model ``name`` to ``repo``: a copy of ``src`` with other parameters."""
    dst = os.path.join(repo, name)
    shutil.copytree(os.path.join(repo, src), dst, ignore=shutil.ignore_patterns("__pycache__"))
    cfg = read_config(os.path.join(dst, "config.pbtxt"))
    cfg.name = name
    for k, v in params.items():
        cfg.parameters[k].string_value = str(v)
    write_config(os.path.join(dst, "config.pbtxt"), cfg, f"generated from {src} by tokenrouter.repository")


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
        ValueError: unknown pair, or an override names a model not in ``src``.
    """
    if pair not in PAIRS:
        raise ValueError(f"unknown pair {pair!r}; known: {sorted(PAIRS)}")
    if os.path.exists(out):
        shutil.rmtree(out)
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    merged: Dict[str, Dict[str, object]] = {}
    for source in (PAIRS[pair], model_params or {}):
        for m, p in source.items():
            merged.setdefault(m, {}).update(p)
    for m, p in merged.items():
        path = os.path.join(out, m, "config.pbtxt")
        if not os.path.isfile(path):
            raise ValueError(f"model {m!r} is not in the repository {src}")
        set_parameters(path, p, f"generated by tokenrouter.repository (pair {pair}) from {src}/{m}")
    for name, p in (routers or {}).items():
        add_router(out, name, p)
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


def main(argv: Optional[Iterable[str]] = None) -> int:
    """CLI: write a repository variant."""
    ap = argparse.ArgumentParser(prog="python -m tokenrouter.repository", description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", default="model_repository")
    ap.add_argument("--out", required=True)
    ap.add_argument("--pair", default="demo", choices=sorted(PAIRS))
    ap.add_argument("--set", action="append", default=[], metavar="MODEL.KEY=VALUE",
                    help="set a config parameter of one model (repeatable)")
    a = ap.parse_args(list(argv) if argv is not None else None)
    try:
        make_variant(a.src, a.out, a.pair, model_params=parse_settings(a.set))
    except ValueError as e:
        ap.error(str(e))
    print(a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
