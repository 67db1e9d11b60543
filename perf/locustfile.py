"""Locust load test: streaming users of ``token_router`` through ``/generate_stream`` (SSE).

Each user sends a prompt, reads the server-sent events and reports three
custom Locust entries per request: ``TTFT`` (ms to the first text chunk),
``ITL`` (ms between chunks, one entry per gap) and ``e2e`` (whole request; its
response length is the number of output tokens, so Locust's table shows
tokens/request).  Decode throughput in tokens/s is printed at the end.

Headless run (see README)::

    locust -f perf/locustfile.py --headless -u 8 -r 8 -t 60s --host http://localhost:8000

Environment: TOKENROUTER_MAX_TOKENS (default 64), TOKENROUTER_PROMPTS (file, one
prompt per line; default perf/prompts.txt), TOKENROUTER_MODEL (the router model,
default token_router), TOKENROUTER_SAMPLING (JSON object merged into the sampling
parameters, e.g. '{"routing_threshold": 0.1}'), TOKENROUTER_LOCUST_RESULT (file: the
totals are also written there as JSON: tokens, requests, failures, start/end in
``time.perf_counter()`` seconds, tokens_per_s).
"""

from __future__ import annotations

import json
import os
import random
import threading
import time

from locust import HttpUser, events, task

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPTS_FILE = os.environ.get("TOKENROUTER_PROMPTS", os.path.join(HERE, "prompts.txt"))
MAX_TOKENS = int(os.environ.get("TOKENROUTER_MAX_TOKENS", "64"))
MODEL = os.environ.get("TOKENROUTER_MODEL", "token_router")
SAMPLING = json.loads(os.environ.get("TOKENROUTER_SAMPLING", "") or "{}")
RESULT_FILE = os.environ.get("TOKENROUTER_LOCUST_RESULT", "")
with open(PROMPTS_FILE, encoding="utf-8") as f:
    PROMPTS = [line.strip() for line in f if line.strip()]

_lock = threading.Lock()
_totals = {"tokens": 0, "requests": 0, "failures": 0, "start": None, "end": None}


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


@events.quitting.add_listener
def _report(environment, **_kw) -> None:
    if _totals["start"] is not None and _totals["end"] > _totals["start"]:
        tps = _totals["tokens"] / (_totals["end"] - _totals["start"])
        print(f"decode throughput: {tps:.1f} tokens/s ({_totals['tokens']} output tokens)")
    if RESULT_FILE:
        span = (_totals["end"] - _totals["start"]) if _totals["start"] is not None else 0.0
        with open(RESULT_FILE, "w", encoding="utf-8") as f:
            json.dump({**_totals, "seconds": span,
                       "tokens_per_s": _totals["tokens"] / span if span > 0 else 0.0}, f)
