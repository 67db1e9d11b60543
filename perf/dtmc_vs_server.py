"""The DTMC against the real server in steady state: predicted B* vs the measured-best B.

Paper §Design, "DTMC for B*", validated the chain by sweeping the LLM's B with
the SLM's threshold fixed at 1.  Here every model's threshold is searched and
swept, on the size-realistic pair (real SmolLM2 SLM, larger random-weight LLM)
through Triton, at each N (default 2, 4, 8, 32), with N clients sending
requests back to back for the whole N (``perf/loadgen.py`` steady state):

0. calibration (unless ``--no-calibrate``): each model's steps are timed alone
   at batch sizes 1, 2, 4, … up to the largest N (``bench_matrix.calibrate_server``);
1. eager run (B = 1 everywhere): its routing events become a profile
   (``python -m scheduler_model profile``, its step-latency model fitted to the
   served steps and the calibration scaled to their level), and ``solve`` gives
   B* for every model and the predicted throughput;
2. coordinate sweep on the running server (``configure`` op, the load keeps
   running; each point waits for its own warm-up: every client finishes a
   request sent after the change): B_llm over a log-ish grid with B_slm at the
   DTMC's value, then B_slm over the grid with B_llm at the best found (each
   grid always contains the DTMC's value, so B* itself is measured);
3. confirmation (``--confirm R``, default 4), when the sweep's best is not B*:
   B* and the best are measured again in R pairs (B*, best; best, B*; …) and
   the verdict uses the paired ratio B*/best (geometric mean of the R ratios,
   95 % Student-t interval): the sweep's best is the maximum of noisy points, so
   taken alone it overstates the gap (winner's curse);
4. print per N: the DTMC's B*, the measured-best B, measured throughput at both
   (mean ± 95 % half-width over ``--windows`` windows), the sweep's and the
   confirmed ratio, and whether B* is within 5 % of the best (ratio ≥ 0.95).

Delayed batching uses a wait bound of ``--wait-factor`` × the SLM's mean step
time in the eager run, the same rule as ``bench_matrix.py``'s tokenrouter mode,
at every sweep point; the DTMC models that bound (``solve --max-wait-us``), so its
predicted throughput at a large B is the bounded wait's, not a wait for B
requests however long it takes.

Run time here (2 cores, defaults: 32 tokens, 12 s per point): grid
1,2,3,4,6,8,12,16,24,32 up to N gives 3 + 7 + 11 + 19 measured points plus 4
eager runs; a point costs its warm-up (one request, ~2-15 s) and 12 s, so
about 1 + 2 + 3.5 + 9 min + 2 min of server start ≈ 18 min, plus the calibration
(~40 s); the confirmation adds 2R points per N where the sweep's best is not B*
(4-15 min at R = 4): 20-35 min in all.

    source deploy/env.sh && python perf/dtmc_vs_server.py              # ~20-35 min here
    python perf/dtmc_vs_server.py --pair demo --concurrency 2 --max-tokens 16 --duration 3   # quick
    python perf/dtmc_vs_server.py --replay perf/results/dtmc-…   # re-predict a recorded run, no server
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from statistics import fmean
from typing import Any, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

from bench_matrix import (MODELS, RESET, _events_size, _prompts, _read_slice, _stats_delta, _wait_idle,  # noqa: E402
                          b_star_from_events, calibrate_server, configure_mode, ratio_interval,
                          wait_bound_us)
from loadgen import SteadyLoad, load_tokenizer, run_load, window_summary  # noqa: E402
from tokenrouter.tools import admin  # noqa: E402
from tokenrouter.tools.repository import make_variant  # noqa: E402
from tritonserver import TritonServer, exit_on_termination  # noqa: E402

GRID = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


def grid(N: int, must: int, base=GRID) -> List[int]:
    """Thresholds to sweep at concurrency N: ``base`` up to N, plus N and ``must`` (the DTMC's value)."""
    return sorted({b for b in base if b <= N} | {N, int(must)})


def within(measured_at_star: float, best: float, tol: float = 0.05) -> bool:
    """Whether B*'s measured throughput is within ``tol`` (relative) of the measured best."""
    return measured_at_star >= (1.0 - tol) * best


def _key(B: Dict[str, int]) -> Tuple[int, ...]:
    return tuple(int(B[m]) for m in MODELS)


def _fmt_B(B: Dict[str, int]) -> str:
    return ",".join(f"{m}={int(B[m])}" for m in MODELS)


def sweep_one_N(url: str, load: SteadyLoad, N: int, args, events: Dict[str, str], start: Dict[str, int],
                out_dir: str, calibration: Optional[str] = None) -> Dict[str, Any]:
    """Eager profile, DTMC solve and the coordinate sweep at one N.

    The models must be in eager mode (:data:`RESET`) when ``load`` starts; the load keeps running
    through every point.  Returns the report row (see :func:`markdown`)."""
    probe = lambda: {m: admin.model_stats(url, m) for m in MODELS}  # noqa: E731
    eager = load.measure(args.duration, args.windows, probe=probe, since=load.t_started)
    lines = [x for m in MODELS for x in _read_slice(events[m], start[m])]
    eager_s = window_summary(load.snapshot(), eager["bounds"], probes=eager["probes"], latencies="completed")
    wait_us = wait_bound_us(_stats_delta(eager["probes"][0], eager["probes"][-1]), args.wait_factor)
    sol = b_star_from_events(lines, N, out_dir, calibration, wait_us)
    star = {m: int(sol["B_star"][m]) for m in MODELS}
    predicted = {_key(r["B"]): r.get("throughput_tokens_per_s") for r in sol.get("table", []) if "B" in r}
    print(f"N={N}: eager {eager_s['throughput_tok_s']:.2f} tok/s; DTMC B* = {_fmt_B(star)} "
          f"(predicted {sol.get('throughput_tokens_per_s') or float('nan'):.2f} tok/s); wait bound {wait_us} us",
          flush=True)
    measured: Dict[Tuple[int, ...], Dict[str, Any]] = {}

    def run_at(B: Dict[str, int]) -> Dict[str, Any]:
        configure_mode(url, "tokenrouter", B, wait_us)
        mm = load.measure(args.duration, args.windows, probe=probe)
        return window_summary(load.snapshot(), mm["bounds"], probes=mm["probes"], latencies="completed")

    def point(B: Dict[str, int]) -> float:
        k = _key(B)
        if k not in measured:
            s = run_at(B)
            measured[k] = {"B": dict(B), "throughput_tok_s": s["throughput_tok_s"], "throughput": s["throughput"],
                           "e2e_p50_s": s["e2e_p50_s"], "e2e_p99_s": s["e2e_p99_s"], "llm_share": s["llm_share"],
                           "errors": s["errors"], "dtmc_tok_s": predicted.get(k)}
            th = s["throughput"]
            print(f"N={N} B {_fmt_B(B)}: measured {th['mean']:.2f} ±{th['ci95']:.2f} tok/s"
                  + (f", DTMC {predicted[k]:.2f}" if predicted.get(k) is not None else ""), flush=True)
        return measured[k]["throughput_tok_s"]

    if sol["profile"] is not None:
        for b in grid(N, star["llm"], args.grid):  # phase 1: B_llm, B_slm at the DTMC's value
            point({"slm": star["slm"], "llm": b})
        best_llm = max((v for v in measured.values() if v["B"]["slm"] == star["slm"]),
                       key=lambda v: v["throughput_tok_s"])["B"]["llm"]
        for b in grid(N, star["slm"], args.grid):  # phase 2: B_slm, B_llm at the best
            point({"slm": b, "llm": best_llm})
    else:
        point(star)
    best = max(measured.values(), key=lambda v: v["throughput_tok_s"])
    at_star = measured[_key(star)]
    confirm = confirm_pair(run_at, star, best["B"], args.confirm, N) if _key(best["B"]) != _key(star) else None
    if confirm:
        ratio, lo, hi = confirm["ratio"], confirm["low"], confirm["high"]
    else:  # B* is the sweep's best, or no confirmation: the sweep's own ratio
        ratio = (at_star["throughput_tok_s"] / best["throughput_tok_s"]) if best["throughput_tok_s"] else float("nan")
        lo = hi = float("nan")
    return {"N": N, "B_star_dtmc": star, "dtmc_tok_s": sol.get("throughput_tokens_per_s"),
            "method": sol.get("method"), "note": sol.get("note"), "wait_us": wait_us,
            "eager_tok_s": eager_s["throughput_tok_s"], "eager": eager_s["throughput"],
            "measured_at_B_star": at_star, "B_best_measured": best["B"], "measured_best": best,
            "sweep_ratio_star_to_best": at_star["throughput_tok_s"] / best["throughput_tok_s"]
            if best["throughput_tok_s"] else float("nan"),
            "confirm": confirm, "ratio_star_to_best": ratio, "ratio_low": lo, "ratio_high": hi,
            "within_5pct": within(ratio, 1.0),
            "points": list(measured.values()), "profile": sol["profile"]}


def confirm_pair(run_at, star: Dict[str, int], best: Dict[str, int], repeats: int, N: int
                 ) -> Optional[Dict[str, Any]]:
    """Measure B* and the sweep's best in ``repeats`` pairs; the paired ratio B*/best.

    The sweep's best is the maximum of noisy points, so it is biased upward (winner's curse);
    measuring both again, back to back, removes that bias and pairs the ratios.  The order
    within a pair alternates (B*, best; best, B*; …: ABBA), so a machine that speeds up or
    slows down steadily favours neither over an even number of pairs.  ``run_at(B)``
    configures the server and returns :func:`loadgen.window_summary` of one measurement period.

    Returns:
        ``{"B_star": [tok/s …], "best": [tok/s …], "ratio", "low", "high"}`` (paired geometric-mean
        ratio with its 95 % Student-t interval, :func:`bench_matrix.ratio_interval`; low/high NaN
        for one pair), or None when ``repeats`` < 1.
    """
    if repeats < 1:
        return None
    got: Dict[str, List[float]] = {"B_star": [], "best": []}
    for r in range(repeats):
        order = (("B_star", star), ("best", best)) if r % 2 == 0 else (("best", best), ("B_star", star))
        for name, B in order:
            got[name].append(run_at(B)["throughput_tok_s"])
        print(f"N={N} confirm {r + 1}/{repeats}: B* {got['B_star'][-1]:.2f}, best {got['best'][-1]:.2f} tok/s",
              flush=True)
    ratio, lo, hi = ratio_interval({"throughput_repeats": got["B_star"], "throughput_tok_s": fmean(got["B_star"])},
                                   {"throughput_repeats": got["best"], "throughput_tok_s": fmean(got["best"])})
    return {**got, "ratio": ratio, "low": lo, "high": hi}


def _f(x, nd=2) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def markdown(report: Dict[str, Any]) -> str:
    """Per-point table and the per-N summary (B* vs measured best)."""
    lines = [f"DTMC vs server, steady state ({report['pair']} pair, {report['max_tokens']} output tokens, "
             f"{report['duration_s']:g} s per point in {report['windows']} windows; tok/s = mean ± 95 % half-width)",
             "", "| N | B | measured tok/s | DTMC tok/s | e2e p50/p99 s | LLM share |", "|---|---|---|---|---|---|"]
    for r in report["rows"]:
        for v in r["points"]:
            lines.append(f"| {r['N']} | {_fmt_B(v['B'])} | {_f(v['throughput_tok_s'])} ±{_f(v['throughput']['ci95'])} | "
                         f"{_f(v['dtmc_tok_s'])} | {_f(v['e2e_p50_s'])}/{_f(v['e2e_p99_s'])} | "
                         f"{_f(v['llm_share'], 3)} |")
    lines += ["", "| N | DTMC B* | DTMC tok/s | measured at B* | measured-best B | measured best | B*/best (sweep) | "
              "B*/best (confirmed, 95 %) | within 5 % |", "|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        s, b, c = r["measured_at_B_star"], r["measured_best"], r.get("confirm")
        conf = (f"{_f(r['ratio_star_to_best'], 3)} ({_f(r['ratio_low'], 3)}–{_f(r['ratio_high'], 3)}) over "
                f"{len(c['B_star'])} pairs" if c else "– (B* is the best)")
        lines.append(f"| {r['N']} | {_fmt_B(r['B_star_dtmc'])} | {_f(r['dtmc_tok_s'])} | "
                     f"{_f(s['throughput_tok_s'])} ±{_f(s['throughput']['ci95'])} | {_fmt_B(r['B_best_measured'])} | "
                     f"{_f(b['throughput_tok_s'])} ±{_f(b['throughput']['ci95'])} | "
                     f"{_f(r['sweep_ratio_star_to_best'], 3)} | {conf} | {'yes' if r['within_5pct'] else 'no'} |")
    return "\n".join(lines)


def _solve(profile: str, wait_us: Optional[int]) -> Dict[str, Any]:
    """``python -m scheduler_model solve`` on a stored profile, as :func:`b_star_from_events` runs it."""
    import subprocess

    cmd = [sys.executable, "-m", "scheduler_model", "solve", "--profile", profile, "--json", "--quantum-s", "0.005"]
    if wait_us is not None:
        cmd += ["--max-wait-us", ",".join(f"{m}={int(wait_us)}" for m in MODELS)]
    return json.loads(subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, text=True).stdout)


def replay(out_dir: str) -> str:
    """Re-predict a recorded run (its ``dtmc_vs_server.json`` and ``profile-N*.json``) with the
    chain as it is now, without and with the run's wait bound, against the points it measured.

    Returns the markdown tables.  Raises OSError / KeyError for a folder that is not such a run."""
    with open(os.path.join(out_dir, "dtmc_vs_server.json")) as f:
        report = json.load(f)
    if not isinstance(report, dict) or not isinstance(report.get("rows"), list):
        raise ValueError("its dtmc_vs_server.json has no list of rows")
    out = ["(– : a B the search did not evaluate: infeasible for that chain, Σ(B_i − 1) ≥ N without "
           "the wait bound, or beyond the search's thresholds)", ""]
    for row in report["rows"]:
        N, w = row["N"], row.get("wait_us")
        prof = os.path.join(out_dir, f"profile-N{N}.json")
        if not os.path.exists(prof):
            out.append(f"N = {N}: no profile stored (B = 1 without one)")
            continue
        free, bounded = _solve(prof, None), _solve(prof, w)
        tf = {_key(r["B"]): r["throughput_tokens_per_s"] for r in free["table"]}
        tb = {_key(r["B"]): r["throughput_tokens_per_s"] for r in bounded["table"]}
        points = {_key(p["B"]): p for p in row["points"]}
        best = max(points.values(), key=lambda p: p["throughput_tok_s"])
        out += [f"N = {N}, wait bound {w} us: B* without the bound {_fmt_B(free['B_star'])} ({free['method']}), "
                f"with it {_fmt_B(bounded['B_star'])} ({bounded['method']}); measured best {_fmt_B(best['B'])}", "",
                "| B | measured tok/s (mean ± 95 %) | chain | chain with the wait bound |", "|---|---:|---:|---:|"]
        for k in sorted(points):
            p = points[k]
            out.append(f"| {_fmt_B(p['B'])} | {_f(p['throughput']['mean'])} ± {_f(p['throughput']['ci95'])} | "
                       f"{_f(tf.get(k))} | {_f(tb.get(k))} |")
        out.append("")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", default="size-realistic")
    ap.add_argument("--concurrency", default="2,4,8,32", help="comma list of N (default 2,4,8,32)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--duration", type=float, default=12.0, help="seconds of measurement per point (default 12)")
    ap.add_argument("--windows", type=int, default=3, help="windows per point (default 3)")
    ap.add_argument("--wait-factor", type=float, default=1.0,
                    help="delayed-batching wait bound in SLM mean step times of the eager run (default 1, "
                         "as bench_matrix)")
    ap.add_argument("--confirm", type=int, default=4,
                    help="when the sweep's best is not B*: measure both in this many pairs (order alternating, "
                         "ABBA) and judge the paired ratio (default 4; >= 2 for an interval; 0 = judge the "
                         "sweep's points)")
    ap.add_argument("--no-calibrate", dest="calibrate", action="store_false",
                    help="fit the DTMC's step latency to the eager run's steps only (default: also to a "
                         "calibration of each model at batch sizes up to max N, taken once after start)")
    ap.add_argument("--grid", default=",".join(map(str, GRID)), help="thresholds swept (each capped at N)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", time.strftime("dtmc-%Y%m%d-%H%M%S")))
    ap.add_argument("--replay", metavar="DIR",
                    help="no server: re-predict the run recorded in DIR (its dtmc_vs_server.json and profiles) "
                         "with the chain without and with that run's wait bound, beside what it measured")
    a = ap.parse_args(argv)
    if a.replay:
        try:
            print(replay(a.replay))
        except (OSError, KeyError, ValueError) as exc:
            ap.error(f"--replay {a.replay}: not a dtmc_vs_server run ({exc})")
        return 0
    exit_on_termination()
    from tokenrouter.tools.repository import PAIRS, read_config
    from tokenrouter.triton.common import resolve_model_path

    if a.pair not in PAIRS:
        ap.error(f"--pair: known pairs are {sorted(PAIRS)}")
    try:
        Ns = [int(x) for x in a.concurrency.split(",") if x]
        a.grid = tuple(int(x) for x in a.grid.split(",") if x)
    except ValueError:
        ap.error("--concurrency and --grid take comma-separated integers")
    if not Ns or min(Ns) < 1 or not a.grid or min(a.grid) < 1 or a.max_tokens < 1:
        ap.error("--concurrency, --grid and --max-tokens take positive integers")
    if a.duration <= 0 or a.windows < 1 or a.wait_factor < 0 or a.confirm < 0:
        ap.error("--duration must be > 0, --windows >= 1, --wait-factor >= 0, --confirm >= 0")
    os.makedirs(a.out, exist_ok=True)
    events = {m: os.path.join(a.out, f"events-{m}.jsonl") for m in MODELS}
    repo = make_variant(os.path.join(ROOT, "model_repository"), os.path.join(a.out, "model_repository"), a.pair,
                        model_params={m: {"event_log": events[m]} for m in MODELS})
    rp = read_config(os.path.join(repo, "token_router", "config.pbtxt")).parameters
    tok = load_tokenizer(resolve_model_path(rp["tokenizer_path"].string_value if "tokenizer_path" in rp
                                            else "smollm2-135m-instruct"))
    prompts = _prompts()
    report = {"pair": a.pair, "max_tokens": a.max_tokens, "duration_s": a.duration, "windows": a.windows,
              "calibrate": a.calibrate, "confirm": a.confirm,
              "wait_factor": a.wait_factor, "grid": list(a.grid), "rows": []}
    t0 = time.time()
    with TritonServer(repo, ready_timeout=900, log_path=os.path.join(a.out, "tritonserver.log")) as srv:
        url = srv.grpc_url
        run_load(url, prompts, 2, 8)  # warm-up, as bench_matrix: the calibration should not time cold kernels
        calibration = None
        if a.calibrate:
            try:
                calibration = calibrate_server(url, max(Ns), os.path.join(a.out, "calibration.json"))
            except RuntimeError as exc:  # e.g. a KV pool too small for max N rows: fit the served steps only
                print(f"  calibration failed ({exc}); profiling without it", flush=True)
        for N in Ns:
            for m in MODELS:
                admin.configure(url, m, **RESET)
            start = {m: _events_size(events[m]) for m in MODELS}
            load = SteadyLoad(url, prompts, N, a.max_tokens, tokenizer=tok).start()
            try:
                row = sweep_one_N(url, load, N, a, events, start, a.out, calibration)
            except BaseException:  # interrupted: no drain; leaving the server block stops the server
                load.stop(timeout_s=0, cancel=True)
                raise
            load.stop(cancel=True)  # every point is measured: the requests in flight are not needed
            _wait_idle(lambda: {m: admin.model_stats(url, m) for m in MODELS})
            report["rows"].append(row)
            print(f"N={N}: DTMC B* {_fmt_B(row['B_star_dtmc'])} measured "
                  f"{row['measured_at_B_star']['throughput_tok_s']:.2f} tok/s; best {_fmt_B(row['B_best_measured'])} "
                  f"{row['measured_best']['throughput_tok_s']:.2f} tok/s; within 5 %: "
                  f"{'yes' if row['within_5pct'] else 'no'}", flush=True)
            with open(os.path.join(a.out, "dtmc_vs_server.json"), "w") as f:
                json.dump(report, f, indent=1)
        for m in MODELS:
            admin.configure(url, m, **RESET)
    md = markdown(report)
    with open(os.path.join(a.out, "dtmc_vs_server.md"), "w") as f:
        f.write(md + "\n")
    print("\n" + md + f"\n\nwrote {a.out} in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
