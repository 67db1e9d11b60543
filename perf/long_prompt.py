#!/usr/bin/env python
"""What one long prompt costs the other requests: a short request sent while it prefills.

Against a running server (``deploy/serve``): for each ``--chunks`` value the models'
``prefill_chunk_tokens`` is set through their ``configure`` op, one long prompt
(``--long-tokens`` tokens, about; ``--long-requests`` of them at once, each a different text) is
sent, and ``--delay`` seconds later a short one ("Hi", the same ``--max-tokens``).  Prints each
request's end-to-end latency in seconds.
The models' setting is put back to the first value of ``--restore`` at the end.

    source deploy/env.sh && deploy/serve --background
    python perf/long_prompt.py                        # chunks 0 (off) and 512, a ~7,500-token prompt
    python perf/long_prompt.py --chunks 0,256,512,2048 --long-tokens 3000
    python perf/long_prompt.py --long-requests 2 --long-tokens 3000 --chunks 0,512,0,512   # two at once
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import requests

from tokenrouter.tools import admin

#: about 14 tokens of the SmolLM2 tokenizer
SENTENCE = "Tell me about the history of the printing press, year by year. "


def _generate(http: str, text: str, max_tokens: int, out: dict, tag: str) -> None:
    t0 = time.perf_counter()
    r = requests.post(f"http://{http}/v2/models/token_router/generate", timeout=1800, json={
        "text_input": text, "sampling_parameters": json.dumps({"max_tokens": max_tokens, "temperature": 0})})
    body = r.json()
    out[tag] = {"e2e_s": time.perf_counter() - t0, "status": r.status_code,
                "input_tokens": body.get("num_input_tokens"), "error": body.get("error")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--http", default="localhost:8000", help="Triton HTTP address")
    ap.add_argument("--grpc", default="localhost:8001", help="Triton gRPC address (for the configure op)")
    ap.add_argument("--models", default="slm,llm")
    ap.add_argument("--chunks", default="0,512", help="prefill_chunk_tokens values to compare (0: off)")
    ap.add_argument("--restore", type=int, default=512, help="prefill_chunk_tokens to leave set at the end")
    ap.add_argument("--long-tokens", type=int, default=7500)
    ap.add_argument("--long-requests", type=int, default=1, help="long prompts sent at once")
    ap.add_argument("--delay", type=float, default=3.0, help="seconds between the long and the short request")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--no-warmup", action="store_true",
                    help="skip the untimed long request sent first (a fresh server's first long prefill is slower)")
    a = ap.parse_args()
    models = [m for m in a.models.split(",") if m]
    if a.long_requests < 1:
        sys.exit("--long-requests must be >= 1")
    # a different first sentence for each long prompt: no request is another's copy
    long_texts = [f"Prompt {i}. " + SENTENCE * max(1, a.long_tokens // 14) for i in range(a.long_requests)]
    print("| prefill_chunk_tokens | long prompt tokens | long e2e s | short e2e s (sent after "
          f"{a.delay:g} s) |\n|---|---|---|---|")
    try:
        if not a.no_warmup:
            warm: dict = {}
            _generate(a.http, long_texts[0], a.max_tokens, warm, "warmup")
        for chunk in (int(c) for c in a.chunks.split(",")):
            for m in models:
                admin.configure(a.grpc, m, prefill_chunk_tokens=chunk)
            out: dict = {}
            longs = [threading.Thread(target=_generate, args=(a.http, text, a.max_tokens, out, f"long{i}"))
                     for i, text in enumerate(long_texts)]
            for t in longs:
                t.start()
            time.sleep(a.delay)
            _generate(a.http, "Hi", a.max_tokens, out, "short")
            for t in longs:
                t.join()
            for r in out.values():
                if r["status"] != 200:
                    sys.exit(f"a request failed: {r}")
            tags = [f"long{i}" for i in range(a.long_requests)]
            n_in = ", ".join(str(out[t]["input_tokens"]) for t in tags)
            e2e = ", ".join(f"{out[t]['e2e_s']:.1f}" for t in tags)
            print(f"| {chunk} | {n_in} | {e2e} | {out['short']['e2e_s']:.1f} |", flush=True)
    finally:
        for m in models:
            admin.configure(a.grpc, m, prefill_chunk_tokens=a.restore)


if __name__ == "__main__":
    main()
