"""Step latencies of one model's engine alone, without a server (CPU or GPU).

Loads one :class:`tokenrouter.engine.sglang_engine.SGLangEngine` in this process and times
:meth:`SGLangEngine.calibrate`'s synthetic steps (prefill, decode, and a resume
step in which one row has 2 new tokens) at the given batch sizes.  One warm-up
pass runs first, so the timed pass sees warm kernels.

``--sglang-decode`` swaps the batched CPU decode attention back to SGLang's own
per-request loop (``TorchNativeAttnBackend._run_sdpa_forward_decode``), the
comparison in docs/performance.md ("Engine step times").  Resume steps run as
extend forwards and keep the batched extend attention either way.

    source deploy/env.sh
    python perf/engine_steps.py                                   # SLM as the size-realistic pair serves it (dtype auto), 1 thread, batch 1, 8, 32
    python perf/engine_steps.py --dtype float32                   # the demo pair's dtype
    python perf/engine_steps.py --sglang-decode                   # the same with SGLang's decode loop
    python perf/engine_steps.py --model llama-size-realistic --load-format dummy
    python perf/engine_steps.py --batch-sizes 8 --profile                   # where a step's time goes
    python perf/engine_steps.py --batch-sizes 8 --context 480 --kv-gather both       # K/V gather: served vs earlier, alternated
    python perf/engine_steps.py --model qwen2.5-coder-1.5b-instruct --threads 2 --batch-sizes 1,2 --context 256 \
        --mmap-thresholds 33554432,1048576                              # glibc's mmap threshold, alternated

``--profile`` then also runs ``--decode-steps`` more decode steps of max(batch sizes) rows
under ``torch.profiler`` and prints the operators by self CPU time; the row named
``step[DECODE …]`` is the step's own Python, outside any operator.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct",
                    help="folder under $TOKENROUTER_WEIGHTS, or an absolute path (default smollm2-135m-instruct)")
    ap.add_argument("--dtype", default="auto",
                    help="float32, bfloat16, float16 or auto (default; the size-realistic pair's: bfloat16 where "
                         "the CPU has native bf16, else float32)")
    ap.add_argument("--cpu-linear-weights", default="packed",
                    help="dual, packed (default; the size-realistic pair's) or rowmajor")
    ap.add_argument("--load-format", default="auto", help="auto, or dummy for random weights")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1, as served)")
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--context", type=int, default=96, help="prompt tokens per synthetic sequence (default 96)")
    ap.add_argument("--decode-steps", type=int, default=6)
    ap.add_argument("--sglang-decode", action="store_true",
                    help="use SGLang's per-request decode attention loop instead of the batched one")
    ap.add_argument("--kv-gather", choices=("head-rows", "two-copy", "both"), default="head-rows",
                    help="batched attention's K/V gather: head-rows (served: one copy, head-major), "
                         "two-copy (whole tokens, then a transposing copy), or both: the two alternated "
                         "in this process (--alternations), compared on max(batch sizes) rows")
    ap.add_argument("--alternations", type=int, default=8,
                    help="--kv-gather both, --mmap-thresholds: pairs of timed passes, the order alternating (default 8)")
    ap.add_argument("--mmap-thresholds", default="", metavar="A,B",
                    help="time whole calibration passes (prefill, decode, resume at each batch size) with glibc's "
                         "mmap threshold at A and at B bytes in turn, in this process (malloc_mmap_threshold_bytes; "
                         "32 MiB, the most glibc allows, stands for glibc's own dynamic threshold after warm-up)")
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("--profile", action="store_true",
                    help="also profile decode steps of max(batch sizes) rows with torch.profiler")
    a = ap.parse_args(argv)
    try:
        bs = [int(x) for x in a.batch_sizes.split(",") if x]
    except ValueError:
        ap.error("--batch-sizes takes comma-separated integers")
    if not bs or min(bs) < 1 or a.context < 1 or a.decode_steps < 1 or a.threads < 1 or a.alternations < 1:
        ap.error("--batch-sizes, --context, --decode-steps, --threads and --alternations take positive integers")

    from tokenrouter.engine.config import EngineConfig
    from tokenrouter.engine.sglang_engine import SGLangEngine
    from tokenrouter.triton.common import resolve_model_path

    need = max(bs) * (a.context + a.decode_steps + 4)
    engine = SGLangEngine(EngineConfig(model_path=resolve_model_path(a.model), dtype=a.dtype,
                                       load_format=a.load_format, torch_threads=a.threads,
                                       cpu_linear_weights=a.cpu_linear_weights,
                                       kv_pool_tokens=max(4096, 2 * need), max_running_requests=max(bs) + 1))
    if a.sglang_decode:
        from sglang.srt.layers.attention import torch_native_backend as tnb

        from tokenrouter.engine.cpu import attention
        if attention._orig_sdpa_decode is None:
            ap.error("--sglang-decode: the batched CPU attention is not installed here (a GPU host?)")
        tnb.TorchNativeAttnBackend._run_sdpa_forward_decode = attention._orig_sdpa_decode
    if a.kv_gather == "two-copy":
        from tokenrouter.engine.cpu import attention
        attention.HEAD_ROW_GATHER = False
    engine.calibrate(bs, context=a.context, decode_steps=2)  # warm-up
    if a.mmap_thresholds:
        try:
            pair = [int(x) for x in a.mmap_thresholds.split(",")]
            if len(pair) != 2:
                raise ValueError
        except ValueError:
            ap.error("--mmap-thresholds takes two integers A,B (bytes)")
        return _alternate_mmap_thresholds(engine, bs, a.context, a.decode_steps, a.alternations, pair, a.json)
    if a.kv_gather == "both":
        return _alternate_kv_gather(engine, max(bs), a.context, a.decode_steps, a.alternations)
    rows = engine.calibrate(bs, context=a.context, decode_steps=a.decode_steps)
    attn = "per-request (SGLang's)" if a.sglang_decode else f"batched, {a.kv_gather} K/V gather"
    print(f"{a.model} ({engine.dtype}, {a.cpu_linear_weights} linear weights, {a.threads} thread(s), "
          f"context {a.context}, {attn} decode attention)")
    print("| rows | decode median ms | resume ms | prefill ms (rows per step) |")
    print("|---|---|---|---|")
    for r in rows:
        pre = ", ".join(f"{p['latency_s'] * 1e3:.0f} ({p['rows']})" for p in r["prefill"])
        print(f"| {r['batch_size']} | {r['decode_median_s'] * 1e3:.1f} | {r['resume_latency_s'] * 1e3:.1f} | {pre} |")
    if a.profile:
        _profile_decode(engine, max(bs), a.context, a.decode_steps)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": a.model, "dtype": engine.dtype, "cpu_linear_weights": a.cpu_linear_weights,
                       "threads": a.threads, "context": a.context, "decode_attention": attn, "rows": rows}, f, indent=1)
    return 0


def _alternate_kv_gather(engine, rows: int, context: int, steps: int, pairs: int) -> int:
    """Time ``rows``-row decode steps with each K/V gather in turn, ``pairs`` times (order
    alternating: AB, BA, ...), in this one process, and print each side's median step time
    (the median of a pass's ``steps`` decode steps, in ms) and the paired ratio two-copy /
    head-rows per pair (median, min, max): on a host whose speed drifts, pairs taken
    minutes apart in separate runs do not separate a 5-10 % change."""
    import statistics

    from tokenrouter.engine.cpu import attention

    times = {True: [], False: []}
    for i in range(pairs):
        for flag in ((False, True) if i % 2 == 0 else (True, False)):
            attention.HEAD_ROW_GATHER = flag
            times[flag].append(engine.calibrate([rows], context=context, decode_steps=steps)[0]["decode_median_s"] * 1e3)
    attention.HEAD_ROW_GATHER = True
    ratios = [a / b for a, b in zip(times[False], times[True])]
    print(f"{rows} rows, context {context}, {pairs} alternations: decode step median two-copy "
          f"{statistics.median(times[False]):.1f} ms, head-rows {statistics.median(times[True]):.1f} ms; "
          f"two-copy / head-rows per pair: median {statistics.median(ratios):.3f} "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f})")
    return 0


def _alternate_mmap_thresholds(engine, bs, context: int, steps: int, pairs: int, thresholds, out) -> int:
    """Run ``engine.calibrate(bs, context, steps)`` with glibc's mmap threshold at each of
    ``thresholds`` (bytes) in turn, ``pairs`` times (order alternating: AB, BA, ...), in this one
    process (:func:`tokenrouter.engine.host_memory.set_mmap_threshold`), and print per batch size each
    side's median prefill, decode (median step) and resume time in ms and the paired ratio B / A of
    each (median, min, max over the pairs).  Writes every pass to ``out`` (JSON) when given.

    Raises:
        SystemExit: the C library is not glibc (no ``mallopt``).
    """
    import statistics

    from tokenrouter.engine.host_memory import set_mmap_threshold

    passes = []
    for i in range(pairs):
        for side in ((0, 1) if i % 2 == 0 else (1, 0)):
            if not set_mmap_threshold(thresholds[side]):
                raise SystemExit("--mmap-thresholds: this C library has no mallopt (not glibc)")
            for r in engine.calibrate(bs, context=context, decode_steps=steps):
                passes.append({"pair": i, "threshold_bytes": thresholds[side], "batch_size": r["batch_size"],
                               "prefill_ms": 1e3 * sum(p["latency_s"] for p in r["prefill"]),
                               "decode_ms": 1e3 * r["decode_median_s"], "resume_ms": 1e3 * r["resume_latency_s"]})
    print(f"context {context}, {pairs} alternations, mmap threshold A = {thresholds[0]} B = {thresholds[1]} bytes")
    print("| rows | step | A median ms | B median ms | B / A per pair: median (min, max) |")
    print("|---|---|---|---|---|")
    summary = []
    for b in bs:
        for kind in ("prefill_ms", "decode_ms", "resume_ms"):
            side = [[p[kind] for p in passes if p["batch_size"] == b and p["threshold_bytes"] == t]
                    for t in thresholds]
            ratios = [y / x for x, y in zip(*side)]
            row = {"batch_size": b, "step": kind[:-3], "a_median_ms": statistics.median(side[0]),
                   "b_median_ms": statistics.median(side[1]), "ratio_median": statistics.median(ratios),
                   "ratio_min": min(ratios), "ratio_max": max(ratios)}
            summary.append(row)
            print(f"| {b} | {row['step']} | {row['a_median_ms']:.1f} | {row['b_median_ms']:.1f} | "
                  f"{row['ratio_median']:.3f} ({row['ratio_min']:.3f}, {row['ratio_max']:.3f}) |")
    if out:
        with open(out, "w") as f:
            json.dump({"context": context, "decode_steps": steps, "alternations": pairs,
                       "thresholds_bytes": list(thresholds), "threads": torch_threads(), "summary": summary,
                       "passes": passes}, f, indent=1)
    return 0


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _profile_decode(engine, rows: int, context: int, steps: int) -> None:
    """Print ``torch.profiler``'s operator table (by self CPU time) over ``steps`` decode steps
    of ``rows`` synthetic sequences of ``context`` tokens, after 2 untimed steps."""
    import random

    from torch.profiler import ProfilerActivity, profile

    rng = random.Random(0)
    seqs = [engine.add(f"__profile-{j}", [rng.randrange(engine.vocab_size) for _ in range(context)])
            for j in range(rows)]
    def step() -> None:
        engine.forward(seqs)
        for s in seqs:
            s.tokens.append(rng.randrange(engine.vocab_size))

    try:
        for _ in range(3):  # the prefill and 2 untimed decode steps
            step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                step()
    finally:
        for s in seqs:
            engine.release(s)
    print(f"\ntorch.profiler, {steps} decode steps of {rows} rows (self CPU time per step = total / {steps}):")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    raise SystemExit(main())
