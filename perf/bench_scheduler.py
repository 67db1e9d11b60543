#!/usr/bin/env python
"""Benchmark of scheduler_model's B* search: time and peak memory against N, for M = 2 and 3.

For each (M, N) it runs, each in a fresh subprocess (so peak RSS is that run's own):

* ``exact-dtmc``: the full B* search with the exact chain, if its estimated time (first chain's
  time × number of feasible B) fits ``--exact-budget-s``; otherwise ``exact-chain``: one chain at
  B = (1, …, 1) only, to show how far the exact chain goes (states, seconds, MB), until it
  exceeds ``--max-states``.
* ``crn-racing``: the simulation-based search with common random numbers over every feasible B.

Where both searches ran, "loss vs exact" = 1 − T_exact(B*_racing) / T_exact(B*_exact), i.e. the
throughput given up by taking racing's B* instead of the exact one, by the exact chain.

Usage::

    python perf/bench_scheduler.py            # N = 2 … 64, a few minutes on 2 cores
    python perf/bench_scheduler.py --full     # N up to 128, bigger exact budgets

Prints two markdown tables (all thresholds free; the first model's fixed at 1 as in the
paper's R2R validation): N, M, method, states, seconds, peak MB, B*, T(B*), loss vs exact.
The systems: an R2R-like pair (M = 2) and a small/medium/large trio (M = 3), latencies as
tables by batch size, quantum 1 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time



def make_system(M: int, N: int):
    from scheduler_model.system import System

    if M == 2:
        return System(models=("slm", "llm"), concurrency=N,
                      latency=[{1: 0.006, 64: 0.010}, {1: 0.027, 64: 0.045}],
                      P=[[0.9, 0.1], [0.6, 0.4]], C=[[1, 0], [1, 1]], quantum_s=1e-3)
    if M == 3:
        return System(models=("small", "medium", "large"), concurrency=N,
                      latency=[{1: 0.004, 64: 0.008}, {1: 0.012, 64: 0.020}, {1: 0.030, 64: 0.048}],
                      P=[[0.85, 0.1, 0.05], [0.5, 0.4, 0.1], [0.4, 0.1, 0.5]],
                      C=[[1, 0, 0], [1, 1, 1], [1, 1, 1]], quantum_s=1e-3)
    raise ValueError("M must be 2 or 3")


def worker(spec: dict) -> dict:
    """Run one measurement in this process and return a JSON-able dict."""
    from scheduler_model import dtmc, search
    from scheduler_model.errors import StateSpaceTooLargeError

    system = make_system(spec["M"], spec["N"])
    if spec.get("fixed"):
        system = system.with_(fixed_thresholds=spec["fixed"])
    t0 = time.perf_counter()
    out = {"M": spec["M"], "N": spec["N"]}
    if spec["mode"] == "exact":
        cands = list(search.feasible_thresholds(system))
        try:
            first = dtmc.throughput(system, cands[0], max_states=spec["max_states"], on_periodic="ignore")
        except StateSpaceTooLargeError:
            out.update(method="exact-chain", states=f">{spec['max_states']}", seconds=time.perf_counter() - t0)
            return out
        est = first.seconds * len(cands)
        if len(cands) > 1 and est > spec["budget"]:
            # the first B (all ones) has the largest chain; average with the last (largest B)
            last = dtmc.throughput(system, cands[-1], max_states=spec["max_states"], on_periodic="ignore")
            est = 0.5 * (first.seconds + last.seconds) * len(cands)
        if est <= spec["budget"]:
            res = search.search_exact(system, max_states=spec["max_states"], candidates=cands)
            out.update(method="exact-dtmc", states=res.max_states, B_star=res.B_star,
                       T=res.throughput_tokens_per_s,
                       table={json.dumps(r["B"], sort_keys=True): r["throughput_tokens_per_s"] for r in res.table})
        else:
            out.update(method="exact-chain (1 B)", states=first.states, B_star=first.B,
                       T=first.throughput_tokens_per_s, note=f"full search est. {est:.0f} s")
    else:
        res = search.find_B_star(system, method="crn-racing", seed=spec.get("seed", 0))
        out.update(method="crn-racing", states=0, B_star=res.B_star, T=res.throughput_tokens_per_s,
                   candidates=len(res.table))
    out["seconds"] = time.perf_counter() - t0
    return out


def run_sub(spec: dict, timeout: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"M": spec["M"], "N": spec["N"], "method": spec["mode"], "error": f"timeout {timeout:.0f} s"}
    if p.returncode != 0:
        return {"M": spec["M"], "N": spec["N"], "method": spec["mode"], "error": p.stderr.strip()[-300:]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full", action="store_true", help="N up to 128 and larger exact budgets")
    ap.add_argument("--M", type=int, nargs="*", default=[2, 3])
    ap.add_argument("--N", type=int, nargs="*", default=None)
    ap.add_argument("--exact-budget-s", type=float, default=None, help="max est. seconds of a full exact search")
    ap.add_argument("--max-states", type=int, default=None)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        res = worker(json.loads(args.worker))
        res["peak_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
        print(json.dumps(res))
        return
    Ns = args.N or ([2, 4, 8, 16, 32, 64, 96, 128] if args.full else [2, 4, 8, 16, 32, 64])
    budget = args.exact_budget_s or (600.0 if args.full else 40.0)
    max_states = args.max_states or (3_000_000 if args.full else 400_000)
    # baseline RSS of a worker that only imports the package
    base = run_sub({"mode": "exact", "M": 2, "N": 1, "budget": 1e9, "max_states": 10}, 120).get("peak_mb", 0.0)
    print(f"worker baseline peak RSS (imports + N=1): {base:.0f} MB; budgets: exact search {budget:g} s, "
          f"max states {max_states}")
    print()
    table(args.M, Ns, budget, max_states, fixed=None)
    # the paper's setting: the smallest model's threshold fixed at 1, exact search affordable further
    print()
    print("With the first model's threshold fixed at 1 (the paper's R2R setting):")
    print()
    table(args.M, Ns, budget, max_states, fixed=True)


def table(Ms, Ns, budget, max_states, fixed) -> None:
    print("| N | M | method | states | seconds | peak MB | B* | T(B*) tokens/s | loss vs exact |")
    print("|---:|---:|---|---:|---:|---:|---|---:|---:|")
    stop_exact = {M: False for M in Ms}
    for M in Ms:
        fx = {make_system(M, 1).models[0]: 1} if fixed else None
        for N in Ns:
            rows = []
            ex = None
            if not stop_exact[M]:
                ex = run_sub({"mode": "exact", "M": M, "N": N, "budget": budget, "max_states": max_states,
                              "fixed": fx}, timeout=budget * 3 + 120)
                rows.append(ex)
                if "error" in ex or str(ex.get("states", "")).startswith(">"):
                    stop_exact[M] = True
            ra = run_sub({"mode": "race", "M": M, "N": N, "fixed": fx}, timeout=900)
            rows.append(ra)
            for r in rows:
                loss = ""
                if r is ra and ex is not None and "table" in ex and "B_star" in ra:
                    T_ex = ex["table"].get(json.dumps(ra["B_star"], sort_keys=True))
                    if T_ex is not None:
                        loss = f"{100 * (1 - T_ex / ex['T']):.3f} %"
                if "error" in r:
                    print(f"| {N} | {M} | {r['method']} | | | | | | {r['error'][:80]} |")
                    continue
                Bs = ",".join(str(v) for v in r.get("B_star", {}).values()) if r.get("B_star") else ""
                T = f"{r['T']:.1f}" if "T" in r else ""
                note = r.get("note", "")
                print(f"| {N} | {M} | {r['method']}{' (' + note + ')' if note else ''} | {r.get('states', '')} | "
                      f"{r['seconds']:.2f} | {r.get('peak_mb', 0):.0f} | {Bs} | {T} | {loss} |", flush=True)


if __name__ == "__main__":
    main()
