"""vllm_backend parameter compatibility and the LLM-serving metrics, against the real tritonserver.

Parameters: vllm_backend's value forms (numeric strings, "true"/"false", null),
request parameters when ``sampling_parameters`` is absent, the vLLM sampling
keys (penalties, min_tokens, stop_token_ids, include_stop_str_in_output,
skip_special_tokens, logprobs) and the ``return_*`` output switches.
Metrics: every metric a panel of deploy/grafana/tokenrouter.json uses is on
Triton's metrics endpoint, and the values agree with what the client measured.
"""

from __future__ import annotations

import json
import os
import queue
import re
import time
import urllib.request

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from prometheus_client.parser import text_string_to_metric_families

from tr_client import (assert_top_close, concurrently, generate, generate_many, grpc_stream, metric_values,
                       model_stats, router_inputs, token_logprobs, top_n)

PROMPT = "Count: one, two, three,"
GREEDY = {"temperature": 0}


def _post(server, body):
    r = requests.post(f"http://{server.http_url}/v2/models/token_router/generate", json=body, timeout=300)
    out = r.json()
    out["_status"] = r.status_code
    for k in ("routing_summary", "routing_trace", "logprobs"):
        if isinstance(out.get(k), str):
            out[k] = json.loads(out[k])
    return out


# ---------------------------------------------------------------- parameters
def test_string_numbers_booleans_and_nulls_read_as_vllm_backend(triton_server):
    typed = generate(triton_server, PROMPT, {"max_tokens": 6, "temperature": 0, "ignore_eos": True})
    strings = generate(triton_server, PROMPT, {"max_tokens": "6", "temperature": "0", "ignore_eos": "true",
                                               "seed": None, "top_p": None, "stop": None})
    assert typed["_status"] == strings["_status"] == 200, strings
    assert strings["num_output_tokens"] == 6
    assert strings["routing_trace"]["token_ids"] == typed["routing_trace"]["token_ids"]


@pytest.mark.parametrize("sampling,needle", [
    ({"max_tokens": "ten"}, 'max_tokens must be an integer, got "ten"'),
    ({"max_tokens": True}, "max_tokens must be an integer, got true"),
    ({"temperature": "warm"}, "temperature must be a number"),
    ({"ignore_eos": "maybe"}, "ignore_eos must be true or false"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ({"stop_token_ids": "2"}, "stop_token_ids"),
    ({"logprobs": 21}, "logprobs must be <= 20"),
    ({"logprobs": -1}, "logprobs must be >= 0"),
    ({"logprobs": "many"}, "logprobs must be an integer"),
    ({"best_of": 2}, "best_of"),
    ({"stop_token_ids": [10**7]}, "not token ids of this tokenizer"),
])
def test_unconvertible_values_and_unknown_keys_rejected_by_name(triton_server, sampling, needle):
    out = generate(triton_server, PROMPT, sampling)
    assert out["_status"] == 400 and needle in out["error"], out


def test_request_parameters_read_when_sampling_parameters_absent(triton_server):
    # HTTP generate: the top-level "parameters" object (what LiteLLM's Triton provider sends)
    out = _post(triton_server, {"text_input": PROMPT, "parameters": {"max_tokens": 3, "temperature": 0,
                                                                      "ignore_eos": True}})
    assert out["_status"] == 200 and out["num_output_tokens"] == 3, out
    bad = _post(triton_server, {"text_input": PROMPT, "parameters": {"max_tokens": 3, "temprature": 0}})
    assert bad["_status"] == 400 and "temprature" in bad["error"], bad
    # errors name where the key came from
    assert "unknown keys in parameters" in bad["error"], bad
    for params, needle in (({"routing_threshold": 1.5}, "parameters.routing_threshold"),
                           ({"stop_token_ids": "[100000000]"}, "parameters.stop_token_ids")):
        bad = _post(triton_server, {"text_input": PROMPT, "parameters": {"max_tokens": 3, **params}})
        assert bad["_status"] == 400 and needle in bad["error"] and "sampling_parameters" not in bad["error"], bad
    bad = _post(triton_server, {"text_input": PROMPT, "parameters": {"max_tokens": "ten"}})
    assert bad["_status"] == 400 and "parameters.max_tokens" in bad["error"] \
        and "sampling_parameters" not in bad["error"], bad
    # list-valued keys as a JSON array in a string (request parameters are scalars)
    base = _post(triton_server, {"text_input": PROMPT, "exclude_input_in_output": True,
                                 "parameters": {"max_tokens": 12, "temperature": 0, "ignore_eos": True}})
    text = base["text_output"]
    stop = text[len(text) // 2:][:3]
    cut = _post(triton_server, {"text_input": PROMPT, "exclude_input_in_output": True, "parameters": {
        "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stop": json.dumps([stop, "\u0000never"])}})
    assert cut["_status"] == 200 and cut["finish_reason"] == "stop", cut
    assert stop not in cut["text_output"] and len(cut["text_output"]) < len(text), (cut, text)
    # sampling keys in both places (the "parameters" object or top-level keys) are refused, never ignored
    for extra in ({"parameters": {"max_tokens": 3}}, {"max_tokens": 3}, {"foo": 1}):
        both = _post(triton_server, {"text_input": PROMPT, **extra,
                                     "sampling_parameters": json.dumps({"max_tokens": 5, "ignore_eos": True})})
        assert both["_status"] == 400 and "send the sampling keys in one place" in both["error"] \
            and sorted(extra.get("parameters", extra))[0] in both["error"], both
    # a top-level key without sampling_parameters is a request parameter, and the error says so
    bad = _post(triton_server, {"text_input": PROMPT, "max_tokens": 3, "foo": 1})
    assert bad["_status"] == 400 and "['foo']" in bad["error"] and "top-level keys" in bad["error"], bad
    # gRPC request parameters
    q: "queue.Queue" = queue.Queue()
    c = grpcclient.InferenceServerClient(triton_server.grpc_url)
    c.start_stream(callback=lambda result, error: q.put((result, error)))
    try:
        c.async_stream_infer("token_router", router_inputs(PROMPT, None, False),
                             parameters={"max_tokens": 4, "temperature": 0, "ignore_eos": True})
        result, error = q.get(timeout=300)
    finally:
        c.stop_stream()
        c.close()
    assert error is None, error
    assert int(result.as_numpy("num_output_tokens").reshape(-1)[0]) == 4


@pytest.fixture(scope="module")
def hf_model():
    """SmolLM2 in plain transformers (fp32): an independent reference for penalties and logprobs."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = os.path.join(os.environ["TOKENROUTER_WEIGHTS"], "smollm2-135m-instruct")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    return tok, model


@pytest.mark.parametrize("threshold", [None, 1.0])
def test_repetition_penalty_matches_transformers_across_handoffs(triton_server, hf_model, threshold):
    """Greedy with repetition_penalty equals transformers' RepetitionPenaltyLogitsProcessor, with and
    without handoffs: every model penalises the same tokens (prompt + output of all models)."""
    import torch

    tok, model = hf_model
    n = 24
    ids = torch.tensor([tok.encode("Once upon a time, a little robot who lived in a lighthouse")])
    with torch.no_grad():
        ref = model.generate(ids, do_sample=False, max_new_tokens=n, repetition_penalty=1.5,
                             attention_mask=torch.ones_like(ids), pad_token_id=tok.eos_token_id)[0, ids.shape[1]:]
        plain = model.generate(ids, do_sample=False, max_new_tokens=n, attention_mask=torch.ones_like(ids),
                               pad_token_id=tok.eos_token_id)[0, ids.shape[1]:]
    assert ref.tolist() != plain.tolist()  # the penalty matters for this prompt
    sp = {"max_tokens": n, "temperature": 0, "repetition_penalty": 1.5}  # both stop at EOS
    if threshold is not None:
        sp["routing_threshold"] = threshold
    out = generate(triton_server, "Once upon a time, a little robot who lived in a lighthouse", sp)
    assert out["_status"] == 200, out
    if threshold is None:
        assert out["routing_summary"]["handoffs"] > 0
    assert out["routing_trace"]["token_ids"] == ref.tolist()


def test_presence_frequency_penalties_reduce_repeats(triton_server):
    base, pen = generate_many(triton_server, [
        (PROMPT, {"max_tokens": 32, "temperature": 0, "ignore_eos": True}),
        (PROMPT, {"max_tokens": 32, "temperature": 0, "ignore_eos": True, "presence_penalty": 2.0,
                  "frequency_penalty": 2.0})])
    assert pen["_status"] == 200

    def repeats(ids):
        return len(ids) - len(set(ids))

    assert repeats(pen["routing_trace"]["token_ids"]) < repeats(base["routing_trace"]["token_ids"])


def test_min_tokens_stop_token_ids_and_stop_string_options(triton_server):
    chat = "Reply with one word: what colour is the sky?"
    # these two at once (no equality between them); the requests compared exactly below go one at a time
    short, special = concurrently(
        lambda: generate(triton_server, chat, {"max_tokens": 40, "temperature": 0}, chat=True),
        lambda: generate(triton_server, chat, {"max_tokens": 40, "temperature": 0, "skip_special_tokens": False},
                         chat=True))
    assert short["finish_reason"] == "stop" and short["num_output_tokens"] < 15, short
    n = short["num_output_tokens"]
    longer = generate(triton_server, chat, {"max_tokens": 40, "temperature": 0, "min_tokens": n + 5}, chat=True)
    assert longer["num_output_tokens"] >= n + 5, longer
    # the EOS token is decoded into the text when special tokens are not skipped
    assert "<|im_end|>" in special["text_output"] and "<|im_end|>" not in short["text_output"]

    base = generate(triton_server, PROMPT, {"max_tokens": 24, "temperature": 0, "ignore_eos": True})
    ids = base["routing_trace"]["token_ids"]
    stop_id = ids[5]
    k = ids.index(stop_id)
    cut = generate(triton_server, PROMPT, {"max_tokens": 24, "temperature": 0, "stop_token_ids": [stop_id]})
    assert cut["finish_reason"] == "stop" and cut["routing_trace"]["token_ids"] == ids[:k + 1], cut

    text = base["text_output"]
    stop = text[text.index(",", 1):][:2]
    kept = generate(triton_server, PROMPT, {"max_tokens": 24, "temperature": 0, "stop": [stop],
                                            "include_stop_str_in_output": True})
    dropped = generate(triton_server, PROMPT, {"max_tokens": 24, "temperature": 0, "stop": [stop]})
    assert kept["text_output"] == dropped["text_output"] + stop, (kept, dropped)


def test_logprobs_from_the_writing_model_and_output_switches(triton_server, hf_model):
    """``logprobs`` N (vllm_backend's output): every output token with its logprob, rank and top N
    under the raw distribution of the model that wrote it, across handoffs (both models here are
    SmolLM2: plain transformers on the same tokens is the reference); asking changes no token."""
    import torch

    tok, model = hf_model
    n = 5

    def ask(sampling, **inputs):
        body = {"text_input": PROMPT, "exclude_input_in_output": True, "return_routing_trace": True,
                "sampling_parameters": json.dumps({"max_tokens": 12, "temperature": 0, "ignore_eos": True,
                                                   **sampling}), **inputs}
        out = _post(triton_server, body)
        assert out["_status"] == 200, out
        return out

    out = ask({"logprobs": n}, return_logprobs=True, return_finish_reason=False, return_num_input_tokens=False)
    assert "finish_reason" not in out and "num_input_tokens" not in out
    assert out["num_output_tokens"] == 12
    ids = out["routing_trace"]["token_ids"]
    assert out["routing_summary"]["handoffs"] > 0  # both models wrote some of them
    entries = token_logprobs(out["logprobs"])
    assert [e["id"] for e in entries] == ids  # one per output token, the token first
    prompt_ids = tok.encode(PROMPT)
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + ids])).logits[0, len(prompt_ids) - 1:-1]
    ref = torch.log_softmax(logits.float(), -1)
    for i, e in enumerate(entries):
        # greedy without a grammar: the token is the most likely one; the rest are the top N, sorted
        assert e["rank"] == 1 and [e["rank"]] + e["top_ranks"] == list(range(1, n + 1)), e
        assert [v for _, v in e["top"]] == sorted((v for _, v in e["top"]), reverse=True), e
        assert e["decoded"] == tok.decode([e["id"]]), e
        assert abs(e["logprob"] - float(ref[i, e["id"]])) < 2e-3, (i, e)
        top = torch.topk(ref[i], n)
        assert_top_close(top_n(e, n), list(zip(top.indices.tolist(), top.values.tolist())), 2e-3, f"token {i}")
    # the sampled token's logprob is the same without the top N; no logprobs: the same tokens
    alone = ask({"logprobs": 0}, return_logprobs=True)
    assert alone["routing_trace"]["token_ids"] == ids
    single = token_logprobs(alone["logprobs"])
    assert all(len(d) == 1 for d in alone["logprobs"]) and [e["id"] for e in single] == ids
    assert np.allclose([e["logprob"] for e in single], [e["logprob"] for e in entries], atol=1e-5)
    plain = ask({})
    assert plain["routing_trace"]["token_ids"] == ids and "logprobs" not in plain
    # the sampling key alone turns the output on; streaming: each response carries its tokens' logprobs
    st = grpc_stream(triton_server, PROMPT, {"max_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": 3})
    assert st["error"] is None and len(st["logprobs_chunks"]) > 1, st
    streamed = token_logprobs([d for chunk in st["logprobs_chunks"] for d in chunk])
    assert [e["id"] for e in streamed] == ids
    assert np.allclose([e["logprob"] for e in streamed], [e["logprob"] for e in entries], atol=1e-5)
    # without the switch or the key no logprobs output is sent
    plain = _post(triton_server, {"text_input": PROMPT, "sampling_parameters": json.dumps({"max_tokens": 2})})
    assert "logprobs" not in plain and plain["finish_reason"] in ("stop", "length")
    # return_logprobs alone: the sampled token's logprob (N = 0); request parameters carry N too
    out = _post(triton_server, {"text_input": PROMPT, "return_logprobs": True,
                                "parameters": {"max_tokens": 3, "temperature": 0, "ignore_eos": True,
                                               "logprobs": 2}})
    assert out["_status"] == 200 and [len(d) for d in out["logprobs"]] == [2, 2, 2], out


# ------------------------------------------------------------------- metrics
def _scrape(server):
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def _total(samples, name, **labels):
    """Sum of the samples named ``name`` whose labels include ``labels``."""
    return sum(v for (n, lab), v in samples.items()
               if n == name and all(dict(lab).get(k) == str(x) for k, x in labels.items()))


def _dashboard_metrics(repo_root):
    d = json.loads((repo_root / "deploy" / "grafana" / "tokenrouter.json").read_text())
    exprs = [t["expr"] for p in d["panels"] for t in p.get("targets", [])]
    assert exprs
    names = set()
    for e in exprs:
        names.update(re.findall(r"\b(tokenrouter[_:][A-Za-z0-9_:]+)", e))
    return names


def test_dashboard_metrics_exist_and_agree_with_the_client(triton_server, repo_root):
    used = _dashboard_metrics(repo_root)
    before = _scrape(triton_server)
    present = {n for n, _ in before}
    missing = sorted(used - present)
    assert not missing, f"dashboard panels use metrics the server does not export: {missing}"

    # three streamed requests: the client times its first chunk and its end
    prompts = ["Tell me about the sea.", "Name three colours.", PROMPT]
    results, client_ttft, client_e2e = [], [], []
    for p in prompts:
        q: "queue.Queue" = queue.Queue()
        c = grpcclient.InferenceServerClient(triton_server.grpc_url)
        c.start_stream(callback=lambda result, error: q.put((time.monotonic(), result, error)))
        out = {}
        try:
            t0 = time.monotonic()
            c.async_stream_infer("token_router", router_inputs(p, {"max_tokens": 16, "temperature": 0}, True),
                                 enable_empty_final_response=True)
            first = None
            while True:
                t, result, error = q.get(timeout=300)
                assert error is None, error
                txt = result.as_numpy("text_output")
                if first is None and txt is not None and txt.size and txt.reshape(-1)[0]:
                    first = t
                for k in ("num_input_tokens", "num_output_tokens", "finish_reason", "routing_summary"):
                    v = result.as_numpy(k)
                    if v is not None and v.size:
                        out[k] = v.reshape(-1)[0]
                par = result.get_response().parameters.get("triton_final_response")
                if par is not None and par.bool_param:
                    break
        finally:
            c.stop_stream()
            c.close()
        assert first is not None
        client_ttft.append(first - t0)
        client_e2e.append(t - t0)
        out["routing_summary"] = json.loads(out["routing_summary"])
        results.append(out)
    after = _scrape(triton_server)
    kinds = {fam.name: fam.type for fam in text_string_to_metric_families(
        urllib.request.urlopen(triton_server.metrics_url, timeout=10).read().decode())}
    for name in ("tokenrouter_extend_tokens", "tokenrouter_decode_tokens", "tokenrouter_handoffs_out"):
        assert kinds.get(name) == "counter", (name, kinds.get(name))  # prometheus_client drops "_total"

    def delta(name, **labels):
        return _total(after, name, **labels) - _total(before, name, **labels)

    n = len(prompts)
    m = "tokenrouter:"
    assert delta(m + "e2e_request_latency_seconds_count") == n
    assert delta(m + "time_to_first_token_seconds_count") == n
    assert delta(m + "request_queue_time_seconds_count") == n
    assert delta(m + "prompt_tokens_total") == sum(int(r["num_input_tokens"]) for r in results)
    assert delta(m + "generation_tokens_total") == sum(int(r["num_output_tokens"]) for r in results)
    for model in ("slm", "llm"):
        assert delta(m + "generation_tokens_total", writer=model) == sum(
            r["routing_summary"]["tokens_by_model"][model] for r in results)
    for reason in ("stop", "length"):
        assert delta(m + "request_success_total", finished_reason=reason) == sum(
            r["finish_reason"].decode() == reason for r in results)
    handoffs = sum(r["routing_summary"]["handoffs"] for r in results)
    assert handoffs > 0
    assert delta(m + "handoffs_total") == handoffs
    for pair in ("slm->llm", "llm->slm"):
        a, b = pair.split("->")
        assert delta(m + "handoffs_total", **{"from": a, "to": b}) == sum(
            r["routing_summary"]["handoffs_by_pair"].get(pair, 0) for r in results)
    assert delta(m + "handoff_latency_seconds_count") == handoffs
    # server-side times lie within what the client saw
    ttft = delta(m + "time_to_first_token_seconds_sum")
    e2e = delta(m + "e2e_request_latency_seconds_sum")
    queue_s = delta(m + "request_queue_time_seconds_sum")
    assert 0 < ttft <= sum(client_ttft), (ttft, client_ttft)
    assert ttft < e2e <= sum(client_e2e), (e2e, client_e2e)
    assert 0 <= queue_s <= ttft
    assert 0 < delta(m + "handoff_latency_seconds_sum") <= e2e
    tpot_n = delta(m + "time_per_output_token_seconds_count")
    assert tpot_n == sum(int(r["num_output_tokens"]) >= 2 for r in results)
    # a histogram's +Inf bucket counts every observation
    assert delta(m + "e2e_request_latency_seconds_bucket", le="+Inf") == n
    # nothing running or waiting once every answer is in
    deadline = time.time() + 10
    while time.time() < deadline:
        now = _scrape(triton_server)
        if _total(now, m + "num_requests_running") == 0 and _total(now, m + "num_requests_waiting") == 0:
            break
        time.sleep(0.2)
    assert _total(now, m + "num_requests_running") == 0 and _total(now, m + "num_requests_waiting") == 0


def test_model_metrics_move_while_a_request_runs(triton_server):
    """The models' metrics are published while they are busy, not only when they fall idle: during one
    long streamed request the model's decode counter and KV gauge follow its ``stats`` op."""
    q: "queue.Queue" = queue.Queue()
    c = grpcclient.InferenceServerClient(triton_server.grpc_url)
    c.start_stream(callback=lambda result, error: q.put(error))
    sampling = {"max_tokens": 600, "temperature": 0, "ignore_eos": True, "routing_threshold": 1.0}  # the SLM only
    try:
        c.async_stream_infer("token_router", router_inputs("Tell me a long story.", sampling, True),
                             enable_empty_final_response=True)
        seen = []
        for _ in range(3):  # three reads, each after 25 more streamed chunks
            for _ in range(25):
                assert q.get(timeout=120) is None
            time.sleep(2 * 0.1)  # two of the models' publication intervals
            published = (metric_values(triton_server, "tokenrouter_decode_tokens_total")["slm"],
                         metric_values(triton_server, "tokenrouter_kv_tokens_in_use")["slm"])
            stats = model_stats(triton_server, "slm")
            seen.append((*published, stats["decode_tokens"], stats["kv_tokens_in_use"]))
    finally:
        c.stop_stream(cancel_requests=True)
        c.close()
    decoded = [s[0] for s in seen]
    assert decoded[0] < decoded[1] < decoded[2], seen  # the counter moves during the request
    for published, kv, stats_decoded, stats_kv in seen:
        assert kv > 0, seen  # the request's KV is shown while it runs
        assert 0 <= stats_decoded - published < 25, seen  # a few steps behind the model's own count at most
