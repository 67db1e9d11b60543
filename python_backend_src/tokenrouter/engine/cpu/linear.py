"""CPU linear layers: every unquantised linear weight packed once for oneDNN, at load time, and
the rows of a step rounded up to a few sizes (:func:`row_bucket`) so that oneDNN's per-shape
kernels are reused.

Why buckets: oneDNN creates a kernel (a primitive, JIT-compiled) for each input shape it meets and
keeps it in two LRU caches bounded by ``cpu_kernel_cache_entries`` (memory, docs/reliability.md).
A step's rows are the tokens it computes: decode rows plus every extend's new tokens, so under
routing (resume extends of a few tokens each beside decode rows) almost every step has a new
row count, the caches thrash, and each step pays kernel creation for every linear shape of the
model.  Rounded up to a bucket (exact up to 16 rows, then multiples of 16 up to 256, of 64 up to
1,024, of 256 beyond), a server meets about 50 row counts per weight shape, which the caches
hold; the padding rows are zeros, computed and dropped (a step of 17-32 rows costs one of 32:
on AMX tiles of 16 rows, and while the weights' bytes bound the step, about the same).
"""

from __future__ import annotations

import torch

from .shims import cuda_available

__all__ = ["prepack_linear_weights", "row_bucket"]


def row_bucket(rows: int) -> int:
    """The row count a linear layer computes for ``rows`` input rows (>= rows; module docstring).

    Exact up to 16, then rounded up to a multiple of 16 up to 256, of 64 up to 1,024, of 256 beyond.
    """
    if rows <= 16:
        return rows
    step = 16 if rows <= 256 else 64 if rows <= 1024 else 256
    return -(-rows // step) * step


class _PrepackedLinear:
    """Quantisation-method stand-in running a linear layer on a oneDNN-prepacked weight.

    Wraps the layer's original method (``UnquantizedLinearMethod`` or, for a tied
    lm_head, ``UnquantizedEmbeddingMethod``); every other attribute, e.g.
    ``embedding()`` for the tied token embedding, goes to the original.
    """

    #: up to this many rows MKL's row-major small-batch kernel is faster (when kept)
    SMALL_ROWS = 3

    def __init__(self, orig, packed: torch.Tensor, rowmajor_kept: bool, buckets: bool = True):
        self._orig = orig
        self._packed = packed
        self._rowmajor_kept = rowmajor_kept
        self._buckets = buckets

    def apply(self, layer, x: torch.Tensor, bias=None) -> torch.Tensor:
        """``F.linear(x, layer.weight, bias)``; x: [..., in] -> [..., out], same dtype.

        Rows <= :attr:`SMALL_ROWS` use the row-major weight when it was kept,
        more rows the packed one, padded with zero rows to :func:`row_bucket` (when buckets are on).
        """
        shape = x.shape
        rows = x.numel() // shape[-1] if shape[-1] else 0
        if self._rowmajor_kept and (x.dtype != self._packed.dtype or rows <= self.SMALL_ROWS):
            return self._orig.apply(layer, x, bias)
        if x.dtype != self._packed.dtype:  # no row-major weight to fall back on: compute in the weight's dtype
            return self.apply(layer, x.to(self._packed.dtype), bias).to(x.dtype)
        if x.dim() != 2:
            x = x.reshape(-1, shape[-1])
        padded = row_bucket(rows) if self._buckets else rows
        if padded != rows:
            x = torch.cat([x, x.new_zeros(padded - rows, shape[-1])])
        y = torch.ops.mkldnn._linear_pointwise(x, self._packed, bias, "none", [], "")
        if padded != rows:
            y = y[:rows]
        return y if len(shape) == 2 else y.view(*shape[:-1], y.shape[-1])

    def __getattr__(self, name):
        return getattr(self._orig, name)


def prepack_linear_weights(model: torch.nn.Module, batch_hint: int = 8, keep_rowmajor: bool = True,
                           row_buckets: bool = True) -> int:
    """Re-lay every unquantised linear weight of ``model`` for oneDNN, once, at load time.

    Why: on the CPU, ``F.linear`` with an ``[out, in]`` row-major fp32 weight uses
    MKL's small-batch kernel for 1-3 rows, but from 4 rows on MKL re-packs the
    whole weight on every call: a decode step of 4 requests then costs about
    twice one of 3 (measured here, 0.8B Llama shape, 1 thread: 260 ms at 3 rows,
    465 ms at 4).  A weight packed once for oneDNN keeps the step nearly flat up
    to 8-16 rows, which is what batching decode steps relies on (on GPUs the
    same role is played by CUDA graphs and cuBLAS, paper §5 "Engineering").

    Applies to SGLang linear layers whose method is ``UnquantizedLinearMethod``
    and to an lm_head computed by ``UnquantizedEmbeddingMethod`` (tied
    embeddings keep their weight for the token lookup).

    Args:
        model: the loaded SGLang model (CPU, float32 or bfloat16 weights).
        batch_hint: rows the packing is tuned for (tokens per forward).
        row_buckets: pad each call's rows to :func:`row_bucket` (module docstring).
        keep_rowmajor: for float32 weights, keep the row-major weights too and use
            them for 1-3 rows (in fp32 the packed path costs 3-14 % more there: a
            lone request decodes at full speed) at the price of storing the linear
            weights twice; False drops them (same memory as before, small fp32
            steps slightly slower).  bfloat16 weights never keep them: oneDNN's
            packed bf16 kernel is faster at 1-3 rows too (measured, one thread,
            a 1-row decode step: SmolLM2-135M 66 -> 54 ms, the 0.82B Llama shape
            172 -> 155 ms).

    Returns:
        Number of layers prepacked (0 when the oneDNN ops are unavailable, on
        GPUs, or for other dtypes/quantisations: those layers keep ``F.linear``).
    """
    if cuda_available() or not torch.backends.mkldnn.is_available():
        return 0
    reorder = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
    if reorder is None:
        return 0
    n = 0
    lm_heads = {id(getattr(model, "lm_head", None))}
    for module in model.modules():
        qm = getattr(module, "quant_method", None)
        w = getattr(module, "weight", None)
        kind = type(qm).__name__
        if (kind not in ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod") or not isinstance(w, torch.Tensor)
                or w.dim() != 2 or w.device.type != "cpu" or w.dtype not in (torch.float32, torch.bfloat16)):
            continue
        is_head = kind == "UnquantizedEmbeddingMethod"
        if is_head and id(module) not in lm_heads:
            continue  # a token embedding that is not also the lm_head
        try:
            packed = reorder(w.detach(), batch_hint)
            x = torch.randn(2, w.shape[1], dtype=w.dtype)
            ref = torch.nn.functional.linear(x, w)
            got = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
            if not torch.allclose(ref.float(), got.float(), rtol=1e-2, atol=1e-2):
                continue
        except (RuntimeError, NotImplementedError):
            return n  # this torch build cannot: keep F.linear everywhere else too
        keep = keep_rowmajor and w.dtype == torch.float32
        module.quant_method = _PrepackedLinear(qm, packed, keep, row_buckets)
        if not (keep or is_head):  # the row-major copy is no longer read
            module.weight.data = torch.empty(0, dtype=w.dtype)
        n += 1
    return n
