"""Speculative decoding (algorithm ``speculative``): the SLM drafts, the LLM verifies.

* the rejection-sampling rule on synthetic distributions (no model): the verified token is
  distributed as the LLM's p whatever the draft distribution q (Leviathan et al. 2023, Thm 3.5);
* the engine: logits at every drafted position of one extend equal those of decoding the same
  tokens one by one; truncating a sequence frees the KV of the cut tokens;
* the real server (one tritonserver for the module): with temperature 0 the output equals
  LLM-only's token for token for every prompt, alone and 8 at a time, with drafts that are
  all accepted (the demo pair: the same SmolLM2 in both roles) and with drafts that are often
  rejected (drafts sampled at ``draft_temperature`` 1.5, verification greedy: the rollback
  runs); the routing summary / trace / metrics count drafts and accepted drafts; a cancelled
  request and a request whose LLM dies leave no KV on any model, drafts included.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import queue
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tr_client import (generate, grpc_stream, metric_values, model_stats, router_inputs, stream_then_cancel,
                       wait_kv_released)

REPO_ROOT = Path(__file__).resolve().parent.parent

PROMPTS = [
    "Explain why the sky is blue in two sentences.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Three tips for staying healthy are",
    "The capital of France is",
    "Write a haiku about the sea.",
]
N = 32  # output tokens per request
TIMEOUT = 900  # s per request: the CPU may be shared with other jobs

ROUTERS = {
    "token_router_llm": {"algorithm": "none", "algorithm_params": '{"model": 1}'},
    "token_router_spec": {"algorithm": "speculative", "algorithm_params": '{"k": 4}'},
    # drafts sampled at temperature 1 (verification stays greedy): many are rejected
    "token_router_spec_reject": {"algorithm": "speculative",
                                 "algorithm_params": '{"k": 4, "draft_temperature": 1.0}'},
    # hotter drafts, more of them: most are rejected
    "token_router_spec_hot": {"algorithm": "speculative",
                              "algorithm_params": '{"k": 5, "draft_temperature": 1.5}'},
    "token_router_spec_adaptive": {"algorithm": "speculative",
                                   "algorithm_params": '{"k": 2, "adaptive": true, "k_max": 6, '
                                                       '"draft_temperature": 0.8}'},
}


# ------------------------------------------------------------------ the rule, no model
def _verifier(sampling):
    from tokenrouter.algorithms.speculative import Speculative

    algo = Speculative(1, 2, Speculative.validate_params({}, 2))
    state = SimpleNamespace(header=SimpleNamespace(sampling=sampling), rid="r")
    return algo, SimpleNamespace(rid="r", state=state)


def test_rejection_sampling_preserves_the_target_distribution():
    from tokenrouter.algorithms.speculative import target_probs
    from tokenrouter.engine.sampling import BatchSampler

    g = torch.Generator().manual_seed(0)
    V = 6
    p_logits = torch.randn(V, generator=g) * 2
    sampling = {"temperature": 0.9, "top_p": 1.0, "top_k": 0, "seed": 7}
    p = target_probs(p_logits, sampling)
    q = torch.softmax(torch.randn(V, generator=g) * 2, -1)  # a different draft distribution
    algo, res = _verifier(sampling)
    algo._q = [[list(range(V)), q.tolist()]]
    sampler = BatchSampler()
    counts = torch.zeros(V)
    n, accepted = 20000, 0
    logits2 = torch.stack([p_logits, p_logits])  # position 0 (the draft's) and the bonus position
    for _ in range(n):
        d = int(torch.multinomial(q, 1, generator=g)[0])
        out = algo.verify(res, logits2, [d], sampler)
        counts[out[0]] += 1
        accepted += len(out) == 2
    emp = counts / n
    assert (emp - p).abs().max() < 0.015, (emp, p)  # ~4 standard errors at n = 20000
    # the acceptance rate is sum_x min(p, q) (Leviathan et al. 2023, Corollary 3.6)
    assert abs(accepted / n - float(torch.minimum(p, q).sum())) < 0.015


def test_greedy_verification_accepts_the_argmax_prefix():
    algo, res = _verifier({"temperature": 0})
    logits = torch.full((4, 10), -5.0)
    for pos, tok in enumerate([3, 4, 9, 1]):
        logits[pos, tok] = 5.0
    assert algo.verify(res, logits, [3, 4, 9]) == [3, 4, 9, 1]  # all accepted + the bonus token
    assert algo.verify(res, logits, [3, 7, 9]) == [3, 4]  # rejected at 1: the LLM's token instead
    assert algo.verify(res, logits, [0, 4, 9]) == [3]


def test_parameters_are_checked():
    from tokenrouter.algorithms import configure

    _, params = configure("speculative", '{"k": 3}', 2)
    assert params["k"] == 3 and params["adaptive"] is False
    for bad in ('{"k": 0}', '{"k": 2.5}', '{"draft_temperature": -1}', '{"tau": 0.1}'):
        with pytest.raises(ValueError):
            configure("speculative", bad, 2)
    with pytest.raises(ValueError, match="between 2 and 2"):
        configure("speculative", "{}", 3)


# ------------------------------------------------------------------ the engine
@pytest.fixture()
def engine(smollm2_engine):
    return smollm2_engine  # tests/conftest.py: one engine per test process


def test_engine_position_logits_and_truncate(engine):
    prompt = engine.tokenizer.encode("The quick brown fox jumps over")
    s = engine.add("ref", prompt)
    ref = []
    for _ in range(8):
        out = engine.forward([s])
        assert out.position_logits is None
        ref.append(out.logits[0].clone())
        s.tokens.append(int(out.logits[0].argmax()))
    full = list(s.tokens)
    engine.release(s)
    # one extend of the prompt + 4 tokens, beside another request: logits at the last 5 positions
    s = engine.add("v", full[:len(prompt) + 4])
    s.verify_positions = 5
    other = engine.add("o", engine.tokenizer.encode("Hello there my friend"))
    out = engine.forward([other, s])
    assert out.position_logits[0] is None and out.position_logits[1].shape == (5, engine.vocab_size)
    for j in range(5):
        assert torch.allclose(out.position_logits[1][j], ref[j], atol=1e-3), j
    assert torch.allclose(out.position_logits[1][-1], out.logits[1], atol=1e-4)
    assert s.verify_positions == 0  # one forward only
    # roll back 2 tokens: their KV slots are freed, the rest is reused
    held = engine.kv_tokens_in_use()
    assert engine.truncate(s, len(prompt) + 2) == 2
    assert engine.kv_tokens_in_use() == held - 2 and s.kv_len == len(prompt) + 2
    s.tokens += full[len(prompt) + 2:len(prompt) + 5]
    s.verify_positions = 3
    other.tokens.append(int(out.logits[0].argmax()))
    out = engine.forward([s, other])
    assert out.extend_tokens == 3 + 1  # only the new tokens run
    for j in range(3):
        assert torch.allclose(out.position_logits[0][j], ref[3 + j], atol=1e-3), j
    with pytest.raises(ValueError):
        engine.truncate(s, len(s.tokens) + 1)
    s.verify_positions = 2  # more positions than new tokens
    other.tokens.append(1)
    s.tokens.append(1)
    with pytest.raises(ValueError, match="positions"):
        engine.forward([s, other])
    engine.release(s)
    engine.release(other)
    assert engine.kv_tokens_in_use() == 0


# ------------------------------------------------------------------ the server
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tokenrouter.tools.repository import make_variant
    from tr_server import running_server

    tmp = tmp_path_factory.mktemp("speculative")
    small = {"kv_pool_tokens": "8192", "max_running_requests": "32"}
    repo = make_variant(str(REPO_ROOT / "model_repository"), str(tmp / "repo"),
                        model_params={"slm": small, "llm": small}, routers=ROUTERS)
    with running_server(repo, tmp) as srv:
        yield srv


def greedy(n=N, **kw):
    return {"max_tokens": n, "temperature": 0, **kw}


def _ids(out):
    assert out["_status"] == 200, out
    return out["routing_trace"]["token_ids"]


@pytest.fixture(scope="module")
def reference(server):
    """LLM-only greedy output of every prompt (token ids)."""
    return {p: _ids(generate(server, p, greedy(), model="token_router_llm", timeout=TIMEOUT)) for p in PROMPTS}


def _check_summary(out):
    summ, tr = out["routing_summary"], out["routing_trace"]
    spec = summ["speculative"]
    assert spec["rounds"] == len(tr["drafts"]) > 0
    assert spec["drafted"] == sum(d["drafted"] for d in tr["drafts"])
    assert spec["accepted"] == sum(d["accepted"] for d in tr["drafts"]) <= spec["drafted"]
    assert spec["acceptance_rate"] == round(spec["accepted"] / spec["drafted"], 4)
    # the accepted drafts are the SLM's tokens, the rest the LLM's (one per round at most)
    n = len(tr["token_ids"])
    assert summ["tokens_by_model"]["slm"] == spec["accepted"] == tr["trace"].count(0)
    assert summ["tokens_by_model"]["llm"] == n - spec["accepted"] <= spec["rounds"]
    pos = 0
    for d in tr["drafts"]:  # each round: its accepted drafts (slm), then one llm token
        assert d["pos"] == pos, (d, tr["drafts"])
        assert tr["trace"][pos:pos + d["accepted"]] == [0] * min(d["accepted"], n - pos)
        pos += d["accepted"] + 1
    return spec


@pytest.mark.parametrize("router", ["token_router_spec", "token_router_spec_reject", "token_router_spec_hot",
                                    "token_router_spec_adaptive"])
def test_greedy_output_equals_llm_only(server, reference, router):
    drafted = accepted = 0
    for p in PROMPTS:
        out = generate(server, p, greedy(), model=router, timeout=TIMEOUT)
        assert _ids(out) == reference[p], (router, p)
        spec = _check_summary(out)
        drafted, accepted = drafted + spec["drafted"], accepted + spec["accepted"]
    if router == "token_router_spec":  # same model drafts and verifies: (almost) every draft accepted
        assert accepted >= 0.9 * drafted, (accepted, drafted)
    else:  # sampled drafts: some are rejected and rolled back
        assert accepted < drafted, (accepted, drafted)
    st = wait_kv_released(server)
    for m, s in st.items():
        assert s["kv_tokens_in_use"] == 0 and s["active"] == 0, (m, s)
    if router == "token_router_spec_reject":
        assert st["slm"]["draft_tokens_rolled_back"] > 0
        assert st["llm"]["drafts_verified"] > st["llm"]["drafts_accepted"] > 0


def test_greedy_equals_llm_only_under_concurrency(server, reference):
    jobs = [(router, p) for router in ("token_router_spec", "token_router_spec_reject") for p in PROMPTS]
    with cf.ThreadPoolExecutor(8) as ex:
        outs = list(ex.map(lambda j: generate(server, j[1], greedy(), model=j[0], timeout=TIMEOUT), jobs))
    for (router, p), out in zip(jobs, outs):
        assert _ids(out) == reference[p], (router, p)
        _check_summary(out)
    st = wait_kv_released(server)
    for m, s in st.items():
        assert s["kv_tokens_in_use"] == 0 and s["active"] == 0, (m, s)


def test_stop_and_budget_end_a_round(server):
    # a budget below k: the drafts stop at the budget, the output has exactly max_tokens tokens
    for n in (1, 2, 3):
        out = generate(server, PROMPTS[0], greedy(n, ignore_eos=True), model="token_router_spec", timeout=TIMEOUT)
        ref = generate(server, PROMPTS[0], greedy(n, ignore_eos=True), model="token_router_llm", timeout=TIMEOUT)
        assert _ids(out) == _ids(ref) and len(_ids(out)) == n and out["finish_reason"] == "length"
    # EOS ends the request inside a round, as with LLM-only
    out = generate(server, "Say OK.", greedy(64), model="token_router_spec", timeout=TIMEOUT)
    ref = generate(server, "Say OK.", greedy(64), model="token_router_llm", timeout=TIMEOUT)
    assert _ids(out) == _ids(ref) and out["finish_reason"] == ref["finish_reason"]


def test_sampled_requests_are_served_and_counted_in_the_metrics(server):
    before = metric_values(server, "tokenrouter:spec_decode_num_draft_tokens_total")
    sp = {"max_tokens": 24, "temperature": 0.8, "top_p": 0.95, "seed": 3}
    a = generate(server, PROMPTS[2], sp, model="token_router_spec_reject", timeout=TIMEOUT)
    b = generate(server, PROMPTS[2], sp, model="token_router_spec_reject", timeout=TIMEOUT)
    assert a["_status"] == 200 and len(_ids(a)) == 24
    assert _ids(a) == _ids(b)  # a seeded request is reproducible
    spec = _check_summary(a)
    deadline = time.time() + 10
    while time.time() < deadline:
        after = metric_values(server, "tokenrouter:spec_decode_num_draft_tokens_total")
        if after.get("token_router_spec_reject", 0) >= before.get("token_router_spec_reject", 0) + 2 * spec["drafted"]:
            break
        time.sleep(0.5)
    assert after["token_router_spec_reject"] - before.get("token_router_spec_reject", 0) >= 2 * spec["drafted"]
    acc = metric_values(server, "tokenrouter:spec_decode_num_accepted_tokens_total")["token_router_spec_reject"]
    assert 0 < acc <= after["token_router_spec_reject"]
    # penalties are not supported: a clear error for that request alone
    bad = generate(server, PROMPTS[2], {"max_tokens": 4, "repetition_penalty": 1.2}, model="token_router_spec",
                   timeout=TIMEOUT)
    assert bad["_status"] != 200 and "does not support" in bad.get("error", ""), bad
    wait_kv_released(server)


def test_cancelled_requests_free_all_kv(server):
    sp_long = {"max_tokens": 400, "temperature": 0, "ignore_eos": True}

    def cancel_one(i, router):
        return stream_then_cancel(server, router, f"Tell a very long story number {i}.", sp_long, timeout=TIMEOUT)

    with cf.ThreadPoolExecutor(4) as ex:
        futs = [ex.submit(cancel_one, i, r) for i, r in
                enumerate(["token_router_spec", "token_router_spec_reject", "token_router_spec_reject"])]
        other = ex.submit(grpc_stream, server, PROMPTS[3], greedy(16), model="token_router_spec_reject",
                          timeout=TIMEOUT)
        assert all(f.result() == 3 for f in futs)
        o = other.result()
    ref = generate(server, PROMPTS[3], greedy(16), model="token_router_llm", timeout=TIMEOUT)
    assert o["error"] is None and o["text"] == ref["text_output"]
    st = wait_kv_released(server, timeout=60)
    for m, s in st.items():
        assert s["kv_tokens_in_use"] == 0 and s["kv_rows_in_use"] == 0 and s["active"] == 0, (m, s)


def test_llm_failure_frees_the_drafters_kv(server):
    """Last test of the module: it kills the LLM's stub (as an OOM kill would)."""
    from tr_server import python_stubs

    s = _stream(server, "token_router_spec_reject", "Tell me a long story about a dragon.",
                {"max_tokens": 400, "temperature": 0, "ignore_eos": True})
    assert s["first"].wait(TIMEOUT)
    pid = python_stubs(server)["llm_0_0"].pid
    os.kill(pid, signal.SIGKILL)
    assert s["done"].wait(TIMEOUT)
    assert s["error"] and "llm" in s["error"], s
    st = wait_kv_released(server, models=("slm",), timeout=60)
    assert st["slm"]["kv_tokens_in_use"] == 0 and st["slm"]["active"] == 0, st


def _stream(server, model, prompt, sampling):
    import threading

    import tritonclient.grpc as grpcclient

    state = {"first": threading.Event(), "done": threading.Event(), "error": None}
    q: "queue.Queue" = queue.Queue()
    c = grpcclient.InferenceServerClient(server.grpc_url)
    c.start_stream(callback=lambda result, error: q.put((result, error)))
    c.async_stream_infer(model, router_inputs(prompt, sampling, True, trace=False), enable_empty_final_response=True)

    def read():
        try:
            while True:
                result, error = q.get(timeout=300)
                if error is not None:
                    state["error"] = str(error)
                    return
                state["first"].set()
                p = result.get_response().parameters.get("triton_final_response")
                if p is not None and p.bool_param:
                    return
        finally:
            state["first"].set()
            state["done"].set()
            c.stop_stream()
            c.close()

    threading.Thread(target=read, daemon=True).start()
    return state
