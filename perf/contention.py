"""Each model's step time alone and while the other model steps, from a served run's step events.

Both models of a pair step on the same machine: on a CPU they share the cores' memory
bandwidth and caches, on a GPU the device.  This reads the models' routing-event logs
(``event_log`` parameter, JSON Lines; a ``step`` event's ``t`` is its end and
``latency_s`` its duration), keeps the pure decode steps (``extend_tokens`` 0), and for each
one computes the share of its duration during which the other model was also in a step.
It prints, per model and batch size, the median step time of the steps that overlapped the
other model's steps for less than ``--alone`` of their time and for more than
``--during``, and their ratio; with ``--calibration`` (``python -m scheduler_model
calibrate``'s output: each model stepped while the other was idle) also the calibrated
decode time.

    python perf/contention.py --events perf/results/dtmc-amd-248/events-slm.jsonl \\
        perf/results/dtmc-amd-248/events-llm.jsonl --calibration perf/results/dtmc-amd-248/calibration.json
"""

from __future__ import annotations

import argparse
import bisect
import json
import statistics
from typing import Dict, List, Sequence, Tuple


def load_steps(path: str) -> Tuple[str, List[Dict]]:
    """The ``step`` events of one model's event log, and that model's name.

    Raises:
        ValueError: no step event, or steps of several models in one file.
    """
    steps = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                e = json.loads(line)
                if e.get("event") == "step":
                    steps.append(e)
    names = {e["model"] for e in steps}
    if len(names) != 1:
        raise ValueError(f"{path}: expected the steps of one model, found {sorted(names) or 'none'}")
    return names.pop(), steps


def overlap_shares(steps: Sequence[Dict], other: Sequence[Dict]) -> List[float]:
    """For each step of ``steps``, the share (0-1) of its duration inside any step of ``other``.

    Steps are intervals ``[t - latency_s, t]`` in seconds; one model's steps do not overlap
    each other (a model runs one step at a time), so the shares are sums of pairwise overlaps.
    """
    iv = sorted((e["t"] - e["latency_s"], e["t"]) for e in other)
    ends = [b for _, b in iv]
    out = []
    for e in steps:
        a, b = e["t"] - e["latency_s"], e["t"]
        i, tot = bisect.bisect_right(ends, a), 0.0
        while i < len(iv) and iv[i][0] < b:
            tot += max(0.0, min(b, iv[i][1]) - max(a, iv[i][0]))
            i += 1
        out.append(tot / (b - a) if b > a else 0.0)
    return out


def contention_table(steps: Sequence[Dict], other: Sequence[Dict], alone: float = 0.05,
                     during: float = 0.95, min_steps: int = 5) -> List[Dict]:
    """Median pure-decode step time per batch size, alone against while ``other`` steps.

    Returns:
        one dict per batch size (ascending) with at least ``min_steps`` steps in either
        group: ``batch_size``, ``alone_s`` / ``during_s`` (medians in s, None below
        ``min_steps`` steps), ``n_alone`` / ``n_during``, ``ratio`` (during / alone, or None).
    """
    dec = [e for e in steps if not e.get("extend_tokens")]
    groups: Dict[int, Tuple[List[float], List[float]]] = {}
    for e, s in zip(dec, overlap_shares(dec, other)):
        g = groups.setdefault(int(e["batch_size"]), ([], []))
        if s < alone:
            g[0].append(e["latency_s"])
        elif s > during:
            g[1].append(e["latency_s"])
    rows = []
    for b in sorted(groups):
        lo, hi = groups[b]
        if max(len(lo), len(hi)) < min_steps:
            continue
        a = statistics.median(lo) if len(lo) >= min_steps else None
        d = statistics.median(hi) if len(hi) >= min_steps else None
        rows.append({"batch_size": b, "alone_s": a, "during_s": d, "n_alone": len(lo), "n_during": len(hi),
                     "ratio": d / a if a and d else None})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", nargs=2, required=True, metavar="EVENTS.jsonl", help="the two models' event logs")
    ap.add_argument("--calibration", help="calibrate's JSON: each model's decode time alone")
    ap.add_argument("--alone", type=float, default=0.05, help="'alone': overlap share below this (default 0.05)")
    ap.add_argument("--during", type=float, default=0.95, help="'during': overlap share above this (default 0.95)")
    a = ap.parse_args(argv)
    try:
        (m0, s0), (m1, s1) = load_steps(a.events[0]), load_steps(a.events[1])
        calib = {}
        if a.calibration:
            with open(a.calibration) as f:
                c = json.load(f)
            calib = {m: {r["batch_size"]: r["decode_median_s"] for r in v["table"]} for m, v in c["models"].items()}
    except (OSError, ValueError, KeyError, TypeError) as e:  # json.JSONDecodeError is a ValueError
        ap.error(f"cannot read the inputs: {e}")
    ms = lambda x: "–" if x is None else f"{x * 1e3:.1f}"  # noqa: E731
    for model, steps, other_name, other in ((m0, s0, m1, s1), (m1, s1, m0, s0)):
        print(f"\n{model}: pure decode steps, median ms (steps); alone = < {a.alone:.0%} of the step inside "
              f"a {other_name} step, during = > {a.during:.0%}")
        print("| rows | alone | during | during / alone | calibrated alone | during / calibrated |")
        print("|---|---|---|---|---|---|")
        for r in contention_table(steps, other, a.alone, a.during):
            cal = calib.get(model, {}).get(r["batch_size"])
            print(f"| {r['batch_size']} | {ms(r['alone_s'])} ({r['n_alone']}) | {ms(r['during_s'])} ({r['n_during']}) | "
                  + ("–" if r["ratio"] is None else f"{r['ratio']:.2f}") + f" | {ms(cal)} | "
                  + (f"{r['during_s'] / cal:.2f}" if cal and r["during_s"] else "–") + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
