"""What oneDNN's bounded per-shape kernel caches cost a routed step, with and without row buckets.

    source deploy/env.sh
    python perf/kernel_cache_step.py                      # Qwen2.5-Coder-1.5B's linear shapes, ~2 min
    python perf/kernel_cache_step.py --steps 600 --layers 28

A routed step's rows (tokens) are decode rows plus resume extends of a few tokens each, so its
row count changes from step to step.  oneDNN creates a kernel (a JIT-compiled primitive) per
input shape and keeps it in two LRU caches bounded by ``cpu_kernel_cache_entries`` (256 by
default: docs/reliability.md, "Memory over time").  This runs the linear layers of one decoder
layer of the model's shapes (qkv, o, gate_up, down; bfloat16, prepacked as the engine packs them:
:mod:`tokenrouter.engine.cpu.linear`) ``--layers`` times per step, for ``--steps`` steps whose row
counts are drawn from a routed mix (``--rows LOW,HIGH``), in three settings, each in a fresh
process (the libraries read the capacities once):

* ``caches 256``: the engine's default bound, every row count as it comes;
* ``caches 1024``: the libraries' own default, every row count as it comes;
* ``caches 256 + buckets``: the default bound with rows padded to ``row_bucket`` (the default).

Reported per setting: the mean and p50/p90 step time (ms) after a warm-up pass over the same row
counts, the process's resident memory, and its anonymous part before and after one
``malloc_trim(0)`` (what the models' ``malloc_trim_interval_s`` gives back).  Raw JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: Qwen2.5-Coder-1.5B: hidden 1536, intermediate 8960, 12 query heads and 2 KV heads of 128
SHAPES = {"qkv": (1536, 1536 + 2 * 256), "o": (1536, 1536), "gate_up": (1536, 2 * 8960), "down": (8960, 1536)}
SETTINGS = {"caches 256": (256, False), "caches 1024": (1024, False), "caches 256 + buckets": (256, True)}


def child(entries: int, buckets: bool, steps: int, layers: int, lo: int, hi: int, seed: int) -> dict:
    """One setting in this process (the capacities must be set before torch's first oneDNN call)."""
    for var in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY"):
        os.environ[var] = str(entries)
    import torch

    sys.path.insert(0, str(ROOT / "python_backend_src"))
    from types import SimpleNamespace

    from tokenrouter.engine.cpu.linear import _PrepackedLinear
    from tokenrouter.engine.host_memory import HostMemoryTrimmer, resident_anonymous_bytes

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    layers_ = []
    for name, (k, n) in SHAPES.items():
        w = torch.randn(n, k, dtype=torch.bfloat16) * 0.02
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 8)
        layers_.append((k, _PrepackedLinear(SimpleNamespace(apply=None), packed, False, buckets)))
    rng = random.Random(seed)
    rows = [rng.randint(lo, hi) for _ in range(steps)]

    def step(m: int) -> float:
        t0 = time.perf_counter()
        for _ in range(layers):
            for k, lin in layers_:
                lin.apply(None, torch.zeros(m, k, dtype=torch.bfloat16))
        return time.perf_counter() - t0

    for m in rows:  # warm-up pass: what fits in the caches is in them
        step(m)
    times = sorted(step(m) for m in rows)
    rss = int(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmRSS"))) / 1024
    anon = resident_anonymous_bytes() / 2**20
    trimmer = HostMemoryTrimmer(1e-9)  # what the models' periodic malloc_trim gives back
    trimmer.maybe_trim()
    return {"entries": entries, "buckets": buckets, "distinct_rows": len(set(rows)),
            "step_ms_mean": 1e3 * sum(times) / len(times), "step_ms_p50": 1e3 * times[len(times) // 2],
            "step_ms_p90": 1e3 * times[int(0.9 * len(times))], "rss_mib": rss,
            "anon_mib": anon, "anon_after_malloc_trim_mib": resident_anonymous_bytes() / 2**20}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--layers", type=int, default=4, help="decoder layers' linears run per step")
    ap.add_argument("--rows", default="8,120", metavar="LOW,HIGH", help="a step's row counts, drawn uniformly")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    lo, hi = (int(x) for x in a.rows.split(","))
    if a.child:
        entries, buckets = SETTINGS[a.child]
        print(json.dumps(child(entries, buckets, a.steps, a.layers, lo, hi, a.seed)))
        return 0
    results = {}
    for name in SETTINGS:
        out = subprocess.run([sys.executable, __file__, "--child", name, "--steps", str(a.steps), "--layers",
                              str(a.layers), "--rows", a.rows, "--seed", str(a.seed)],
                             capture_output=True, text=True, check=True)
        results[name] = json.loads(out.stdout.strip().splitlines()[-1])
        r = results[name]
        print(f"{name:22s} step mean {r['step_ms_mean']:7.1f} ms  p50 {r['step_ms_p50']:7.1f}  "
              f"p90 {r['step_ms_p90']:7.1f}  RSS {r['rss_mib']:.0f} MiB  anonymous {r['anon_mib']:.0f} MiB, "
              f"{r['anon_after_malloc_trim_mib']:.0f} after malloc_trim  ({r['distinct_rows']} row counts)",
              flush=True)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"command": "python perf/kernel_cache_step.py " + " ".join(
            sys.argv[1:] if argv is None else argv), "shapes": SHAPES, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
