"""Where the time goes: one decode step and one handoff, TokenRouter vs std-serving.

Like the paper's profile of its Std. Serving baseline (§Design, "Handoff–resume"),
measured through Triton on one server, modes switched at run time:

* decode step (per pure-decode step, from the models' counters): model forward (incl. batch
  preparation), route (sampling, entropy, route/send decisions), response
  sending to the router; and the client-seen inter-token latency, whose excess
  over the step is the router/Triton/gRPC response path.
* handoff (per handoff, from the router): the gap from a handoff event to the
  peer's first response, split into the peer's forward time for the resume
  step (mean forward of steps that resume requests, no prompt prefill) and the rest: the inter-model
  round trip (ZeroMQ) and queueing.

    source deploy/env.sh && python perf/breakdown.py [--pair demo] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

from bench_matrix import MODELS, RESET, _prompts  # noqa: E402
from counters import counter_deltas, model_counters  # noqa: E402
from loadgen import percentile  # noqa: E402
from tokenrouter.tools import admin  # noqa: E402
from tokenrouter.tools.cli import stream_generate  # noqa: E402
from tokenrouter.tools.repository import make_variant  # noqa: E402
from tritonserver import TritonServer, exit_on_termination  # noqa: E402

KEYS = ("steps", "decode_steps", "decode_step_forward_s", "resume_steps", "resume_step_forward_s", "forward_s", "route_s", "send_s",
        "step_time_s")


def measure(url: str, prompts, n_requests: int, max_tokens: int, router: str = "token_router"):
    before = model_counters(url, KEYS, MODELS)
    itl, gaps = [], []
    for i in range(n_requests):
        stamps = []
        out = stream_generate(url, prompts[i % len(prompts)], {"max_tokens": max_tokens, "temperature": 0,
                                                               "ignore_eos": True},
                              on_text=lambda s: stamps.append(time.perf_counter()), model=router)
        itl += [b - a for a, b in zip(stamps, stamps[1:])]
        gaps += out["routing_summary"].get("handoff_gap_s", [])
    d = counter_deltas(before, model_counters(url, KEYS, MODELS))
    steps = sum(d[m]["steps"] for m in MODELS)
    res_steps = sum(d[m]["resume_steps"] for m in MODELS)
    res_fwd = sum(d[m]["resume_step_forward_s"] for m in MODELS)
    dec_steps = max(sum(d[m]["decode_steps"] for m in MODELS), 1)
    row = {
        "decode_forward_ms": 1e3 * sum(d[m]["decode_step_forward_s"] for m in MODELS) / dec_steps,
        "route_ms": 1e3 * sum(d[m]["route_s"] for m in MODELS) / max(steps, 1),
        "send_ms": 1e3 * sum(d[m]["send_s"] for m in MODELS) / max(steps, 1),
        "itl_p50_ms": 1e3 * percentile(itl, 50),
        "handoffs": len(gaps),
        "handoff_gap_ms": 1e3 * statistics.fmean(gaps) if gaps else float("nan"),
        "resume_forward_ms": 1e3 * res_fwd / max(res_steps, 1),
    }
    row["step_ms"] = row["decode_forward_ms"] + row["route_ms"] + row["send_ms"]
    row["response_path_ms"] = row["itl_p50_ms"] - row["step_ms"]
    row["handoff_overhead_ms"] = row["handoff_gap_ms"] - row["resume_forward_ms"]
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", default="demo")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--out", default=os.path.join(HERE, "results", time.strftime("breakdown-%Y%m%d-%H%M%S")))
    a = ap.parse_args(argv)
    exit_on_termination()
    os.makedirs(a.out, exist_ok=True)
    repo = make_variant(os.path.join(ROOT, "model_repository"), os.path.join(a.out, "model_repository"), a.pair)
    prompts = _prompts()
    rows = {}
    with TritonServer(repo, ready_timeout=900, log_path=os.path.join(a.out, "tritonserver.log")) as srv:
        url = srv.grpc_url
        stream_generate(url, prompts[0], {"max_tokens": 4})  # warm-up
        for mode, cfg, router in (("tokenrouter (pending resume)", {}, "token_router"),
                                  ("std-serving (re-prefill)", {"readmit_on_resume": True}, "token_router")):
            for m in MODELS:
                admin.configure(url, m, **{**RESET, **cfg})
            rows[mode] = measure(url, prompts, a.requests, a.max_tokens, router)
        for m in MODELS:
            admin.configure(url, m, **RESET)
    labels = [("decode step: model forward", "decode_forward_ms"), ("decode step: route (sample, entropy, rule)", "route_ms"),
              ("decode step: send response to the router", "send_ms"), ("decode step total", "step_ms"),
              ("client ITL p50", "itl_p50_ms"), ("ITL − step: router/gRPC response path", "response_path_ms"),
              ("handoff: event → peer's first response", "handoff_gap_ms"),
              ("handoff: peer's resume forward (extend step)", "resume_forward_ms"),
              ("handoff: inter-model round trip + queueing", "handoff_overhead_ms")]
    modes = list(rows)
    lines = [f"Time breakdown ({a.pair} pair, N = 1, {a.requests} requests × {a.max_tokens} tokens), ms", "",
             "| component | " + " | ".join(modes) + " |", "|---|" + "---|" * len(modes)]
    for label, k in labels:
        lines.append(f"| {label} | " + " | ".join(f"{rows[m][k]:.2f}" for m in modes) + " |")
    lines.append("| handoffs measured | " + " | ".join(str(rows[m]["handoffs"]) for m in modes) + " |")
    md = "\n".join(lines)
    with open(os.path.join(a.out, "breakdown.json"), "w") as f:
        json.dump(rows, f, indent=1)
    with open(os.path.join(a.out, "breakdown.md"), "w") as f:
        f.write(md + "\n")
    print(md + f"\n\nwrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
