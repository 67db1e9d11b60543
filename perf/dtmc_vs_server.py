"""The DTMC against the real server: predicted B* vs the measured-best B_llm.

Paper §Design, "DTMC for B*": validated on R2R with the SLM's threshold fixed
at 1, sweeping the LLM's B at N = 2, 3, 4.  Here, on the size-realistic pair
(real SmolLM2 SLM, larger random-weight LLM) through Triton:

1. run the load eagerly (B = 1) and turn the models' routing events into a
   profile (measured L_i(b), P, C) with ``python -m scheduler_model profile``;
2. ``python -m scheduler_model solve`` gives B* and the predicted T(B) table;
3. sweep B_llm = 1 … N (B_slm = 1) on the running server (``configure`` op)
   and measure decode throughput for each;
4. print measured vs predicted, and whether the argmax agrees.

    source deploy/env.sh && python perf/dtmc_vs_server.py              # ~10 min here
    python perf/dtmc_vs_server.py --pair demo --concurrency 2 --max-tokens 16   # quick
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (os.path.join(ROOT, "python_backend_src"), os.path.join(ROOT, "tests"), ROOT, HERE):
    if p not in sys.path:
        sys.path.insert(0, p)

from bench_matrix import MODELS, RESET, _events_size, _prompts, _read_slice, b_star_from_events  # noqa: E402
from loadgen import run_load, summarize  # noqa: E402
from tokenrouter import admin  # noqa: E402
from tokenrouter.repository import make_variant  # noqa: E402
from tritonserver import TritonServer, exit_on_termination  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", default="size-realistic")
    ap.add_argument("--concurrency", default="2,3,4")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--max-wait-s", type=float, default=1.0,
                    help="delayed-batching wait bound during the sweep (large: a pure threshold, as the DTMC)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", time.strftime("dtmc-%Y%m%d-%H%M%S")))
    a = ap.parse_args(argv)
    exit_on_termination()
    Ns = [int(x) for x in a.concurrency.split(",")]
    os.makedirs(a.out, exist_ok=True)
    events = {m: os.path.join(a.out, f"events-{m}.jsonl") for m in MODELS}
    repo = make_variant(os.path.join(ROOT, "model_repository"), os.path.join(a.out, "model_repository"), a.pair,
                        model_params={m: {"event_log": events[m]} for m in MODELS})
    prompts = _prompts()
    report = {"pair": a.pair, "max_tokens": a.max_tokens, "requests_per_client": a.requests_per_client, "rows": []}
    with TritonServer(repo, ready_timeout=900, log_path=os.path.join(a.out, "tritonserver.log")) as srv:
        url = srv.grpc_url
        run_load(url, prompts, 2, 8)  # warm-up
        for N in Ns:
            for m in MODELS:
                admin.configure(url, m, **RESET)
            start = {m: _events_size(events[m]) for m in MODELS}
            run_load(url, prompts, N, a.max_tokens, a.requests_per_client)
            lines = [x for m in MODELS for x in _read_slice(events[m], start[m])]
            sol = b_star_from_events(lines, N, a.out)
            if sol["profile"] is None:
                print(f"N={N}: no profile ({sol['note']}); skipped", flush=True)
                continue
            predicted = {int(r["B"]["llm"]): r["throughput_tokens_per_s"] for r in sol["table"]
                         if int(r["B"]["slm"]) == 1}
            measured = {}
            for B in range(1, N + 1):
                admin.configure(url, "llm", delayed_batch_size=B,
                                delayed_batch_max_wait_us=int(a.max_wait_s * 1e6) if B > 1 else 0)
                s = summarize(run_load(url, prompts, N, a.max_tokens, a.requests_per_client))
                measured[B] = s["throughput_tok_s"]
                print(f"N={N} B_llm={B}: measured {measured[B]:.2f} tok/s, DTMC {predicted.get(B, float('nan')):.2f}"
                      f" tok/s", flush=True)
            best = max(measured, key=measured.get)
            row = {"N": N, "B_star_dtmc": int(sol["B_star"]["llm"]), "B_best_measured": best,
                   "agree": best == int(sol["B_star"]["llm"]), "measured_tok_s": measured,
                   "dtmc_tok_s": predicted, "profile": sol["profile"], "method": sol.get("method")}
            report["rows"].append(row)
            with open(os.path.join(a.out, "dtmc_vs_server.json"), "w") as f:
                json.dump(report, f, indent=1)
        for m in MODELS:
            admin.configure(url, m, **RESET)
    lines = [f"DTMC vs server ({a.pair}, {a.max_tokens} output tokens, B_slm = 1)", "",
             "| N | B_llm | measured tok/s | DTMC tok/s |", "|---|---|---|---|"]
    for r in report["rows"]:
        for B, v in r["measured_tok_s"].items():
            lines.append(f"| {r['N']} | {B} | {v:.2f} | {r['dtmc_tok_s'].get(B, float('nan')):.2f} |")
    lines += ["", "| N | DTMC B* | measured best | agree |", "|---|---|---|---|"]
    lines += [f"| {r['N']} | {r['B_star_dtmc']} | {r['B_best_measured']} | {'yes' if r['agree'] else 'no'} |"
              for r in report["rows"]]
    md = "\n".join(lines)
    with open(os.path.join(a.out, "dtmc_vs_server.md"), "w") as f:
        f.write(md + "\n")
    print("\n" + md + f"\n\nwrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
