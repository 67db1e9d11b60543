"""The OpenAI-compatible front end (tokenrouter.tools.openai_frontend) with real clients.

One front end process per module, in front of the session's tritonserver: the
official ``openai`` client (chat and completions, streamed and not), LiteLLM
through its OpenAI provider and through its Triton provider (straight to
Triton's generate endpoint), OpenAI-format errors and cancellation.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
import urllib.error
import urllib.request

import pytest

from tr_client import generate, model_stats, wait_kv_released
from tr_server import start_openai_frontend, stop_openai_frontend

openai = pytest.importorskip("openai")

MODEL = "token_router"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def frontend(triton_server, tmp_path_factory):
    """``python -m tokenrouter.tools.openai_frontend`` on a free port; yields its base URL (``http://…:port``)."""
    proc, base = start_openai_frontend(triton_server, tmp_path_factory.mktemp("openai_frontend") / "frontend.log")
    try:
        yield base
    finally:
        stop_openai_frontend(proc)


@pytest.fixture(scope="module")
def client(frontend):
    return openai.OpenAI(base_url=frontend + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def tokenizer():
    from tokenrouter.tools.openai_frontend import load_tokenizer
    from tokenrouter.triton.common import resolve_model_path

    return load_tokenizer(resolve_model_path("smollm2-135m-instruct"))


def _error(e: "openai.APIStatusError") -> dict:
    body = e.response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_chat_matches_router_and_reports_usage(client, triton_server):
    """Greedy chat answer = token_router's own answer with apply_chat_template (same prompt tokens)."""
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16, temperature=0)
    direct = generate(triton_server, QUESTION[0]["content"], {"max_tokens": 16, "temperature": 0}, chat=True)
    assert direct["_status"] == 200, direct
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == direct["text_output"]
    assert "Paris" in choice.message.content
    assert choice.finish_reason == direct["finish_reason"]
    assert r.usage.prompt_tokens == direct["num_input_tokens"]
    assert r.usage.completion_tokens == direct["num_output_tokens"] <= 16
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    summary = r.model_extra["routing_summary"]
    assert sum(summary["tokens_by_model"].values()) == r.usage.completion_tokens
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.model == MODEL


def test_chat_stream_equals_non_stream(client):
    kw = dict(model=MODEL, messages=QUESTION, max_tokens=12, temperature=0)
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == full.choices[0].finish_reason
    assert sum(finish[0].model_extra["routing_summary"]["tokens_by_model"].values()) == \
        full.usage.completion_tokens
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert len({c.id for c in chunks}) == 1


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_honoured(client, stream):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Write a long essay about the sea."}],
              max_tokens=5, temperature=0.7, seed=3, extra_body={"ignore_eos": True})
    if stream:
        chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        assert chunks[-1].usage.completion_tokens == 5
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    else:
        r = client.chat.completions.create(**kw)
        assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
        # max_completion_tokens is the newer name of the same setting
        kw.pop("max_tokens")
        r2 = client.chat.completions.create(**kw, max_completion_tokens=3)
        assert r2.usage.completion_tokens == 3


def test_multi_turn_chat_renders_every_message(client, tokenizer):
    """All turns reach the model: the prompt token count is that of the whole rendered conversation."""
    messages = [{"role": "system", "content": "You answer in one word."},
                {"role": "user", "content": "Name a colour."},
                {"role": "assistant", "content": "Blue."},
                {"role": "user", "content": [{"type": "text", "text": "Name "}, {"type": "text", "text": "another."}]}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    flat = messages[:3] + [{"role": "user", "content": "Name another."}]
    want = tokenizer.apply_chat_template(flat, add_generation_prompt=True, tokenize=False)
    last_only = tokenizer.apply_chat_template(flat[-1:], add_generation_prompt=True, tokenize=False)
    assert len(tokenizer.encode(want)) != len(tokenizer.encode(last_only))
    assert r.usage.prompt_tokens == len(tokenizer.encode(want))


@pytest.mark.parametrize("stream", [False, True])
def test_completions_stop_strings(client, stream):
    kw = dict(model=MODEL, prompt="1, 2, 3, 4, 5,", max_tokens=12, temperature=0)
    free = client.completions.create(**kw)
    assert " 7," in free.choices[0].text, free.choices[0].text  # the stop string would occur
    if stream:
        chunks = list(client.completions.create(**kw, stop=[" 7", "zzz"], stream=True))
        text = "".join(c.choices[0].text for c in chunks)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
    else:
        r = client.completions.create(**kw, stop=" 7")
        text, finish = r.choices[0].text, [r.choices[0].finish_reason]
        assert r.object == "text_completion" and r.model_extra["routing_summary"]["algorithm"]
    assert finish == ["stop"]
    assert " 7" not in text
    assert free.choices[0].text.startswith(text) and text.strip()


def _bytes_text(entries) -> str:
    return b"".join(bytes(e.bytes) for e in entries).decode("utf-8")


def test_chat_logprobs_parsed_by_the_openai_client(client, triton_server, tokenizer):
    """``logprobs`` + ``top_logprobs``: one entry per output token, each with ``top_logprobs``
    exactly N most likely, sorted; the router's own values; the same in a stream's chunks."""
    from tr_client import token_logprobs, top_n

    n = 3
    kw = dict(model=MODEL, messages=QUESTION, max_tokens=12, temperature=0)
    r = client.chat.completions.create(**kw, logprobs=True, top_logprobs=n)
    plain = client.chat.completions.create(**kw)
    assert r.choices[0].message.content == plain.choices[0].message.content  # asking changes nothing
    assert plain.choices[0].logprobs is None
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    text = r.choices[0].message.content
    joined = _bytes_text(content)  # the exact bytes join into the text (+ the end-of-turn token)
    assert joined == text or (joined.startswith(text) and joined[len(text):] == tokenizer.eos_token), (joined, text)
    direct = generate(triton_server, QUESTION[0]["content"], {"max_tokens": 12, "temperature": 0, "logprobs": n},
                      chat=True)
    ref = token_logprobs(direct["logprobs"])
    assert len(ref) == len(content)
    for c, e in zip(content, ref):
        assert c.logprob == pytest.approx(e["logprob"], abs=1e-5) and c.token == e["decoded"]
        assert len(c.top_logprobs) == n
        assert [t.logprob for t in c.top_logprobs] == sorted((t.logprob for t in c.top_logprobs), reverse=True)
        assert c.top_logprobs[0].token == c.token  # greedy: the top-1 token is the one written
        assert [t.logprob for t in c.top_logprobs] == pytest.approx([v for _, v in top_n(e, n)], abs=1e-5)
        assert [t.token for t in c.top_logprobs] == [tokenizer.decode([i]) for i, _ in top_n(e, n)]
    # top_logprobs 0: the token's own logprob, no alternatives
    r0 = client.chat.completions.create(**kw, logprobs=True, top_logprobs=0)
    assert [c.top_logprobs for c in r0.choices[0].logprobs.content] == [[]] * len(content)
    assert [c.logprob for c in r0.choices[0].logprobs.content] == pytest.approx([c.logprob for c in content], abs=1e-5)
    # streamed: the chunks' entries, in order, are the whole response's
    chunks = list(client.chat.completions.create(**kw, logprobs=True, top_logprobs=n, stream=True))
    streamed = [e for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert sum(1 for ch in chunks if ch.choices and ch.choices[0].logprobs) > 1
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-5)
    assert [[t.token for t in e.top_logprobs] for e in streamed] == [[t.token for t in e.top_logprobs]
                                                                      for e in content]


@pytest.mark.parametrize("stream", [False, True])
def test_completions_logprobs_parsed_by_the_openai_client(client, stream):
    """Legacy ``logprobs`` N: ``tokens``, ``token_logprobs``, ``top_logprobs`` (the token and the top
    N: up to N + 1 entries) and ``text_offset`` (each token's place in the text)."""
    kw = dict(model=MODEL, prompt="Count: one, two, three,", max_tokens=10, temperature=0,
              extra_body={"ignore_eos": True})
    if stream:
        chunks = list(client.completions.create(**kw, logprobs=2, stream=True))
        text = "".join(c.choices[0].text for c in chunks)
        lps = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
        assert len(lps) > 1
        tokens = [t for lp in lps for t in lp.tokens]
        token_lps = [v for lp in lps for v in lp.token_logprobs]
        tops = [d for lp in lps for d in lp.top_logprobs]
        offsets = [o for lp in lps for o in lp.text_offset]
    else:
        r = client.completions.create(**kw, logprobs=2)
        text, lp = r.choices[0].text, r.choices[0].logprobs
        tokens, token_lps, tops, offsets = lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset
        assert r.usage.completion_tokens == len(tokens) == 10
    assert len(tokens) == len(token_lps) == len(tops) == len(offsets) == 10
    assert "".join(tokens) == text  # plain ASCII: each token's text is its share of the answer
    assert offsets == [len("".join(tokens[:i])) for i in range(10)]
    for t, v, d in zip(tokens, token_lps, tops):
        assert 1 <= len(d) <= 3 and d[t] == v and v <= 0  # greedy: the token is the most likely
        assert max(d.values()) == v


def test_logprobs_out_of_range_are_refused_naming_the_field(client):
    for kw, param in ((dict(logprobs=True, top_logprobs=21), "top_logprobs"),
                      (dict(logprobs=True, top_logprobs=-1), "top_logprobs"),
                      (dict(top_logprobs=2), "top_logprobs")):  # top_logprobs needs logprobs: true
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, **kw)
        assert _error(e.value)["param"] == param, (kw, _error(e.value))
    for n in (6, -1):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, logprobs=n)
        err = _error(e.value)
        assert err["param"] == "logprobs" and "between 0 and 5" in err["message"], err


def test_errors_are_openai_format(client, frontend):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4", messages=QUESTION, max_tokens=4)
    err = _error(e.value)
    assert err["param"] == "model" and err["code"] == "model_not_found" and "gpt-4" in err["message"]

    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, n=2)
    assert _error(e.value)["param"] == "n"

    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt="Hello", max_tokens=0, stream=stream)
        err = _error(e.value)
        assert err["param"] == "max_tokens" and err["type"] == "invalid_request_error" and "at least 1" in err["message"]

    # checked by the router itself (context length), answered as a 400 before any token
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=10**6, stream=True)
    assert "context length" in _error(e.value)["message"]
    # a chat prompt over the context length names the chat request's own field
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi " * 9000}],
                                       max_tokens=4)
    err = _error(e.value)
    assert "context length" in err["message"] and err["param"] == "messages", err

    # checked by the router (a token id beyond the vocabulary): a 400 naming the field, not a 500
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, extra_body={"stop_token_ids": [10**7]})
    assert _error(e.value)["param"] == "stop_token_ids", _error(e.value)
    # a TokenRouter extension checked by the router: named as the client sent it
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, extra_body={"routing_threshold": 5})
    err = _error(e.value)
    assert err["param"] == "routing_threshold" and err["message"].startswith("routing_threshold"), err
    assert "sampling_parameters" not in err["message"], err

    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "narrator", "content": "x"}], max_tokens=4)
    assert _error(e.value)["param"] == "messages[0].role"

    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, extra_body={"best_of_all": 1})
    assert _error(e.value)["param"] == "best_of_all"

    # malformed JSON and wrong types: still OpenAI-format 400s
    req = urllib.request.Request(frontend + "/v1/completions", data=b'{"model": ', method="POST",
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as he:
        urllib.request.urlopen(req, timeout=30)
    assert he.value.code == 400 and "error" in json.loads(he.value.read())
    req = urllib.request.Request(frontend + "/v1/completions", data=b'{"model": "\xff\xfe"}', method="POST",
                                 headers={"Content-Type": "application/json"})  # not UTF-8
    with pytest.raises(urllib.error.HTTPError) as he:
        urllib.request.urlopen(req, timeout=30)
    err = json.loads(he.value.read())["error"]
    assert he.value.code == 400 and err["code"] == "invalid_json" and "UTF-8" in err["message"], err
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, extra_body={"temperature": "hot"})
    assert _error(e.value)["param"] == "temperature"
    # JSON true/false is no number (pydantic alone reads max_tokens: true as 1, routing_threshold: false as 0)
    for field, value in (("max_tokens", True), ("routing_threshold", False), ("top_logprobs", True)):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                           **({"max_tokens": 4} if field != "max_tokens" else {}),
                                           extra_body={field: value})
        err = _error(e.value)
        assert err["param"] == field and err["message"] == f"{field} must be a number, got {json.dumps(value)}", err


def test_client_cancel_frees_kv(client, frontend, triton_server):
    """Closing a stream, or dropping the connection of a non-streamed request, cancels the router request."""
    kw = dict(model=MODEL, prompt="Tell me a long story.", max_tokens=400, extra_body={"ignore_eos": True})
    with client.completions.create(**kw, stream=True) as s:
        got = 0
        for c in s:
            got += bool(c.choices[0].text)
            if got >= 3:
                break
        assert sum(model_stats(triton_server, m)["active"] for m in ("slm", "llm")) >= 1
    st = wait_kv_released(triton_server)
    assert all(v["kv_tokens_in_use"] == 0 and v["active"] == 0 for v in st.values()), st

    host, port = frontend.rsplit("//", 1)[1].split(":")
    body = json.dumps({"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 400,
                       "ignore_eos": True}).encode()
    sock = socket.create_connection((host, int(port)))
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.time() + 120
        while sum(model_stats(triton_server, m)["active"] for m in ("slm", "llm")) == 0:
            assert time.time() < deadline, "the request never became active"
            time.sleep(0.2)
    finally:
        sock.close()
    st = wait_kv_released(triton_server)
    assert all(v["kv_tokens_in_use"] == 0 and v["active"] == 0 for v in st.values()), st


def test_shutdown_ends_running_requests_after_the_grace(triton_server, tmp_path):
    """SIGINT: requests still running after ``--graceful-shutdown-s`` end with "server is shutting
    down" (a stream: an error event, then ``[DONE]``; a plain request: 503), their router requests
    are cancelled (KV back to 0), and the front end exits 0."""
    import http.client
    import threading

    log = tmp_path / "frontend.log"
    proc, base = start_openai_frontend(triton_server, log, "--graceful-shutdown-s", "1")
    host, port = base.rsplit("//", 1)[1].split(":")
    try:
        events, plain = [], {}

        def stream():
            c = http.client.HTTPConnection(host, int(port), timeout=300)
            c.request("POST", "/v1/chat/completions", json.dumps({
                "model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}],
                "max_tokens": 400, "ignore_eos": True, "stream": True}), {"Content-Type": "application/json"})
            for line in c.getresponse():
                if line.startswith(b"data: "):
                    events.append(line[6:].strip().decode())

        def request():
            c = http.client.HTTPConnection(host, int(port), timeout=300)
            c.request("POST", "/v1/completions", json.dumps({
                "model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 400, "ignore_eos": True}),
                {"Content-Type": "application/json"})
            r = c.getresponse()
            plain.update(status=r.status, body=json.loads(r.read()))

        threads = [threading.Thread(target=f, daemon=True) for f in (stream, request)]
        for t in threads:
            t.start()
        deadline = time.time() + 120
        while len(events) < 4 or sum(model_stats(triton_server, m)["active"] for m in ("slm", "llm")) < 2:
            assert time.time() < deadline, ("the requests never ran", events)
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        for t in threads:
            t.join(120)
        assert proc.wait(60) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert events[-1] == "[DONE]", events[-3:]
    err = json.loads(events[-2])["error"]
    assert err["message"] == "server is shutting down" and err["code"] == "server_shutting_down", err
    assert not any('"finish_reason": "length"' in e for e in events), "the stream ran to its end"
    assert plain["status"] == 503 and plain["body"]["error"]["message"] == "server is shutting down", plain
    st = wait_kv_released(triton_server)
    assert all(v["kv_tokens_in_use"] == 0 and v["active"] == 0 for v in st.values()), st
    assert "Traceback" not in log.read_text(), log.read_text()


# ----------------------------------------------------------------------------- LiteLLM
@pytest.fixture(scope="module")
def litellm():
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network: use the bundled map
    mod = pytest.importorskip("litellm", reason="litellm is not installed (it is pinned in deploy/requirements.txt)")
    yield mod
    # LiteLLM keeps its httpx clients (and their keep-alive connections to Triton's HTTP port)
    # for the process; an idle one holds the shared server's shutdown for its exit timeout
    for client in [*mod.in_memory_llm_clients_cache.cache_dict.values(), mod.module_level_client]:
        close = getattr(client, "close", None)
        if callable(close):
            try:
                close()
            except Exception:  # noqa: BLE001 - an async client or one already closed
                pass


@pytest.mark.parametrize("stream", [False, True])
def test_litellm_openai_provider(litellm, frontend, stream):
    kw = dict(model=f"openai/{MODEL}", api_base=frontend + "/v1", api_key="unused", messages=QUESTION,
              max_tokens=6, temperature=0, stop=["France"])
    if stream:
        parts = list(litellm.completion(**kw, stream=True))
        text = "".join(p.choices[0].delta.content or "" for p in parts)
        finish = [p.choices[0].finish_reason for p in parts if p.choices[0].finish_reason]
    else:
        r = litellm.completion(**kw)
        text, finish = r.choices[0].message.content, [r.choices[0].finish_reason]
        assert 0 < r.usage.completion_tokens <= 6
        assert r.routing_summary["tokens_by_model"]
    # greedy answer: "The capital of France is Paris."; cut before the stop string
    assert text.startswith("The capital of") and "France" not in text
    assert finish == ["stop"]


@pytest.mark.parametrize("stream", [False, True])
def test_litellm_triton_provider(litellm, triton_server, tokenizer, stream):
    """LiteLLM's Triton provider posts to /generate with its settings in the top-level "parameters".

    Needs token_router to read the request's ``parameters`` when ``sampling_parameters``
    is absent (vllm_backend's behaviour): without it ``max_tokens`` and ``ignore_eos``
    (LiteLLM passes extra keyword arguments on in "parameters") are ignored.
    """
    base = f"http://{triton_server.http_url}/v2/models/{MODEL}/generate"
    prompt = "Write a long essay about the sea."
    r = litellm.completion(model=f"triton/{MODEL}", api_base=base, messages=[{"role": "user", "content": prompt}],
                           max_tokens=4, ignore_eos=True, stream=stream)
    if stream:
        text = "".join(p.choices[0].delta.content or "" for p in r)
    else:
        text = r.choices[0].message.content
    out = text[len(prompt):] if text.startswith(prompt) else text  # vllm_backend echoes the prompt
    assert out.strip()
    # 4 generated tokens re-encode to about 4 (a BPE merge across the boundary may add one)
    assert len(tokenizer.encode(out)) <= 5, out
