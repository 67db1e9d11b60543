"""Command line: ``python -m scheduler_model {solve,profile,simulate} …``.

* ``solve --profile PROFILE.json [--json] [--write-config MODEL_REPOSITORY] [--method auto|exact|crn-racing]
  [--max-states N] [--time-budget-s S] [--seed S] [--min-gain G] [--quantum-s Q]
  [--max-wait-us slm=5000,llm=85000]``
  B* search (``--min-gain``, default 0.02: among B predicted within that relative gain of the
  best, the one with the least waiting; :mod:`scheduler_model.search`); ``--json`` prints ``{"B_star", "throughput_tokens_per_s", "method", "states", "table", …}``,
  otherwise a readable table. ``--write-config`` writes B* into each model's config.pbtxt
  (:mod:`scheduler_model.config_writer`); ``--transport triton`` writes it for the router's
  Triton transport (dynamic batcher only; the decode loop's own delayed batching off).
  ``--calibration CALIB.json`` refits the calibrated models' step latency first
  (:func:`scheduler_model.calibrate.apply_calibration`); ``--concurrency N`` overrides N. The
  JSON also carries ``concurrency`` and ``step_latency_s`` {model: [L̄(1), …, L̄(max batch)]}
  (s), the latencies the search used. ``--max-wait-us`` models the server's wait bound
  (``delayed_batch_max_wait_us``) in the chain and the racing simulator, and
  ``--write-config`` then writes that bound for the models with B*_i > 1.
* ``profile --events EVENTS.jsonl --models slm,llm --concurrency N [--calibration CALIB.json]
  [-o PROFILE.json]`` converts a routing event log to a profile (:mod:`scheduler_model.profile`),
  with the step-latency model fitted to the events' steps and the calibration's.
* CALIB.json, the calibration file, is written by the server's client, which times synthetic steps
  on a running, idle server: ``python -m tokenrouter.tools.admin calibrate --models slm,llm
  '{"batch_sizes": [1, 2, 4, 8, 16, 32]}' -o CALIB.json`` (:mod:`scheduler_model.calibrate`;
  this package imports nothing of the server).
* ``simulate --profile PROFILE.json --thresholds slm=1,llm=2 [--events E] [--json]
  [--max-wait-us slm=5000,llm=20000]`` runs the discrete-event simulator
  (:mod:`scheduler_model.simulate`), optionally with the server's wait bound.

Exit status: 0 on success, 2 on a usage, profile, feasibility or config error (message on stderr).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any, List, Optional

from .errors import SchedulerModelError


def _parse_per_model(text: str, what: str = "threshold", value: str = "B") -> dict:
    """``MODEL=INT,MODEL=INT`` as {model: int}; argparse.ArgumentTypeError naming ``what`` and
    ``value`` for a malformed part or a model named twice."""
    out = {}
    for part in text.split(","):
        if not part.strip():
            continue
        if "=" not in part:
            raise argparse.ArgumentTypeError(f"{what} {part!r} is not MODEL={value}")
        k, v = part.split("=", 1)
        k = k.strip()
        if k in out:
            raise argparse.ArgumentTypeError(f"{what}: model {k!r} given twice")
        try:
            out[k] = int(v)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} {part!r}: {value} must be an integer") from None
    return out


def _parse_thresholds(text: str) -> dict:
    return _parse_per_model(text)


def _parse_wait_us(text: str) -> dict:
    return _parse_per_model(text, "wait bound", "microseconds")


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of the CLI."""
    ap = argparse.ArgumentParser(prog="python -m scheduler_model",
                                 description="TokenRouter delayed-batching model: DTMC, B* search, simulator.")
    sub = ap.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("solve", help="find B* for a profile")
    s.add_argument("--profile", required=True, help="PROFILE.json")
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")
    s.add_argument("--write-config", metavar="MODEL_REPOSITORY", help="write B* into <repo>/<model>/config.pbtxt")
    s.add_argument("--transport", choices=("zmq", "triton"), default="zmq",
                   help="the router's transport the configs are for (with --write-config): zmq writes B* into "
                        "the batcher and the decode loop's delayed batching; triton into the batcher only "
                        "(the loop gets delayed_batch_size 1, wait 0). Default zmq")
    s.add_argument("--method", default="auto", choices=["auto", "exact", "crn-racing"])
    s.add_argument("--max-states", type=int, default=500_000, help="per-chain state limit of the exact method")
    s.add_argument("--time-budget-s", type=float, default=20.0, help="auto: exact only if it fits this budget")
    s.add_argument("--seed", type=int, default=0, help="seed of crn-racing")
    s.add_argument("--min-gain", type=float, default=0.02,
                   help="relative predicted gain a B with more waiting needs over one with less (default 0.02; "
                        "0 = plain argmax)")
    s.add_argument("--quantum-s", type=float, default=None, help="override the profile's quantum_s (s)")
    s.add_argument("--calibration", metavar="CALIB.json",
                   help="refit the calibrated models' step latency to this calibration (calibrate's output)")
    s.add_argument("--concurrency", type=int, default=None, help="override the profile's concurrency N")
    s.add_argument("--max-wait-us", type=_parse_wait_us, default=None,
                   help="the server's delayed_batch_max_wait_us per model, e.g. slm=5000,llm=85000: an idle "
                        "model starts a batch once its oldest request waited this long (default: no bound, "
                        "the paper's chain); a coarser --quantum-s (e.g. 0.001) keeps the chains small")

    p = sub.add_parser("profile", help="convert a routing event log to PROFILE.json")
    p.add_argument("--events", required=True, help="EVENTS.jsonl")
    p.add_argument("--models", required=True, help="comma-separated model names, e.g. slm,llm")
    p.add_argument("--concurrency", required=True, type=int, help="N")
    p.add_argument("--quantum-s", type=float, default=1e-4, help="DTMC quantum δ in seconds")
    p.add_argument("--fixed-thresholds", type=_parse_thresholds, default=None, help="e.g. slm=1")
    p.add_argument("--calibration", metavar="CALIB.json",
                   help="also fit the step latency to these calibration steps (calibrate's output)")
    p.add_argument("-o", "--output", help="write here instead of stdout")

    m = sub.add_parser("simulate", help="discrete-event simulation for given thresholds")
    m.add_argument("--profile", required=True)
    m.add_argument("--thresholds", required=True, type=_parse_thresholds, help="e.g. slm=1,llm=2")
    m.add_argument("--events", type=int, default=100_000, help="completion events to simulate")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--max-wait-us", type=_parse_wait_us, default=None,
                   help="the server's delayed_batch_max_wait_us per model, e.g. slm=5000,llm=20000")
    m.add_argument("--json", action="store_true")
    return ap


def _fmt_B(B: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in B.items())


def _wait_s(system, given: Optional[dict]) -> Optional[List[Optional[float]]]:
    """--max-wait-us {model: µs} as per-model seconds (None where not given), or None.

    Raises:
        ProfileError: unknown model names or negative values.
    """
    from .errors import ProfileError

    if not given:
        return None
    unknown = set(given) - set(system.models)
    if unknown:
        raise ProfileError(f"--max-wait-us names unknown models {sorted(unknown)}")
    if any(v < 0 for v in given.values()):
        raise ProfileError(f"--max-wait-us values must be >= 0, got {given}")
    return [given[m] / 1e6 if m in given else None for m in system.models]


def cmd_solve(args: argparse.Namespace) -> int:
    if not (math.isfinite(args.min_gain) and args.min_gain >= 0):
        print(f"error: --min-gain must be a finite number >= 0, got {args.min_gain}", file=sys.stderr)
        return 2
    from . import config_writer
    from .profile import load_profile
    from .search import find_B_star
    from .system import System

    prof = load_profile(args.profile)
    if args.quantum_s is not None:
        prof["quantum_s"] = args.quantum_s
    if args.concurrency is not None:
        prof["concurrency"] = args.concurrency
    if args.calibration:
        from .calibrate import apply_calibration, load_calibration

        prof = apply_calibration(prof, load_calibration(args.calibration))
    system = System.from_profile(prof)
    wait_s = _wait_s(system, args.max_wait_us)
    res = find_B_star(system, method=args.method, max_states=args.max_states,
                      time_budget_s=args.time_budget_s, seed=args.seed, min_gain=args.min_gain,
                      max_wait_s=wait_s)
    out = res.to_json()
    out["concurrency"] = system.N
    out["step_latency_s"] = {m: [round(system.latency_s(i, b), 6) for b in range(1, system.max_batch[i] + 1)]
                             for i, m in enumerate(system.models)}
    if args.write_config:
        wait = config_writer.max_wait_us(system, res.B_star, res.throughput_tokens_per_s)
        for m, w in zip(system.models, wait_s or []):
            if w is not None and res.B_star[m] > 1:
                wait[m] = int(args.max_wait_us[m])  # the bound the search modelled
        msgs = config_writer.write_configs(args.write_config, res.B_star, wait, transport=args.transport)
        out["max_queue_delay_us"] = wait
        out["config_changes"] = msgs
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"profile: {args.profile}  models: {', '.join(system.models)}  N = {system.N}")
    print(f"method: {res.method}  ({res.seconds:.2f} s)")
    for n in res.notes:
        print(f"note: {n}")
    extra = "states" if res.method == "exact-dtmc" else "events"
    print()
    print(f"| B | throughput (tokens/s) | {extra} |")
    print("|---|---:|---:|")
    for row in res.table:
        mark = " **B***" if row["B"] == res.B_star else ""
        print(f"| {_fmt_B(row['B'])}{mark} | {row['throughput_tokens_per_s']:.2f} | {row.get(extra, '')} |")
    print()
    se_v = res.throughput_stderr_tokens_per_s
    se = f" ± {se_v:.2f}" if se_v and math.isfinite(se_v) else ""  # NaN: a racing row chosen by the tie rule
    print(f"B* = {_fmt_B(res.B_star)}   T(B*) = {res.throughput_tokens_per_s:.2f}{se} tokens/s"
          + (f"   states = {res.states}" if res.states else ""))
    for msg in out.get("config_changes", []):
        print(f"config: {msg}")
    return 0


def _emit(obj: Any, output: Optional[str], indent: int) -> int:
    """Write ``obj`` as JSON to ``output`` (a path), or print it when ``output`` is empty; returns 0."""
    text = json.dumps(obj, indent=indent)
    if output:
        with open(output, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
    else:
        print(text)
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from .profile import profile_from_events, read_events

    models = [m.strip() for m in args.models.split(",") if m.strip()]
    calib = None
    if args.calibration:
        from .calibrate import load_calibration

        calib = load_calibration(args.calibration)
    prof = profile_from_events(read_events(args.events), models, args.concurrency, quantum_s=args.quantum_s,
                               fixed_thresholds=args.fixed_thresholds, calibration=calib)
    return _emit(prof, args.output, indent=2)


def cmd_simulate(args: argparse.Namespace) -> int:
    from .profile import load_profile
    from .simulate import simulate
    from .system import System

    system = System.from_profile(load_profile(args.profile))
    wait = _wait_s(system, args.max_wait_us)
    res = simulate(system, args.thresholds, events=args.events, seed=args.seed, max_wait_s=wait)
    if args.json:
        print(json.dumps(res.to_json(), indent=2))
    else:
        print(f"B = {_fmt_B(system.thresholds_dict(system.thresholds_vector(args.thresholds)))}: "
              f"T = {res.throughput_tokens_per_s:.2f} ± {res.stderr_tokens_per_s:.2f} tokens/s "
              f"({res.events} events, {res.simulated_s:.1f} simulated s)")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    """Run the CLI; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return {"solve": cmd_solve, "profile": cmd_profile, "simulate": cmd_simulate}[args.cmd](args)
    except SchedulerModelError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
