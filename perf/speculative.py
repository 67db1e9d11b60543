"""Speculative decoding against LLM-only in one run: throughput, TPOT, acceptance rate, best k, bound.

    source deploy/env.sh
    python perf/speculative.py                                   # demo pair, N = 1 and 8, k = 2, 4, 6
    python perf/speculative.py --pair qwen-coder --concurrency 1,8,32 --duration 120
    python perf/speculative.py --pair qwen-coder --prompts humaneval --k 2,4 --no-adaptive --max-tokens 384 \\
        --duration 40 --repeats 2                               # the real pair on its task (~21 min here)
    python perf/speculative.py --k 4 --concurrency 1 --duration 20 --windows 2   # a smoke run
    python perf/speculative.py --pair qwen-coder --prompts gsm-symbolic --max-tokens 768 --k 4 --no-adaptive \
        --slm-only --router rstitch=rstitch:'{"tau": 0.05}' --router dv=draft_verify:'{"k": 4, "alpha": 0.3}' \
        --concurrency 1,8 --duration 120      # routing, draft-verify and speculation on long answers

One tritonserver serves the pair (``tokenrouter.tools.repository.make_variant``) with one router
model per setting: ``token_router_llm`` (algorithm ``none``, model 1: LLM-only, the baseline),
``token_router_spec_k<k>`` (algorithm ``speculative``, greedy drafts) for every ``--k`` and
``token_router_spec_adaptive`` (adaptive k,
from ``max(--k)`` up to ``--k-max``).  For every concurrency N, each setting runs as N
closed-loop clients (:class:`perf.loadgen.SteadyLoad`: greedy, ``ignore_eos``, ``--max-tokens``
output tokens, chat prompts from data/router_prompts.jsonl; ``--prompts humaneval``: HumanEval's,
stopped as ``perf/quality.py`` stops them), warms up, and is measured over
``--windows`` windows of ``--duration`` / windows seconds; the settings alternate in the order
given, repeated ``--repeats`` times, so drift of a shared host falls on all of them alike.

Reported per (N, setting), means over repeats with the per-window spread:
* ``throughput_tok_s`` (output tokens streamed per second) and its ratio to LLM-only of the same
  repeat (``speedup``); ``itl_p50_s`` … ``itl_p99_s`` (TPOT: (e2e − TTFT) / (tokens − 1) per request);
* ``acceptance_rate``: accepted / drafted tokens over the measurement (the LLM's counters
  ``drafts_accepted`` / ``drafts_verified``), ``tokens_per_round`` (output tokens per
  verification: accepted drafts + 1) and ``drafts_per_round`` (the mean k, adaptive too);
* the bound (Leviathan et al. 2023, §3.4, with measured costs): ``t_verify_llm_s``, the LLM's
  mean step in the speculative run (a verification: an extend of k + 1 tokens per request),
  against ``t_decode_llm_s``, its mean step in the LLM-only run of the same N
  (``verify_over_decode``); ``t_draft_slm_s``, the SLM's mean step; and the sequential ceiling
  ``speedup_bound = tokens_per_round × t_decode_llm / (k × t_draft_slm + t_verify_llm)``
  (one round = k drafting steps, then one verification; LLM-only writes one token per step).
  The two handoffs per round are what separates ``speedup`` from it at N = 1; at N > 1 the SLM
  drafts for some requests while the LLM verifies others, which the ceiling does not count.

* where the time goes: each model's steps per output token (``llm_steps_per_token``,
  ``slm_steps_per_token``, from its step counter) and, with memory-bound steps, the weight traffic
  an output token costs (``weight_gb_per_token``: steps per token × :func:`step_weight_gb`) and the
  speed-up that traffic alone predicts against LLM-only (``weight_traffic_speedup``).

``--slm-only`` adds the SLM alone (``token_router_slm``) and ``--router NAME=ALGO[:JSON]`` any other
router model (``token_router_NAME``: e.g. R-Stitch or draft-verify at one threshold) to the same
run, so that routing, draft-verify and speculation meet on the same prompts; every setting also
reports ``answers_per_s`` (requests completed in the windows per second), TTFT and end-to-end
p50/p90 and its LLM-token share.

The pair's models run on one torch thread each (``torch_threads`` 1), so that they step in
parallel on two cores; LLM-only then leaves a core idle.  ``--llm-threads T`` adds the LLM as a
user would serve it alone, on T threads: ``token_router_llm_t<T>``, served by ``llm_t<T>``, a
copy of the LLM in the same server (its memory is loaded twice).  Ratios stay against
``token_router_llm``; compare with this row too.

``best_k`` per N is the setting with the highest mean throughput (of all but LLM-only and SLM-only).  Raw results go to ``--out``
(default ``perf/results/speculative-<pair>.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from counters import counter_deltas, model_counters  # noqa: E402
from loadgen import SteadyLoad, load_tokenizer, triton_client, window_summary  # noqa: E402

COUNTERS = ("forward_s", "steps", "verifications", "drafts_verified", "drafts_accepted", "draft_tokens",
            "step_time_s")


def ratio_interval(ratios):
    """The geometric mean of paired ratios with its 95 % t-interval on the log scale
    (:func:`bench_matrix.ratio_interval`'s paired case).

    Args:
        ratios: positive floats, one per repeat (a setting's tokens/s over LLM-only's of the same repeat).
    Returns:
        ``[low, geo_mean, high]``, or None for fewer than two ratios (no spread to measure).
    """
    xs = [r for r in ratios if r and r > 0]
    if len(xs) < 2:
        return None
    from bench_matrix import ratio_interval as paired

    mid, low, high = paired({"throughput_repeats": xs}, {"throughput_repeats": [1.0] * len(xs)})
    return [low, mid, high]


def run_setting(url: str, router: str, prompts, n: int, max_tokens: int, duration: float, windows: int,
                tokenizer, chat: bool = True, task: str = "humaneval", llm: str = "llm") -> dict:
    """One steady-state measurement of router model ``router`` at concurrency ``n`` (``chat``: the
    server applies the chat template; false for prompts rendered client-side).  The models'
    prefix caches are emptied first: every setting sends the same prompts from the first one on,
    and would otherwise find the previous setting's prompts cached."""
    from tokenrouter.tools import admin

    for m in ("slm", llm):
        admin.flush(url, m)
    gen = triton_client(url, router, chat=chat)
    if not chat:  # a task's: requests stop as perf/quality.py's do (HumanEval: code block's end; EOS)
        from quality import task_sampling

        gen = task_sampling(gen, task)
    load = SteadyLoad(gen, prompts, n, max_tokens, tokenizer=tokenizer).start()
    try:
        def probe():  # the counters of the setting's LLM, under the key "llm"
            c = model_counters(url, COUNTERS, ("slm", llm))
            return {"slm": c["slm"], "llm": c[llm]}

        m = load.measure(duration, windows, probe=probe, since=load.t_started)
        records = load.snapshot()
    finally:
        load.stop(cancel=True)
    res = window_summary(records, m["bounds"], llm=llm, probes=None, latencies="completed")
    d = counter_deltas(m["probes"][0], m["probes"][-1])
    res["acceptance_rate"] = (d["llm"]["drafts_accepted"] / d["llm"]["drafts_verified"]
                              if d["llm"]["drafts_verified"] else None)
    v = d["llm"]["verifications"]
    res["verifications"] = int(v)
    res["tokens_per_round"] = (d["llm"]["drafts_accepted"] + v) / v if v else None
    res["drafts_per_round"] = d["slm"]["draft_tokens"] / v if v else None
    # mean forward time of one step (s): the LLM's steps are decodes (LLM-only) or verifications
    # (speculative: an extend of k + 1 tokens per request), the SLM's are drafting steps
    res["t_step_llm_s"] = d["llm"]["forward_s"] / d["llm"]["steps"] if d["llm"]["steps"] else None
    res["t_step_slm_s"] = d["slm"]["forward_s"] / d["slm"]["steps"] if d["slm"]["steps"] else None
    # steps per output token: with memory-bound steps, what each model's weights cost an answer
    for side in ("llm", "slm"):
        res[f"{side}_steps"] = int(d[side]["steps"])
        res[f"{side}_steps_per_token"] = (d[side]["steps"] / res["output_tokens"]
                                          if res.get("output_tokens") else None)
    res["llm_busy_share"] = d["llm"]["step_time_s"] / (m["bounds"][-1] - m["bounds"][0])
    res["slm_busy_share"] = d["slm"]["step_time_s"] / (m["bounds"][-1] - m["bounds"][0])
    return res


def step_weight_gb(repo: str, model: str) -> float | None:
    """GB of weights one forward step of ``model`` (a model of the run's repository) reads: the
    parameters of its safetensors checkpoint in the dtype it is served in (its ``dtype``, ``auto``
    resolved as the engine resolves it on this host), an untied input embedding counted as nothing
    (a step looks up one row per token).  None where the checkpoint has no safetensors files.

    A decoding step of a few rows is memory-bound on a CPU, so ``steps per output token × this``
    is the weight traffic an answer costs (the ``weight_gb_per_token`` of a setting).
    """
    import glob
    import math
    import struct

    from tokenrouter.engine.device import resolve_dtype
    from tokenrouter.tools.repository import read_config
    from tokenrouter.triton.common import resolve_model_path

    params = read_config(os.path.join(repo, model, "config.pbtxt")).parameters
    path = resolve_model_path(params["model_path"].string_value)
    dtype = resolve_dtype(params["dtype"].string_value if "dtype" in params else "auto", "cpu")
    counts = {}
    for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        with open(f, "rb") as fh:
            header = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
        for name, t in header.items():
            if name != "__metadata__":
                counts[name] = math.prod(t["shape"])
    if not counts:
        return None
    n = sum(counts.values())
    if "lm_head.weight" in counts:  # untied: the input embedding is looked up, not read whole
        n -= sum(c for name, c in counts.items() if name.endswith("embed_tokens.weight"))
    return n * {"float32": 4, "float16": 2, "bfloat16": 2}[dtype] / 1e9


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", default="demo", help="a pair of tokenrouter.tools.repository.PAIRS (default demo)")
    ap.add_argument("--concurrency", default="1,8", help="comma-separated N (default 1,8)")
    ap.add_argument("--k", default="2,4,6", help="comma-separated drafts per round (default 2,4,6); none: no speculative setting")
    ap.add_argument("--k-max", type=int, default=8, help="largest k of the adaptive setting (default 8)")
    ap.add_argument("--no-adaptive", action="store_true", help="leave out the adaptive-k setting")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds measured per setting and repeat")
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--kv-pool-tokens", type=int, default=16384)
    ap.add_argument("--prompts", choices=("chat", "humaneval", "gsm-symbolic", "math500"), default="chat",
                    help="chat = data/router_prompts.jsonl with the server's chat template (default); "
                         "humaneval = HumanEval's 164 problems as perf/quality.py renders and stops them "
                         "(--max-tokens is then the cap); gsm-symbolic / math500: that task's test split")
    ap.add_argument("--slm-only", action="store_true", help="also measure the SLM alone (token_router_slm)")
    ap.add_argument("--model-param", action="append", default=[], metavar="KEY=VALUE",
                    help="a parameter of both models' config.pbtxt for the whole run, e.g. "
                         "cpu_linear_row_buckets=false (repeatable)")
    ap.add_argument("--llm-threads", type=int, default=0, metavar="T",
                    help="also measure the LLM alone on T torch threads (token_router_llm_t<T>, served by a copy "
                         "llm_t<T> of the LLM; the pair's models run on one thread each, so that they step in "
                         "parallel: this is the LLM as a user would serve it alone on T cores). The copy is a third "
                         "model in memory: the qwen-coder pair in float32 (a CPU without native bf16) then needs "
                         "about 25 GB, and on 24 GiB a model is killed for memory")
    ap.add_argument("--router", action="append", default=[], metavar="NAME=ALGO[:JSON]",
                    help="another setting in the same run: a router model NAME (token_router_NAME) with algorithm "
                         "ALGO and its parameters, e.g. rstitch=rstitch:'{\"tau\": 0.05}' or "
                         "dv=draft_verify:'{\"k\": 4, \"alpha\": 0.3}' (repeatable)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    from tokenrouter.tools.repository import make_variant
    from tritonserver import TritonServer, exit_on_termination

    exit_on_termination()  # killed or timed out: leave the with-block, so that the server stops too

    ks = [] if a.k.strip().lower() in ("", "none") else [int(k) for k in a.k.split(",")]
    if not ks and not a.no_adaptive:
        ap.error("--k none leaves no k for the adaptive setting: add --no-adaptive")
    ns = [int(n) for n in a.concurrency.split(",")]
    routers = {"token_router_llm": {"algorithm": "none", "algorithm_params": '{"model": 1}'}}
    for k in ks:
        routers[f"token_router_spec_k{k}"] = {"algorithm": "speculative", "algorithm_params": json.dumps({"k": k})}
    if a.slm_only:
        routers["token_router_slm"] = {"algorithm": "none", "algorithm_params": '{"model": 0}'}
    for spec in a.router:
        name, _, rest = spec.partition("=")
        algo, _, params = rest.partition(":")
        if not name or not algo:
            ap.error(f"--router takes NAME=ALGO[:JSON], got {spec!r}")
        try:
            json.loads(params or "{}")
        except ValueError as e:
            ap.error(f"--router {spec!r}: the parameters are not JSON ({e})")
        routers[f"token_router_{name}"] = {"algorithm": algo, "algorithm_params": params or "{}"}
    if not a.no_adaptive:
        routers["token_router_spec_adaptive"] = {"algorithm": "speculative", "algorithm_params": json.dumps(
            {"k": max(ks), "adaptive": True, "k_max": a.k_max})}
    pool = {"kv_pool_tokens": str(a.kv_pool_tokens), "max_running_requests": str(max(64, 2 * max(ns)))}
    for kv in a.model_param:
        key, eq, value = kv.partition("=")
        if not eq or not key:
            ap.error(f"--model-param takes KEY=VALUE, got {kv!r}")
        pool[key.strip()] = value.strip()
    tmp = tempfile.mkdtemp(prefix="bench-speculative-")
    repo = make_variant(str(ROOT / "model_repository"), os.path.join(tmp, "repo"), pair=a.pair,
                        model_params={"slm": pool, "llm": pool}, routers=routers)
    llm_of = {name: "llm" for name in routers}  # the model each setting's counters are read from
    if a.llm_threads > 0:
        from tokenrouter.tools.repository import add_router

        solo = f"llm_t{a.llm_threads}"
        add_router(repo, solo, {"torch_threads": a.llm_threads}, src="llm")  # a copy of the LLM, T threads
        name = f"token_router_{solo}"
        routers[name] = {"algorithm": "none", "algorithm_params": '{"model": 1}', "models": f"slm,{solo}"}
        add_router(repo, name, routers[name])
        llm_of[name] = solo
    if a.prompts != "chat":
        from quality import router_tokenizer, task_prompts

        prompts = task_prompts(router_tokenizer(repo), a.prompts, "all" if a.prompts == "humaneval" else "test")
    else:
        prompts = [json.loads(line)["prompt"] for line in open(ROOT / "data" / "router_prompts.jsonl")
                   if line.strip()]
    from tokenrouter.tools.repository import read_config
    tok_path = read_config(os.path.join(repo, "token_router", "config.pbtxt")).parameters["tokenizer_path"].string_value
    weights = os.environ.get("TOKENROUTER_WEIGHTS", "")
    tokenizer = load_tokenizer(tok_path if os.path.isabs(tok_path) else os.path.join(weights, tok_path))
    gb_step = {m: step_weight_gb(repo, m) for m in set(llm_of.values()) | {"slm"}}
    results = {}
    t_start = time.time()
    with TritonServer(repo, log_path=os.path.join(tmp, "tritonserver.log")) as srv:
        url = srv.grpc_url
        for n in ns:
            per = {name: [] for name in routers}

            def mean_of(rs, key):
                xs = [r[key] for r in rs if r.get(key) is not None]
                return statistics.fmean(xs) if len(xs) == len(rs) else None
            for rep in range(a.repeats):
                for name in routers:
                    r = run_setting(url, name, prompts, n, a.max_tokens, a.duration, a.windows, tokenizer,
                                    chat=a.prompts == "chat", task=a.prompts, llm=llm_of[name])
                    per[name].append(r)
                    print(f"N={n} rep={rep} {name:14s} {r['throughput_tok_s']:7.2f} tok/s  "
                          f"{r['requests_per_s']:.4f} answers/s  LLM share {r.get('llm_share')}  "
                          f"ITL p50 {r['itl_p50_s'] * 1e3:7.1f} ms  acceptance {r['acceptance_rate']}  "
                          f"LLM step {r['t_step_llm_s']}  SLM step {r['t_step_slm_s']}", flush=True)
            base = per["token_router_llm"]
            summary = {}
            for name, runs in per.items():
                tps = [r["throughput_tok_s"] for r in runs]
                row = {"throughput_tok_s": statistics.fmean(tps),
                       "speedup": statistics.fmean(r["throughput_tok_s"] / b["throughput_tok_s"]
                                                   for r, b in zip(runs, base)),
                       # paired over repeats: each repeat's ratio to LLM-only of the same repeat
                       "speedup_per_repeat": [r["throughput_tok_s"] / b["throughput_tok_s"]
                                              for r, b in zip(runs, base)],
                       "answers_speedup_per_repeat": [r["requests_per_s"] / b["requests_per_s"]
                                                      if b["requests_per_s"] else None
                                                      for r, b in zip(runs, base)],
                       "speedup_ci95": ratio_interval([r["throughput_tok_s"] / b["throughput_tok_s"]
                                                       for r, b in zip(runs, base)]),
                       **{q: statistics.fmean(r[q] for r in runs) for q in
                          ("itl_p50_s", "itl_p90_s", "itl_p99_s", "ttft_p50_s", "ttft_p90_s", "e2e_p50_s",
                           "e2e_p90_s") if all(r.get(q) is not None for r in runs)},
                       # answers/s: requests completed inside the windows, and output tokens/s over the
                       # mean answer length of the completed requests (steadier with few long answers)
                       "answers_per_s": statistics.fmean(r["requests_per_s"] for r in runs),
                       "llm_share": statistics.fmean(r["llm_share"] for r in runs
                                                     if r.get("llm_share") is not None) if any(
                           r.get("llm_share") is not None for r in runs) else None,
                       "runs": runs}
                if name != "token_router_llm":
                    def mean(key, rs=runs):
                        xs = [r[key] for r in rs if r.get(key) is not None]
                        return statistics.fmean(xs) if xs else None
                    row["acceptance_rate"] = mean("acceptance_rate")
                    t_dec, t_ver, t_dr = mean("t_step_llm_s", base), mean("t_step_llm_s"), mean("t_step_slm_s")
                    tpr, k = mean("tokens_per_round"), mean("drafts_per_round")
                    row.update(tokens_per_round=tpr, drafts_per_round=k, t_decode_llm_s=t_dec, t_verify_llm_s=t_ver,
                               t_draft_slm_s=t_dr)
                    if None not in (t_dec, t_ver, t_dr, tpr, k):
                        # sequential bound: one round = k drafting steps + one verify step, LLM-only
                        # writes one token per decode step (Leviathan et al. 2023, §3.4, measured costs)
                        row.update(verify_over_decode=t_ver / t_dec,
                                   speedup_bound=tpr * t_dec / (k * t_dr + t_ver))
                gb = {"llm": gb_step.get(llm_of[name]), "slm": gb_step.get("slm")}
                per_tok = [mean_of(runs, f"{side}_steps_per_token") for side in ("llm", "slm")]
                if None not in (gb["llm"], gb["slm"]) and all(x is not None for x in per_tok):
                    row["llm_steps_per_token"], row["slm_steps_per_token"] = per_tok
                    row["weight_gb_per_token"] = per_tok[0] * gb["llm"] + per_tok[1] * gb["slm"]
                summary[name] = row
            base_gb = summary["token_router_llm"].get("weight_gb_per_token")
            for row in summary.values():  # the speed-up memory-bound steps predict: weight traffic's
                if base_gb and row.get("weight_gb_per_token"):
                    row["weight_traffic_speedup"] = base_gb / row["weight_gb_per_token"]
            best = max((nm for nm in summary if nm not in ("token_router_llm", "token_router_slm")
                        and not nm.startswith("token_router_llm_t")),
                       key=lambda nm: summary[nm]["throughput_tok_s"], default="token_router_llm")
            results[str(n)] = {"settings": summary, "best": best}
            print(f"N={n}: best {best} ({summary[best]['speedup']:.2f}x LLM-only)", flush=True)
    out = a.out or str(ROOT / "perf" / "results" / f"speculative-{a.pair}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    meta = {"pair": a.pair, "model_params": pool, "weight_gb_per_step": gb_step, "prompts": a.prompts, "concurrency": ns, "k": ks, "max_tokens": a.max_tokens, "duration_s": a.duration,
            "windows": a.windows, "repeats": a.repeats, "routers": routers, "started": t_start,
            "command": "python perf/speculative.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    with open(out, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
