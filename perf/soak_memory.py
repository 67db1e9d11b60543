"""The memory soak: does every process of a served pair stay flat under an hour of mixed traffic?

Starts ``deploy/serve`` (the real pair by default) on its own ports, runs
:mod:`tokenrouter.tools.soak` against it -- N concurrent clients, prompts of mixed length (one line
to ~1,800 tokens) and outputs of 4-256 tokens, streamed and not, client cancels and client
disconnects, a share of hostile requests, one model stub SIGKILLed every ``--kill-every`` seconds
(slm and llm in turn) -- while every process's resident memory is sampled every ``--rss-every``
seconds. Writes the soak's report with the samples as JSON and a memory-over-time plot, then stops
the server.

    python perf/soak_memory.py                       # 1 hour, N = 16, the real pair (~70 min)
    python perf/soak_memory.py --seconds 900 --kill-every 300 --warmup 300 --window 600   # 15 min
    python perf/soak_memory.py --plot-only perf/results/2026-12-06-xeon-soak-qwen-coder.json

Pass: every process's RSS ranges over at most ``--tolerance-mb`` MiB in the last ``--window``
seconds (a restarted stub's first ``--warmup`` seconds left out), every valid request answered
(text, a clear error while a model was down, or "busy"), every hostile one refused naming its
limit, and the server ready again after each kill. Exit status 0 on a pass.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def plot(report: dict, png: Path, title: str) -> None:
    """Resident memory (MiB) of each process against time (min), kills marked; one panel each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = report["rss"]["samples"]
    names = [n for n in ("llm_0_0", "slm_0_0", "token_router_0_0", "tritonserver")
             if any(n in s["rss_mb"] for s in samples)]
    fig, axes = plt.subplots(len(names), 1, figsize=(8, 2.1 * len(names)), sharex=True)
    for ax, name in zip(axes, names):
        for key, label in (("rss_mb", "RSS"), ("anon_mb", "anonymous"), ("shmem_mb", "shared")):
            pts = [(s["t_s"] / 60, s[key][name]) for s in samples if name in s.get(key, {})]
            ax.plot([t for t, _ in pts], [r for _, r in pts], ".-", ms=3, lw=1, label=label)
        for k in report.get("kills", []):
            ax.axvline(k["t_s"] / 60, color="red" if k["model"] + "_0_0" == name else "0.8", lw=0.8, ls="--")
        w = report["rss"]["summary"].get(name, {})
        rng = (f"last {report['rss']['window_s'] / 60:.0f} min: one process's range "
               f"{w.get('process_range_mb', w['window_range_mb']):.0f} MiB, all its processes' "
               f"{w['window_range_mb']:.0f} MiB") if "window_range_mb" in w else ""
        ax.set_ylabel("RSS (MiB)")
        ax.set_title(f"{name}  {rng}", fontsize=9, loc="left")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    axes[-1].set_xlabel("minutes (dashed: a stub killed; red: this one)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--pair", default="qwen-coder", help="deploy/serve --pair")
    ap.add_argument("--seconds", type=float, default=3600)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--kill-every", type=float, default=900, help="seconds between two stub kills (0 = none)")
    ap.add_argument("--hostile-fraction", type=float, default=0.1)
    ap.add_argument("--max-tokens", default="4,256", metavar="LOW,HIGH")
    ap.add_argument("--long-fraction", type=float, default=0.3)
    ap.add_argument("--rss-every", type=float, default=30)
    ap.add_argument("--warmup", type=float, default=600, help="seconds of warm-up (also after each restart)")
    ap.add_argument("--window", type=float, default=2400, help="final window of the flatness check (s)")
    ap.add_argument("--tolerance-mb", type=float, default=50)
    ap.add_argument("--http-port", type=int, default=18400, help="HTTP port; gRPC and metrics on the next two")
    ap.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                    help="an extra deploy/serve argument (repeatable), e.g. --serve-arg=--no-curve")
    ap.add_argument("--out", default="", help="results JSON (default perf/results/<date>-soak-<pair>.json)")
    ap.add_argument("--plot", default="", help="plot PNG (default docs/img/soak-memory-<pair>.png)")
    ap.add_argument("--plot-only", default="", metavar="JSON", help="summarise a results file's samples again (into it) and redraw its plot, then exit")
    a = ap.parse_args(argv)

    png = Path(a.plot or ROOT / "docs" / "img" / f"soak-memory-{a.pair}.png")
    if a.plot_only:  # the summaries computed again from the samples (this version's figures), and the plot
        from tokenrouter.tools import memwatch

        path = Path(a.plot_only)
        rep = json.loads(path.read_text())
        r = rep["rss"]
        settle = max(r["warmup_s"], 60.0)
        # the load's end on the samples' clock; files written before it was recorded have the load's
        # wall time, which began a second or so after the first sample
        until = r.get("traffic_end_s", rep.get("seconds"))
        r["summary"] = memwatch.summarize(r["samples"], r["warmup_s"], r["window_s"], settle, until_s=until)
        r["summary_anon"] = memwatch.summarize(r["samples"], r["warmup_s"], r["window_s"], settle, key="anon_mb",
                                               until_s=until)
        if until is not None:
            from tokenrouter.tools.soak import heap_change

            r["heap_change"] = heap_change(r["samples"], ["slm", "llm"], until - r["window_s"], until, settle)
        path.write_text(json.dumps(rep, indent=1))
        plot(rep, png, rep.get("title", ""))
        print(json.dumps({"rss": r["summary"], "anon": r["summary_anon"], "heap": r.get("heap_change")}, indent=1))
        print(png)
        return 0
    out = Path(a.out or ROOT / "perf" / "results" / f"{datetime.date.today()}-soak-{a.pair}.json")
    name = f"soak-{a.http_port}"
    serve = [str(ROOT / "deploy" / "serve"), "--name", name, "--pair", a.pair, "--http-port", str(a.http_port),
             "--grpc-port", str(a.http_port + 1), "--metrics-port", str(a.http_port + 2), "--openai-port", "0"]
    subprocess.run([*serve, "--background", *a.serve_arg], check=True)
    try:
        from tokenrouter.tools.soak import run_soak

        cache = Path(os.environ.get("TOKENROUTER_CACHE", Path.home() / ".cache" / "tokenrouter"))
        pid = int((cache / f"run-{name}" / "tritonserver.pid").read_text())
        lo, hi = (int(x) for x in a.max_tokens.split(","))
        rep = run_soak(f"localhost:{a.http_port + 1}", a.seconds, a.concurrency, progress=True,
                       kill_stub="slm,llm" if a.kill_every else "", kill_every_s=a.kill_every or 60.0,
                       kill_periodic=True, server_pid=pid, hostile_fraction=a.hostile_fraction,
                       disconnect_fraction=0.05, max_tokens=(lo, hi), long_fraction=a.long_fraction,
                       rss_every_s=a.rss_every, warmup_s=a.warmup, window_s=a.window,
                       rss_tolerance_mb=a.tolerance_mb, request_timeout_s=600)
    finally:
        subprocess.run([*serve, "--stop"], check=False)
    kills = f"a kill every {a.kill_every / 60:.0f} min" if a.kill_every else "no kills"
    rep["title"] = (f"soak, pair {a.pair}, N = {a.concurrency}, {a.seconds / 60:.0f} min, {kills}, "
                    f"{a.hostile_fraction:.0%} hostile")
    rep["command"] = "python perf/soak_memory.py " + " ".join(argv if argv is not None else sys.argv[1:])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rep, indent=1))
    plot(rep, png, rep["title"])
    print(json.dumps({k: v for k, v in rep.items() if k not in ("rss", "problems")}, indent=1))
    print(json.dumps(rep["rss"]["summary"], indent=1))
    print(json.dumps(rep["rss"].get("heap_change", {}), indent=1))
    print("\n".join(rep["problems"][:20]))
    print(f"results: {out}\nplot: {png}\nsoak: {'PASSED' if rep['passed'] else 'FAILED'}")
    return 0 if rep["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
