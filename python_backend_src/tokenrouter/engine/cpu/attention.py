"""CPU attention: SGLang's torch_native backend attends only the new tokens' rows, in padded batches.

:func:`patch_torch_native_extend` installs it (with :mod:`.rope`).  A step's KV slots are
gathered once per step into padded tables (:class:`_StepPlan`), one per count of new tokens
(decode rows, resumes of up to :data:`GROUP_MAX_NEW` tokens), split by length where padding
would exceed :data:`PAD_LIMIT`; each layer then attends each table with two batched float32
matmuls and a softmax.  Prefills longer than :data:`GROUP_MAX_NEW` tokens keep SDPA.
"""

from __future__ import annotations

import torch

from . import step_key
from .rope import install_rope
from .shims import cuda_available

__all__ = ["patch_torch_native_extend", "GROUP_MAX_NEW", "PAD_LIMIT"]

_orig_sdpa_extend = None
_orig_sdpa_decode = None
_orig_init_metadata = None

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


def _plan(backend, tensors, new_lens, req_to_token) -> _StepPlan:
    """The step's plan cached on ``backend``, built anew when ``tensors`` (the step's
    ``req_pool_indices``, ``seq_lens``, …) are other objects or were changed in place."""
    key = tuple((t, step_key.version(t)) for t in tensors)  # the plan keeps them alive: ids are not reused
    plan = getattr(backend, "_tr_plan", None)
    if plan is None or len(plan.key) != len(key) or any(
            a is not b or va != vb for (a, va), (b, vb) in zip(plan.key, key)):
        plan = _StepPlan(key, tensors[0], tensors[1], new_lens, req_to_token)
        backend._tr_plan = plan
    return plan


def _init_metadata_dropping_plan(self, forward_batch):
    self._tr_plan = None
    step_key.next_step()
    return _orig_init_metadata(self, forward_batch)


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
    (:class:`_StepPlan`) once; replaces ``RotaryEmbedding.forward_native``
    (:func:`.rope.install_rope`).  Idempotent; call after :func:`.shims.install`.  Returns
    True when installed, False on GPU hosts unless ``on_gpu`` (an engine on a GPU
    that runs torch_native: the ops here are device-agnostic torch) or if SGLang's
    backend no longer has these methods.
    """
    global _orig_sdpa_extend, _orig_sdpa_decode, _orig_init_metadata
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
    install_rope()
    return True
