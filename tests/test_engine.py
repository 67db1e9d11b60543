"""Runner-level tests of the engine: suspend/resume keeps KV exactly."""

from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(scope="module")
def engine(smollm2_engine):
    return smollm2_engine  # tests/conftest.py: one engine per test process


def _greedy(engine, rid, prompt_ids, steps):
    s = engine.add(rid, prompt_ids)
    logits = []
    for _ in range(steps):
        out = engine.forward([s])
        logits.append(out.logits[0].clone())
        s.tokens.append(int(out.logits[0].argmax()))
    toks = list(s.tokens)
    engine.release(s)
    return logits, toks


def test_suspend_resume_matches_uninterrupted(engine):
    tok = engine.tokenizer
    pa = tok.encode("The quick brown fox jumps over")
    pb = tok.encode("Once upon a time, in a land far away, there lived")
    ref_logits, ref_tokens = _greedy(engine, "ref", pa, 10)
    assert engine.kv_tokens_in_use() == 0
    a, b = engine.add("a", pa), engine.add("b", pb)
    for i in range(4):
        out = engine.forward([a, b])
        assert torch.allclose(out.logits[0], ref_logits[i], atol=1e-3)
        a.tokens.append(int(out.logits[0].argmax()))
        b.tokens.append(int(out.logits[1].argmax()))
    held = engine.kv_tokens_in_use()
    # a is pending: other requests step, its KV stays
    for _ in range(3):
        out = engine.forward([b])
        b.tokens.append(int(out.logits[0].argmax()))
    assert engine.kv_tokens_in_use() == held + 3
    # resume a with one new token; b decodes in the same (single, extend) forward ...
    out = engine.forward([a, b])
    assert out.num_extend == 2 and out.extend_tokens == 2
    assert torch.allclose(out.logits[0], ref_logits[4], atol=1e-3)
    a.tokens.append(int(out.logits[0].argmax()))
    b.tokens.append(int(out.logits[1].argmax()))
    engine.forward([b])  # a pending again
    b.tokens.append(0)
    # ... and with three tokens written by a peer after a's own last token: only
    # those four unprocessed tokens are extended, never the prefix
    a.tokens = list(ref_tokens[: len(pa) + 8])
    out = engine.forward([a])
    assert out.extend_tokens == 4, "only the new tokens are run, never the prefix"
    assert torch.allclose(out.logits[0], ref_logits[8], atol=1e-3)
    a.tokens.append(int(out.logits[0].argmax()))
    out = engine.forward([a])
    assert out.num_extend == 0
    assert torch.allclose(out.logits[0], ref_logits[9], atol=1e-3)
    assert a.extend_tokens_total == len(pa) + 1 + 4
    engine.release(a)
    engine.release(b)
    assert engine.kv_tokens_in_use() == 0 and engine.rows_in_use() == 0


def test_release_is_idempotent_and_capacity_checked(engine):
    from tokenrouter.engine.sequence import KVCapacityError

    s = engine.add("x", [1, 2, 3])
    engine.forward([s])
    engine.release(s)
    engine.release(s)
    assert engine.kv_tokens_in_use() == 0
    big = engine.add("big", list(range(10, 3000)))
    with pytest.raises(KVCapacityError):
        engine.check_fits(big)
    engine.release(big)
    with pytest.raises(ValueError):
        engine.add("empty", [])



def test_free_slots_kept_in_order_and_logits_unchanged(engine):
    """Released slots go back to the allocator's free list in ascending order before the next
    allocation (KV locality), and where a request's slots lie does not change its logits."""
    tok = engine.tokenizer
    free = lambda: engine.runner.token_to_kv_pool_allocator.free_pages  # noqa: E731
    ref, _ = _greedy(engine, "ref", tok.encode("The capital of France is"), 3)
    seqs = [engine.add(f"o{i}", tok.encode(f"Request number {i} says")) for i in range(4)]
    engine.forward(seqs)
    for s in seqs:
        s.tokens.append(11)
    engine.forward(seqs)  # decode slots of the four requests interleave
    for i in (2, 0, 3):  # released out of order: SGLang appends their slots at the tail
        engine.release(seqs[i])
    f = free()
    assert not bool((f[1:] >= f[:-1]).all()), "the release order should leave the free list unsorted"
    seqs[1].tokens.append(12)
    engine.forward([seqs[1]])  # the next step sorts before it allocates
    f = free()
    assert bool((f[1:] > f[:-1]).all())
    engine.release(seqs[1])
    # the same request in slots taken from the re-ordered pool: the same logits
    again, _ = _greedy(engine, "ref2", tok.encode("The capital of France is"), 3)
    for a, b in zip(ref, again):
        assert torch.equal(a, b)
    assert engine.kv_tokens_in_use() == 0


def _logits_of_batches(e, tag):
    """Logits of a prefill, a decode and a two-token resume for batches of 1, 3 and 6 requests."""
    tok = e.tokenizer
    prompts = [tok.encode(t) for t in ("The quick brown fox", "Once upon a time", "1, 2, 3,", "Dear sir,",
                                       "import numpy as", "The capital of France is")]
    out = []
    for n in (1, 3, 6):
        seqs = [e.add(f"{tag}-{n}-{i}", p) for i, p in enumerate(prompts[:n])]
        first = e.forward(seqs).logits
        out.append(first)
        for i, s in enumerate(seqs):
            s.tokens.append(int(first[i].argmax()))
        out.append(e.forward(seqs).logits)  # decode
        for s in seqs:
            s.tokens.extend([11, 12])  # a resume with two new tokens each
        out.append(e.forward(seqs).logits)
        for s in seqs:
            e.release(s)
    return out


def test_cpu_prepacked_linear_weights_give_the_same_logits(engine, monkeypatch):
    """The oneDNN-prepacked linear weights (default "dual") compute what SGLang's F.linear does.

    Compared on the same engine with the original row-major methods swapped back in;
    "dual" as configured (1-3 rows row-major, more rows packed) and packed for every
    batch size.
    """
    from tokenrouter.engine.cpu.linear import _PrepackedLinear

    assert engine.prepacked_layers > 0, "the default engine should prepack its linear layers on the CPU"
    wrapped = [(m, m.quant_method) for m in engine.runner.model.modules()
               if isinstance(getattr(m, "quant_method", None), _PrepackedLinear)]
    assert len(wrapped) == engine.prepacked_layers
    dual = _logits_of_batches(engine, "dual")
    monkeypatch.setattr(_PrepackedLinear, "SMALL_ROWS", 0)
    packed = _logits_of_batches(engine, "packed")
    for m, qm in wrapped:
        m.quant_method = qm._orig
    try:
        ref = _logits_of_batches(engine, "ref")
    finally:
        for m, qm in wrapped:
            m.quant_method = qm
    for got in (dual, packed):
        for a, b in zip(got, ref):
            assert a.shape == b.shape and a.shape[1] == engine.vocab_size
            assert torch.allclose(a, b, atol=2e-3, rtol=1e-3), float((a - b).abs().max())
    assert engine.kv_tokens_in_use() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_linear_row_buckets(dtype):
    """A prepacked linear layer pads a call's rows to a few sizes (row_bucket) and returns the same
    rows as without padding; the sizes are few, so oneDNN's per-shape kernels stay cached."""
    from types import SimpleNamespace

    from tokenrouter.engine.cpu.linear import _PrepackedLinear, row_bucket

    assert [row_bucket(n) for n in (1, 7, 16, 17, 32, 33, 256, 257, 1024, 1025)] == \
        [1, 7, 16, 32, 32, 48, 256, 320, 1024, 1280]
    assert len({row_bucket(n) for n in range(1, 1025)}) == 16 + 15 + 12
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch build")
    torch.manual_seed(0)
    w = torch.randn(96, 64, dtype=dtype)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 8)
    except RuntimeError as e:  # e.g. bf16 on a CPU without AVX-512 (the engine then keeps F.linear)
        pytest.skip(f"oneDNN cannot prepack {dtype} weights on this CPU: {e}")
    orig = SimpleNamespace(apply=lambda layer, x, bias=None: torch.nn.functional.linear(x, w, bias))
    on, off = _PrepackedLinear(orig, packed, False, True), _PrepackedLinear(orig, packed, False, False)
    for rows in (1, 5, 17, 40, 300):
        x = torch.randn(rows, 64, dtype=dtype)
        a, b = on.apply(None, x), off.apply(None, x)
        assert a.shape == b.shape == (rows, 96)
        assert torch.allclose(a.float(), b.float(), atol=1e-2, rtol=1e-2)
        x3 = x.view(1, rows, 64)  # [..., in] shapes keep their leading dimensions
        assert on.apply(None, x3).shape == (1, rows, 96)


def test_cpu_attention_matches_sglang(engine):
    """The batched CPU attention gives SGLang torch_native's logits.

    One step resumes 8 requests of different lengths with 1, 2, 2, 1, 9, 1, 3, 3 new tokens:
    groups by count, contiguous (2, 2 and 3, 3) and not (the 1s), masks with padding, a
    lone longer extend (9), and a 1-token group split because its lengths differ too much
    (200 against 30 and 25 tokens).  Then decode steps of the 8 rows (split by padding) and
    of 3 rows of equal length (no mask).
    """
    from sglang.srt.layers.attention import torch_native_backend as tnb

    from tokenrouter.engine.cpu import attention as cpu_attention

    cls = tnb.TorchNativeAttnBackend
    assert cls._run_sdpa_forward_extend is cpu_attention._sdpa_forward_extend_new_rows, "patch not installed on the CPU"
    assert cls._run_sdpa_forward_decode is cpu_attention._sdpa_forward_decode_batched, "patch not installed on the CPU"
    tok = engine.tokenizer
    long_prompt = tok.encode("Tell me about the history of the printing press. " * 20)  # ~200 tokens
    assert len(long_prompt) >= 200 and 9 > cpu_attention.GROUP_MAX_NEW >= 3
    lengths = (200, 190, 185, 30, 150, 25, 60, 55)
    new_tokens = (1, 2, 2, 1, 9, 1, 3, 3)
    assert len(cpu_attention._split_padding([(0, 200, 0), (3, 30, 1), (5, 25, 2)])) == 2

    def run(tag):
        seqs = [engine.add(f"{tag}-{i}", long_prompt[:L]) for i, L in enumerate(lengths)]
        out = [engine.forward(seqs).logits]  # prefill
        for n, s in zip(new_tokens, seqs):
            s.tokens.extend([13 + j for j in range(n)])
        out.append(engine.forward(seqs).logits)
        for _ in range(2):
            for s in seqs:
                s.tokens.append(17)
            step = engine.forward(seqs)
            assert step.num_extend == 0, "expected a decode step"
            out.append(step.logits)
        for s in seqs:
            engine.release(s)
        same = [engine.add(f"{tag}-same-{i}", long_prompt[i:i + 40]) for i in range(3)]
        engine.forward(same)
        for _ in range(2):
            for s in same:
                s.tokens.append(19)
            out.append(engine.forward(same).logits)
        for s in same:
            engine.release(s)
        return out

    new = run("new")
    cls._run_sdpa_forward_extend, cls._run_sdpa_forward_decode = cpu_attention._orig_sdpa_extend, cpu_attention._orig_sdpa_decode
    try:
        ref = run("ref")
    finally:
        cls._run_sdpa_forward_extend = cpu_attention._sdpa_forward_extend_new_rows
        cls._run_sdpa_forward_decode = cpu_attention._sdpa_forward_decode_batched
    assert len(new) == len(ref) == 6
    for a, b in zip(new, ref):
        assert a.shape == b.shape and a.shape[1] == engine.vocab_size
        assert torch.allclose(a, b, atol=2e-3, rtol=1e-3), float((a - b).abs().max())
    assert engine.kv_tokens_in_use() == 0


@pytest.mark.parametrize("gather", ["head-rows", "two-copy", "strided-pool"])
@pytest.mark.parametrize("dtype,heads,kv_heads", [(torch.bfloat16, 9, 3), (torch.float32, 9, 3),
                                                  (torch.bfloat16, 32, 8), (torch.float32, 4, 4)])
def test_cpu_group_attention_matches_float64_reference(dtype, heads, kv_heads, gather, monkeypatch):
    """The grouped decode/resume attention (float32 batched matmuls, not SDPA) against a
    float64 per-request reference: GQA and plain multi-head, masks with padding, groups of
    several new tokens, rows that are not contiguous in the step's token order, and a
    group split by its padding.  K/V gathered head-major in one copy (served), in two
    copies (``HEAD_ROW_GATHER`` off), and from a pool that is not contiguous (a strided
    view, which must take the two-copy path and not copy the pool)."""
    from tokenrouter.engine.cpu import attention as cpu_attention

    monkeypatch.setattr(cpu_attention, "HEAD_ROW_GATHER", gather != "two-copy")

    g = torch.Generator().manual_seed(0)
    d, pool, rows_max, ctx = 16, 4096, 16, 512
    lengths = (200, 190, 185, 30, 150, 25, 60, 55, 7)
    new = (1, 2, 2, 1, 1, 1, 3, 3, 1)
    perm = torch.randperm(pool - 1, generator=g) + 1  # scattered KV slots
    req_to_token = torch.zeros(rows_max, ctx, dtype=torch.int32)
    for r, L in enumerate(lengths):
        req_to_token[r, :L] = perm[r * ctx // 8: r * ctx // 8 + L].to(torch.int32)
    k_cache = torch.randn(pool, kv_heads, d, generator=g).to(dtype)
    v_cache = torch.randn(pool, kv_heads, d, generator=g).to(dtype)
    if gather == "strided-pool":  # every other token of a pool twice the size: same values, not contiguous
        k_cache = torch.stack((k_cache, torch.full_like(k_cache, float("nan"))), 1).view(2 * pool, kv_heads, d)[::2]
        v_cache = torch.stack((v_cache, torch.full_like(v_cache, float("nan"))), 1).view(2 * pool, kv_heads, d)[::2]
        assert not k_cache.is_contiguous()
    q_tok = torch.randn(sum(new), heads, d, generator=g).to(dtype)
    plan = cpu_attention._StepPlan(None, torch.tensor(range(len(lengths))), torch.tensor(lengths), list(new), req_to_token)
    assert not plan.lone and len(plan.groups) >= 4  # by count, and the 1-token group split by padding
    out = torch.zeros_like(q_tok)
    for grp in plan.groups:
        grp.attend(q_tok, out, k_cache, v_cache, d ** -0.5)
        assert (grp.head_rows is not None) == (gather == "head-rows")
    t, rep = 0, heads // kv_heads
    for r, (L, n) in enumerate(zip(lengths, new)):
        slots = req_to_token[r, :L].long()
        k = k_cache[slots].double().repeat_interleave(rep, dim=1).transpose(0, 1)  # [heads, L, d]
        v = v_cache[slots].double().repeat_interleave(rep, dim=1).transpose(0, 1)
        q = q_tok[t:t + n].double().transpose(0, 1)  # [heads, n, d]
        s = q @ k.transpose(1, 2) * d ** -0.5
        visible = torch.arange(L)[None, :] <= (L - n + torch.arange(n))[:, None]
        ref = torch.softmax(s.masked_fill(~visible, float("-inf")), -1) @ v
        tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
        got = out[t:t + n].double().transpose(0, 1)
        assert torch.allclose(got, ref, atol=tol), (r, float((got - ref).abs().max()))
        t += n


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cpu_rotary_embedding_is_bit_identical_to_sglangs(engine, dtype):
    """The per-step cached, jointly rotated RoPE (``_rope_forward_native``) against SGLang's
    own ``forward_native`` on the served model's rotary module: bit-identical queries and
    keys, also when the positions tensor is changed in place or replaced within one step
    (the cached cos/sin must follow), and the served model actually uses it."""
    from sglang.srt.layers.rotary_embedding import base as rope_base
    from tokenrouter.engine.cpu import rope as cpu_rope

    if cpu_rope._orig_rope_native is None:
        pytest.skip("the CPU rotary embedding is not installed on this host")
    assert rope_base.RotaryEmbedding.forward_native is cpu_rope._rope_forward_native
    rope = next(m for m in engine.runner.model.modules() if isinstance(m, rope_base.RotaryEmbedding))
    assert rope._forward_method.__func__ is cpu_rope._rope_forward_native  # what the layers call
    cfg = engine.model_config
    heads, kv_heads, d = cfg.num_attention_heads, cfg.num_key_value_heads, rope.head_size
    g = torch.Generator().manual_seed(1)
    positions = torch.tensor([0, 5, 17, 100, 101, 3, 2047])
    for step in range(3):
        if step == 1:
            positions.add_(7)  # same tensor, new values
        elif step == 2:
            positions = torch.tensor([9, 8, 7])  # a new tensor
        T = positions.shape[0]
        qkv = torch.randn(T, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
        q, k, _ = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)  # strided views, as served
        q_ref, k_ref = cpu_rope._orig_rope_native(rope, positions, q.clone(), k.clone())
        for _ in range(2):  # the second call reads the cached cos/sin
            q_got, k_got = cpu_rope._rope_forward_native(rope, positions, q, k)
            assert q_got.shape == q.shape and k_got.shape == k.shape
            assert torch.equal(q_got, q_ref) and torch.equal(k_got, k_ref), step
    offsets = torch.ones_like(positions)  # not the fast path: SGLang's own result
    q_got, k_got = cpu_rope._rope_forward_native(rope, positions, q, k, offsets)
    q_ref, k_ref = cpu_rope._orig_rope_native(rope, positions, q, k, offsets)
    assert torch.equal(q_got, q_ref) and torch.equal(k_got, k_ref)


def _heap_in_use_mib() -> float:
    """glibc's bytes in use by malloc (mallinfo2), in MiB"""
    from tokenrouter.engine.host_memory import heap_stats

    return heap_stats()["malloc_in_use_bytes"] / 2**20


def test_cpu_kernel_caches_are_bounded(engine):
    """Each new step shape adds an entry to PyTorch's and oneDNN's primitive caches; bounded
    (cpu_kernel_cache_entries), a stream of new prompt lengths stops growing the heap."""
    from tokenrouter.engine.cpu import kernel_caches

    if torch.cuda.is_available():
        pytest.skip("CPU kernel caches")
    entries = engine.config.cpu_kernel_cache_entries
    assert entries > 0
    for var in kernel_caches.CACHE_ENV:  # set before the engine's first oneDNN call (or by the user)
        assert os.environ.get(var), var
    # ~5 linear shapes per step length: 2 x entries / 5 lengths fill the caches, as many more must not grow them
    n = 2 * entries // 5
    assert kernel_caches.warm_kernel_caches(engine, n) == n
    before = _heap_in_use_mib()
    for m in range(n + 1, 2 * n + 1):
        s = engine.add(f"shape{m}", [100 + i % 500 for i in range(m)])
        engine.forward([s])
        engine.release(s)
    grown = _heap_in_use_mib() - before
    # unbounded (the libraries' 1,024 each) this grows by ~0.5 MiB a length here: ~100 MiB
    assert grown < 25, f"the heap grew by {grown:.0f} MiB over {n} new step shapes"
    assert engine.kv_tokens_in_use() == 0 and engine.rows_in_use() == 0


def test_bound_kernel_caches_keeps_the_users_setting(monkeypatch):
    from tokenrouter.engine.cpu.kernel_caches import CACHE_ENV, bound_kernel_caches

    monkeypatch.setenv(CACHE_ENV[0], "64")
    monkeypatch.delenv(CACHE_ENV[1], raising=False)
    assert bound_kernel_caches(128) == {CACHE_ENV[0]: "64", CACHE_ENV[1]: "128"}
    monkeypatch.delenv(CACHE_ENV[1])
    assert CACHE_ENV[1] not in bound_kernel_caches(0)
    with pytest.raises(ValueError, match="cpu_kernel_cache_entries"):
        bound_kernel_caches(-1)


@pytest.mark.parametrize("model", ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"])
def test_load_tokenizer_behaves_as_autotokenizer(model):
    """The router's tokenizer (``load_tokenizer``: PreTrainedTokenizerFast, a lighter import) encodes,
    decodes, renders chat templates and names special and stop tokens as AutoTokenizer's does."""
    from transformers import AutoTokenizer

    from tokenrouter.engine.detok import TokenStrings, load_tokenizer, stop_token_ids
    from tokenrouter.triton.common import resolve_model_path

    path = resolve_model_path(model)
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        pytest.skip(f"{model} is not prepared (deploy/prepare_weights.py)")
    ref, tok = AutoTokenizer.from_pretrained(path), load_tokenizer(path)
    texts = ["Hello world!  \n\tdef f(x):\n    return x**2  # ünïcødé 🤖", " leading space", "a<|im_end|>b",
             "<|endoftext|><|im_start|>user"]
    for t in texts:
        ids = ref.encode(t)
        assert tok.encode(t) == ids, t
        for skip in (False, True):
            assert tok.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), t
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    for kw in ({"add_generation_prompt": True}, {"add_generation_prompt": False}, {"tools": tools}):
        assert tok.apply_chat_template(msgs, tokenize=False, **kw) == ref.apply_chat_template(msgs, tokenize=False, **kw)
    for attr in ("eos_token_id", "unk_token_id", "bos_token_id", "pad_token_id", "model_max_length", "all_special_ids"):
        assert getattr(tok, attr) == getattr(ref, attr), attr
    assert len(tok) == len(ref) and tok.get_vocab() == ref.get_vocab()
    assert stop_token_ids(tok) == stop_token_ids(ref)
    some = list(range(0, len(ref), 97)) + sorted(ref.all_special_ids)
    a, b = TokenStrings(tok), TokenStrings(ref)
    assert [(a.text(i), a.bytes(i)) for i in some] == [(b.text(i), b.bytes(i)) for i in some]


def test_model_registry_imports_only_the_served_architectures():
    """An engine narrows SGLang's model registry to tokenrouter.engine.sglang_models before SGLang's
    first import: the architectures of the pairs resolve without importing SGLang's other 260 model
    modules; another architecture still resolves (the registry then imports them all); a package
    the user named is kept."""
    import subprocess
    import sys

    code = r"""
import os, sys
from tokenrouter.engine.cpu import install
from tokenrouter.engine.sglang_models import narrow_model_registry
install()
os.environ["SGLANG_EXTERNAL_MODEL_PACKAGE"] = "users.own"
assert narrow_model_registry() is False and os.environ["SGLANG_EXTERNAL_MODEL_PACKAGE"] == "users.own"
del os.environ["SGLANG_EXTERNAL_MODEL_PACKAGE"]
assert narrow_model_registry() is True
from sglang.srt.models.registry import ModelRegistry
models = lambda: sorted(m for m in sys.modules if m.startswith("sglang.srt.models."))
assert models() == ["sglang.srt.models.llama", "sglang.srt.models.qwen2", "sglang.srt.models.registry"], models()
for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM"):
    assert ModelRegistry.resolve_model_cls([arch])[1] == arch
assert len(models()) == 3
assert ModelRegistry.resolve_model_cls(["GPT2LMHeadModel"])[1] == "GPT2LMHeadModel"
assert len(models()) > 100, len(models())
print("ok")
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={k: v for k, v in os.environ.items() if k != "SGLANG_EXTERNAL_MODEL_PACKAGE"})
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stdout[-2000:] + p.stderr[-3000:]
