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

Call :func:`install` before the first ``import sglang``.  It also moves SGLang's
"Ignore import error when loading sglang.srt.models.…" warnings (about 30 per model
load: model files that need GPU kernels) to DEBUG on CPU hosts.

Two CPU performance steps, used by :class:`tokenrouter.engine.sglang_engine.SGLangEngine`:

* :func:`patch_torch_native_extend` — the torch_native backend's attention
  computes only the new tokens' rows (a resume no longer costs a full
  ``seq_len x seq_len`` attention), and attends the step's decode rows and short
  resumes in padded SDPA calls (one per count of new tokens, split by length
  where padding would cost too much) instead of a Python loop over the requests,
  and the rotary embedding (:func:`_rope_forward_native`) takes each step's
  cos/sin once instead of once per layer;
* :func:`prepack_linear_weights` — linear weights packed once for oneDNN, so a
  decode step of 4-16 requests costs little more than one of 1-3.
"""

from __future__ import annotations

import logging
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
    from ..torchvision_compat import declare_torchvision_ops

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
        if self._rowmajor_kept and (x.dtype != self._packed.dtype or rows <= self.SMALL_ROWS):
            return self._orig.apply(layer, x, bias)
        if x.dtype != self._packed.dtype:  # no row-major weight to fall back on: compute in the weight's dtype
            return self.apply(layer, x.to(self._packed.dtype), bias).to(x.dtype)
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
        module.quant_method = _PrepackedLinear(qm, packed, keep)
        if not (keep or is_head):  # the row-major copy is no longer read
            module.weight.data = torch.empty(0, dtype=w.dtype)
        n += 1
    return n


# ------------------------------------------------------------- CPU attention
_orig_sdpa_extend = None
_orig_sdpa_decode = None
_orig_init_metadata = None
_orig_rope_native = None
_plain_apply_rotary_emb = None
#: bumped by every forward step's ``init_forward_metadata``: ties cached per-step tables to one step
_step_serial = 0

#: gather K/V head-major in one copy (:meth:`_Group._gather`); False: whole tokens, then a
#: transposing copy (the earlier path, kept for ``perf/engine_steps.py --kv-gather two-copy``)
HEAD_ROW_GATHER = True

#: requests with more new tokens than this (prefills) are attended one by one: padded
#: into a group of short ones they would multiply the group's attention work
GROUP_MAX_NEW = 8


class _Group:
    """Requests of one forward step with the same number ``n`` of new tokens, attended together.

    Attributes (built once per step, used by every layer):
        n: new tokens (queries) per request.
        slots: int64 ``[B * L]``: KV slot of each key position, request-major, L = the
            longest sequence; positions past a request's length repeat its first slot
            (a finite value that the mask hides).  ``index_select`` with it gathers K and
            V 3-6x faster than the advanced indexing SGLang's loop uses.
        head_rows: int64 ``[B * kv_heads * L]``: ``slots`` spread over the KV heads,
            ``slot * kv_heads + c`` in (request, KV head, position) order, i.e. the rows of
            the pool viewed as ``[pool_tokens * kv_heads, head_dim]`` that form
            :meth:`attend`'s ``[B * kv_heads, L, head_dim]`` operand; built by the first
            layer that attends (it needs the KV head count), None before.
        mask: bool ``[B, 1, n, L]`` (key j visible to query i iff j <= seq_len - n + i),
            or None when every request has length L and n == 1.
        bias: float32 ``[B * kv_heads, group * n, L]``: ``mask`` as an additive bias (0 or
            -inf) laid out for :meth:`attend`'s batched matmuls; built by the first layer
            that attends (it needs the head counts), None without a mask.
        start: first query row in the step's token order when the group's rows are
            contiguous there, else None and ``index`` (int64 ``[B * n]``) lists them.
    """

    __slots__ = ("n", "B", "L", "slots", "head_rows", "mask", "bias", "start", "index")

    def __init__(self, n, rows, seq_lens, token_starts, req_to_token):
        dev = req_to_token.device
        lens = torch.tensor(seq_lens, dtype=torch.int64, device=dev)
        L = int(max(seq_lens))
        pos = torch.arange(L, device=dev)
        slots = req_to_token[torch.tensor(rows, dtype=torch.int64, device=dev), :L]
        valid = pos[None, :] < lens[:, None]
        self.n, self.B, self.L = n, len(rows), L
        self.bias = self.head_rows = None
        self.slots = torch.where(valid, slots, slots[:, :1]).to(torch.int64).reshape(-1)
        if n == 1 and min(seq_lens) == L:
            self.mask = None
        else:
            last = (lens - n)[:, None] + torch.arange(n, device=dev)[None, :]  # [B, n] last visible key
            self.mask = (pos[None, None, :] <= last[:, :, None]).unsqueeze(1)
        first = token_starts[0]
        if all(t == first + i * n for i, t in enumerate(token_starts)):
            self.start, self.index = first, None
        else:
            self.start = None
            self.index = torch.tensor([t + j for t in token_starts for j in range(n)], dtype=torch.int64,
                                      device=dev)

    def _gather(self, cache: torch.Tensor, kvh: int) -> torch.Tensor:
        """This group's keys or values of ``cache`` [pool_tokens, kv_heads, dim] as float32
        ``[B * kv_heads, L, dim]``, in one ``index_select``.

        Gathering whole tokens (``slots``) gives ``[B, L, kv_heads, dim]``, which the batched
        matmuls need head-major: a second full copy per layer.  Viewing the pool as one row
        per (token, KV head) and gathering ``head_rows`` writes the head-major layout
        directly (the same values in the same layout, so the result is bit-identical).
        Measured on an AVX2-only AMD EPYC (float32, one thread, ``perf/engine_steps.py
        --kv-gather both``): an 8-row SLM decode step 227 -> 188 ms at 480 keys of context
        and 126 -> 120 ms at 96 (medians of 8 alternations), the LLM's 471 -> 454 ms at 96
        (docs/performance.md, "Engine step times").  In bfloat16 the ``.float()`` copies
        remain and the gain is smaller.  A pool that is not contiguous
        (never seen in SGLang's pools) takes the two-copy path.
        """
        B, L = self.B, self.L
        if not cache.is_contiguous() or not HEAD_ROW_GATHER:
            return self._gather_tokens(cache, kvh)
        if self.head_rows is None or self.head_rows.numel() != B * kvh * L:
            heads = torch.arange(kvh, dtype=torch.int64, device=self.slots.device)
            self.head_rows = (self.slots.view(B, 1, L) * kvh + heads.view(1, kvh, 1)).reshape(-1)
        return cache.view(-1, cache.shape[-1]).index_select(0, self.head_rows).view(B * kvh, L, -1).float()

    def _gather_tokens(self, cache: torch.Tensor, kvh: int) -> torch.Tensor:
        """:meth:`_gather`'s result in two copies: whole tokens, then head-major."""
        B, L = self.B, self.L
        return cache.index_select(0, self.slots).view(B, L, kvh, -1).transpose(1, 2).reshape(B * kvh, L, -1).float()

    def attend(self, q_tok, output, k_cache, v_cache, scaling) -> None:
        """Fill this group's rows of ``output`` [tokens, heads, head_dim] from ``q_tok`` (same shape).

        Computes ``softmax(q k^T * scaling + mask) v`` in float32 with two batched matmuls per
        layer, the query heads of one KV head stacked as rows (grouped-query attention: query
        head h reads KV head h // (heads / kv_heads), as SDPA's ``enable_gqa``).  Not
        ``scaled_dot_product_attention``: for a few query rows its CPU kernel is 4-7x slower in
        bfloat16 (measured on an AMD EPYC, one thread: 8 rows x 110 keys, 9 / 3 heads: 1.07 ms
        against 0.26 ms per call) and no faster in float32; its error against a float64
        reference is the same (≈ 2e-3 in bfloat16, ≈ 3e-7 in float32).
        """
        B, n, L = self.B, self.n, self.L
        if self.start is not None:
            q = q_tok[self.start:self.start + B * n]
        else:
            q = q_tok.index_select(0, self.index)
        H, d = q.shape[-2], q.shape[-1]
        kvh = k_cache.shape[-2]
        if scaling is None:
            scaling = d ** -0.5  # SDPA's default
        g = H // kvh
        # [B * kvh, g * n, d]: row (j, t) of KV head c is query head c * g + j, token t
        q = q.view(B, n, kvh, g, d).permute(0, 2, 3, 1, 4).reshape(B * kvh, g * n, d).float()
        k, v = self._gather(k_cache, kvh), self._gather(v_cache, kvh)
        if self.mask is None:
            scores = torch.bmm(q, k.transpose(1, 2)).mul_(scaling)
        else:
            if self.bias is None:
                bias = torch.zeros(self.mask.shape, dtype=torch.float32, device=q.device)
                bias.masked_fill_(~self.mask, float("-inf"))  # [B, 1, n, L]
                self.bias = bias.unsqueeze(2).expand(B, kvh, g, n, L).reshape(B * kvh, g * n, L)
            scores = torch.baddbmm(self.bias, q, k.transpose(1, 2), alpha=scaling)
        o = torch.bmm(torch.softmax(scores, dim=-1), v)  # [B * kvh, g * n, dv]
        o = o.view(B, kvh, g, n, -1).permute(0, 3, 1, 2, 4).reshape(B * n, H, -1).to(output.dtype)
        if self.start is not None:
            output[self.start:self.start + B * n] = o
        else:
            output.index_copy_(0, self.index, o)


class _StepPlan:
    """How one forward step's requests are attended: groups (:class:`_Group`) and lone prefills.

    Built by the first layer of a step and reused by the others (the backend's
    ``init_forward_metadata`` drops it); ``key`` ties it to that step's tensors.

    Args:
        req_pool_indices, seq_lens: ``[num_seqs]`` int tensors of the step.
        new_lens: new tokens per request: a list of int or an int tensor ``[num_seqs]``
            (all 1 for a decode step).
        req_to_token: ``[rows, max_context]`` KV slot table.
    """

    def __init__(self, key, req_pool_indices, seq_lens, new_lens, req_to_token):
        self.key = key
        rows, lens = req_pool_indices.tolist(), seq_lens.tolist()
        if isinstance(new_lens, torch.Tensor):
            new_lens = new_lens.tolist()
        by_n = {}
        self.lone = []  # (row, seq_len, n, token_start)
        t = 0
        for row, L, n in zip(rows, lens, new_lens):
            if n <= GROUP_MAX_NEW:
                by_n.setdefault(n, []).append((row, L, t))
            else:
                self.lone.append((row, L, n, t))
            t += n
        self.groups = [_Group(n, [r for r, _, _ in g], [L for _, L, _ in g], [s for _, _, s in g], req_to_token)
                       for n, members in by_n.items() for g in _split_padding(members)]


#: a group's padded key positions (rows x longest sequence) may exceed the sum of its
#: sequences' lengths by this factor at most; longer mixes are split (:func:`_split_padding`)
PAD_LIMIT = 1.5


def _split_padding(members):
    """Split ``members`` [(row, seq_len, token_start), …] so that no group pads beyond :data:`PAD_LIMIT`.

    One group pads every request to the longest: a step mixing one 8k-token request with 31
    short ones would gather and attend 32 x 8k keys.  When the padded total exceeds
    ``PAD_LIMIT`` x the real one, the members are sorted by length (longest first) and cut
    greedily into groups that each respect the bound.  Returns a list of member lists (the
    input itself, in order, when it already does).
    """
    lens = [L for _, L, _ in members]
    if len(members) * max(lens) <= PAD_LIMIT * sum(lens):
        return [members]
    out, cur, total = [], [], 0
    for m in sorted(members, key=lambda m: -m[1]):
        if cur and (len(cur) + 1) * cur[0][1] > PAD_LIMIT * (total + m[1]):
            out.append(cur)
            cur, total = [], 0
        cur.append(m)
        total += m[1]
    out.append(cur)
    return out


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # an inference-mode tensor has no version counter: identity alone
        return -1


def _plan(backend, tensors, new_lens, req_to_token) -> _StepPlan:
    """The step's plan cached on ``backend``, built anew when ``tensors`` (the step's
    ``req_pool_indices``, ``seq_lens``, …) are other objects or were changed in place."""
    key = tuple((t, _version(t)) for t in tensors)  # the plan keeps them alive: ids are not reused
    plan = getattr(backend, "_tr_plan", None)
    if plan is None or len(plan.key) != len(key) or any(
            a is not b or va != vb for (a, va), (b, vb) in zip(plan.key, key)):
        plan = _StepPlan(key, tensors[0], tensors[1], new_lens, req_to_token)
        backend._tr_plan = plan
    return plan


def _init_metadata_dropping_plan(self, forward_batch):
    global _step_serial
    self._tr_plan = None
    _step_serial += 1
    return _orig_init_metadata(self, forward_batch)


def _rope_forward_native(self, positions, query, key, offsets=None, fused_set_kv_buffer_arg=None):
    """Neox-style rotary embedding of one step's queries and keys in 7 tensor ops (replaces SGLang's).

    SGLang 0.5.23's ``RotaryEmbedding.forward_native`` gathers the step's cos/sin rows
    from ``cos_sin_cache`` again in every layer and rotates the queries and the keys
    apart, about 25 small operations per layer (0.11 ms for 8 tokens on an AMD EPYC,
    one thread).  Here the step's ``cos`` and ``sin`` tables (``[tokens, 1, head_size]``,
    each half repeated, in the query's dtype) are built by the first layer and reused by
    the others (tied to the step by :data:`_step_serial` and to ``positions`` by identity
    and version), and queries and keys are rotated together:
    ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = [-x2, x1]``
    (0.035 ms).  Each element is the same product and sum in the same dtype as SGLang's
    ``x1 * cos - x2 * sin`` and ``x2 * cos + x1 * sin``, so the result is bit-identical.

    Args (as the method it replaces): positions int ``[tokens]``; query ``[tokens,
    heads * head_size]``; key ``[tokens, kv_heads * head_size]``.  GPT-J style, partial
    rotary dims, offsets, multimodal positions and fused KV writes go to the original.

    Returns:
        ``(query, key)`` rotated, each of its input's shape (views of one new tensor).
    """
    d = self.head_size
    if (offsets is not None or fused_set_kv_buffer_arg is not None or not self.is_neox_style
            or self.rotary_dim != d or positions.dim() != 1 or query.dtype != key.dtype
            or hasattr(self, "sin_cos_cache") or self._apply_rotary_emb_wrapped is not _plain_apply_rotary_emb):
        return _orig_rope_native(self, positions, query, key, offsets, fused_set_kv_buffer_arg)
    T = positions.shape[0]
    tag = (_step_serial, _version(positions), query.dtype)
    c = getattr(self, "_tr_rope", None)  # (tag, positions, cos_sin_cache, cos, sin)
    if c is None or c[0] != tag or c[1] is not positions or c[2] is not self.cos_sin_cache:
        cos, sin = self.cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)
        cos = torch.cat((cos, cos), dim=-1).unsqueeze(1).to(query.dtype)
        sin = torch.cat((sin, sin), dim=-1).unsqueeze(1).to(query.dtype)
        c = self._tr_rope = (tag, positions, self.cos_sin_cache, cos, sin)
    cos, sin = c[3], c[4]
    q_shape, k_shape = query.shape, key.shape
    q = query.reshape(T, -1, d)
    H = q.shape[1]
    x = torch.cat((q, key.reshape(T, -1, d)), dim=1)  # [T, heads + kv_heads, d]
    x1, x2 = x.chunk(2, dim=-1)
    out = (x * cos).add_(torch.cat((x2.neg(), x1), dim=-1).mul_(sin))
    return out[:, :H].reshape(q_shape), out[:, H:].reshape(k_shape)


def _sdpa_forward_decode_batched(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                                 encoder_lens=None, scaling=None, enable_gqa=False, causal=False,
                                 is_cross_attn=False, sliding_window_size=None):
    """Decode attention of the step's requests in padded SDPA calls, not a loop (replaces SGLang's).

    SGLang 0.5.23's ``TorchNativeAttnBackend._run_sdpa_forward_decode`` loops over the
    requests in Python in every layer: about ten small tensor operations per request
    and layer, so a step of 8 requests on a 30-layer model issues ~2,400 of them.
    Here the step's KV slots are gathered once into a ``[B, L]`` table (L: the longest
    sequence, shorter ones masked), and each layer runs one gather of K and V and one
    ``scaled_dot_product_attention`` over ``[B, heads, 1, L]``: the same result.  Requests
    whose lengths differ too much form several such groups (:func:`_split_padding`).

    Args (as the method it replaces): query/output [num_seqs, heads, head_dim];
    k_cache/v_cache [pool_tokens, kv_heads, head_dim]; req_to_token [rows,
    max_context]; req_pool_indices, seq_lens: [num_seqs] int tensors.
    Encoder, cross-attention and sliding-window layers go to the original.

    Returns:
        ``output``, filled.
    """
    if encoder_lens is not None or is_cross_attn or (sliding_window_size is not None and sliding_window_size > -1):
        return _orig_sdpa_decode(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                                 encoder_lens, scaling=scaling, enable_gqa=enable_gqa, causal=causal,
                                 is_cross_attn=is_cross_attn, sliding_window_size=sliding_window_size)
    plan = _plan(self, (req_pool_indices, seq_lens), [1] * int(seq_lens.shape[0]), req_to_token)
    for g in plan.groups:
        g.attend(query, output, k_cache, v_cache, scaling)  # GQA from the head counts
    return output


def _sdpa_forward_extend_new_rows(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices,
                                  seq_lens, extend_prefix_lens, extend_seq_lens, encoder_lens=None,
                                  scaling=None, enable_gqa=False, causal=False, is_cross_attn=False,
                                  sliding_window_size=None):
    """Extend attention computing only the new tokens' rows, short ones batched (replaces SGLang's).

    SGLang 0.5.23's ``TorchNativeAttnBackend._run_sdpa_forward_extend`` pads every
    request's queries to its whole sequence and runs a full causal attention of
    ``seq_len x seq_len``, then keeps the last ``extend_len`` rows.  For a request
    resumed with 1-2 new tokens at a 500-token context that is ~250-500x the work
    of the rows it keeps, and since a step that resumes anything runs as one
    extend forward, every request of that step paid it.  Here each request's
    ``extend_len`` queries attend to its ``seq_len`` keys with the causal mask
    offset by its prefix (query ``i`` sees keys ``0 .. prefix + i``): the same
    result, O(extend x seq) work.  Requests with the same number of new tokens, up
    to :data:`GROUP_MAX_NEW` (decode rows and resumes, most of a routed step), run
    as one padded SDPA call per layer (:class:`_Group`, split by length where padding would
    cost more than :data:`PAD_LIMIT`); longer ones (prefills)
    one by one.

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
    plan = _plan(self, (req_pool_indices, seq_lens, extend_seq_lens), extend_seq_lens, req_to_token)
    for g in plan.groups:
        g.attend(query, output, k_cache, v_cache, scaling)  # GQA from the head counts
    hd = query.dim() - 2
    for row, seq_len, n, start in plan.lone:
        end = start + n
        q = query[start:end].movedim(0, hd)  # [heads, n, head_dim]
        slots = req_to_token[row, :seq_len].to(torch.int64)
        k = k_cache.index_select(0, slots).movedim(0, hd)
        v = v_cache.index_select(0, slots).movedim(0, hd)
        if not (q.dtype == k.dtype == v.dtype):
            k, v = k.to(q.dtype), v.to(q.dtype)
        prefix = seq_len - n
        mask, is_causal = None, False
        if prefix == 0:  # a prefill: square, ordinary causal mask
            is_causal = True
        else:
            pos = torch.arange(seq_len, device=q.device)
            mask = pos[None, :] <= (prefix + torch.arange(n, device=q.device))[:, None]
        out = torch.nn.functional.scaled_dot_product_attention(
            q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask, is_causal=is_causal,
            scale=scaling, enable_gqa=enable_gqa)
        output[start:end] = out.squeeze(0).movedim(hd, 0)
    return output


def patch_torch_native_extend(on_gpu: bool = False) -> bool:
    """Install the batched attention of this module into SGLang's torch_native backend (CPU hosts).

    Replaces ``_run_sdpa_forward_extend`` by :func:`_sdpa_forward_extend_new_rows`,
    ``_run_sdpa_forward_decode`` by :func:`_sdpa_forward_decode_batched`, and wraps
    ``init_forward_metadata`` so that each forward step builds its attention plan
    (:class:`_StepPlan`) once; replaces ``RotaryEmbedding.forward_native`` by
    :func:`_rope_forward_native`.  Idempotent; call after :func:`install`.  Returns
    True when installed, False on GPU hosts unless ``on_gpu`` (an engine on a GPU
    that runs torch_native: the ops here are device-agnostic torch) or if SGLang's
    backend no longer has these methods.
    """
    global _orig_sdpa_extend, _orig_sdpa_decode, _orig_init_metadata, _orig_rope_native, _plain_apply_rotary_emb
    if cuda_available() and not on_gpu:
        return False
    from sglang.srt.layers.attention import torch_native_backend as tnb

    cls = tnb.TorchNativeAttnBackend
    if _orig_sdpa_extend is not None:
        return True
    if not all(hasattr(cls, m) for m in ("_run_sdpa_forward_extend", "_run_sdpa_forward_decode",
                                         "init_forward_metadata")):
        return False
    _orig_sdpa_extend = cls._run_sdpa_forward_extend
    _orig_sdpa_decode = cls._run_sdpa_forward_decode
    _orig_init_metadata = cls.init_forward_metadata
    cls._run_sdpa_forward_extend = _sdpa_forward_extend_new_rows
    cls._run_sdpa_forward_decode = _sdpa_forward_decode_batched
    cls.init_forward_metadata = _init_metadata_dropping_plan
    try:
        from sglang.srt.layers.rotary_embedding import base as rope_base
        from sglang.srt.layers.rotary_embedding.utils import apply_rotary_emb
    except ImportError:  # another SGLang layout: keep its rotary embedding
        return True
    if hasattr(rope_base.RotaryEmbedding, "forward_native"):
        _plain_apply_rotary_emb = apply_rotary_emb
        _orig_rope_native = rope_base.RotaryEmbedding.forward_native
        rope_base.RotaryEmbedding.forward_native = _rope_forward_native
    return True
