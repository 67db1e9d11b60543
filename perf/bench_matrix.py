"""The benchmark matrix: TokenRouter against its baselines, measured in one run.

For each pair (demo, size-realistic) one real tritonserver is started on a
variant of model_repository; the modes are switched at run time through the
models' ``configure`` op (same code, one switch each), so every ratio compares
runs of the same server process:

==============  =============================================================
tokenrouter     own pace per model, pending-state resume, delayed batching
                with B* from scheduler_model (profile measured in this run)
eager-async     the same, B = 1 and no delay
std-serving     a returning request is re-admitted and re-prefilled (no pending state)
lock-step       models step in turn, one global step at a time (official style)
llm-only        no routing: the LLM writes every token (router algorithm "none")
slm-only        no routing: the SLM writes every token
no-triton       tokenrouter's engines, decode loops, ZeroMQ channel, router logic and
                B*, in worker processes driven without Triton (SGLang keeps one model
                per process): the limit the Triton path is measured against
==============  =============================================================

Per cell (mode × concurrency N × max output tokens) it prints decode tokens/s,
TTFT, ITL p50/p99, end-to-end latency, LLM token share and handoffs per request,
then ratios of tokenrouter against each baseline.  Results: JSON, a markdown
table and PNG plots under --out.

Scaled for a 2-core CPU by default (output lengths 16/48 tokens instead of the
issue's 128/512, N up to 8, one request per client); ``--full`` restores
128/512, N up to 16 and three requests per client for GPU hosts.

    source deploy/env.sh && python perf/bench_matrix.py            # ~30-40 min on 2 cores
    python perf/bench_matrix.py --pairs demo --concurrency 1,4 --max-tokens 16   # smoke
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (os.path.join(ROOT, "python_backend_src"), os.path.join(ROOT, "tests"), ROOT, HERE):
    if p not in sys.path:
        sys.path.insert(0, p)

from loadgen import run_load, summarize  # noqa: E402
from tokenrouter import admin  # noqa: E402
from tokenrouter.repository import make_variant  # noqa: E402
from tritonserver import TritonServer, exit_on_termination  # noqa: E402

MODELS = ["slm", "llm"]
ALL_MODES = ["tokenrouter", "eager-async", "std-serving", "lock-step", "llm-only", "slm-only", "no-triton"]
BASELINES = ["eager-async", "std-serving", "lock-step", "llm-only", "slm-only", "no-triton"]
RESET = {"delayed_batch_size": 1, "delayed_batch_max_wait_us": 0, "readmit_on_resume": False,
         "lockstep_group": ""}


def _prompts() -> List[str]:
    with open(os.path.join(HERE, "prompts.txt"), encoding="utf-8") as f:
        return [line.strip() for line in f if line.strip()]


def _events_size(path: str) -> int:
    return os.path.getsize(path) if os.path.exists(path) else 0


def _read_slice(path: str, start: int) -> List[str]:
    with open(path, "rb") as f:
        f.seek(start)
        return [ln.decode() for ln in f.read().splitlines() if ln.strip()]


def b_star_from_events(event_lines: List[str], concurrency: int, workdir: str) -> Dict[str, Any]:
    """Profile the run's routing events and solve the DTMC (SLM threshold fixed at 1, as in the paper)."""
    ev = os.path.join(workdir, f"events-N{concurrency}.jsonl")
    with open(ev, "w") as f:
        f.write("\n".join(event_lines) + "\n")
    prof = os.path.join(workdir, f"profile-N{concurrency}.json")
    py = sys.executable
    made = subprocess.run([py, "-m", "scheduler_model", "profile", "--events", ev, "--models", ",".join(MODELS),
                           "--concurrency", str(concurrency), "-o", prof], cwd=ROOT,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if made.returncode != 0:  # e.g. no request reached the LLM: nothing to batch there
        print(f"  (no profile at N={concurrency}: {made.stderr.strip()}; B = 1)", flush=True)
        return {"B_star": {m: 1 for m in MODELS}, "table": [], "profile": None,
                "note": made.stderr.strip()}
    with open(prof) as f:
        profile = json.load(f)
    profile["fixed_thresholds"] = {"slm": 1}
    with open(prof, "w") as f:
        json.dump(profile, f)
    # a 5 ms quantum keeps the exact chain small for CPU step times of 50-300 ms
    out = subprocess.run([py, "-m", "scheduler_model", "solve", "--profile", prof, "--json", "--quantum-s", "0.005"],
                         check=True,
                         cwd=ROOT, capture_output=True, text=True)
    res = json.loads(out.stdout)
    res["profile"] = profile
    return res


def _lat(profile: Dict[str, Any], model: str) -> float:
    v = profile["step_latency_s"][model]
    return float(v if not isinstance(v, dict) else v[sorted(v, key=int)[0]])


def router_algorithm(pair: str, override: Dict[str, Any]) -> tuple:
    """``(algorithm name, parameters)`` of the pair's token_router with ``override`` merged in.

    The base parameters are the pair's (:data:`tokenrouter.repository.PAIRS`), else
    the repository's token_router config.
    """
    from tokenrouter.repository import PAIRS, read_config

    rp = read_config(os.path.join(ROOT, "model_repository", "token_router", "config.pbtxt")).parameters
    algo = rp["algorithm"].string_value if "algorithm" in rp else "rstitch"
    base = PAIRS[pair].get("token_router", {}).get("algorithm_params")
    if base is None:
        base = rp["algorithm_params"].string_value if "algorithm_params" in rp else ""
    return algo, {**json.loads(base or "{}"), **override}


def run_pair(pair: str, args, results: Dict[str, Any], out_dir: str) -> None:
    work = os.path.join(out_dir, f"run-{pair}")
    os.makedirs(work, exist_ok=True)
    events = {m: os.path.join(work, f"events-{m}.jsonl") for m in MODELS}
    model_params: Dict[str, Dict[str, object]] = {m: {"event_log": events[m]} for m in MODELS}
    if args.algorithm_params:
        _, merged = router_algorithm(pair, args.algorithm_params)
        model_params["token_router"] = {"algorithm_params": json.dumps(merged)}
    repo = make_variant(os.path.join(ROOT, "model_repository"), os.path.join(work, "model_repository"), pair,
                        model_params=model_params,
                        routers={"token_router_llm_only": {"algorithm": "none", "algorithm_params": '{"model": 1}'},
                                 "token_router_slm_only": {"algorithm": "none", "algorithm_params": '{"model": 0}'}})
    prompts = _prompts()
    print(f"\n== pair {pair}: starting tritonserver", flush=True)
    with TritonServer(repo, ready_timeout=900, log_path=os.path.join(work, "tritonserver.log")) as srv:
        url = srv.grpc_url
        run_load(url, prompts, 2, 8)  # warm-up
        for L in args.max_tokens:
            for N in args.concurrency:
                bstar = None
                for mode in [m for m in args.modes if m != "no-triton"]:
                    for m in MODELS:
                        admin.configure(url, m, **RESET)
                    router = "token_router"
                    if mode == "tokenrouter":
                        if bstar is None:  # profile an eager run at this (N, L) first
                            start = {m: _events_size(events[m]) for m in MODELS}
                            run_load(url, prompts, N, L, args.requests_per_client)
                            lines = [x for m in MODELS for x in _read_slice(events[m], start[m])]
                            bstar = b_star_from_events(lines, N, work)
                        B = dict(bstar["B_star"])
                        B.update(args.batch_override)
                        wait_us = (int(1e6 * args.wait_factor * _lat(bstar["profile"], "slm"))
                                   if bstar["profile"] else 0)
                        for m in MODELS:
                            admin.configure(url, m, delayed_batch_size=int(B[m]),
                                            delayed_batch_max_wait_us=wait_us if B[m] > 1 else 0)
                    elif mode == "std-serving":
                        for m in MODELS:
                            admin.configure(url, m, readmit_on_resume=True)
                    elif mode == "lock-step":
                        for m in MODELS:
                            admin.configure(url, m, lockstep_group=",".join(MODELS))
                    elif mode == "llm-only":
                        router = "token_router_llm_only"
                    elif mode == "slm-only":
                        router = "token_router_slm_only"
                    before = {m: admin.model_stats(url, m) for m in MODELS}
                    run = run_load(url, prompts, N, L, args.requests_per_client, model=router)
                    after = {m: admin.model_stats(url, m) for m in MODELS}
                    row = {"pair": pair, "mode": mode, "N": N, "max_tokens": L, **summarize(run)}
                    row["model_stats"] = {m: {k: after[m][k] - before[m][k] for k in
                                              ("steps", "decode_tokens", "extend_tokens", "extend_runs",
                                               "handoffs_out", "step_time_s", "forward_s", "route_s", "send_s")}
                                          for m in MODELS}
                    if mode == "tokenrouter":
                        row["B_star"] = B
                        row["B_dtmc"] = bstar["B_star"]
                        row["wait_us"] = wait_us
                        row["dtmc_throughput_tok_s"] = bstar.get("throughput_tokens_per_s")
                    results["rows"].append(row)
                    print(f"{pair:15s} {mode:12s} N={N:<3d} L={L:<4d} {row['throughput_tok_s']:8.1f} tok/s  "
                          f"TTFT {row['ttft_p50_s']:.3f}s  ITL p50 {row['itl_p50_s'] * 1e3:.1f}ms  "
                          f"llm {row['llm_share']:.2f}  handoffs/req {row['handoffs_per_request']:.1f}"
                          + (f"  B*={row['B_star']}" if mode == 'tokenrouter' else "")
                          + (f"  errors={row['errors']}" if row["errors"] else ""), flush=True)
                    with open(os.path.join(out_dir, "results.json"), "w") as f:
                        json.dump(results, f, indent=1)
        for m in MODELS:
            admin.configure(url, m, **RESET)
        results.setdefault("triton_batching", {})[pair] = triton_batching(srv.http_url)
        print(f"Triton statistics ({pair}): " + ", ".join(
            f"{m}: {v['inference_count']} requests in {v['execution_count']} executions"
            for m, v in results["triton_batching"][pair].items()), flush=True)
    if "no-triton" in args.modes:
        run_no_triton(pair, repo, args, results, out_dir, prompts)


def triton_batching(http_url: str) -> Dict[str, Dict[str, int]]:
    """inference_count vs execution_count of each LLM model from Triton's statistics endpoint.

    A ratio above 1 means the dynamic batcher handed several requests (new ones
    and handoff resumes) to one ``execute`` call.
    """
    import urllib.request

    out = {}
    for m in MODELS:
        with urllib.request.urlopen(f"http://{http_url}/v2/models/{m}/stats", timeout=10) as r:
            st = json.load(r)["model_stats"][0]
        out[m] = {"inference_count": int(st.get("inference_count", 0)),
                  "execution_count": int(st.get("execution_count", 0))}
    return out


def run_no_triton(pair: str, repo: str, args, results: Dict[str, Any], out_dir: str, prompts: List[str]) -> None:
    """The no-Triton baseline: same configs (read from the variant repository), same B* per cell."""
    from tokenrouter.direct import DirectCluster, DirectRouter
    from tokenrouter.repository import read_config
    from tokenrouter.triton_common import llm_settings, resolve_model_path

    def params(model):
        return {k: v.string_value for k, v in read_config(os.path.join(repo, model, "config.pbtxt")).parameters.items()}

    print(f"== pair {pair}: no-triton baseline (worker processes, no Triton)", flush=True)
    cluster = DirectCluster({m: llm_settings(params(m)) for m in MODELS})
    try:
        rp = params("token_router")
        router = DirectRouter(cluster, MODELS, resolve_model_path(rp.get("tokenizer_path", "smollm2-135m-instruct")),
                              rp.get("algorithm", "rstitch"), json.loads(rp.get("algorithm_params") or "{}"))
        gen = lambda p, sp, cb: router.generate(p, sp, on_text=cb)  # noqa: E731
        run_load(gen, prompts, 2, 8)  # warm-up
        for L in args.max_tokens:
            for N in args.concurrency:
                tr = [r for r in results["rows"] if r["pair"] == pair and r["mode"] == "tokenrouter"
                      and r["N"] == N and r["max_tokens"] == L]
                B = tr[0]["B_star"] if tr else {m: 1 for m in MODELS}
                wait = tr[0].get("wait_us", 0) if tr else 0
                for m in MODELS:
                    cluster.configure(m, delayed_batch_size=int(B[m]), max_wait_s=(wait if B[m] > 1 else 0) / 1e6)
                row = {"pair": pair, "mode": "no-triton", "N": N, "max_tokens": L,
                       **summarize(run_load(gen, prompts, N, L, args.requests_per_client)), "B_star": B}
                results["rows"].append(row)
                print(f"{pair:15s} {'no-triton':12s} N={N:<3d} L={L:<4d} {row['throughput_tok_s']:8.1f} tok/s  "
                      f"TTFT {row['ttft_p50_s']:.3f}s  ITL p50 {row['itl_p50_s'] * 1e3:.1f}ms  "
                      f"llm {row['llm_share']:.2f}", flush=True)
                with open(os.path.join(out_dir, "results.json"), "w") as f:
                    json.dump(results, f, indent=1)
    finally:
        cluster.close()


def _fmt(x: float, unit: str = "") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:.3g}{unit}"


def markdown(results: Dict[str, Any]) -> str:
    """The results table plus tokenrouter's ratios against each baseline."""
    rows = results["rows"]
    lines = [f"Settings: {results['settings']}", "",
             "| pair | mode | N | max tokens | tok/s | TTFT p50 s | ITL p50 ms | ITL p99 ms | e2e p50 s | "
             "LLM share | handoffs/req | B* |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['pair']} | {r['mode']} | {r['N']} | {r['max_tokens']} | {_fmt(r['throughput_tok_s'])} | "
                     f"{_fmt(r['ttft_p50_s'])} | {_fmt(r['itl_p50_s'] * 1e3)} | {_fmt(r['itl_p99_s'] * 1e3)} | "
                     f"{_fmt(r['e2e_p50_s'])} | {_fmt(r['llm_share'])} | {_fmt(r['handoffs_per_request'])} | "
                     f"{r.get('B_star', '')} |")
    base = {(r["pair"], r["N"], r["max_tokens"], r["mode"]): r["throughput_tok_s"] for r in rows}
    present = [b for b in BASELINES if any(r["mode"] == b for r in rows)]
    if any(r["mode"] == "tokenrouter" for r in rows) and present:
        lines += ["", "Throughput ratio tokenrouter / baseline (same run):", "",
                  "| pair | N | max tokens | " + " | ".join(present) + " |",
                  "|---|---|---|" + "---|" * len(present)]
        for r in rows:
            if r["mode"] != "tokenrouter":
                continue
            k = (r["pair"], r["N"], r["max_tokens"])
            cells = [_fmt(r["throughput_tok_s"] / base[(*k, b)]) + "×" if base.get((*k, b)) else "–"
                     for b in present]
            lines.append(f"| {k[0]} | {k[1]} | {k[2]} | " + " | ".join(cells) + " |")
    diag = [r for r in rows if r.get("model_stats")]
    if diag:
        lines += ["", "Diagnostics from the models' counters: busy = seconds in steps, batch = requests per "
                  "step; overlap bound = (busy slm + busy llm) / max(busy), the most that stepping at "
                  "its own pace can gain over lock-step with this routing mix:", "",
                  "| pair | mode | N | max tokens | " + " | ".join(f"busy {m} s | batch {m}" for m in MODELS)
                  + " | overlap bound |", "|---|---|---|---|" + "---|---|" * len(MODELS) + "---|"]
        for r in diag:
            ms = r["model_stats"]
            busy = [ms[m]["step_time_s"] for m in MODELS]
            batch = [(ms[m]["decode_tokens"] + ms[m]["extend_runs"]) / ms[m]["steps"] if ms[m]["steps"] else
                     float("nan") for m in MODELS]
            bound = sum(busy) / max(busy) if max(busy) > 0 else float("nan")
            lines.append(f"| {r['pair']} | {r['mode']} | {r['N']} | {r['max_tokens']} | "
                         + " | ".join(f"{_fmt(b)} | {_fmt(x)}" for b, x in zip(busy, batch))
                         + f" | {_fmt(bound)}× |")
    return "\n".join(lines)


def _plot(path: str, title: str, xlabel: str, series: Dict[str, List[tuple]]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 4))
    for label, pts in series.items():
        pts = sorted(pts)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("decode throughput (tokens/s)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plots(results: Dict[str, Any], out_dir: str) -> List[str]:
    """Throughput against N per mode (one PNG per pair and length) and against output length."""
    rows, files = results["rows"], []
    for pair in sorted({r["pair"] for r in rows}):
        pr = [r for r in rows if r["pair"] == pair]
        modes = [m for m in ALL_MODES if any(r["mode"] == m for r in pr)]
        for L in sorted({r["max_tokens"] for r in pr}):
            files.append(_plot(os.path.join(out_dir, f"throughput_vs_N_{pair}_{L}tok.png"),
                               f"{pair}: {L} output tokens", "concurrency N",
                               {m: [(r["N"], r["throughput_tok_s"]) for r in pr
                                    if r["mode"] == m and r["max_tokens"] == L] for m in modes}))
        Nmax = max(r["N"] for r in pr)
        files.append(_plot(os.path.join(out_dir, f"throughput_vs_length_{pair}.png"), f"{pair}: N = {Nmax}",
                           "max output tokens",
                           {m: [(r["max_tokens"], r["throughput_tok_s"]) for r in pr
                                if r["mode"] == m and r["N"] == Nmax] for m in modes}))
    return files


def _scale_note(a) -> str:
    """Say in the output how these settings differ from the issue-size ones (--full)."""
    if a.full:
        return ""
    notes = []
    if max(a.max_tokens) < 512:
        notes.append(f"output lengths {'/'.join(map(str, a.max_tokens))} tokens instead of 128/512")
    if max(a.concurrency) < 16:
        notes.append("N = 16 left to --full")
    if a.requests_per_client < 3:
        notes.append(f"{a.requests_per_client} request(s) per client (--full: 3)")
    return "scaled for a 2-core CPU: " + ", ".join(notes) if notes else ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", default="demo,size-realistic")
    ap.add_argument("--modes", default=",".join(ALL_MODES))
    ap.add_argument("--concurrency", default=None, help="comma list (default 1,4,8; --full: 1,4,8,16)")
    ap.add_argument("--max-tokens", default=None, help="comma list (default 16,48; --full: 128,512)")
    ap.add_argument("--requests-per-client", type=int, default=None)
    ap.add_argument("--wait-factor", type=float, default=1.0,
                    help="delayed-batching wait bound in SLM step times (default 1)")
    ap.add_argument("--batch-override", default="",
                    help="use these B_i instead of the DTMC's B* in tokenrouter mode, e.g. slm=3 "
                         "(exploration; the table marks the B used)")
    ap.add_argument("--algorithm-params", default="",
                    help="JSON merged into the pair's routing-algorithm parameters, e.g. '{\"tau\": 0.3}' "
                         "(the size-realistic pair's τ 0.4 sends ~9 %% of tokens to the LLM)")
    ap.add_argument("--full", action="store_true", help="issue-size settings for GPU hosts")
    ap.add_argument("--out", default=os.path.join(HERE, "results", time.strftime("matrix-%Y%m%d-%H%M%S")))
    a = ap.parse_args(argv)
    exit_on_termination()
    from tokenrouter.repository import PAIRS

    a.pairs = [p for p in a.pairs.split(",") if p]
    if not a.pairs or set(a.pairs) - set(PAIRS):
        ap.error(f"--pairs: known pairs are {sorted(PAIRS)}")
    try:
        a.batch_override = {k.strip(): int(v) for k, v in (x.split("=") for x in a.batch_override.split(",") if x)}
    except ValueError:
        ap.error("--batch-override takes model=B pairs, e.g. slm=3,llm=6")
    if set(a.batch_override) - set(MODELS) or any(v < 1 for v in a.batch_override.values()):
        ap.error(f"--batch-override: models are {MODELS}, B >= 1")
    try:
        a.algorithm_params = json.loads(a.algorithm_params) if a.algorithm_params else {}
    except json.JSONDecodeError as e:
        ap.error(f"--algorithm-params is not JSON: {e}")
    if not isinstance(a.algorithm_params, dict):
        ap.error("--algorithm-params must be a JSON object")
    if a.algorithm_params:  # checked here, not 45 s later by the server
        from tokenrouter.algorithms import get_algorithm

        for pair in a.pairs:
            algo, merged = router_algorithm(pair, a.algorithm_params)
            try:
                get_algorithm(algo).validate_params(merged, num_models=len(MODELS))
            except ValueError as e:
                ap.error(f"--algorithm-params for {algo} ({pair} pair): {e}")
    a.modes = [m for m in a.modes.split(",") if m]
    bad = set(a.modes) - set(ALL_MODES)
    if bad:
        ap.error(f"unknown modes {sorted(bad)}; known: {ALL_MODES}")
    try:
        a.concurrency = [int(x) for x in (a.concurrency or ("1,4,8,16" if a.full else "1,4,8")).split(",")]
        a.max_tokens = [int(x) for x in (a.max_tokens or ("128,512" if a.full else "16,48")).split(",")]
    except ValueError:
        ap.error("--concurrency and --max-tokens take comma-separated integers, e.g. 1,4,8")
    if a.requests_per_client is None:
        a.requests_per_client = 3 if a.full else 1
    if min(a.concurrency) < 1 or min(a.max_tokens) < 1 or a.requests_per_client < 1:
        ap.error("--concurrency, --max-tokens and --requests-per-client take positive integers")
    os.makedirs(a.out, exist_ok=True)
    settings = {"pairs": a.pairs, "modes": a.modes, "batch_override": a.batch_override,
                "algorithm_params": a.algorithm_params, "concurrency": a.concurrency, "max_tokens": a.max_tokens,
                "requests_per_client": a.requests_per_client, "full": a.full,
                "note": _scale_note(a)}
    results: Dict[str, Any] = {"settings": settings, "rows": []}
    print(f"settings: {settings}")
    t0 = time.time()
    for pair in a.pairs:
        run_pair(pair, a, results, a.out)
    md = markdown(results)
    for pair, v in results.get("triton_batching", {}).items():
        md += f"\n\nTriton statistics ({pair}, whole run): " + ", ".join(
            f"{m} {x['inference_count']} requests / {x['execution_count']} executions" for m, x in v.items())
    with open(os.path.join(a.out, "results.md"), "w") as f:
        f.write(md + "\n")
    files = plots(results, a.out)
    print("\n" + md)
    print(f"\nwrote {a.out}/results.json, results.md, " + ", ".join(os.path.basename(f) for f in files)
          + f" in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
