"""tritonserver's memory under one kind of traffic at a time (docs/reliability.md, "Memory over time").

Sends N requests of one kind to a running server, ``--concurrency`` at once, and prints
tritonserver's resident memory (``/proc/PID/status``: ``VmRSS``, ``RssAnon``, ``RssShmem``,
``RssFile``, in MiB) before and after, and the change per 100 requests, as one JSON line.  Kinds:
those of ``tokenrouter.tools.soak`` (``stream``, ``plain``, ``cancel``, ``disconnect``, ``bad``),
one of its hostile inputs (``hostile:NAME``, NAME in :data:`tokenrouter.tools.soak.HOSTILE`:
``huge_prompt``, ``long_stop``, ``many_stops``, ``deep_json``, ``many_stop_ids``), ``stats`` (a
model's ``stats`` op, through Triton) or ``ready`` (one 1-token request through the router).

Usage (a server started with ``deploy/serve --pair demo --background``)::

    python perf/traffic_memory.py hostile:huge_prompt 20 --concurrency 4 \\
        --server-pid "$(cat ~/.cache/tokenrouter/run/tritonserver.pid)"
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from typing import Dict

from tokenrouter.tools import admin, default_grpc_url, soak

FIELDS = ("VmRSS", "RssAnon", "RssShmem", "RssFile")


def memory_mib(pid: int) -> Dict[str, float]:
    """The :data:`FIELDS` of ``/proc/PID/status``, in MiB."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in FIELDS:
                out[key] = round(int(value.split()[0]) / 1024, 1)
    return out


def one(kind: str, rng: random.Random, a: argparse.Namespace) -> str:
    """Send one request of ``kind``; return its outcome (``ok``, ``error``, ``cancelled``, ...)."""
    if kind in ("plain", "stream", "cancel", "disconnect", "bad"):
        return soak._one(a.url, a.router, rng, kind, 300, a.thresholds, max_tokens=a.max_tokens,
                         long_fraction=a.long_fraction)["outcome"]
    if kind.startswith("hostile:") and kind[len("hostile:"):] in soak.HOSTILE:
        return soak._one(a.url, a.router, rng, "hostile", 300, a.thresholds, hostile_mib=a.hostile_mib,
                         hostile_names=[kind[len("hostile:"):]])["outcome"]
    if kind == "stats":
        admin.model_stats(a.url, rng.choice(a.models))
        return "ok"
    if kind == "ready":
        return "ok" if admin.router_ready(a.url, a.router)["ready"] else "not-ready"
    raise SystemExit(f"unknown kind {kind!r} (see the module docstring)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kind")
    ap.add_argument("n", type=int, help="requests to send")
    ap.add_argument("--server-pid", type=int, required=True, help="the tritonserver's pid")
    ap.add_argument("--url", default=default_grpc_url(), help="Triton gRPC address")
    ap.add_argument("--router", default="token_router")
    ap.add_argument("--models", default="slm,llm", help="models the stats ops go to")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", default="4,16", metavar="LOW,HIGH")
    ap.add_argument("--long-fraction", type=float, default=0.0, help="share of long prompts (as the soak's)")
    ap.add_argument("--hostile-mib", type=float, default=32.0)
    ap.add_argument("--thresholds", default="0.1,0.2,0.3")
    a = ap.parse_args(argv)
    a.max_tokens = tuple(int(x) for x in a.max_tokens.split(","))
    a.thresholds = [float(x) for x in a.thresholds.split(",") if x.strip()]
    a.models = [m for m in a.models.split(",") if m]
    before, t0 = memory_mib(a.server_pid), time.monotonic()
    lock, sent, outcomes = threading.Lock(), [0], {}

    def client(i: int) -> None:
        rng = random.Random(1000 + i)
        while True:
            with lock:
                if sent[0] >= a.n:
                    return
                sent[0] += 1
            outcome = one(a.kind, rng, a)
            with lock:
                outcomes[outcome] = outcomes.get(outcome, 0) + 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(a.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    time.sleep(2)  # the server frees a request's state once its end reaches the completion queue
    after = memory_mib(a.server_pid)
    delta = {k: round(after[k] - before[k], 1) for k in before}
    print(json.dumps({"kind": a.kind, "n": a.n, "concurrency": a.concurrency,
                      "seconds": round(time.monotonic() - t0, 1), "outcomes": outcomes, "before_mib": before,
                      "after_mib": after, "delta_mib": delta,
                      "per_100_mib": {k: round(100 * v / a.n, 2) for k, v in delta.items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
