"""CPU-only compatibility shims for running SGLang 0.5.23 without a GPU.

Everything here applies only when no CUDA device is present (:func:`install` is a
no-op otherwise), so the same engine code runs unchanged on GPU hosts.

SGLang's CPU engine (``SGLANG_USE_CPU_ENGINE=1``) expects three things a plain
CPU machine with PyPI wheels does not have:

1. ``sgl_kernel`` — the CPU build of sgl-kernel is not published on PyPI.  SGLang
   imports a few symbols from it at module import time, but with
   ``attention_backend="torch_native"`` on a CPU without AMX only the KV-index
   bookkeeping ops are *called*.  We register a module named ``sgl_kernel`` whose
   bookkeeping ops are implemented in torch; every other symbol resolves to a
   function that raises ``NotImplementedError`` naming itself if ever called.
2. ``torchvision`` — PyPI's torchvision is a CUDA build; importing it beside the
   CPU torch fails with "operator torchvision::nms does not exist".  SGLang only
   imports it (for multimodal transforms).  Declaring the two operator schemas
   with ``torch.library`` (torch's own mechanism) lets it import.
3. ``triton`` is installed as the real package (imported, never run on CPU).

Call :func:`install` before the first ``import sglang``.  It also moves SGLang's
"Ignore import error when loading sglang.srt.models.…" warnings (about 30 per model
load: model files that need GPU kernels) to DEBUG on CPU hosts.
"""

from __future__ import annotations

import logging
import os
import sys
import types

import torch

__all__ = ["install", "cuda_available"]

_installed = False


def cuda_available() -> bool:
    """Return True when a CUDA device is usable (then nothing here is applied)."""
    return torch.cuda.is_available()


def _assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Torch version of sgl_kernel's ``assign_req_to_token_pool_cpu``.

    For request ``i`` of the batch writes
    ``req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]]`` from
    the next ``end_offset[i] - start_offset[i]`` entries of ``out_cache_loc``
    (KV slot indices, int64), packed in batch order.  Same semantics as the
    Triton kernel ``assign_req_to_token_pool`` in sglang/srt/mem_cache/allocation.py.
    """
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    pos = 0
    for row, s, e in zip(rows, starts, ends):
        n = e - s
        if n > 0:
            req_to_token[row, s:e] = out_cache_loc[pos : pos + n].to(req_to_token.dtype)
        pos += n


def _copy_all_layer_kv_cache_cpu(*args, **kwargs):  # pragma: no cover - not on our path
    raise NotImplementedError(
        "sgl_kernel.copy_all_layer_kv_cache_cpu (KV cache move) is not available on this CPU build"
    )


class _SglKernelCPU(types.ModuleType):
    """Module standing in for ``sgl_kernel`` on CPU hosts without its CPU build."""

    def __init__(self) -> None:
        super().__init__("sgl_kernel")
        self.__file__ = __file__
        self.__path__ = []  # lets ``import sgl_kernel.x`` find submodules we register
        self.assign_req_to_token_pool_cpu = _assign_req_to_token_pool_cpu
        self.copy_all_layer_kv_cache_cpu = _copy_all_layer_kv_cache_cpu

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)

        def _unavailable(*args, **kwargs):
            raise NotImplementedError(
                f"sgl_kernel.{name} is not available on this CPU host "
                "(no sgl-kernel CPU build); use attention_backend='torch_native'"
            )

        _unavailable.__name__ = name
        return _unavailable



def _declare_torchvision_ops() -> None:
    """Declare the ``torchvision::nms``/``qnms`` schemas so the CUDA torchvision wheel imports."""
    from ...torchvision_compat import declare_torchvision_ops

    declare_torchvision_ops()


#: SGLang's loggers that warn once per model file whose import fails (GPU-only kernels on a CPU host)
_IMPORT_NOISE_LOGGERS = ("sglang.srt.models.registry", "sglang.srt.managers.multimodal_processor")


class _ImportNoiseToDebug(logging.Filter):
    """Logs SGLang's "Ignore import error when loading …" warnings at DEBUG instead.

    On a CPU host dozens of SGLang's model files fail to import (they need CUDA kernels),
    and SGLang warns once per file at every model load.  The records are kept, at DEBUG, so
    ``logging.getLogger("sglang.srt.models.registry").setLevel(logging.DEBUG)`` shows them.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.WARNING and str(record.msg).startswith("Ignore import error when loading"):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


def install() -> bool:
    """Apply the CPU compatibility steps once; return True if applied.

    Idempotent.  Does nothing (returns False) when CUDA is available.  Sets
    ``SGLANG_USE_CPU_ENGINE=1`` if unset.
    """
    global _installed
    if _installed:
        return True
    if cuda_available():
        return False
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    try:
        import sgl_kernel  # noqa: F401  # a real CPU build wins
    except ImportError:
        sys.modules["sgl_kernel"] = _SglKernelCPU()
    _declare_torchvision_ops()
    for name in _IMPORT_NOISE_LOGGERS:
        logging.getLogger(name).addFilter(_ImportNoiseToDebug())
    _installed = True
    return True

