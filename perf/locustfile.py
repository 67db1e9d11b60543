"""Locust load test: streaming users of ``token_router`` through ``/generate_stream`` (SSE).

Each user sends a prompt, reads the server-sent events and reports three
custom Locust entries per request: ``TTFT`` (ms to the first text chunk),
``ITL`` (ms between chunks, one entry per gap) and ``e2e`` (whole request; its
response length is the number of output tokens, so Locust's table shows
tokens/request).  Decode throughput in tokens/s is printed at the end.

Headless run (see docs/performance.md, "Running the benchmarks")::

    locust -f perf/locustfile.py --headless -u 8 -r 8 -t 60s --host http://localhost:8000

Environment: TOKENROUTER_MAX_TOKENS (default 64), TOKENROUTER_PROMPTS (file, one
prompt per line; default perf/prompts.txt), TOKENROUTER_MODEL (the router model,
default token_router), TOKENROUTER_SAMPLING (JSON object merged into the sampling
parameters, e.g. '{"routing_threshold": 0.1}'), TOKENROUTER_LOCUST_RESULT (file: the
totals are also written there as JSON: tokens, requests, failures, start/end in
``time.perf_counter()`` seconds, tokens_per_s), TOKENROUTER_WINDOW_S (seconds: also
count the tokens streamed inside the window of this length that opens with the first
request, by their arrival times, so that the drain after the load stops is left out:
``window_tokens``, ``window_s``, ``window_tokens_per_s`` in the result file; the tokens
of requests still streaming when Locust stops count too, one per characters-per-token of
the finished requests),
TOKENROUTER_WINDOWS (split that window into this many equal parts, default 1:
``windows_tokens_per_s`` lists each part's tokens/s, for a spread).

A chunk carries a text delta, not a token count: a request's tokens are spread over
its chunks in proportion to their characters (``loadgen.token_arrival_times`` without
a tokenizer).
"""

from __future__ import annotations

import json
import os
import random
import threading
import time

from locust import HttpUser, events, task

from loadgen import token_arrival_times

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPTS_FILE = os.environ.get("TOKENROUTER_PROMPTS", os.path.join(HERE, "prompts.txt"))
MAX_TOKENS = int(os.environ.get("TOKENROUTER_MAX_TOKENS", "64"))
MODEL = os.environ.get("TOKENROUTER_MODEL", "token_router")
SAMPLING = json.loads(os.environ.get("TOKENROUTER_SAMPLING", "") or "{}")
RESULT_FILE = os.environ.get("TOKENROUTER_LOCUST_RESULT", "")
WINDOW_S = float(os.environ.get("TOKENROUTER_WINDOW_S", "0") or 0)
WINDOWS = max(1, int(os.environ.get("TOKENROUTER_WINDOWS", "1") or 1))
with open(PROMPTS_FILE, encoding="utf-8") as f:
    PROMPTS = [line.strip() for line in f if line.strip()]

_lock = threading.Lock()
_totals = {"tokens": 0, "requests": 0, "failures": 0, "start": None, "end": None}
#: arrival time (perf_counter s) of every output token of every finished request
_token_times: list = []
#: the chunks ``(time, text)`` of requests still streaming (id -> list), and the characters
#: per token of the finished ones (to count the tokens of those cut off when Locust stops)
_in_flight: dict = {}
_chars = {"chars": 0, "tokens": 0}
_first = {"t": None}  # start of the first request, finished or not


class StreamingUser(HttpUser):
    """A client streaming answers from token_router over SSE."""

    @task
    def generate_stream(self) -> None:
        body = {"text_input": random.choice(PROMPTS), "stream": True, "apply_chat_template": True,
                "sampling_parameters": json.dumps({"max_tokens": MAX_TOKENS, "temperature": 0,
                                                   "ignore_eos": True, **SAMPLING})}
        fire = self.environment.events.request.fire
        t0 = time.perf_counter()
        last, ttft, n_tokens, err = None, None, 0, None
        chunks = []
        with _lock:
            _in_flight[id(chunks)] = chunks
            _first["t"] = t0 if _first["t"] is None else min(_first["t"], t0)
        with self.client.post(f"/v2/models/{MODEL}/generate_stream", json=body, stream=True,
                              catch_response=True, name="generate_stream") as resp:
            for line in resp.iter_lines(decode_unicode=True):
                if not line or not line.startswith("data:"):
                    continue
                ev = json.loads(line[5:])
                if "error" in ev:
                    err = ev["error"]
                    break
                now = time.perf_counter()
                if ev.get("text_output"):
                    chunks.append((now, ev["text_output"]))
                    if ttft is None:
                        ttft = now - t0
                        fire(request_type="TTFT", name=MODEL, response_time=ttft * 1000,
                             response_length=0, exception=None, context={})
                    elif last is not None:
                        fire(request_type="ITL", name=MODEL, response_time=(now - last) * 1000,
                             response_length=0, exception=None, context={})
                    last = now
                if "num_output_tokens" in ev:
                    n_tokens = int(ev["num_output_tokens"])
            if err:
                resp.failure(err)
            else:
                resp.success()
        t1 = time.perf_counter()
        fire(request_type="e2e", name=MODEL, response_time=(t1 - t0) * 1000,
             response_length=n_tokens, exception=err, context={})
        with _lock:
            _totals["requests"] += 1
            _totals["failures"] += 1 if err else 0
            _totals["tokens"] += n_tokens
            _totals["start"] = t0 if _totals["start"] is None else min(_totals["start"], t0)
            _totals["end"] = t1 if _totals["end"] is None else max(_totals["end"], t1)
            _in_flight.pop(id(chunks), None)
            if n_tokens and not err:
                _token_times.extend(token_arrival_times(chunks, [0] * n_tokens, t1, None))
                _chars["chars"] += sum(len(c) for _t, c in chunks)
                _chars["tokens"] += n_tokens


def _cut_off_token_times() -> list:
    """Estimated token arrival times of the requests still streaming when the run stopped:
    each chunk counts its characters / the finished requests' characters per token
    (4 when none finished), as whole tokens carried over from chunk to chunk."""
    per_token = _chars["chars"] / _chars["tokens"] if _chars["tokens"] else 4.0
    out = []
    for chunks in list(_in_flight.values()):
        owed = 0.0
        for t, text in chunks:
            owed += len(text) / per_token
            while owed >= 1.0:
                out.append(t)
                owed -= 1.0
    return out


@events.quitting.add_listener
def _report(environment, **_kw) -> None:
    if _totals["start"] is not None and _totals["end"] > _totals["start"]:
        tps = _totals["tokens"] / (_totals["end"] - _totals["start"])
        print(f"decode throughput: {tps:.1f} tokens/s ({_totals['tokens']} output tokens)")
    else:
        print("decode throughput: no request finished during the run (raise -t or lower "
              "TOKENROUTER_MAX_TOKENS); tokens of requests cut off are counted in the window figures only")
    if RESULT_FILE:
        span = (_totals["end"] - _totals["start"]) if _totals["start"] is not None else 0.0
        out = {**_totals, "seconds": span, "tokens_per_s": _totals["tokens"] / span if span > 0 else 0.0}
        times = _token_times + _cut_off_token_times()
        start = _first["t"]
        if WINDOW_S > 0 and start is not None:
            t0, t1 = start, start + WINDOW_S
            n = sum(1 for t in times if t0 <= t < t1)
            part = WINDOW_S / WINDOWS
            each = [0] * WINDOWS
            for t in times:
                if t0 <= t < t1:
                    each[min(WINDOWS - 1, int((t - t0) // part))] += 1
            out.update(window_s=WINDOW_S, window_tokens=n, window_tokens_per_s=n / WINDOW_S,
                       windows_tokens_per_s=[k / part for k in each])
        with open(RESULT_FILE, "w", encoding="utf-8") as f:
            json.dump(out, f)
