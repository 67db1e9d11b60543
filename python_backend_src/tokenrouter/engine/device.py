"""Where and how an engine runs: its device, its weights' dtype, and SGLang's ``ServerArgs`` for them."""

from __future__ import annotations

from typing import Dict

import torch

from .config import DEVICES, DTYPES, EngineConfig

__all__ = ["resolve_device", "resolve_dtype", "cpu_has_native_bf16", "server_args_kwargs", "NO_CUDA_GRAPH_BACKENDS"]


def resolve_device(device: str) -> str:
    """The device an engine configured with ``device`` runs on: ``"cuda"`` or ``"cpu"``.

    Raises:
        ValueError: ``device`` is not auto, cuda or cpu.
        RuntimeError: ``device`` is ``"cuda"`` and torch sees no GPU.
    """
    if device not in DEVICES:
        raise ValueError(f"device must be auto, cuda or cpu, not {device!r}")
    available = torch.cuda.is_available()
    if device == "cuda" and not available:
        raise RuntimeError("device 'cuda' was asked for but torch sees no GPU "
                           f"(torch {torch.__version__}, CUDA build {torch.version.cuda})")
    return "cuda" if (device == "cuda" or (device == "auto" and available)) else "cpu"



def cpu_has_native_bf16(cpuinfo_path: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU computes bfloat16 dot products in hardware.

    x86: the ``avx512_bf16`` or ``amx_bf16`` flag; Arm: the ``bf16`` feature. Without them
    torch emulates bf16 matmuls by converting to float32 on the fly: on an AVX2-only
    host (AMD EPYC Zen 3) an 8-row bf16 decode step of SmolLM2-135M took 349 ms against
    217 ms in float32 and a bf16 prefill 5.4× as long (``perf/engine_steps.py``, docs/performance.md
    "Engine step times"), so halving the bytes per step gains nothing there.

    Returns:
        False also where ``cpuinfo_path`` cannot be read (not Linux).
    """
    try:
        with open(cpuinfo_path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return False
    flags = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def resolve_dtype(dtype: str, device: str) -> str:
    """The weights' dtype for an engine configured with ``dtype`` on ``device`` ("cuda"/"cpu").

    ``"auto"``: bfloat16 on a GPU and on a CPU with native bf16 (:func:`cpu_has_native_bf16`:
    decode is memory-bound and bf16 halves the bytes per step), float32 on other CPUs.
    Any other value is returned as given.

    Raises:
        ValueError: ``dtype`` is not one of :data:`tokenrouter.engine.config.DTYPES`.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    if dtype != "auto":
        return dtype
    return "bfloat16" if device == "cuda" or cpu_has_native_bf16() else "float32"


#: SGLang attention backends that cannot be captured in CUDA graphs (0.5.23: ``torch_native``
#: implements none of ``init_cuda_graph_state`` / ``init_forward_metadata_capture_cuda_graph``)
NO_CUDA_GRAPH_BACKENDS = ("torch_native",)


def server_args_kwargs(cfg: EngineConfig, device: str) -> Dict[str, object]:
    """Keyword arguments of SGLang's ``ServerArgs`` for ``cfg`` on ``device`` ("cuda"/"cpu").

    CPU: ``device="cpu"``, CUDA graphs off, ``torch_native`` attention unless
    ``cfg.attention_backend`` names another. GPU: SGLang's own choices except
    where ``cfg`` sets them (attention backend, CUDA graphs off, their largest
    batch, the memory fraction); ``base_gpu_id`` is ``cfg.gpu_id``. CUDA graphs
    are off with a backend of :data:`NO_CUDA_GRAPH_BACKENDS`, whatever ``cfg.cuda_graph``.
    """
    kwargs: Dict[str, object] = dict(
        model_path=cfg.model_path,
        tokenizer_path=cfg.model_path,
        dtype=resolve_dtype(cfg.dtype, device),
        max_total_tokens=cfg.kv_pool_tokens,
        max_running_requests=cfg.max_running_requests,
        load_format=cfg.load_format,
        random_seed=cfg.random_seed,
        disable_radix_cache=True,
        skip_tokenizer_init=False,
    )
    if cfg.context_length:
        kwargs["context_length"] = cfg.context_length
    if device == "cpu":
        # On a CPU SGLang budgets the KV pool from the host's free memory at load: with its
        # default fraction a 1.5B model's load fails on a busy host ("Loaded weights leave no
        # GPU memory for the KV cache") although the pool's size is ours (kv_pool_tokens).
        # 0.95 keeps its check for a host that really lacks the pool's memory.
        kwargs.update(device="cpu", disable_cuda_graph=True,
                      attention_backend=cfg.attention_backend or "torch_native",
                      mem_fraction_static=float(cfg.mem_fraction_static or 0.95))
        return kwargs
    kwargs.update(device="cuda", base_gpu_id=int(cfg.gpu_id))
    if cfg.attention_backend:
        kwargs["attention_backend"] = cfg.attention_backend
    if not cfg.cuda_graph or cfg.attention_backend in NO_CUDA_GRAPH_BACKENDS:
        kwargs["disable_cuda_graph"] = True
    elif cfg.cuda_graph_max_bs > 0:
        kwargs["cuda_graph_max_bs_decode"] = int(cfg.cuda_graph_max_bs)
    if cfg.mem_fraction_static > 0:
        kwargs["mem_fraction_static"] = float(cfg.mem_fraction_static)
    return kwargs
