"""CPU-only compatibility layer for running SGLang 0.5.23 without a GPU.

Everything here applies only when no CUDA device is present (``install()`` is a
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

Call :func:`install` before the first ``import sglang``.

Two CPU performance steps, used by :class:`tokenrouter.engine.SGLangEngine`:

* :func:`patch_torch_native_extend` — the torch_native backend's extend
  attention computes only the new tokens' rows (a resume no longer costs a full
  ``seq_len x seq_len`` attention);
* :func:`prepack_linear_weights` — linear weights packed once for oneDNN, so a
  decode step of 4-16 requests costs little more than one of 1-3.
"""

from __future__ import annotations

import os
import sys
import types

import torch

__all__ = ["install", "cuda_available", "patch_torch_native_extend", "prepack_linear_weights"]

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
    try:
        torch.ops.torchvision.nms  # noqa: B018 - probe
        return
    except (AttributeError, RuntimeError):
        pass
    lib = torch.library.Library("torchvision", "DEF")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    # keep the Library object alive for the life of the process
    sys.modules[__name__]._torchvision_lib = lib  # type: ignore[attr-defined]


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
    _installed = True
    return True


# ------------------------------------------------------------ CPU linear layers
class _PrepackedLinear:
    """Quantisation-method stand-in running a linear layer on a oneDNN-prepacked weight.

    Wraps the layer's original method (``UnquantizedLinearMethod`` or, for a tied
    lm_head, ``UnquantizedEmbeddingMethod``); every other attribute, e.g.
    ``embedding()`` for the tied token embedding, goes to the original.
    """

    #: up to this many rows MKL's row-major small-batch kernel is faster (when kept)
    SMALL_ROWS = 3

    def __init__(self, orig, packed: torch.Tensor, rowmajor_kept: bool):
        self._orig = orig
        self._packed = packed
        self._rowmajor_kept = rowmajor_kept

    def apply(self, layer, x: torch.Tensor, bias=None) -> torch.Tensor:
        """``F.linear(x, layer.weight, bias)``; x: [..., in] -> [..., out], same dtype.

        Rows <= :attr:`SMALL_ROWS` use the row-major weight when it was kept,
        more rows the packed one.
        """
        shape = x.shape
        rows = x.numel() // shape[-1] if shape[-1] else 0
        if x.dtype != self._packed.dtype or (self._rowmajor_kept and rows <= self.SMALL_ROWS):
            return self._orig.apply(layer, x, bias)
        if x.dim() != 2:
            x = x.reshape(-1, shape[-1])
        y = torch.ops.mkldnn._linear_pointwise(x, self._packed, bias, "none", [], "")
        return y if len(shape) == 2 else y.view(*shape[:-1], y.shape[-1])

    def __getattr__(self, name):
        return getattr(self._orig, name)


def prepack_linear_weights(model: torch.nn.Module, batch_hint: int = 8, keep_rowmajor: bool = True) -> int:
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
        keep_rowmajor: keep the row-major weights too and use them for 1-3 rows
            (the packed path costs 3-14 % more there: a lone request decodes at
            full speed) at the price of storing the linear weights twice;
            False drops them (same memory as before, small steps slightly slower).

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
        module.quant_method = _PrepackedLinear(qm, packed, keep_rowmajor)
        if not (keep_rowmajor or is_head):  # the row-major copy is no longer read
            module.weight.data = torch.empty(0, dtype=w.dtype)
        n += 1
    return n


# ------------------------------------------------------- CPU extend attention
_orig_sdpa_extend = None


def _sdpa_forward_extend_new_rows(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices,
                                  seq_lens, extend_prefix_lens, extend_seq_lens, encoder_lens=None,
                                  scaling=None, enable_gqa=False, causal=False, is_cross_attn=False,
                                  sliding_window_size=None):
    """Extend attention computing only the new tokens' rows (replaces SGLang's torch_native one).

    SGLang 0.5.23's ``TorchNativeAttnBackend._run_sdpa_forward_extend`` pads every
    request's queries to its whole sequence and runs a full causal attention of
    ``seq_len x seq_len``, then keeps the last ``extend_len`` rows.  For a request
    resumed with 1-2 new tokens at a 500-token context that is ~250-500x the work
    of the rows it keeps, and since a step that resumes anything runs as one
    extend forward, every request of that step paid it.  Here each request's
    ``extend_len`` queries attend to its ``seq_len`` keys with the causal mask
    offset by its prefix (query ``i`` sees keys ``0 .. prefix + i``): the same
    result, O(extend x seq) work.

    Args (as the method it replaces): query/output [num_tokens, heads, head_dim];
    k_cache/v_cache [pool_tokens, kv_heads, head_dim]; req_to_token
    [rows, max_context] (int KV slot indices); req_pool_indices, seq_lens,
    extend_prefix_lens, extend_seq_lens: [num_seqs] int tensors.
    Cross-attention, encoder and sliding-window layers go to the original.

    Returns:
        ``output``, filled.
    """
    if (encoder_lens is not None or is_cross_attn or not causal
            or (sliding_window_size is not None and sliding_window_size > -1)):
        return _orig_sdpa_extend(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                                 extend_prefix_lens, extend_seq_lens, encoder_lens, scaling=scaling,
                                 enable_gqa=enable_gqa, causal=causal, is_cross_attn=is_cross_attn,
                                 sliding_window_size=sliding_window_size)
    hd = query.dim() - 2
    q_all = query.movedim(0, hd)  # [heads, num_tokens, head_dim]
    start = 0
    for row, seq_len, prefix, n in zip(req_pool_indices.tolist(), seq_lens.tolist(),
                                       extend_prefix_lens.tolist(), extend_seq_lens.tolist()):
        end = start + n
        q = q_all[:, start:end, :]
        slots = req_to_token[row, :seq_len]
        k = k_cache[slots].movedim(0, hd)
        v = v_cache[slots].movedim(0, hd)
        if not (q.dtype == k.dtype == v.dtype):
            k, v = k.to(q.dtype), v.to(q.dtype)
        mask, is_causal = None, False
        if n > 1:
            if prefix == 0:  # a prefill: square, ordinary causal mask
                is_causal = True
            else:
                pos = torch.arange(seq_len, device=q.device)
                mask = pos[None, :] <= (prefix + torch.arange(n, device=q.device))[:, None]
        out = torch.nn.functional.scaled_dot_product_attention(
            q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask, is_causal=is_causal,
            scale=scaling, enable_gqa=enable_gqa)
        output[start:end] = out.squeeze(0).movedim(hd, 0)
        start = end
    return output


def patch_torch_native_extend() -> bool:
    """Install :func:`_sdpa_forward_extend_new_rows` into SGLang's torch_native backend (CPU hosts).

    Idempotent; call after :func:`install`.  Returns True when installed, False on
    GPU hosts (their attention backends are left alone) or if SGLang's backend
    no longer has the method.
    """
    global _orig_sdpa_extend
    if cuda_available():
        return False
    from sglang.srt.layers.attention import torch_native_backend as tnb

    cls = tnb.TorchNativeAttnBackend
    if _orig_sdpa_extend is not None:
        return True
    if not hasattr(cls, "_run_sdpa_forward_extend"):
        return False
    _orig_sdpa_extend = cls._run_sdpa_forward_extend
    cls._run_sdpa_forward_extend = _sdpa_forward_extend_new_rows
    return True
