"""perf/llamacpp.py's pure parts: the llama-server command line (alone / with a draft, slots,
context), the parsing of its streamed answers into records, and the summary statistics; and the
closed-loop client against a fake server on 127.0.0.1 (no llama.cpp build, no network)."""

from __future__ import annotations

import json
import math
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import llamacpp  # perf/ (pytest.ini)
from llamacpp import (closed_loop, completion_body, context_size, finish_reason, parse_settings, post_completion,
                      record_from_stream, run_summary, server_command, sse_events, summarize)


def _flag(cmd, name):
    """The value after ``name`` in ``cmd`` (None when absent)."""
    return cmd[cmd.index(name) + 1] if name in cmd else None


# --------------------------------------------------------------------------- build pins
def test_build_pins_and_flags():
    assert len(llamacpp.SDIST_SHA256) == 64 and int(llamacpp.SDIST_SHA256, 16) >= 0
    assert llamacpp.VERSION.count(".") == 2
    flags = set(llamacpp.CMAKE_FLAGS)
    for f in ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_SERVER=ON", "-DGGML_CUDA=OFF",
              "-DLLAMA_USE_PREBUILT_UI=OFF", f"-DLLAMA_BUILD_COMMIT={llamacpp.LLAMA_CPP_COMMIT}"):
        assert f in flags
    assert llamacpp.BUILD_JOBS == 2
    # no AMX on x86-64 (its kernels die with SIGILL on the Xeon VM); nothing x86-only elsewhere
    x86 = llamacpp.cmake_flags("x86_64")
    assert x86[: len(llamacpp.CMAKE_FLAGS)] == list(llamacpp.CMAKE_FLAGS)
    assert f"-DCMAKE_CXX_FLAGS={llamacpp.NO_AMX}" in x86 and "-mno-amx-int8" in llamacpp.NO_AMX
    assert llamacpp.cmake_flags("aarch64") == list(llamacpp.CMAKE_FLAGS)


def test_home_under_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("TOKENROUTER_CACHE", str(tmp_path))
    assert llamacpp.home() == tmp_path / f"llamacpp-{llamacpp.VERSION}"
    monkeypatch.delenv("TOKENROUTER_WEIGHTS", raising=False)
    assert llamacpp.weights_dir() == tmp_path / "weights"


# --------------------------------------------------------------------------- command line
def test_command_llm_alone():
    cmd = server_command("/x/llama-server", "/w/llm.gguf", 8, 4096, 12345, 2)
    assert cmd[0] == "/x/llama-server" and _flag(cmd, "-m") == "/w/llm.gguf"
    assert _flag(cmd, "-np") == "8" and _flag(cmd, "-c") == "4096"
    assert _flag(cmd, "--host") == "127.0.0.1" and _flag(cmd, "--port") == "12345"
    assert _flag(cmd, "--threads") == "2" and _flag(cmd, "--threads-batch") == "2"
    assert _flag(cmd, "--cache-ram") == "0"  # no prompt cache across requests
    assert "-md" not in cmd and not any(a.startswith("--spec-") for a in cmd)
    assert "--draft-max" not in cmd and "--draft-min" not in cmd  # removed in this llama.cpp


def test_command_with_draft():
    cmd = server_command("llama-server", "llm.gguf", 1, 1024, 8080, 2, draft_gguf="slm.gguf", draft_max=4, draft_min=1)
    assert _flag(cmd, "-md") == "slm.gguf" and _flag(cmd, "--spec-type") == "draft-simple"  # else it never drafts
    assert _flag(cmd, "--spec-draft-n-max") == "4" and _flag(cmd, "--spec-draft-n-min") == "1"
    assert _flag(cmd, "--spec-draft-threads") == "2" and _flag(cmd, "-np") == "1"
    # the server's default K: no n-max flag
    cmd = server_command("llama-server", "llm.gguf", 1, 1024, 8080, 2, draft_gguf="slm.gguf")
    assert _flag(cmd, "-md") == "slm.gguf" and "--spec-draft-n-max" not in cmd and "--spec-draft-n-min" not in cmd
    with pytest.raises(ValueError):
        server_command("llama-server", "llm.gguf", 1, 1024, 8080, 2, draft_max=4)


def test_context_holds_every_slot():
    # per slot: prompt 300 + 384 output + K 8 + margin 16 = 708 -> 768 (multiple of 64); N slots share -c
    assert context_size(1, 300, 384, 8) == 768
    assert context_size(8, 300, 384, 8) == 8 * 768
    assert context_size(8, 300, 384, None) == context_size(8, 300, 384, 16)  # the server's default K: 16 reserved
    for n in (1, 3, 8):
        c = context_size(n, 123, 64, 4)
        assert c % n == 0 and c // n >= 123 + 64 + 4


def test_settings():
    s = parse_settings("llm,llm+draft", [4, 8])
    assert [x["name"] for x in s] == ["llm", "llm+draft:4", "llm+draft:8"]
    assert s[0]["draft"] is False and s[1]["draft"] and s[2]["draft_max"] == 8
    assert [x["draft_max"] for x in parse_settings("llm+draft:default,llm+draft:6", [4])] == [None, 6]
    assert [x["name"] for x in parse_settings("llm+draft", [None])] == ["llm+draft:default"]
    with pytest.raises(ValueError):
        parse_settings("slm", [4])
    with pytest.raises(ValueError):
        parse_settings("llm+draft:4,llm+draft", [4])


def test_request_is_greedy_and_cold():
    b = completion_body("<|im_start|>user\nhi", 64, ["```"])
    assert b["prompt"].startswith("<|im_start|>") and b["n_predict"] == 64 and b["stop"] == ["```"]
    assert b["temperature"] == 0 and b["top_k"] == 1 and b["cache_prompt"] is False and b["stream"] is True


# --------------------------------------------------------------------------- responses
FINAL = {"content": "", "stop": True, "tokens_predicted": 3, "tokens_evaluated": 42, "stop_type": "word",
         "stopping_word": "```", "truncated": False,
         "timings": {"cache_n": 0, "prompt_n": 42, "prompt_ms": 250.0, "predicted_n": 3, "predicted_ms": 300.0,
                     "predicted_per_second": 10.0, "draft_n": 8, "draft_n_accepted": 6}}


def test_sse_lines_to_events():
    lines = [b'data: {"content": "a", "stop": false}\n', b"\n", b": keep-alive\n",
             ("data: " + json.dumps(FINAL) + "\n").encode(), b"data: [DONE]\n"]
    evs = list(sse_events(lines))
    assert [e["stop"] for e in evs] == [False, True]
    with pytest.raises(llamacpp.LlamaCppError, match="boom"):
        list(sse_events([b'data: {"error": {"message": "boom"}}']))


def test_record_from_stream():
    chunks = [(10.0, {"content": "", "stop": False, "tokens": []}),     # an empty event: not the first token
              (10.5, {"content": "def f", "stop": False, "tokens": [1]}),
              (10.7, {"content": "():", "stop": False, "tokens": [2]}),
              (11.0, {**FINAL})]
    r = record_from_stream(chunks, 9.9, 11.2)
    assert r["text"] == "def f():" and r["error"] == ""
    assert r["ttft_s"] == pytest.approx(0.6) and r["e2e_s"] == pytest.approx(1.3)
    assert r["output_tokens"] == 3 and r["prompt_tokens"] == 42
    assert r["stop_type"] == "word" and r["finish_reason"] == "stop" and r["stopping_word"] == "```"
    assert r["server_prompt_ms"] == 250.0 and r["draft_n"] == 8 and r["draft_n_accepted"] == 6
    # no final event: an error, with what streamed
    cut = record_from_stream(chunks[:2], 9.9, 10.6)
    assert cut["error"] and cut["text"] == "def f" and cut["output_tokens"] == 0
    # the LLM alone: no draft fields
    plain = record_from_stream([(1.0, {**FINAL, "timings": {"predicted_n": 3, "prompt_ms": 5.0}})], 0.5, 1.0)
    assert plain["draft_n"] is None and plain["output_tokens"] == 3


def test_finish_reasons():
    assert finish_reason("limit") == "length"
    assert finish_reason("eos") == "stop" and finish_reason("word") == "stop"
    assert finish_reason("none") is None and finish_reason(None) is None


# --------------------------------------------------------------------------- statistics
def _rec(tokens, ttft, e2e, draft=None, passed=None, error="", finish="stop"):
    r = {"output_tokens": tokens, "ttft_s": ttft, "e2e_s": e2e, "server_prompt_ms": ttft * 500.0,
         "finish_reason": finish, "error": error}
    if draft:
        r["draft_n"], r["draft_n_accepted"] = draft
    if passed is not None:
        r["passed"] = passed
    return r


def test_run_summary():
    recs = [_rec(100, 1.0, 10.0, (40, 30), True), _rec(50, 2.0, 6.0, (20, 10), False, finish="length"),
            _rec(150, 3.0, 14.0, (60, 50), True), _rec(0, float("nan"), 0.1, error="HTTP 500")]
    s = run_summary(recs, wall_s=20.0)
    assert s["answers"] == 3 and s["errors"] == 1 and s["output_tokens"] == 300
    assert s["output_tok_s"] == pytest.approx(15.0) and s["answers_per_s"] == pytest.approx(0.15)
    assert s["ttft_p50_s"] == pytest.approx(2.0) and s["ttft_p90_s"] == pytest.approx(2.8)
    assert s["e2e_p50_s"] == pytest.approx(10.0) and s["e2e_p99_s"] == pytest.approx(13.92)
    assert s["server_ttft_p50_s"] == pytest.approx(1.0)
    assert s["acceptance"] == pytest.approx(90 / 120) and s["cut_at_max_tokens"] == 1
    assert s["passed"] == 2 and s["accuracy"] == pytest.approx(2 / 4)  # over every problem, failed ones too
    plain = run_summary([_rec(10, 0.5, 2.0)], 2.0)
    assert plain["acceptance"] is None and "accuracy" not in plain


def test_summarize_over_repeats():
    def run(setting, n, tok_s, acc=None):
        s = {"output_tok_s": tok_s, "answers_per_s": tok_s / 100, "ttft_p50_s": 1.0, "e2e_p50_s": 5.0,
             "acceptance": acc}
        return {"setting": setting, "n": n, "summary": s}

    out = summarize([run("llm", 1, 10.0), run("llm+draft:4", 1, 14.0, 0.7), run("llm", 1, 12.0),
                     run("llm+draft:4", 1, 16.0, 0.8), run("llm", 8, 30.0)])
    assert out["llm"]["1"]["repeats"] == 2 and out["llm"]["8"]["repeats"] == 1
    t = out["llm"]["1"]["output_tok_s"]
    assert t["mean"] == pytest.approx(11.0) and t["min"] == 10.0 and t["max"] == 12.0 and t["n"] == 2
    assert out["llm+draft:4"]["1"]["acceptance"]["mean"] == pytest.approx(0.75)
    assert "acceptance" not in out["llm"]["1"]  # None in every run: left out
    assert math.isnan(out["llm"]["8"]["output_tok_s"]["sd"])


# --------------------------------------------------------------------------- client against a fake server
class _Fake(BaseHTTPRequestHandler):
    """/completion: streams the prompt back in 2 pieces, then a final event (draft timings)."""

    bodies: list = []

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Fake.bodies.append(body)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        p = body["prompt"]
        for piece in (p[:2], p[2:]):
            self.wfile.write(f"data: {json.dumps({'content': piece, 'stop': False, 'tokens': [1]})}\n\n".encode())
            self.wfile.flush()
        final = {**FINAL, "tokens_predicted": 2, "stop_type": "limit" if p == "cut" else "eos"}
        self.wfile.write(f"data: {json.dumps(final)}\n\n".encode())

    def log_message(self, *a):
        pass


@pytest.fixture()
def fake_server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Fake)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    _Fake.bodies = []
    yield srv.server_address[1]
    srv.shutdown()
    srv.server_close()


def test_closed_loop_against_a_fake_server(fake_server):
    one = post_completion(fake_server, completion_body("hello", 8, ["```"]), 10.0)
    assert one["text"] == "hello" and one["error"] == "" and one["output_tokens"] == 2
    assert one["ttft_s"] <= one["e2e_s"] and one["draft_n_accepted"] == 6
    items = [(f"t/{i}", "cut" if i == 3 else f"prompt {i}") for i in range(6)]
    recs, wall = closed_loop(fake_server, items, 3, 8, ["```"], 10.0)
    assert [r["task_id"] for r in recs] == [t for t, _ in items]          # in item order
    assert [r["text"] for r in recs] == [p for _, p in items]
    assert recs[3]["finish_reason"] == "length" and recs[0]["finish_reason"] == "stop"
    assert wall > 0 and all(0 <= r["t_start_s"] <= wall for r in recs)
    assert all(b["cache_prompt"] is False and b["n_predict"] == 8 for b in _Fake.bodies)
    assert run_summary(recs, wall)["output_tokens"] == 12


def test_a_refused_connection_is_an_error_record():
    port = llamacpp.free_port()  # nothing listens there
    r = post_completion(port, completion_body("x", 4, []), 2.0)
    assert r["error"] and r["output_tokens"] == 0


# --------------------------------------------------------------------------- the server process
FAKE_SERVER = r"""
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"status": "ok"} if self.path == "/health" else {"n_ctx": 1024}).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a): pass
HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_server_started_waited_for_and_stopped(tmp_path):
    port = llamacpp.free_port()
    with llamacpp.LlamaServer([sys.executable, "-c", FAKE_SERVER, str(port)], port, tmp_path / "s.log", 30) as srv:
        assert srv.props() == {"n_ctx": 1024}
        proc = srv.proc
    assert proc.poll() is not None  # stopped on leaving


def test_a_server_that_dies_says_how(tmp_path):
    cmd = ["sh", "-c", "echo loading; kill -ILL $$"]
    with pytest.raises(llamacpp.LlamaCppError, match="SIGILL") as e:
        with llamacpp.LlamaServer(cmd, llamacpp.free_port(), tmp_path / "s.log", 30):
            pass
    assert "loading" in str(e.value)  # the log's tail


def test_busy_cores_of_this_host():
    b = llamacpp.busy_cores(0.05)
    assert math.isnan(b) or 0.0 <= b <= (os.cpu_count() or 1) + 1e-6
