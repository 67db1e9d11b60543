"""Runner-level tests of the engine: suspend/resume keeps KV exactly."""

from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(scope="module")
def engine():
    from tokenrouter.engine import EngineConfig, SGLangEngine

    path = os.path.join(os.environ["TOKENROUTER_WEIGHTS"], "smollm2-135m-instruct")
    e = SGLangEngine(EngineConfig(model_path=path, kv_pool_tokens=2048, max_running_requests=8, torch_threads=2))
    yield e


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
    from tokenrouter.engine import KVCapacityError

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
