"""End-to-end tests of the main job against the real tritonserver (model_repository/)."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import queue
import re
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tr_client import (generate, grpc_stream, metric_values, model_stats, router_inputs, stream_then_cancel,
                       wait_kv_released)

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, a little robot who lived in a lighthouse",
    "Three tips for staying healthy are",
]
N_TOKENS = 32


@pytest.fixture(scope="module")
def hf_greedy():
    """Greedy continuations of PROMPTS by plain transformers (fp32), N_TOKENS each, no EOS stop."""
    from tokenrouter.engine import cpu

    cpu.install()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = os.path.join(os.environ["TOKENROUTER_WEIGHTS"], "smollm2-135m-instruct")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    out = {}
    with torch.no_grad():
        for p in PROMPTS:
            ids = torch.tensor([tok.encode(p)])
            res = model(ids, use_cache=True)
            past, gen = res.past_key_values, []
            for _ in range(N_TOKENS):
                nxt = int(res.logits[0, -1].argmax())
                gen.append(nxt)
                res = model(torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
                past = res.past_key_values
            out[p] = gen
    return out


@pytest.mark.parametrize("threshold,expect", [(1.0, "no-handoff"), (None, "handoffs"), (0.0, "llm-writes")])
def test_greedy_equals_transformers(triton_server, hf_greedy, threshold, expect):
    """Greedy tokens through Triton equal plain transformers', token for token.

    Both roles serve the same weights, so this also holds with handoffs: every
    resume must continue from exactly the right KV state.
    """
    total_handoffs = 0
    for p in PROMPTS:
        sp = {"max_tokens": N_TOKENS, "temperature": 0, "ignore_eos": True}
        if threshold is not None:
            sp["routing_threshold"] = threshold
        out = generate(triton_server, p, sp)
        assert out["_status"] == 200, out
        ids = out["routing_trace"]["token_ids"]
        assert ids == hf_greedy[p], f"prompt {p!r}: triton {ids} != transformers {hf_greedy[p]}"
        assert out["num_output_tokens"] == N_TOKENS
        by = out["routing_summary"]["tokens_by_model"]
        total_handoffs += out["routing_summary"]["handoffs"]
        if expect == "no-handoff":
            assert out["routing_summary"]["handoffs"] == 0 and by == {"slm": N_TOKENS, "llm": 0}
        if expect == "llm-writes":
            assert by == {"slm": 0, "llm": N_TOKENS}
    if expect == "handoffs":
        assert total_handoffs > 0


def test_handoffs_summary_and_extend_only_new_tokens(triton_server):
    """Default τ hands off; summary matches the trace; resumes extend only new tokens."""
    prompt = ("You are a careful assistant. Read the question and answer it in a few sentences, "
              "explaining your reasoning step by step so that a student can follow it. "
              "Question: why do leaves change colour in autumn?")
    before = {m: model_stats(triton_server, m) for m in ("slm", "llm")}
    out = generate(triton_server, prompt, {"max_tokens": 40, "temperature": 0, "ignore_eos": True})
    after = wait_kv_released(triton_server)
    assert out["_status"] == 200, out
    s, tr = out["routing_summary"], out["routing_trace"]
    trace, names = tr["trace"], tr["models"]
    n_in, n_out = out["num_input_tokens"], out["num_output_tokens"]
    assert len(trace) == n_out == 40
    assert s["handoffs"] > 0, "the default threshold should hand off on this prompt"
    assert s["tokens_by_model"] == {m: trace.count(i) for i, m in enumerate(names)}
    assert sum(s["handoffs_by_pair"].values()) == s["handoffs"]
    switches = sum(1 for a, b in zip(trace, trace[1:]) if a != b)
    assert switches <= s["handoffs"]
    for m in ("slm", "llm"):
        d = {k: after[m][k] - before[m][k]
             for k in ("extend_tokens", "decode_tokens", "extend_runs", "prefix_cache_hits")}
        segments = (1 if m == "slm" else 0) + s["handoffs_by_pair"].get(("llm->slm" if m == "slm" else "slm->llm"), 0)
        # at most one extend per visit (prefill or resume; a visit that brings no new token
        # resumes as a plain decode), and each token runs through the model at most once
        assert 1 <= d["extend_runs"] <= segments, (m, d, s)
        assert d["extend_tokens"] + d["decode_tokens"] <= n_in + n_out, (m, d)
        assert d["extend_tokens"] + d["prefix_cache_hits"] >= n_in, (m, d)  # cached prompt tokens run no more
        # a re-prefill on resume would run the whole context again (>= n_in per visit)
        assert d["extend_tokens"] < n_in + n_out
    assert after["slm"]["kv_tokens_in_use"] == 0 and after["llm"]["kv_tokens_in_use"] == 0


def test_chunked_prefill_lets_a_short_request_pass_long_prompts(triton_server):
    """Long prompts prefill in chunks (``prefill_chunk_tokens``, default 512 new tokens per step,
    shared by the step's extends): a short request sent while two long prompts prefill finishes
    first (unchunked, the long ones' single prefill step would end before the short one could run,
    and with one output token each they would finish first); the two prompts' tokens take at least
    one step per 512 of them (a per-request bound would run both in the same steps); and a long
    request's greedy token is the one an unchunked prefill gives."""
    from tokenrouter.tools import admin

    long_prompts = [f"Prompt {i}. " + "Tell me about the history of the printing press, year by year. " * 100
                    for i in range(2)]  # ~1,300 tokens each: 3 chunks each, 6 steps for the two
    sp = {"max_tokens": 1, "temperature": 0}
    before = model_stats(triton_server, "slm")
    order = []

    def run(prompt, tag):
        out = generate(triton_server, prompt, sp)
        order.append(tag)
        return out

    with cf.ThreadPoolExecutor(3) as ex:
        f_long = [ex.submit(run, p, f"long{i}") for i, p in enumerate(long_prompts)]
        time.sleep(0.5)  # the long prompts' first step has begun
        f_short = ex.submit(run, "Hi", "short")
        long_out, short_out = [f.result() for f in f_long], f_short.result()
    after = wait_kv_released(triton_server)
    assert all(o["_status"] == 200 for o in long_out) and short_out["_status"] == 200, (long_out, short_out)
    n_in = [o["num_input_tokens"] for o in long_out]
    assert min(n_in) > 2 * 512 and all(o["num_output_tokens"] == 1 for o in long_out)
    steps = after["slm"]["steps"] - before["steps"]
    assert steps >= -(-sum(n_in) // 512), (steps, n_in)  # at most 512 prefill tokens a step
    assert after["slm"]["prefill_chunks"] - before["prefill_chunks"] >= -(-max(n_in) // 512) - 1
    assert order[0] == "short", order
    for bad in (1.7, True, -1, "abc"):
        with pytest.raises(Exception, match="prefill_chunk_tokens must be an integer >= 0"):
            admin.configure(triton_server.grpc_url, "slm", prefill_chunk_tokens=bad)
    try:
        admin.configure(triton_server.grpc_url, "slm", prefill_chunk_tokens=0)
        whole = generate(triton_server, long_prompts[0], sp)
    finally:
        admin.configure(triton_server.grpc_url, "slm", prefill_chunk_tokens=512)
    assert whole["_status"] == 200 and model_stats(triton_server, "slm")["prefill_chunks"] == after["slm"]["prefill_chunks"]
    assert whole["routing_trace"]["token_ids"] == long_out[0]["routing_trace"]["token_ids"]
    assert after["slm"]["kv_tokens_in_use"] == 0 and after["llm"]["kv_tokens_in_use"] == 0


def test_eight_concurrent_streams_match_non_streamed(triton_server):
    prompts = [f"Write a short note number {i} about {topic}:" for i, topic in
               enumerate(["rivers", "mountains", "cities", "stars", "bread", "music", "trains", "bees"])]
    sp = {"max_tokens": 24, "temperature": 0}
    with cf.ThreadPoolExecutor(8) as ex:
        streamed = list(ex.map(lambda p: grpc_stream(triton_server, p, sp), prompts))
    for p, st in zip(prompts, streamed):
        assert st["error"] is None, st
        assert len(st["chunks"]) >= 2, "a streamed answer comes in several chunks"
        full = generate(triton_server, p, sp)
        assert full["_status"] == 200
        assert st["text"] == full["text_output"], p
        assert st["routing_trace"]["token_ids"] == full["routing_trace"]["token_ids"]
        assert st["finish_reason"] in ("stop", "length")


def test_stream_interval_sends_the_first_token_at_once(triton_server):
    """Models' stream_interval K: the first chunk holds the first token alone, then K tokens a chunk."""
    from tokenrouter.tools import admin

    sp = {"max_tokens": 17, "temperature": 0, "ignore_eos": True, "routing_threshold": 1.0}  # never hands off
    one = grpc_stream(triton_server, PROMPTS[2], sp)
    try:
        for m in ("slm", "llm"):
            admin.configure(triton_server.grpc_url, m, stream_interval=4)
        four = grpc_stream(triton_server, PROMPTS[2], sp)
    finally:
        for m in ("slm", "llm"):
            admin.configure(triton_server.grpc_url, m, stream_interval=1)
    assert one["error"] is None and four["error"] is None, (one, four)
    assert one["routing_summary"]["handoffs"] == four["routing_summary"]["handoffs"] == 0
    assert four["text"] == one["text"] and four["num_output_tokens"] == one["num_output_tokens"] == 17
    one_c, four_c = ([c for c in x["chunks"] if c] for x in (one, four))  # the final response's text is ""
    assert four_c[0] == one_c[0], "the first token is not held back"
    # 1 + 16 tokens in fours: at most 5 chunks (the detokenizer may merge, never split, a chunk)
    assert len(one_c) > 10 and 2 <= len(four_c) <= 5, (one_c, four_c)


def test_http_infer_and_generate_stream(triton_server):
    # plain HTTP infer (non-streaming, decoupled model answering once)
    out = generate(triton_server, "The capital of France is", {"max_tokens": 8, "temperature": 0},
                   exclude_input=False)
    assert out["_status"] == 200 and out["text_output"].startswith("The capital of France is")
    import requests

    body = {"text_input": "The capital of France is", "stream": True,
            "sampling_parameters": json.dumps({"max_tokens": 8, "temperature": 0})}
    r = requests.post(f"http://{triton_server.http_url}/v2/models/token_router/generate_stream", json=body,
                      stream=True, timeout=120)
    events = [json.loads(line[5:]) for line in r.iter_lines(decode_unicode=True) if line.startswith("data:")]
    assert len(events) >= 2
    text = "".join(e.get("text_output", "") for e in events)
    assert text == generate(triton_server, "The capital of France is", {"max_tokens": 8, "temperature": 0})[
        "text_output"]
    assert events[-1]["finish_reason"] in ("stop", "length")


def test_stop_string_and_seeded_sampling(triton_server):
    sp = {"max_tokens": 48, "temperature": 0}
    base = generate(triton_server, "Count: one, two, three,", sp)["text_output"]
    assert "," in base
    stop = base[base.index(","):][:2]
    cut = generate(triton_server, "Count: one, two, three,", {**sp, "stop": [stop]})
    assert cut["finish_reason"] == "stop" and stop not in cut["text_output"]
    assert base.startswith(cut["text_output"])
    s1 = generate(triton_server, "Tell me a story.", {"max_tokens": 24, "temperature": 0.9, "seed": 7})
    s2 = generate(triton_server, "Tell me a story.", {"max_tokens": 24, "temperature": 0.9, "seed": 7})
    assert s1["routing_trace"]["token_ids"] == s2["routing_trace"]["token_ids"]


BAD_SAMPLING = [
    ("not json", "not valid JSON"),
    ('["a"]', "JSON object"),
    ('{"max_tokenz": 4}', "unknown keys"),
    ('{"max_tokens": 3, "max_tokens_given": "banana"}', "unknown keys"),  # the parser's own field
    ('{"max_tokens": 0}', "max_tokens"),
    ('{"max_tokens": -3}', "max_tokens"),
    ('{"max_tokens": 100000}', "context length"),
    ('{"temperature": -1}', "temperature"),
    ('{"top_p": 0}', "top_p"),
    ('{"routing_threshold": 7}', "tau"),
    ('{"seed": 18446744073709551616}', "seed"),
    ('{"temperature": NaN}', "finite"),
    ('{"temperature": Infinity}', "finite"),
    ('{"temperature": 1e309}', "finite"),
    ('{"top_p": NaN}', "finite"),
    ('{"routing_threshold": NaN}', "finite"),
]


@pytest.mark.parametrize("sampling,needle", BAD_SAMPLING)
def test_bad_sampling_parameters_rejected(triton_server, sampling, needle):
    body = {"text_input": "hello", "sampling_parameters": sampling}
    import requests

    r = requests.post(f"http://{triton_server.http_url}/v2/models/token_router/generate", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]


def test_context_overflow_names_the_default_budget(triton_server):
    """A prompt that fits but leaves no room for the default max_tokens: the error says the request
    set none and how many tokens it may ask for (the OpenAI front end passes the message on)."""
    import requests

    url = f"http://{triton_server.http_url}/v2/models/token_router/generate"
    r = requests.post(url, json={"text_input": "hello " * 8150, "sampling_parameters": "{}"}, timeout=120)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    m = re.search(r"prompt \((\d+) tokens\) \+ the default max_tokens \((\d+); the request set none\) "
                  r"exceeds the context length (\d+): set max_tokens to at most (\d+)", err)
    assert m, err
    n_prompt, default, ctx, most = map(int, m.groups())
    assert n_prompt + default > ctx and most == ctx - n_prompt, err
    # a budget the request gave is named as its own
    r = requests.post(url, json={"text_input": "hello", "sampling_parameters": '{"max_tokens": 100000}'},
                      timeout=60)
    assert r.status_code == 400 and "+ max_tokens (100000) exceeds" in r.json()["error"], r.text


def test_bad_inputs_rejected_and_server_keeps_serving(triton_server):
    c = httpclient.InferenceServerClient(triton_server.http_url)

    def infer(inputs):
        # the router is decoupled: use gRPC streaming for the raw-tensor cases
        return grpc_stream(triton_server, "", None, inputs=inputs, timeout=60)

    def inp(name, arr, dtype):
        x = grpcclient.InferInput(name, list(arr.shape), dtype)
        x.set_data_from_numpy(arr)
        return x

    cases = {
        "empty": [inp("text_input", np.array([b""], dtype=np.object_), "BYTES")],
        "whitespace": [inp("text_input", np.array([b"   "], dtype=np.object_), "BYTES")],
        "non-utf8": [inp("text_input", np.array([b"\xff\xfe\xfa"], dtype=np.object_), "BYTES")],
        "wrong dtype": [inp("text_input", np.array([1], dtype=np.int32), "INT32")],
        "wrong shape": [inp("text_input", np.array([b"a", b"b"], dtype=np.object_), "BYTES")],
        "missing": [inp("stream", np.array([True]), "BOOL")],
        "long prompt": [inp("text_input", np.array([("word " * 9000).encode()], dtype=np.object_), "BYTES")],
    }
    for name, ins in cases.items():
        out = infer(ins)
        assert out["error"], f"{name}: expected an error, got {out}"
    ok = generate(triton_server, "The capital of France is", {"max_tokens": 4, "temperature": 0})
    assert ok["_status"] == 200 and ok["num_output_tokens"] == 4
    try:
        assert c.is_server_live()
    finally:
        c.close()  # an idle keep-alive connection holds the server's shutdown for its exit timeout
    st = wait_kv_released(triton_server)
    assert all(s["kv_tokens_in_use"] == 0 for s in st.values()), st


def test_cancelled_streams_free_kv_and_others_unaffected(triton_server):
    sp_long = {"max_tokens": 400, "temperature": 0, "ignore_eos": True}
    sp = {"max_tokens": 16, "temperature": 0}
    reference = generate(triton_server, "Name three planets:", sp)["text_output"]

    def cancel_one(i):
        return stream_then_cancel(triton_server, "token_router", f"Tell a very long story number {i}.", sp_long,
                                  timeout=120)

    with cf.ThreadPoolExecutor(4) as ex:
        cancels = [ex.submit(cancel_one, i) for i in range(3)]
        other = ex.submit(grpc_stream, triton_server, "Name three planets:", sp)
        assert all(f.result() == 3 for f in cancels)
        o = other.result()
    assert o["error"] is None and o["text"] == reference
    st = wait_kv_released(triton_server, timeout=60)
    for m, s in st.items():
        assert s["kv_tokens_in_use"] == 0 and s["kv_rows_in_use"] == 0 and s["active"] == 0, (m, s)
    # the same zero is visible on Triton's metrics endpoint
    deadline = time.time() + 10
    while time.time() < deadline:
        kv = metric_values(triton_server, "tokenrouter_kv_tokens_in_use")
        if kv.get("slm") == 0 and kv.get("llm") == 0:
            break
        time.sleep(0.2)
    assert kv.get("slm") == 0 and kv.get("llm") == 0, kv


def test_garbage_to_internal_models_fails_alone(triton_server):
    """Bad work sent straight to a model subserver is rejected; concurrent requests are unharmed."""
    from tokenrouter.tools import admin

    sp = {"max_tokens": 24, "temperature": 0}
    reference = generate(triton_server, "Name three rivers:", sp)["text_output"]
    bad = [
        {"rid": "g1", "max_tokens": 4, "models": ["slm", "llm"], "resume": True},          # unknown resume
        {"rid": "g2", "max_tokens": -1, "models": ["slm", "llm"]},                          # bad budget
        {"rid": "g3", "max_tokens": 4, "models": ["slm", "llm"], "sampling": {"seed": 2**70}},
        {"rid": "g4", "max_tokens": 4, "models": ["slm", "llm"], "params": {"tau": "x"}},
    ]
    with cf.ThreadPoolExecutor(2) as ex:
        victim = ex.submit(grpc_stream, triton_server, "Name three rivers:", sp)
        for hdr in bad:
            with pytest.raises(RuntimeError):
                admin.model_op(triton_server.grpc_url, "slm", "run", hdr, request_id=hdr["rid"])
        with pytest.raises(RuntimeError, match="non-empty string rid"):  # a header without its request id
            admin.model_op(triton_server.grpc_url, "slm", "run", {"max_tokens": 4, "models": ["slm", "llm"]},
                           request_id="g6")
        with pytest.raises(RuntimeError):  # token ids outside the vocabulary
            _run_with_tokens(triton_server, [10**9])
        v = victim.result()
    assert v["error"] is None and v["text"] == reference
    st = wait_kv_released(triton_server)
    assert all(s["kv_tokens_in_use"] == 0 and s["active"] == 0 for s in st.values()), st


def _run_with_tokens(server, tokens):
    q: "queue.Queue" = queue.Queue()
    c = grpcclient.InferenceServerClient(server.grpc_url)
    c.start_stream(callback=lambda result, error: q.put((result, error)))
    try:
        def inp(name, arr, dtype):
            x = grpcclient.InferInput(name, list(arr.shape), dtype)
            x.set_data_from_numpy(arr)
            return x
        hdr = json.dumps({"rid": "g5", "max_tokens": 4, "models": ["slm", "llm"]})
        c.async_stream_infer("slm", [inp("request_id", np.array([[b"g5"]], dtype=np.object_), "BYTES"),
                                     inp("input_ids", np.array([tokens], dtype=np.int64), "INT64"),
                                     inp("peer_req", np.array([[hdr.encode()]], dtype=np.object_), "BYTES")])
        result, error = q.get(timeout=60)
        if error is not None:
            raise RuntimeError(str(error))
    finally:
        c.stop_stream()
        c.close()


def test_tiny_temperature_is_greedy_and_other_requests_unharmed(triton_server):
    """A temperature below 1e-5 is greedy (vLLM's convention) instead of overflowing the softmax;
    concurrent sampled requests in the same batches are unaffected."""
    sp_ref = {"max_tokens": 12, "temperature": 0}
    reference = generate(triton_server, "Name three rivers:", sp_ref)["text_output"]
    with cf.ThreadPoolExecutor(4) as ex:
        others = [ex.submit(generate, triton_server, f"Tell me about number {i}.",
                            {"max_tokens": 12, "temperature": 0.7, "seed": i}) for i in range(3)]
        tiny = ex.submit(generate, triton_server, "Name three rivers:", {"max_tokens": 12, "temperature": 1e-45})
        assert all(o.result()["_status"] == 200 for o in others)
        t = tiny.result()
    assert t["_status"] == 200 and t["text_output"] == reference


def test_sampler_confines_a_failing_row():
    import torch

    from tokenrouter.engine.sampling import BatchSampler

    logits = torch.randn(3, 50)
    logits[1] = float("nan")  # e.g. a broken row: multinomial rejects it
    errors = {}
    out = BatchSampler().sample(logits, ["a", "b", "c"], [{"temperature": 1.0, "seed": 1}] * 3, errors=errors)
    assert list(errors) == [1] and "sampling failed" in errors[1]
    assert out.shape == (3,) and 0 <= int(out[0]) < 50 and 0 <= int(out[2]) < 50
    with pytest.raises(RuntimeError):
        BatchSampler().sample(logits, ["a", "b", "c"], [{"temperature": 1.0}] * 3)


def test_admin_command_line(triton_server):
    """`python -m tokenrouter.tools.admin`: stats of both models as JSON, configure, clear errors."""
    import subprocess
    import sys

    wait_kv_released(triton_server)
    run = lambda *a: subprocess.run([sys.executable, "-m", "tokenrouter.tools.admin", *a, "--url",  # noqa: E731
                                     triton_server.grpc_url], capture_output=True, text=True, timeout=120)
    p = run("stats")
    assert p.returncode == 0, p.stderr
    st = json.loads(p.stdout)
    assert set(st) == {"slm", "llm"}
    assert all(s["kv_tokens_in_use"] == 0 and s["kv_capacity_tokens"] > 0 for s in st.values())
    p = run("configure", "--models", "llm", '{"stream_interval": 1}')
    assert p.returncode == 0 and set(json.loads(p.stdout)) == {"llm"}, p.stderr
    p = run("configure", "--models", "llm", '{"no_such_setting": 1}')
    assert p.returncode == 1 and "no_such_setting" in p.stderr and p.stdout == ""  # no answer: no JSON
    p = run("configure", "--models", "llm,slm", '{"stream_interval": 0}')
    assert p.returncode == 1 and p.stdout == "" and "stream_interval" in p.stderr
    p = run("configure", "not json")
    assert p.returncode == 2 and "JSON" in p.stderr
    p = run("stats", "--models", "nosuchmodel")
    assert p.returncode == 1 and "nosuchmodel" in p.stderr


def test_server_log_keeps_sglang_lines_but_not_cpu_import_noise(triton_server):
    """On a CPU host SGLang warns "Ignore import error when loading sglang.srt.models.…" for
    about 30 GPU-only model files at every model load; the CPU layer logs those at DEBUG.
    SGLang's other log lines still reach the server log."""
    if triton_server.log_path is None:
        pytest.skip("this server's log is not kept")
    text = triton_server.log_path.read_text(errors="replace")
    assert "Cuda graph is disabled" in text  # an SGLang INFO line of each CPU model load
    assert "Ignore import error when loading" not in text
