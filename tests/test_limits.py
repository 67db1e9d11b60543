"""Input limits and overload answers against a real server (docs/reliability.md, "Limits").

Oversized and hostile inputs at each entry -- Triton's HTTP generate endpoint, a gRPC
stream, the OpenAI front end -- are refused with an error naming the limit, before any
work that grows with the input: the stubs' resident memory does not jump, tritonserver keeps no
copy of a refused input once it is answered, and a healthy stream running at the same time
completes.  A flood of legal requests on a server with a
small KV pool and a short queue is answered with results or "busy" (Triton's UNAVAILABLE, a
message starting "busy: " and naming the limit; a 503 from the OpenAI front end), never with
a dead-peer error or a 600 s wait.

The server here is the demo repository with a small KV pool and short queues on the
models (``KV_POOL``, ``MODEL_QUEUE``), and a short router queue timeout (``QUEUE_TIMEOUT_S``).
"""

from __future__ import annotations

import http.client
import json
import re
import threading
import time
from pathlib import Path

import pytest
import requests

from tr_client import grpc_stream, wait_kv_released
from tr_server import (generate_error_status, python_stubs, rss_bytes, running_server, start_openai_frontend,
                       stop_openai_frontend)

pytestmark = pytest.mark.server

REPO_ROOT = Path(__file__).resolve().parent.parent
#: KV pool of each model (tokens): two flood requests fit at once
KV_POOL = 1024
#: the llm's malloc_mmap_threshold_bytes (the slm keeps glibc's own threshold)
MMAP_THRESHOLD = 1 << 20
#: requests that may wait for KV on a model; more are refused at once as busy
MODEL_QUEUE = 2
#: seconds a request may wait in a queue (router and models)
QUEUE_TIMEOUT_S = 3
#: what an oversized input is in these tests (the issue's were 100-200 MiB; the limits are
#: checked on the size, so a smaller one shows the same path without taking the host's memory)
BIG = 16 * 1024 * 1024
#: growth of a stub's resident memory allowed across a refused oversized request: the input
#: itself passes through the stub once (Triton's shared memory and one bytes copy); tokenising
#: or parsing it (what the limits prevent) took about 80 bytes per input byte
RSS_MARGIN = 8 * BIG
HEALTHY = {"max_tokens": 48, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tokenrouter.tools.repository import make_variant

    work = tmp_path_factory.mktemp("limits")
    model = {"kv_pool_tokens": KV_POOL, "max_queued_requests": MODEL_QUEUE, "queue_timeout_s": QUEUE_TIMEOUT_S}
    repo = make_variant(str(REPO_ROOT / "model_repository"), str(work / "repo"), model_params={
        "slm": model, "llm": {**model, "malloc_mmap_threshold_bytes": MMAP_THRESHOLD},
        "token_router": {"queue_timeout_s": QUEUE_TIMEOUT_S}})
    with running_server(repo, work) as s:
        yield s


def _stub_rss(server) -> dict:
    """{model instance: VmRSS in bytes} of the Python stubs of ``server``."""
    rss = {instance: rss_bytes(stub.pid) for instance, stub in python_stubs(server).items()}
    return {instance: r for instance, r in rss.items() if r is not None}


class _Healthy:
    """A streamed request running in a thread while the hostile ones arrive."""

    def __init__(self, server):
        self.out = None
        self.thread = threading.Thread(target=self._run, args=(server,), daemon=True)
        self.thread.start()

    def _run(self, server):
        self.out = grpc_stream(server, "Write a short story about a lighthouse keeper.", HEALTHY, timeout=300)

    def check(self):
        self.thread.join(300)
        assert self.out is not None and self.out["error"] is None, self.out
        assert self.out.get("finish_reason") == "length" and self.out.get("num_output_tokens") == 48, self.out


def _assert_rss_flat(before: dict, after: dict) -> None:
    assert set(before) == set(after), (before, after)  # no stub died (and none restarted)
    grown = {m: after[m] - before[m] for m in before}
    assert all(g < RSS_MARGIN for g in grown.values()), {m: f"{g / 2**20:.0f} MiB" for m, g in grown.items()}


def _busy_total(server) -> float:
    """``tokenrouter:request_busy_total`` summed over its series (reasons)."""
    text = requests.get(server.metrics_url, timeout=10).text
    return sum(float(v) for v in re.findall(r"^tokenrouter:request_busy_total\{[^}]*\}\s+(\S+)$", text, re.M))


def _generate(server, body: dict) -> requests.Response:
    return requests.post(f"http://{server.http_url}/v2/models/token_router/generate", json=body, timeout=120)


def test_http_generate_refuses_oversized_and_hostile_inputs(server):
    healthy = _Healthy(server)
    before = _stub_rss(server)
    cases = [
        ({"text_input": "a" * BIG}, r"text_input is 16777216 bytes; the limit is \d+ \(max_input_bytes\)"),
        ({"text_input": "hi", "sampling_parameters": json.dumps({"stop": ["x"] * 50000})},
         r"sampling_parameters is \d+ bytes; the limit is 65536 \(max_sampling_parameters_bytes\)"),
        ({"text_input": "hi", "sampling_parameters": json.dumps({"stop": ["x"] * 17})},
         r"stop has 17 strings; the limit is 16 \(max_stop_strings\)"),
        ({"text_input": "hi", "sampling_parameters": json.dumps({"stop": "y" * 2000})},
         r"stop has a string of 2000 bytes; the limit is 1024 \(max_stop_string_bytes\)"),
        ({"text_input": "hi", "sampling_parameters": "[" * 60000},
         r"nested 60000 levels deep; the limit is 8 \(max_json_depth\)"),
        ({"text_input": "hi", "sampling_parameters": json.dumps({"stop_token_ids": [1] * 2000})},
         r"stop_token_ids has 2000 ids; the limit is 1024 \(max_stop_token_ids\)"),
        # the request's "parameters" (read when sampling_parameters is absent): the same limits
        ({"text_input": "hi", "parameters": {"stop": json.dumps(["x"] * 17)}},
         r"parameters.stop has 17 strings; the limit is 16 \(max_stop_strings\)"),
    ]
    for body, pattern in cases:
        r = _generate(server, body)
        assert r.status_code == 400, (pattern, r.status_code, r.text[:300])
        assert re.search(pattern, r.json()["error"]), (pattern, r.text[:300])
    _assert_rss_flat(before, _stub_rss(server))
    healthy.check()


def test_grpc_stream_refuses_oversized_input(server):
    healthy = _Healthy(server)
    before = _stub_rss(server)
    out = grpc_stream(server, "b" * BIG, {"max_tokens": 4})
    assert out["error"] and re.search(r"text_input is 16777216 bytes; the limit is \d+ \(max_input_bytes\)",
                                      out["error"]), out["error"][:300]
    out = grpc_stream(server, "hi", {"stop": ["z" * 5000]})
    assert out["error"] and "(max_stop_string_bytes)" in out["error"], out["error"][:300]
    _assert_rss_flat(before, _stub_rss(server))
    healthy.check()


#: a prompt above glibc's largest dynamic mmap threshold (32 MiB on 64-bit): a buffer that holds it
#: whole is a mapping of its own, whichever the allocator's state (a smaller one may sit in a heap)
HUGE = 34 * 2**20
#: huge requests sent at once (each takes a gRPC request state of its own), in each of two rounds
HUGE_AT_ONCE = 4


def _prompt_sized_mappings(pid: int) -> list:
    """Resident bytes of each private anonymous mapping of process ``pid`` whose size is that of a
    buffer holding one ``HUGE`` input (``HUGE`` to ``HUGE`` + 1 MiB: not glibc's 64 MiB heaps)."""
    out, cur = [], None
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        if "-" in head[0] and ":" not in head[0]:  # a mapping's header: "start-end perms offset dev inode [path]"
            lo, hi = (int(x, 16) for x in head[0].split("-"))
            cur = (hi - lo) if len(head) == 5 and head[1].startswith("rw") else None
        elif head[0] == "Rss:" and cur is not None and HUGE <= cur <= HUGE + 2**20:
            out.append(int(head[1]) * 1024)
    return out


def test_tritonserver_keeps_no_copy_of_refused_inputs(server):
    """Huge refused prompts leave no copy in tritonserver once answered.

    With Triton's default pool of gRPC request states (``--grpc-infer-allocation-pool-size`` 8
    per handler), a released state kept the whole last request it carried (its
    ``ModelInferRequest``) until the pool handed it to another request: after prompts of 34 MiB,
    4 at a time, mappings of 34 MiB stayed resident in tritonserver. deploy/serve (and the
    tests' server) run with a pool of 0."""
    pid = server.process.pid
    for _ in range(2):
        outs: list = [None] * HUGE_AT_ONCE

        def send(i: int) -> None:
            outs[i] = grpc_stream(server, "c" * HUGE, {"max_tokens": 4})

        threads = [threading.Thread(target=send, args=(i,)) for i in range(HUGE_AT_ONCE)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        for out in outs:
            assert out is not None and out["error"] and f"text_input is {HUGE} bytes; the limit is" in out["error"], \
                (out or {}).get("error", "")[:300]
    # a state is freed when its stream's end reaches the server's completion queue: poll for it
    deadline = time.monotonic() + 30
    while (kept := [r for r in _prompt_sized_mappings(pid) if r >= HUGE // 2]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not kept, f"tritonserver still holds {len(kept)} buffers of a {HUGE / 2**20:.0f} MiB prompt " \
                     f"({sum(kept) / 2**20:.0f} MiB resident) after {2 * HUGE_AT_ONCE} of them were refused"


#: a prompt under the demo's max_input_bytes (8,192 x 82 = 671,744) with 300,001 tokens
OVER_CONTEXT = "a " * 300_000
#: router stub growth allowed over the over-context refusals: tokenised whole, such a prompt
#: took about 35 MiB each, which the allocator kept (about 380 MiB after 27 of them)
OVER_CONTEXT_RSS_MARGIN = 48 * 2**20


def test_prompt_over_the_context_is_refused_without_tokenising_it_whole(server):
    router = lambda: {m: r for m, r in _stub_rss(server).items() if m.startswith("token_router")}
    assert len(OVER_CONTEXT.encode()) < 671_744
    _generate(server, {"text_input": OVER_CONTEXT})  # the first refusal's one-off allocations
    before = router()
    assert before, _stub_rss(server)
    for _ in range(12):
        r = _generate(server, {"text_input": OVER_CONTEXT, "sampling_parameters": json.dumps({"max_tokens": 4})})
        assert r.status_code == 400, (r.status_code, r.text[:300])
        assert re.search(r"prompt has at least \d+ tokens \(counted until past the limit\); "
                         r"the context length is 8192", r.json()["error"]), r.text[:300]
    after = router()
    grown = {m: after[m] - before[m] for m in before}
    assert all(g < OVER_CONTEXT_RSS_MARGIN for g in grown.values()), {m: f"{g / 2**20:.0f} MiB" for m, g in grown.items()}
    r = _generate(server, {"text_input": "hi", "sampling_parameters": json.dumps({"max_tokens": 4})})
    assert r.status_code == 200, r.text[:300]


def test_request_that_can_never_fit_the_kv_pool_is_refused_at_once(server):
    """A prompt + max_tokens beyond the model's KV pool (but within the context) is a 400 naming the
    pool, not a wait: it could never be admitted."""
    r = _generate(server, {"text_input": "hello " * 200, "sampling_parameters": json.dumps({"max_tokens": 1000})})
    assert r.status_code == 400, r.text
    assert f"has {KV_POOL} in its pool" in r.json()["error"], r.text


def test_flood_is_answered_with_results_or_busy(server):
    """More concurrent requests than the KV pool holds and the queues take: each gets its result
    or "busy" naming the limit that ran out, none another error."""
    busy_before = _busy_total(server)
    prompt = "Tell me about the history of the printing press. " * 25  # about 250 tokens
    sampling = json.dumps({"max_tokens": 150, "temperature": 0, "ignore_eos": True})
    results = [None] * 10

    def one(i):
        results[i] = _generate(server, {"text_input": prompt, "sampling_parameters": sampling})

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(results))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    ok = [r for r in results if r.status_code == 200]
    busy = [r for r in results if r.status_code != 200]
    assert ok and busy, [r.status_code for r in results]
    expected = generate_error_status(server, 503)  # busy: UNAVAILABLE
    for r in busy:
        # the router's code is UNAVAILABLE; "busy: " tells overload apart from bad input either way
        assert r.status_code == expected, (r.status_code, r.text[:300])
        msg = r.json()["error"]
        assert msg.startswith("busy: ") and re.search(r"max_queued_requests|queue_timeout_s", msg), msg
    busy_after = _busy_total(server)
    assert busy_after - busy_before == len(busy), (busy_before, busy_after, len(busy))
    st = wait_kv_released(server)
    assert all(s["kv_tokens_in_use"] == 0 for s in st.values()), st


# ------------------------------------------------------------------ OpenAI front end
@pytest.fixture(scope="module")
def frontend(server, tmp_path_factory):
    proc, base = start_openai_frontend(server, tmp_path_factory.mktemp("openai_limits") / "frontend.log",
                                       "--max-body-bytes", str(1024 * 1024), "--max-messages", "64")
    try:
        yield base, proc
    finally:
        stop_openai_frontend(proc)


def _openai_error(status: int, body: bytes) -> dict:
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    return err


def test_openai_frontend_refuses_oversized_bodies_before_reading_them(server, frontend):
    base, proc = frontend
    host, port = base.removeprefix("http://").split(":")
    healthy = _Healthy(server)
    # the chat path loads the tokenizer on its first request (a one-time cost): before the baseline
    r = requests.post(base + "/v1/chat/completions", timeout=120, json={
        "model": "token_router", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    before, fe_before = _stub_rss(server), rss_bytes(proc.pid)

    # a Content-Length over the limit: answered before the body is sent (only 1 KiB of it is)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(BIG))
    conn.endheaders()
    conn.send(b'{"model": "token_router", "prompt": "' + b"a" * 1024)
    r = conn.getresponse()
    err = _openai_error(r.status, r.read())
    conn.close()
    assert r.status == 413 and err["code"] == "request_too_large", err
    assert f"request body is {BIG} bytes; the limit is 1048576 bytes (--max-body-bytes)" == err["message"], err

    # no Content-Length (chunked): counted as it arrives
    def chunks():
        yield b'{"model": "token_router", "prompt": "'
        for _ in range(BIG // 65536):
            yield b"a" * 65536
        yield b'"}'

    r = requests.post(base + "/v1/completions", data=chunks(), headers={"Content-Type": "application/json"},
                      timeout=120)
    assert r.status_code == 413 and _openai_error(r.status_code, r.content)["code"] == "request_too_large", r.text

    # too many messages, and limits of the router named through the front end
    r = requests.post(base + "/v1/chat/completions", timeout=60, json={
        "model": "token_router", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}] * 65})
    err = _openai_error(r.status_code, r.content)
    assert r.status_code == 400 and err["param"] == "messages" and "the limit is 64 (--max-messages)" in \
        err["message"], err
    r = requests.post(base + "/v1/completions", timeout=60, json={
        "model": "token_router", "prompt": "hi", "max_tokens": 4, "stop": ["s"] * 17})
    err = _openai_error(r.status_code, r.content)
    assert r.status_code == 400 and err["param"] == "stop" and "(max_stop_strings)" in err["message"], err
    r = requests.post(base + "/v1/completions", timeout=60, json={
        "model": "token_router", "prompt": "hi", "max_tokens": 4, "stop": ["x"] * 50000})  # the sampling fields the front end packs: over max_sampling_parameters_bytes
    err = _openai_error(r.status_code, r.content)
    assert r.status_code == 400 and err["param"] == "stop" and "(max_sampling_parameters_bytes)" in err["message"], err
    assert "sampling_parameters" not in err["message"].replace("max_sampling_parameters_bytes", ""), err
    r = requests.post(base + "/v1/completions", timeout=60, json={
        "model": "token_router", "prompt": "c" * (1000 * 1024), "max_tokens": 4})
    err = _openai_error(r.status_code, r.content)
    assert r.status_code == 400 and err["param"] == "prompt" and "(max_input_bytes)" in err["message"], err
    assert "text_input" not in err["message"], err  # named by its OpenAI field, not token_router's input
    r = requests.post(base + "/v1/chat/completions", timeout=60, json={
        "model": "token_router", "max_tokens": 4, "messages": [{"role": "user", "content": "c" * (1000 * 1024)}]})
    err = _openai_error(r.status_code, r.content)
    assert r.status_code == 400 and err["param"] == "messages" and "(max_input_bytes)" in err["message"], err
    assert "text_input" not in err["message"] and "messages" in err["message"], err

    _assert_rss_flat(before, _stub_rss(server))
    assert rss_bytes(proc.pid) - fe_before < RSS_MARGIN, (fe_before, rss_bytes(proc.pid))
    healthy.check()


def test_openai_frontend_answers_busy_as_503(server, frontend):
    """A flood through the front end: each request gets its completion or a 503 ``server_busy``."""
    base, _ = frontend
    prompt = "Explain how a steam engine works, step by step. " * 25
    results = [None] * 8

    def one(i):
        results[i] = requests.post(base + "/v1/completions", timeout=300, json={
            "model": "token_router", "prompt": prompt, "max_tokens": 150, "temperature": 0, "ignore_eos": True})

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(results))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    codes = [r.status_code for r in results]
    assert set(codes) <= {200, 503} and 503 in codes, [(r.status_code, r.text[:200]) for r in results]
    for r in results:
        if r.status_code == 503:
            err = _openai_error(503, r.content)
            assert err["code"] == "server_busy" and err["message"].startswith("busy: "), err
            assert r.headers.get("Retry-After") == "1"
    wait_kv_released(server)


def test_mmap_threshold_setting_is_in_force_and_reported(server):
    """``malloc_mmap_threshold_bytes`` set on one model only: its ``stats`` report it in force. The
    other model's process inherited tritonserver's fixed threshold (``MALLOC_MMAP_THRESHOLD_``, set
    as deploy/serve sets it) and replaced it at load with 32 MiB, where glibc's own ends up."""
    from tokenrouter.engine.host_memory import MAX_MMAP_THRESHOLD_BYTES
    from tokenrouter.tools import admin

    assert admin.model_stats(server.grpc_url, "llm")["malloc_mmap_threshold_bytes"] == MMAP_THRESHOLD
    assert admin.model_stats(server.grpc_url, "slm")["malloc_mmap_threshold_bytes"] == MAX_MMAP_THRESHOLD_BYTES
