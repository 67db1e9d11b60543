"""Online B* against fixed thresholds under a bursty load (Locust, N stepping between 2 and 32).

One tritonserver serves a variant of model_repository with two routers over the same
models: ``token_router`` (thresholds fixed by this script through the models'
``configure`` op) and ``token_router_online`` (``online_adaptation: true``: the router
re-solves B* from the live routing events and applies it, :mod:`tokenrouter.routing.online_bstar`).
Each variant runs the same Locust load shape (``perf/locust_bursty.py``: the number of
streaming users steps between ``--levels`` every ``--step-s`` seconds for ``--duration``
seconds; users above a lower level finish their request first):

* ``online``: both models start at B = 1 and ``token_router_online`` adapts them
  (the SLM's threshold held at 1, as the paper does, unless ``--online-free-slm``);
* ``fixed-B<b>`` for each b of ``--fixed-b``: SLM at 1, LLM at b with the delayed-batching
  wait bound ``--wait-us`` (0 for b = 1), through ``token_router``.

Reported per variant: output tokens/s inside the load shape's ``--duration``, counted
by the tokens' arrival times (the drain after the shape ends is left out), as the mean
over the shape's cycles (one cycle = every level once) ± the 95 % half-width; requests,
failures; for ``online`` also the B* solves and changes and the timeline of the
thresholds (``tokenrouter_batch_threshold`` read every ``--sample-s``).  The summary
compares online B* with the best fixed B over the whole run; with ``--rounds R`` the
sequence of variants runs R times, interleaved, and the ratio is paired per round (the
geometric mean of the R ratios, 95 % interval; a machine that drifts during the run then
weighs on every variant alike).  Results: ``--out``/results.json.

    source deploy/env.sh
    python perf/bursty_online.py                                   # demo pair, 4 × 240 s (~20 min on 2 cores)
    python perf/bursty_online.py --pair size-realistic --duration 480 --step-s 60
    python perf/bursty_online.py --levels 2,4 --step-s 10 --duration 20 --max-tokens 8 --fixed-b 1   # smoke

Only one router adapts at a time: while ``token_router`` serves a fixed variant,
``token_router_online`` is idle and leaves the thresholds alone.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

from bench_matrix import ratio_interval  # noqa: E402
from loadgen import run_load, spread  # noqa: E402
from tokenrouter.tools import admin  # noqa: E402
from tokenrouter.tools.repository import PAIRS, make_variant  # noqa: E402
from tritonserver import TritonServer, exit_on_termination  # noqa: E402

MODELS = ["slm", "llm"]
ONLINE_ROUTER = "token_router_online"


def metric(metrics_url: str, name: str) -> Dict[tuple, float]:
    """``{sorted label tuple: value}`` of one metric on Triton's metrics endpoint."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    out = {}
    for m in re.finditer(r'^' + re.escape(name) + r'\{([^}]*)\}\s+([0-9.eE+-]+)$', text, re.M):
        out[tuple(sorted(re.findall(r'(\w+)="([^"]*)"', m.group(1))))] = float(m.group(2))
    return out


def router_metric(metrics_url: str, name: str, router: str = ONLINE_ROUTER) -> float:
    """Value of a metric whose only label is ``router`` (0 when absent)."""
    return metric(metrics_url, name).get((("router", router),), 0.0)


class ThresholdTimeline:
    """Reads ``tokenrouter_batch_threshold`` and the router's running requests every ``every_s`` seconds."""

    def __init__(self, metrics_url: str, every_s: float):
        self.url, self.every_s = metrics_url, every_s
        self.samples: List[Dict[str, Any]] = []
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                B = {dict(k)["model"]: v for k, v in metric(self.url, "tokenrouter_batch_threshold").items()
                     if dict(k).get("router") == ONLINE_ROUTER}
                running = {dict(k).get("model"): v for k, v in
                           metric(self.url, "tokenrouter:num_requests_running").items()}
                self.samples.append({"t_s": round(time.monotonic() - self._t0, 2), "B": B,
                                     "running": running.get(ONLINE_ROUTER)})
            except Exception:  # noqa: BLE001 - a missed sample
                pass

    def stop(self) -> List[Dict[str, Any]]:
        self._stop.set()
        self._thread.join(timeout=10)
        return self.samples


def run_locust(http_url: str, router: str, args, workdir: str, name: str) -> Dict[str, Any]:
    """One Locust run of the bursty shape against ``router``; returns locustfile's totals.

    Raises:
        RuntimeError: Locust failed or wrote no totals.
    """
    result = os.path.join(workdir, f"locust-{name}.json")
    env = {**os.environ, "TOKENROUTER_MODEL": router, "TOKENROUTER_MAX_TOKENS": str(args.max_tokens),
           "TOKENROUTER_LEVELS": ",".join(str(n) for n in args.levels), "TOKENROUTER_STEP_S": str(args.step_s),
           "TOKENROUTER_DURATION_S": str(args.duration), "TOKENROUTER_LOCUST_RESULT": result,
           "TOKENROUTER_SAMPLING": json.dumps(args.sampling), "TOKENROUTER_WINDOW_S": str(args.duration),
           "TOKENROUTER_WINDOWS": str(cycles(args))}
    cmd = [sys.executable, "-m", "locust", "-f", os.path.join(HERE, "locust_bursty.py"), "--headless",
           "--host", f"http://{http_url}", "--stop-timeout", "600", "--only-summary",
           "--csv", os.path.join(workdir, f"locust-{name}")]
    with open(os.path.join(workdir, f"locust-{name}.log"), "w") as log:
        rc = subprocess.run(cmd, env=env, cwd=HERE, stdout=log, stderr=subprocess.STDOUT).returncode
    if not os.path.exists(result):
        raise RuntimeError(f"locust ({name}) exited with {rc} and wrote no totals; see {log.name}")
    with open(result) as f:
        return json.load(f)


def merge_rounds(rounds: List[Dict[str, Any]]) -> Dict[str, Any]:
    """One variant's row over its ``--rounds`` runs: mean and spread over all their cycles,
    ``rounds_tokens_per_s`` (each round's mean, for paired ratios), summed counts.

    Raises:
        ValueError: ``rounds`` is empty.
    """
    if not rounds:
        raise ValueError("no rounds")
    cycles_all = [x for r in rounds for x in r["cycles_tokens_per_s"]]
    sp = spread(cycles_all)
    out = {k: v for k, v in rounds[-1].items() if k not in ("round", "timeline")}
    out.update(tokens_per_s=sp["mean"], ci95=sp["ci95"], min=sp["min"], max=sp["max"],
               cycles_tokens_per_s=cycles_all, rounds_tokens_per_s=[r["tokens_per_s"] for r in rounds],
               **{k: sum(r[k] for r in rounds) for k in ("tokens", "requests", "failures", "seconds")})
    if "solves" in rounds[0]:
        out.update(solves=sum(r["solves"] for r in rounds), changes=sum(r["changes"] for r in rounds),
                   timelines=[r.get("timeline", []) for r in rounds])
    return out


def _as_matrix_row(row: Dict[str, Any]) -> Dict[str, Any]:
    """A variant's row in the shape :func:`bench_matrix.ratio_interval` reads: mean and spread over the
    cycles, and each round's mean (paired ratios when both rows ran >= 2 rounds)."""
    return {"throughput_tok_s": row["tokens_per_s"], "throughput": spread(row["cycles_tokens_per_s"]),
            "throughput_repeats": row["rounds_tokens_per_s"]}


def cycles(args) -> int:
    """Whole cycles of the load shape in ``--duration`` (one cycle = each level for ``--step-s``; at least 1)."""
    return max(1, int(args.duration // (args.step_s * len(args.levels))))


def configure_fixed(url: str, b_llm: int, wait_us: int) -> None:
    """SLM at B = 1, LLM at ``b_llm`` (wait bound ``wait_us``, 0 for b = 1)."""
    admin.configure(url, "slm", delayed_batch_size=1, delayed_batch_max_wait_us=0)
    admin.configure(url, "llm", delayed_batch_size=int(b_llm), delayed_batch_max_wait_us=wait_us if b_llm > 1 else 0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", default="demo", choices=sorted(PAIRS))
    ap.add_argument("--levels", default="2,32", help="user counts the load steps between (default 2,32)")
    ap.add_argument("--step-s", type=float, default=30.0, help="seconds per level (default 30)")
    ap.add_argument("--duration", type=float, default=240.0, help="seconds of load per variant (default 240)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the variants' sequence this many times, interleaved (online, fixed-B1, …, "
                         "online, …); the online / best-fixed ratio is then paired per round (default 1)")
    ap.add_argument("--fixed-b", default="1,2,4", help="the LLM thresholds of the fixed variants (default 1,2,4)")
    ap.add_argument("--wait-us", type=int, default=20000, help="fixed variants' wait bound for B > 1 (µs)")
    ap.add_argument("--online-interval-s", type=float, default=2.0)
    ap.add_argument("--online-window-s", type=float, default=10.0,
                    help="the adapter's window (default 10 s: shorter than a level, so N follows the steps)")
    ap.add_argument("--online-free-slm", action="store_true", help="search the SLM's threshold too")
    ap.add_argument("--online-prior-profile", default="",
                    help="PROFILE.json the adapter uses until its window has data (online_prior_profile)")
    ap.add_argument("--routing-threshold", type=float, default=None,
                    help="routing_threshold of every request (default: the router's configured one)")
    ap.add_argument("--sample-s", type=float, default=2.0, help="seconds between two threshold samples (online)")
    ap.add_argument("--variants", default="", help="comma-separated subset of online,fixed-B<b> (default all)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "bursty_online"))
    args = ap.parse_args(argv)
    args.levels = [int(x) for x in args.levels.split(",") if x.strip()]
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    fixed = [int(x) for x in args.fixed_b.split(",") if x.strip()]
    args.sampling = {} if args.routing_threshold is None else {"routing_threshold": args.routing_threshold}
    variants = ["online"] + [f"fixed-B{b}" for b in fixed]
    if args.variants:
        want = [v.strip() for v in args.variants.split(",") if v.strip()]
        unknown = set(want) - set(variants)
        if unknown:
            ap.error(f"unknown variants {sorted(unknown)}; known: {variants}")
        variants = want
    exit_on_termination()
    args.out = os.path.abspath(args.out)  # Locust runs in perf/: its CSV paths must not be relative
    os.makedirs(args.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="bursty-", dir=args.out)
    online_params = {"online_adaptation": "true", "online_interval_s": str(args.online_interval_s),
                     "online_window_s": str(args.online_window_s),
                     "online_fixed_thresholds": "" if args.online_free_slm else '{"slm": 1}',
                     "online_prior_profile": os.path.abspath(args.online_prior_profile) if args.online_prior_profile
                     else ""}
    repo = make_variant(os.path.join(ROOT, "model_repository"), os.path.join(work, "model_repository"), args.pair,
                        routers={ONLINE_ROUTER: online_params})
    results: Dict[str, Any] = {"args": {k: v for k, v in vars(args).items()}, "rounds": [], "rows": []}
    print(f"== bursty load: N steps {args.levels} every {args.step_s:g} s for {args.duration:g} s per variant; "
          f"variants {variants}", flush=True)
    with TritonServer(repo, ready_timeout=900, log_path=os.path.join(work, "tritonserver.log")) as srv:
        url = srv.grpc_url
        run_load(url, ["Hello, who are you?"], 2, 8)  # warm-up
        for rnd in range(args.rounds):
            for v in variants:
                timeline = None
                if v == "online":
                    configure_fixed(url, 1, 0)
                    router = ONLINE_ROUTER
                    solves0 = router_metric(srv.metrics_url, "tokenrouter_batch_threshold_solves_total")
                    changes0 = router_metric(srv.metrics_url, "tokenrouter_batch_threshold_changes_total")
                    timeline = ThresholdTimeline(srv.metrics_url, args.sample_s)
                else:
                    configure_fixed(url, int(v[len("fixed-B"):]), args.wait_us)
                    router = "token_router"
                tot = run_locust(srv.http_url, router, args, work, f"{v}-round{rnd + 1}")
                sp = spread(tot["windows_tokens_per_s"])
                row = {"variant": v, "router": router, "tokens_per_s": sp["mean"], "ci95": sp["ci95"],
                       "min": sp["min"], "max": sp["max"], "cycles_tokens_per_s": tot["windows_tokens_per_s"],
                       "tokens": tot["tokens"], "requests": tot["requests"], "failures": tot["failures"],
                       "seconds": tot["seconds"], "whole_run_tokens_per_s": tot["tokens_per_s"]}
                if timeline is not None:
                    row["timeline"] = timeline.stop()
                    m_url = srv.metrics_url
                    row["solves"] = router_metric(m_url, "tokenrouter_batch_threshold_solves_total") - solves0
                    row["changes"] = router_metric(m_url, "tokenrouter_batch_threshold_changes_total") - changes0
                    row["B_end"] = {m: admin.model_stats(url, m)["delayed_batch_size"] for m in MODELS}
                row["round"] = rnd
                results["rounds"].append(row)
                extra = (f"  solves {row['solves']:.0f}  changes {row['changes']:.0f}  B at the end {row['B_end']}"
                         if v == "online" else "")
                print(f"{v:10s} round {rnd + 1}/{args.rounds} {row['tokens_per_s']:8.1f} ± {row['ci95']:.1f} tok/s "
                      f"[{row['min']:.1f}-{row['max']:.1f}]  {row['requests']} requests  "
                      f"{row['failures']} failed  {row['seconds']:.0f} s{extra}", flush=True)
                with open(os.path.join(args.out, "results.json"), "w") as f:
                    json.dump(results, f, indent=1)
        configure_fixed(url, 1, 0)
    for v in variants:
        results["rows"].append(merge_rounds([r for r in results["rounds"] if r["variant"] == v]))
        r = results["rows"][-1]
        print(f"{v:10s} all rounds {r['tokens_per_s']:8.1f} ± {r['ci95']:.1f} tok/s [{r['min']:.1f}-{r['max']:.1f}]  "
              f"per round {[round(x, 1) for x in r['rounds_tokens_per_s']]}", flush=True)
    rows = {r["variant"]: r for r in results["rows"]}
    fixed_rows = [r for r in results["rows"] if r["variant"] != "online"]
    if "online" in rows and fixed_rows:
        best = max(fixed_rows, key=lambda r: r["tokens_per_s"])
        ratio, lo, hi = ratio_interval(_as_matrix_row(rows["online"]), _as_matrix_row(best))
        results["summary"] = {"best_fixed": best["variant"], "online_over_best_fixed": ratio,
                              "interval95": [lo, hi]}
        print(f"online B*: {rows['online']['tokens_per_s']:.1f} tok/s; best fixed ({best['variant']}): "
              f"{best['tokens_per_s']:.1f} tok/s; ratio {ratio:.3f} ({lo:.3f}-{hi:.3f})", flush=True)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(results, f, indent=1)
    print(f"results: {os.path.join(args.out, 'results.json')} (run files in {work})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
