"""Per-algorithm serving numbers on the demo pair: LLM token share, handoffs per request, decode tok/s.

    source deploy/env.sh   # or the test environment
    python perf/bench_algorithms.py [--concurrency 4] [--requests 8] [--max-tokens 64] [--out FILE.json]

Starts one tritonserver on a repository written by deploy/algorithm_repository.py
(slm with capture_hidden, llm, mid; one router per algorithm, each algorithm
at its paper setting -- R-Stitch at the repository's demo τ = 0.2, see
model_repository/token_router/config.pbtxt) and, per algorithm, runs
``--requests`` requests from ``--concurrency`` closed-loop clients (greedy,
ignore_eos, ``--max-tokens`` each, prompts from data/router_prompts.jsonl).

Reported per algorithm:
* ``llm_share``: output tokens not written by model 0 (the SLM) / all output tokens
  (ME: the shares of every model are listed too);
* ``handoffs_per_request``: mean handoffs of a request (both directions);
* ``decode_tok_s``: output tokens of all requests / wall time of the phase
  (first request sent -> last response received), tokens per second.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import requests

from tritonserver import TritonServer, exit_on_termination

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("algorithm_repository", ROOT / "deploy" / "algorithm_repository.py")
algorithm_repository = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(algorithm_repository)

ALGOS = {"none (SLM only)": "token_router_none", "citer": "token_router_citer", "r2r": "token_router_r2r",
         "rstitch": "token_router", "colm": "token_router_colm", "me": "token_router_me"}


def one(url: str, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"text_input": prompt, "exclude_input_in_output": True, "apply_chat_template": True,
            "sampling_parameters": json.dumps({"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})}
    r = requests.post(f"http://{url}/v2/models/{model}/generate", json=body, timeout=600)
    r.raise_for_status()
    out = r.json()
    out["routing_summary"] = json.loads(out["routing_summary"])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--algorithms", default=",".join(ALGOS), help="comma-separated subset of " + ",".join(ALGOS))
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    a = ap.parse_args(argv)
    prompts = [json.loads(line)["prompt"] for line in open(ROOT / "data" / "router_prompts.jsonl") if line.strip()]
    tmp = tempfile.mkdtemp(prefix="bench-algorithms-")
    repo = algorithm_repository.write(os.path.join(tmp, "repo"), kv_pool_tokens=8192)
    results = {}
    exit_on_termination()  # killed or timed out: leave the with-block, so that the server stops too
    with TritonServer(repo, log_path=os.path.join(tmp, "tritonserver.log")) as srv:
        one(srv.http_url, "token_router_none", prompts[0], 4)  # warm-up
        for name in a.algorithms.split(","):
            model = ALGOS[name]
            jobs = [prompts[i % len(prompts)] for i in range(a.requests)]
            t0 = time.perf_counter()
            with cf.ThreadPoolExecutor(a.concurrency) as pool:
                outs = list(pool.map(lambda p: one(srv.http_url, model, p, a.max_tokens), jobs))
            wall = time.perf_counter() - t0
            toks = sum(o["num_output_tokens"] for o in outs)
            by = {}
            for o in outs:
                for m, v in o["routing_summary"]["tokens_by_model"].items():
                    by[m] = by.get(m, 0) + v
            res = {"llm_share": round(1 - by.get("slm", 0) / toks, 4),
                   "shares": {m: round(v / toks, 4) for m, v in by.items()},
                   "handoffs_per_request": round(sum(o["routing_summary"]["handoffs"] for o in outs) / len(outs), 2),
                   "decode_tok_s": round(toks / wall, 2), "output_tokens": toks, "wall_s": round(wall, 2),
                   "params": outs[0]["routing_summary"]["params"]}
            results[name] = res
            print(f"{name:16s} llm_share={res['llm_share']:.3f} handoffs/req={res['handoffs_per_request']:.1f} "
                  f"decode={res['decode_tok_s']:.1f} tok/s  shares={res['shares']}", flush=True)
    meta = {"concurrency": a.concurrency, "requests": a.requests, "max_tokens": a.max_tokens,
            "command": "python perf/bench_algorithms.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
