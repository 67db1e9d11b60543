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

Measurement (per cell: mode × concurrency N × max output tokens):

* **steady state** (default, ``--duration SECONDS``), as genai-perf / aiperf
  define it: N clients send requests back to back; a warm-up (until every
  client has finished one request, or 2N requests have finished;
  ``--warmup-s`` sets a minimum) and the drain are excluded.  At the end of
  the period the requests in flight are cancelled (``--drain cancel``, the
  default: their tokens streamed inside the period count; the next cell
  starts once no model holds a request) or awaited (``--drain wait``, the
  runs before 2026-12-04).  The measurement period is split into ``--windows``
  (default 3) consecutive windows and each window's output-token throughput
  counts the tokens streamed inside it, by their client-side arrival times
  (``perf/loadgen.py``).  Reported: tokens/s and requests/s (mean over the
  windows, 95 % confidence half-width and min–max), TTFT / ITL / end-to-end
  latency at p50/p90/p99 of the requests that completed in the period
  (perf_analyzer's convention; with ``--drain wait``: that started in it), LLM token
  share, handoffs per request and each model's busy share of the period
  (``step_time_s`` counters of ``admin.model_stats`` at the window
  boundaries).  Ratios of tokenrouter against each baseline come with a 95 %
  interval from the windows' spread; the SLM-only ceiling and the fraction of
  it tokenrouter reaches, and e2e p99/p50, are in the tables.
* **interleaved repeats** (``--repeats R``, steady state): the sequence of modes
  of a (N, length) runs R times, A B A B ..., so a slow drift of the machine (a
  shared VM) weighs on every mode alike.  The merged row's throughput spread is
  over all windows of all repeats; its latency percentiles are the median over
  the repeats, its counters the sum.  A ratio of two modes is then *paired*: the
  geometric mean of the R per-repeat ratios with a 95 % Student-t interval of
  their logs (:func:`ratio_interval`).  ``--interleave-lengths`` alternates the
  output lengths inside each repeat as well (N, repeat 1: L1 L2, repeat 2: L1 L2 …),
  so the throughput change from the shortest to the longest length, tabled per
  mode, is paired in the same way.
* **CPU by process**: the CPU seconds each process used over the measurement period
  (:func:`cpu_seconds`: the models' stubs, the router stubs, tritonserver, the load
  generator; in no-triton the model workers and the driving process), divided by the
  period: where the cores went, since every process shares this machine's cores.
* ``--stream-interval K``: the models send K tokens per message (the first token at once),
  so the router, Triton and gRPC handle one response per K tokens; every mode, no-triton too.
* **one shot** (``--one-shot``): every client sends ``--requests-per-client``
  requests; throughput is all tokens over the cell's wall time (the slowest
  request ends it), the older figure.

The tokenrouter mode's B* (every model's threshold searched) comes from
``python -m scheduler_model profile`` + ``solve`` on the routing events of the
eager-async cell at the same (N, length), which runs just before it; its
delayed-batching wait bound is ``--wait-factor`` × the SLM's mean step time in
that cell.  Where B* is 1 for every model, tokenrouter's settings are eager-async's, so
its row is that eager-async run (marked ``same_run_as``; ratio exactly 1) rather than a
second sample of the same configuration.  Results: JSON, a markdown table and PNG plots
under --out.

Scaled for a 2-core CPU by default (output lengths 16/48 tokens instead of the
issue's 128/512, N up to 8, 12 s of measurement per cell); ``--full``
restores 128/512, N = 1, 4, 8, 16, 32 and 120 s per cell for GPU hosts.

Run time here (2 cores): a steady cell costs its warm-up (about one to two median
request latencies), ``--duration`` and, with ``--drain wait``, the drain (up to the
longest request's latency).  On the size-realistic pair, requests of 48 tokens take
5-25 s at N = 8-32 in tokenrouter, eager-async and lock-step, llm-only ones 30-80 s,
and std-serving's longest (many returns, each a re-prefill) over 2 min at N = 32.  So
``--pairs size-realistic --concurrency 8,32 --max-tokens 48 --duration 60`` (10 Triton
cells, 2 no-Triton cells, the calibration at start, DTMC solves) took 22-23 min on an Intel
Xeon and a Zen 5 EPYC with the drain, 45 min on the slowest host (AMD EPYC Zen 3, float32)
with the drain and 27-28.5 min there with the default ``--drain cancel``.  The default
command (2 pairs × 3 N × 2 lengths × 7 modes = 84 cells of 12 s, mostly short requests)
takes about 28 min.

    source deploy/env.sh && python perf/bench_matrix.py            # ~28 min on 2 cores
    python perf/bench_matrix.py --pairs size-realistic --concurrency 8,32 --max-tokens 48 --duration 60
    python perf/bench_matrix.py --pairs demo --concurrency 2 --max-tokens 16 --duration 6 \\
        --modes tokenrouter,slm-only                              # smoke
    python perf/bench_matrix.py --one-shot --requests-per-client 4  # the one-shot figure
    python perf/bench_matrix.py --pairs qwen-coder --prompts humaneval --concurrency 8 --max-tokens 384 \\
        --duration 60 --repeats 2 --algorithm-params '{"tau": 0.05}'   # the real pair on its task (~30 min)
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
try:  # the scripts of perf/ that start a server all import this module
    import google.protobuf  # noqa: F401  (the model configs)
    import tritonclient  # noqa: F401
except ImportError as exc:
    sys.exit(f"{os.path.basename(sys.argv[0])}: {exc}. The benchmarks run in the project's "
             "environment: `source deploy/env.sh` first (it creates the environment on first use).")

from loadgen import SteadyLoad, load_tokenizer, run_load, spread, summarize, triton_client, window_summary  # noqa: E402
from tokenrouter.tools import admin  # noqa: E402
from tokenrouter.tools.repository import make_variant  # noqa: E402
from tritonserver import TritonServer, exit_on_termination  # noqa: E402

MODELS = ["slm", "llm"]
ALL_MODES = ["tokenrouter", "eager-async", "std-serving", "lock-step", "llm-only", "slm-only", "no-triton"]
BASELINES = ["eager-async", "std-serving", "lock-step", "llm-only", "slm-only", "no-triton"]
#: opt-in modes (not in the default --modes): tokenrouter through the Triton transport
#: (docs/transport.md); the models' dynamic batcher holds --triton-batcher
EXTRA_MODES = ["tokenrouter-triton"]
RESET = {"delayed_batch_size": 1, "delayed_batch_max_wait_us": 0, "readmit_on_resume": False,
         "lockstep_group": ""}


def _prompts() -> List[str]:
    with open(os.path.join(HERE, "prompts.txt"), encoding="utf-8") as f:
        return [line.strip() for line in f if line.strip()]


def _task_prompts(repo: str, task: str) -> List[str]:
    """``--prompts TASK``: a task's prompts as ``perf/quality.py`` renders them with the router's
    tokenizer (chat template applied client-side: sent with ``apply_chat_template`` false): HumanEval's
    164, or the test split of gsm-symbolic (300) or math500 (251)."""
    from quality import router_tokenizer, task_prompts

    return task_prompts(router_tokenizer(repo), task, "all" if task == "humaneval" else "test")


def _events_size(path: str) -> int:
    return os.path.getsize(path) if os.path.exists(path) else 0


def _read_slice(path: str, start: int) -> List[str]:
    with open(path, "rb") as f:
        f.seek(start)
        return [ln.decode() for ln in f.read().splitlines() if ln.strip()]


def b_star_from_events(event_lines: List[str], concurrency: int, workdir: str,
                       calibration: Optional[str] = None, wait_us: Optional[int] = None) -> Dict[str, Any]:
    """Profile the run's routing events and solve the DTMC for every model's threshold.

    Runs ``python -m scheduler_model profile`` (with ``--calibration`` when a calibration file
    from :func:`calibrate_server` is given: the step-latency fit then spans its batch sizes)
    then ``solve --json`` (a 5 ms quantum keeps the exact chain small for CPU step times of
    50-300 ms), with ``--max-wait-us`` for every model when ``wait_us`` (the wait bound the
    server will run with, µs) is given: the chain then models the bound's timer.

    Returns:
        the solver's JSON (``B_star`` {model: B}, ``table``, ``throughput_tokens_per_s``, …) plus
        ``profile`` (the profile dict); when no profile can be made (e.g. no request reached the
        LLM): ``B_star`` all 1, ``table`` empty, ``profile`` None and ``note`` (the reason).

    Raises:
        subprocess.CalledProcessError: ``solve`` failed.
    """
    ev = os.path.join(workdir, f"events-N{concurrency}.jsonl")
    with open(ev, "w") as f:
        f.write("\n".join(event_lines) + "\n")
    prof = os.path.join(workdir, f"profile-N{concurrency}.json")
    py = sys.executable
    made = subprocess.run([py, "-m", "scheduler_model", "profile", "--events", ev, "--models", ",".join(MODELS),
                           "--concurrency", str(concurrency), "-o", prof]
                          + (["--calibration", calibration] if calibration else []), cwd=ROOT,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if made.returncode != 0:  # e.g. no request reached the LLM: nothing to batch there
        print(f"  (no profile at N={concurrency}: {made.stderr.strip()}; B = 1)", flush=True)
        return {"B_star": {m: 1 for m in MODELS}, "table": [], "profile": None,
                "note": made.stderr.strip()}
    with open(prof) as f:
        profile = json.load(f)
    wait = ["--max-wait-us", ",".join(f"{m}={int(wait_us)}" for m in MODELS)] if wait_us is not None else []
    out = subprocess.run([py, "-m", "scheduler_model", "solve", "--profile", prof, "--json", "--quantum-s", "0.005"]
                         + wait, check=True, cwd=ROOT, capture_output=True, text=True)
    res = json.loads(out.stdout)
    res["profile"] = profile
    return res


def calibrate_server(url: str, max_n: int, path: str, context: int = 96, decode_steps: int = 4) -> str:
    """Time each model's steps alone at batch sizes 1, 2, 4, … up to ``max_n`` (and ``max_n``).

    ``python -m tokenrouter.tools.admin calibrate`` in-process: the events of a served run hold only
    the batch sizes that run formed (an eager LLM at N = 32 steps 1-4 rows), so the DTMC would
    extrapolate beyond them; the calibration gives the latency model the shape up to N, and
    ``profile`` scales it to the served level (:func:`scheduler_model.latency.contention_scale`).
    The models must be idle.  Writes the calibration JSON to ``path`` and returns ``path``.

    Raises:
        RuntimeError: a model refused (busy, KV pool too small for ``max_n`` rows of ``context``).
    """
    from scheduler_model.calibrate import run_calibration

    sizes = sorted({b for b in (1, 2, 4, 8, 16, 32, 64, 128) if b <= max_n} | {int(max_n)})
    t0 = time.time()
    calib = run_calibration(url, MODELS, sizes, context=context, decode_steps=decode_steps, calibrate=admin.calibrate)
    with open(path, "w") as f:
        json.dump(calib, f, indent=1)
    print(f"  calibrated {MODELS} at batch sizes {sizes} (context {context}) in {time.time() - t0:.0f} s", flush=True)
    return path


def wait_bound_us(model_stats: Dict[str, Dict[str, float]], factor: float, model: str = "slm") -> int:
    """Delayed-batching wait bound: ``factor`` × ``model``'s mean step time (µs) in a run.

    Args:
        model_stats: counter increases over the run, ``{model: {"steps", "step_time_s", …}}``.
        factor: multiple of the mean step time (``--wait-factor``).

    Returns:
        the bound in µs (0 when the model made no step).
    """
    st = model_stats.get(model, {})
    return int(1e6 * factor * st["step_time_s"] / st["steps"]) if st.get("steps") else 0


STAT_KEYS = ("steps", "decode_tokens", "extend_tokens", "extend_runs", "handoffs_out", "step_time_s", "forward_s",
             "route_s", "send_s", "prefill_chunks")


def _stats_delta(before: Dict[str, Dict], after: Dict[str, Dict]) -> Dict[str, Dict[str, float]]:
    return {m: {k: after[m][k] - before[m][k] for k in STAT_KEYS} for m in before}


def cpu_seconds(server_pid: Optional[int] = None, workers: Optional[Dict[str, int]] = None) -> Dict[str, float]:
    """CPU seconds (user + system) each serving process has used so far, by role.

    Roles: ``client`` (this process: the load generator, and in no-triton also the router
    logic), ``tritonserver`` (``server_pid``), ``stub <model>`` (each Python-backend stub
    under it, named by its model's folder), ``worker <model>`` (``workers``, name → pid: the
    no-triton model processes).  A process that has gone has no entry.
    """
    import psutil

    from tokenrouter.triton.stub_guard import stub_model

    out: Dict[str, float] = {}

    def add(role: str, proc) -> None:
        try:
            t = proc.cpu_times()
        except psutil.Error:
            return
        out[role] = out.get(role, 0.0) + t.user + t.system

    add("client", psutil.Process())
    procs = [("worker " + name, pid) for name, pid in (workers or {}).items()]
    if server_pid:
        procs.append(("tritonserver", server_pid))
        try:
            for ch in psutil.Process(server_pid).children():
                model = stub_model([a.encode() for a in ch.cmdline()])
                if model is not None:
                    procs.append(("stub " + model, ch.pid))
        except psutil.Error:
            pass
    for role, pid in procs:
        try:
            add(role, psutil.Process(pid))
        except psutil.Error:
            pass
    return out


def measure_cell(target, prompts: List[str], N: int, L: int, args, model: str = "token_router", tokenizer=None,
                 probe=None, cpu=None) -> Dict[str, Any]:
    """One cell's figures: steady state (default) or one shot (``args.one_shot``).

    Args:
        target: Triton gRPC URL or a generate function (no-Triton baseline).
        probe: ``() -> {model: admin.model_stats}``, read at the window boundaries (steady) or
            before/after (one shot); None: no busy shares / counters.
        cpu: ``() -> {role: CPU seconds}`` (:func:`cpu_seconds`), read with the first and last probe.

    Returns:
        :func:`loadgen.window_summary` (steady) or :func:`loadgen.summarize` (one shot) keys, plus
        ``model_stats`` (counter increases over the measurement) when ``probe`` is given, and
        ``cpu_share`` (``{role: CPU seconds / wall seconds}`` of the measurement: 1.0 = one core
        busy) when ``cpu`` is given.
    """
    if args.prompts != "generic":  # a task's: rendered client-side (no chat template), stopped as quality.py stops
        from quality import task_sampling

        target = task_sampling(triton_client(target, model, chat=False) if isinstance(target, str) else target,
                               args.prompts)
    marks: List[tuple] = []
    stats = probe
    if cpu is not None:
        inner = probe

        def probe():  # noqa: F811 - the models' counters, and a CPU reading beside each
            out = inner() if inner else {}
            marks.append((time.perf_counter(), cpu()))
            return out
    if args.one_shot:
        before = probe() if probe else None
        row = summarize(run_load(target, prompts, N, L, args.requests_per_client, model=model, tokenizer=tokenizer))
        if probe:
            after = probe()
            if before:
                row["model_stats"] = _stats_delta(before, after)
        _cpu_share(row, marks)
        return row
    load = SteadyLoad(target, prompts, N, L, model=model, tokenizer=tokenizer,
                      tokens_per_chunk=args.stream_interval).start()
    try:
        m = load.measure(args.duration, args.windows, probe=probe, min_warmup_s=args.warmup_s, since=load.t_started)
    except BaseException:  # Ctrl-C or SIGTERM: cancel, no drain (it can take as long as a request); the server stops
        load.stop(timeout_s=0, cancel=True)
        raise
    cancel = args.drain == "cancel"
    recs = load.stop(cancel=cancel)
    if cancel and stats is not None:
        _wait_idle(stats)
    have_stats = probe is not None and bool(m["probes"][0])
    row = window_summary(recs, m["bounds"], probes=m["probes"] if have_stats else None,
                         latencies="completed" if cancel else "started")
    row["warmup_s"] = m["warmup_s"]
    if have_stats:
        row["model_stats"] = _stats_delta(m["probes"][0], m["probes"][-1])
    _cpu_share(row, marks)
    return row


def _wait_idle(stats: Callable[[], Dict[str, Dict[str, Any]]], timeout_s: float = 120.0) -> None:
    """Wait until no model holds a request (``active`` 0 in every model's stats), so that the
    requests cancelled at the end of a cell do not step into the next one.

    Raises:
        TimeoutError: a model still holds requests after ``timeout_s`` seconds.
    """
    end = time.monotonic() + timeout_s
    while True:
        busy = {m: s.get("active", 0) for m, s in stats().items() if s.get("active", 0)}
        if not busy:
            return
        if time.monotonic() > end:
            raise TimeoutError(f"requests still active {timeout_s:g} s after the cell's cancellation: {busy}")
        time.sleep(0.2)


def _cpu_share(row: Dict[str, Any], marks: List[tuple]) -> None:
    """``row["cpu_share"]``: each role's CPU seconds between the first and last mark / wall seconds."""
    if len(marks) < 2 or marks[-1][0] <= marks[0][0]:
        return
    (t0, a), (t1, b) = marks[0], marks[-1]
    row["cpu_share"] = {k: round((b[k] - a[k]) / (t1 - t0), 4) for k in sorted(b) if k in a}


def _line(pair: str, mode: str, N: int, L: int, row: Dict[str, Any]) -> str:
    th = row.get("throughput") or {}
    ci = f" ±{th['ci95']:.1f}" if th.get("ci95") == th.get("ci95") and th.get("ci95") is not None else ""
    return (f"{pair:15s} {mode:12s} N={N:<3d} L={L:<4d} {row['throughput_tok_s']:8.1f}{ci} tok/s  "
            f"{row['requests_per_s']:.2f} req/s  TTFT p50 {row['ttft_p50_s']:.3f}s  "
            f"ITL p50 {row['itl_p50_s'] * 1e3:.1f}ms  e2e p50/p99 {row['e2e_p50_s']:.2f}/{row['e2e_p99_s']:.2f}s  "
            f"llm {row['llm_share']:.2f}  handoffs/req {row['handoffs_per_request']:.1f}"
            + (f"  B*={row['B_star']}" if "B_star" in row else "")
            + (f" (the {row['same_run_as']} run)" if row.get("same_run_as") else "")
            + (f"  errors={row['errors']}" if row["errors"] else ""))


def _mode_order(modes: List[str], interleave_no_triton: bool = False) -> List[str]:
    """Modes of one repeat in run order: eager-async just before tokenrouter (its events give B*);
    no-triton last where it is interleaved, else not at all (it runs after the server)."""
    order = [m for m in modes if m != "no-triton"]
    if interleave_no_triton and "no-triton" in modes:
        order.append("no-triton")
    if "tokenrouter" in order and "eager-async" in order:
        order.remove("eager-async")
        order.insert(order.index("tokenrouter"), "eager-async")
    return order


def router_algorithm(pair: str, override: Dict[str, Any]) -> tuple:
    """``(algorithm name, parameters)`` of the pair's token_router with ``override`` merged in.

    The base parameters are the pair's (:data:`tokenrouter.tools.repository.PAIRS`), else
    the repository's token_router config.
    """
    from tokenrouter.tools.repository import PAIRS, read_config

    rp = read_config(os.path.join(ROOT, "model_repository", "token_router", "config.pbtxt")).parameters
    algo = rp["algorithm"].string_value if "algorithm" in rp else "rstitch"
    base = PAIRS[pair].get("token_router", {}).get("algorithm_params")
    if base is None:
        base = rp["algorithm_params"].string_value if "algorithm_params" in rp else ""
    return algo, {**json.loads(base or "{}"), **override}


def _save(results: Dict[str, Any], out_dir: str) -> None:
    """Write ``results`` to ``out_dir``/results.json (after every cell, so a stopped run keeps its rows)."""
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=1)


def _model_bs(text: str) -> Dict[str, int]:
    """``"slm=3,llm=6"`` → ``{"slm": 3, "llm": 6}``.

    Raises:
        ValueError: an item is not ``model=B`` with an integer B.
    """
    return {k.strip(): int(v) for k, v in (x.split("=") for x in text.split(",") if x)}


ROUTER_OF_MODE = {"llm-only": "token_router_llm_only", "slm-only": "token_router_slm_only",
                  "tokenrouter-triton": "token_router_triton"}


def configure_mode(url: str, mode: str, B: Optional[Dict[str, int]] = None, wait_us: int = 0) -> str:
    """Put the models of a running server into ``mode``'s settings (module docstring's modes).

    Every model is first reset to eager (:data:`RESET`) and its prefix cache emptied: every cell
    sends the same prompts from the first one on, so without the flush a cell would find the
    previous cell's prompts cached and the modes would not be measured alike.  ``tokenrouter``
    then sets each model's delayed-batching threshold ``B[model]`` with the wait bound
    ``wait_us`` (µs) where B > 1.  ``tokenrouter-triton`` leaves the decode loops eager: Triton's
    batcher groups arrivals.

    Returns:
        the router model the mode's requests go to.
    """
    for m in MODELS:
        admin.configure(url, m, **RESET)
        admin.flush(url, m)
    for m in MODELS:
        if mode == "tokenrouter":
            admin.configure(url, m, delayed_batch_size=int(B[m]), delayed_batch_max_wait_us=wait_us if B[m] > 1 else 0)
        elif mode == "std-serving":
            admin.configure(url, m, readmit_on_resume=True)
        elif mode == "lock-step":
            admin.configure(url, m, lockstep_group=",".join(MODELS))
    return ROUTER_OF_MODE.get(mode, "token_router")


def run_pair(pair: str, args, results: Dict[str, Any], out_dir: str) -> None:
    """All Triton cells of one pair in one tritonserver, then the no-Triton baseline
    (with ``--repeats``: its workers beside the server, its cells interleaved)."""
    from tokenrouter.tools.repository import read_config
    from tokenrouter.triton.common import resolve_model_path

    work = os.path.join(out_dir, f"run-{pair}")
    os.makedirs(work, exist_ok=True)
    events = {m: os.path.join(work, f"events-{m}.jsonl") for m in MODELS}
    model_params: Dict[str, Dict[str, object]] = {
        m: {"event_log": events[m], "stream_interval": args.stream_interval} for m in MODELS}
    if args.algorithm_params:
        _, merged = router_algorithm(pair, args.algorithm_params)
        model_params["token_router"] = {"algorithm_params": json.dumps(merged)}
    repo = make_variant(os.path.join(ROOT, "model_repository"), os.path.join(work, "model_repository"), pair,
                        model_params=model_params,
                        routers={"token_router_llm_only": {"algorithm": "none", "algorithm_params": '{"model": 1}'},
                                 "token_router_slm_only": {"algorithm": "none", "algorithm_params": '{"model": 0}'},
                                 "token_router_triton": {"transport": "triton"}})
    if "tokenrouter-triton" in args.modes:  # the batcher's B and delay are fixed at load
        from scheduler_model.config_writer import write_configs

        B = {m: args.triton_batcher.get(m, 1) for m in MODELS}
        write_configs(repo, B, {m: args.triton_wait_us if B[m] > 1 else 0 for m in MODELS}, transport="triton")
    rp = read_config(os.path.join(repo, "token_router", "config.pbtxt")).parameters
    tok = load_tokenizer(resolve_model_path(rp["tokenizer_path"].string_value if "tokenizer_path" in rp
                                            else "smollm2-135m-instruct"))
    prompts = _prompts() if args.prompts == "generic" else _task_prompts(repo, args.prompts)
    # with --repeats the no-Triton workers run beside the server and their cells interleave with the
    # others, so that ratio is paired too (the idle side's processes use a little CPU, 0.02-0.05
    # cores on the size-realistic pair: the CPU table reads both sides).  Both sets of models are
    # loaded: on a GPU host give the models kv_pool_tokens so that the two sets fit.
    interleave = args.repeats > 1 and "no-triton" in args.modes
    nt = NoTriton(pair, repo, chat=args.prompts == "generic") if interleave else None
    try:
        _run_server_cells(pair, repo, work, events, tok, prompts, nt, args, results, out_dir)
    finally:
        if nt is not None:
            nt.close()
    if "no-triton" in args.modes and not interleave:
        run_no_triton(pair, repo, args, results, out_dir, prompts, tok)


def cell_schedule(concurrency: List[int], lengths: List[int], repeats: int,
                  interleave_lengths: bool = False) -> List[tuple]:
    """The order in which one server measures its cells: a list of ``(N, L, repeat)``.

    By default every length's concurrencies in turn, each (N, L) with its ``repeats`` back to
    back (the modes interleave inside a repeat).  With ``interleave_lengths`` each N's lengths
    alternate inside every repeat (N, rep 0: L1 L2 …, rep 1: L1 L2 …), so that the ratio of
    two lengths' throughput is paired per repeat like the ratio of two modes.
    """
    if interleave_lengths:
        return [(N, L, rep) for N in concurrency for rep in range(repeats) for L in lengths]
    return [(N, L, rep) for L in lengths for N in concurrency for rep in range(repeats)]


def _run_server_cells(pair: str, repo: str, work: str, events: Dict[str, str], tok, prompts: List[str],
                      nt: Optional["NoTriton"], args, results: Dict[str, Any], out_dir: str) -> None:
    """The cells of one tritonserver on ``repo`` (and, interleaved, ``nt``'s no-Triton cells)."""
    print(f"\n== pair {pair}: starting tritonserver", flush=True)
    with TritonServer(repo, ready_timeout=900, log_path=os.path.join(work, "tritonserver.log")) as srv:
        url = srv.grpc_url
        probe = lambda: {m: admin.model_stats(url, m) for m in MODELS}  # noqa: E731
        cpu = lambda: cpu_seconds(server_pid=srv.process.pid, workers=nt.cluster.pids if nt else None)  # noqa: E731
        run_load(url, prompts, 2, 8)  # warm-up
        calib = (calibrate_server(url, max(args.concurrency), os.path.join(work, "calibration.json"))
                 if args.calibrate and "tokenrouter" in args.modes else None)
        state: Dict[tuple, Dict[str, Any]] = {}  # (N, L) -> B*, wait bound, rows by mode
        for N, L, rep in cell_schedule(args.concurrency, args.max_tokens, args.repeats, args.interleave_lengths):
            st = state.setdefault((N, L), {"bstar": None, "wait_us": None, "by_mode": {}})
            eager_row = None  # this repeat's eager-async measurement
            for mode in _mode_order(args.modes, nt is not None):
                if mode == "tokenrouter" and st["bstar"] is None:  # no eager-async cell: profile one first
                    configure_mode(url, "eager-async")
                    start = {m: _events_size(events[m]) for m in MODELS}
                    eager = measure_cell(url, prompts, N, L, args, tokenizer=tok, probe=probe)
                    lines = [x for m in MODELS for x in _read_slice(events[m], start[m])]
                    st["wait_us"] = wait_bound_us(eager["model_stats"], args.wait_factor)
                    st["bstar"] = b_star_from_events(lines, N, work, calib, st["wait_us"])
                    eager_row = {"pair": pair, "mode": "eager-async", "N": N, "max_tokens": L, **eager}
                bstar, wait_us = st["bstar"], st["wait_us"]
                B = {**bstar["B_star"], **args.batch_override} if mode == "tokenrouter" else None
                if mode == "tokenrouter" and eager_row is not None and all(B[m] == 1 for m in MODELS):
                    # B = 1 everywhere is eager-async's configuration (configure_mode): the same run
                    row = {**copy.deepcopy(eager_row), "mode": "tokenrouter", "same_run_as": "eager-async"}
                elif mode == "no-triton":  # tokenrouter's B* of this cell, as run_no_triton takes it
                    B = {**bstar["B_star"], **args.batch_override} if bstar else {m: 1 for m in MODELS}
                    for m in MODELS:  # the idle server's models: eager
                        admin.configure(url, m, **RESET)
                    row = {"pair": pair, "mode": mode, "N": N, "max_tokens": L,
                           **nt.measure(prompts, N, L, args, B, (wait_us or 0) if bstar else 0, tok,
                                        server_pid=srv.process.pid)}
                else:
                    router = configure_mode(url, mode, B, wait_us or 0)
                    start = {m: _events_size(events[m]) for m in MODELS}
                    row = {"pair": pair, "mode": mode, "N": N, "max_tokens": L,
                           **measure_cell(url, prompts, N, L, args, model=router, tokenizer=tok,
                                          probe=probe, cpu=cpu)}
                if mode == "eager-async":
                    eager_row = row
                if mode == "eager-async" and "tokenrouter" in args.modes and rep == 0:
                    lines = [x for m in MODELS for x in _read_slice(events[m], start[m])]
                    st["wait_us"] = wait_bound_us(row["model_stats"], args.wait_factor)
                    st["bstar"] = b_star_from_events(lines, N, work, calib, st["wait_us"])
                if mode == "tokenrouter":
                    row["B_star"] = B
                    row["B_dtmc"] = bstar["B_star"]
                    row["wait_us"] = wait_us
                    row["dtmc_throughput_tok_s"] = bstar.get("throughput_tokens_per_s")
                st["by_mode"].setdefault(mode, []).append(row)
                print(_line(pair, mode, N, L, row)
                      + (f"  (repeat {rep + 1}/{args.repeats})" if args.repeats > 1 else ""), flush=True)
                if args.repeats > 1:
                    results.setdefault("repeat_rows", []).append({**row, "repeat": rep})
                else:
                    results["rows"].append(row)
                _save(results, out_dir)
            if args.repeats > 1 and rep == args.repeats - 1:  # the cell's last repeat: merge it
                for mode, rows in st["by_mode"].items():
                    results["rows"].append(merge_repeats(rows))
                    print(_line(pair, mode, N, L, results["rows"][-1]) + f"  (merged, {len(rows)} repeats)",
                          flush=True)
                _save(results, out_dir)
        for m in MODELS:
            admin.configure(url, m, **RESET)
        results.setdefault("triton_batching", {})[pair] = triton_batching(srv.http_url)
        print(f"Triton statistics ({pair}): " + ", ".join(
            f"{m}: {v['inference_count']} requests in {v['execution_count']} executions"
            for m, v in results["triton_batching"][pair].items()), flush=True)


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



class NoTriton:
    """The no-Triton baseline: its worker processes and router, on the variant repository's configs.

    Args:
        pair: the pair's name (for the log line).
        repo: the variant repository whose model configs the workers take.
        chat: apply the chat template to the prompts (false: a task's ``--prompts``, rendered).

    Raises:
        RuntimeError: a worker did not come up.
    """

    def __init__(self, pair: str, repo: str, chat: bool = True):
        import threading

        from tokenrouter.tools.direct import DirectCluster, DirectRouter
        from tokenrouter.tools.repository import read_config
        from tokenrouter.triton.common import resolve_model_path
        from tokenrouter.triton.settings import LLMSettings

        def params(model):
            return {k: v.string_value for k, v in
                    read_config(os.path.join(repo, model, "config.pbtxt")).parameters.items()}

        class TracingRouter(DirectRouter):
            """DirectRouter that also returns the routing trace (token ids, model per token), as token_router does."""

            _tl = threading.local()

            def segment(self, model, peer_req):
                k = self.models.index(model)
                for ids, ev in super().segment(model, peer_req):
                    if ids:
                        self._tl.ids.extend(ids)
                        self._tl.trace.extend([k] * len(ids))
                    yield ids, ev

            def generate(self, prompt, sampling, chat=True, on_text=None, cancelled=lambda: False):
                self._tl.ids, self._tl.trace = [], []
                out = super().generate(prompt, sampling, chat=chat, on_text=on_text, cancelled=cancelled)
                n = out["num_output_tokens"]
                out["routing_trace"] = {"models": self.models, "token_ids": self._tl.ids[:n],
                                        "trace": self._tl.trace[:n]}
                return out

        print(f"== pair {pair}: no-triton baseline (worker processes, no Triton)", flush=True)
        settings = {m: LLMSettings.from_parameters(params(m)) for m in MODELS}
        self.cluster = DirectCluster({m: (s.engine_kwargs(), s.subserver_kwargs()) for m, s in settings.items()})
        try:
            rp = params("token_router")
            router = TracingRouter(self.cluster, MODELS,
                                   resolve_model_path(rp.get("tokenizer_path", "smollm2-135m-instruct")),
                                   rp.get("algorithm", "rstitch"), json.loads(rp.get("algorithm_params") or "{}"))
            def gen(p, sp, cb, abort=None):
                return router.generate(p, sp, chat=chat, on_text=cb,
                                       cancelled=abort.is_set if abort else (lambda: False))
            self.gen = gen
            run_load(self.gen, _prompts(), 2, 8)  # warm-up
        except BaseException:
            self.cluster.close()
            raise

    def measure(self, prompts: List[str], N: int, L: int, args, B: Dict[str, int], wait_us: int,
                tok=None, server_pid: Optional[int] = None) -> Dict[str, Any]:
        """One cell at thresholds ``B`` (wait bound ``wait_us`` µs where B > 1): :func:`measure_cell`'s row.

        ``server_pid``: a tritonserver running beside the workers, whose processes' CPU is read too.
        """
        for m in MODELS:
            self.cluster.configure(m, delayed_batch_size=int(B[m]), max_wait_s=(wait_us if B[m] > 1 else 0) / 1e6)
        return {**measure_cell(self.gen, prompts, N, L, args, tokenizer=tok,
                               cpu=lambda: cpu_seconds(server_pid=server_pid, workers=self.cluster.pids)),
                "B_star": dict(B)}

    def close(self) -> None:
        """Stop the workers."""
        self.cluster.close()


def run_no_triton(pair: str, repo: str, args, results: Dict[str, Any], out_dir: str, prompts: List[str],
                  tok=None) -> None:
    """The no-Triton cells after the server has stopped: same configs, the tokenrouter cell's B* per cell."""
    nt = NoTriton(pair, repo, chat=args.prompts == "generic")
    try:
        for L in args.max_tokens:
            for N in args.concurrency:
                tr = [r for r in results["rows"] if r["pair"] == pair and r["mode"] == "tokenrouter"
                      and r["N"] == N and r["max_tokens"] == L]
                B = tr[0]["B_star"] if tr else {m: 1 for m in MODELS}
                wait = tr[0].get("wait_us", 0) if tr else 0
                row = {"pair": pair, "mode": "no-triton", "N": N, "max_tokens": L,
                       **nt.measure(prompts, N, L, args, B, wait or 0, tok)}
                results["rows"].append(row)
                print(_line(pair, "no-triton", N, L, row), flush=True)
                _save(results, out_dir)
    finally:
        nt.close()


def _fmt(x: float, unit: str = "") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:.3g}{unit}"


def merge_repeats(rows: List[Dict[str, Any]]) -> Dict[str, Any]:
    """One row from the R interleaved repeats of a cell (``--repeats``), in the same keys.

    Throughput and requests/s: mean and :func:`loadgen.spread` over all windows of all
    repeats, plus ``throughput_repeats`` (each repeat's mean, for paired ratios);
    latency percentiles (``*_p50_s`` …): the median over the repeats; ``llm_share``,
    ``handoffs_per_request``, ``warmup_s``: the mean; request/token counts and the
    models' counter increases (``model_stats``): the sum; ``busy_share``: the spread of
    the repeats' means; ``cpu_share``: each role's mean.  Other keys (B*, settings) come from the
    first repeat; ``same_run_as`` only where every repeat reused that run.

    Raises:
        ValueError: ``rows`` is empty.
    """
    if not rows:
        raise ValueError("no rows to merge")
    out = dict(rows[0])
    out["repeats"] = len(rows)
    if any(r.get("same_run_as") != rows[0].get("same_run_as") for r in rows):
        out.pop("same_run_as", None)  # only some repeats reused another mode's run: the merge is its own
    for key, windows in (("throughput", "throughput_tok_s_windows"), ("requests", "requests_per_s_windows")):
        xs = [x for r in rows for x in r.get(windows, [])]
        sp = spread(xs)
        out[key], out[windows] = sp, xs
        out["throughput_tok_s" if key == "throughput" else "requests_per_s"] = sp["mean"]
    out["throughput_repeats"] = [r["throughput_tok_s"] for r in rows]
    for k, v in rows[0].items():
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            continue
        vals = [float(r[k]) for r in rows if isinstance(r.get(k), (int, float))]
        if re.fullmatch(r"\w+_p\d+_s", k):
            out[k] = statistics.median(vals)
        elif k in ("llm_share", "handoffs_per_request", "warmup_s", "window_s"):
            out[k] = statistics.fmean(vals)
        elif k in ("requests_started", "errors", "output_tokens", "windows"):
            out[k] = type(v)(sum(vals))
    if all("model_stats" in r for r in rows):
        first = rows[0]["model_stats"]
        out["model_stats"] = {m: {k: sum(r["model_stats"][m].get(k, 0) for r in rows) for k in first[m]} for m in first}
    if all("busy_share" in r for r in rows):
        out["busy_share"] = {m: spread([r["busy_share"][m]["mean"] for r in rows]) for m in rows[0]["busy_share"]}
    if all("cpu_share" in r for r in rows):
        roles = set.intersection(*(set(r["cpu_share"]) for r in rows))
        out["cpu_share"] = {k: round(statistics.fmean(r["cpu_share"][k] for r in rows), 4) for k in sorted(roles)}
    return out


def ratio_interval(a: Dict[str, Any], b: Dict[str, Any], paired: bool = True) -> tuple:
    """Throughput ratio a / b of two rows with its 95 % interval from the windows' spread.

    Rows merged from interleaved repeats (``throughput_repeats`` of equal length R >= 2 on
    both): the paired ratio, ``exp(mean_r log(a_r / b_r))`` with the interval
    ``exp(mean ± t_{0.975, R-1} · sd / sqrt(R))`` of those logs, since each repeat of a and b
    ran back to back on the same machine state.  Otherwise: delta method on the log ratio:
    half-width ``h = t_{0.975, n-1} · sqrt(sd_a²/(n_a·m_a²) +
    sd_b²/(n_b·m_b²))`` with ``n = min(n_a, n_b)`` windows; the interval is ``(r·e^-h, r·e^h)``.

    Returns:
        ``(ratio, low, high)``; ``(1, 1, 1)`` when one row is the other's measurement
        (``same_run_as``: tokenrouter at B* = 1 is the eager-async run); low/high NaN for
        one-shot rows or fewer than 2 windows; ratio NaN when b's throughput is 0 or missing.
    """
    reuses = lambda x, y: x.get("same_run_as") is not None and x["same_run_as"] == y.get("mode")  # noqa: E731
    if reuses(a, b) or reuses(b, a):
        return 1.0, 1.0, 1.0  # one measurement under both names (B* = 1: tokenrouter is eager-async)
    ra, rb = a.get("throughput_repeats") or [], b.get("throughput_repeats") or []
    if paired and len(ra) == len(rb) >= 2 and all(x > 0 for x in ra + rb):
        from scipy.stats import t as student_t

        logs = [math.log(x / y) for x, y in zip(ra, rb)]
        m, sd = statistics.fmean(logs), statistics.stdev(logs)
        h = float(student_t.ppf(0.975, len(logs) - 1)) * sd / math.sqrt(len(logs))
        return math.exp(m), math.exp(m - h), math.exp(m + h)
    ma, mb = a.get("throughput_tok_s"), b.get("throughput_tok_s")
    if not ma or not mb or math.isnan(ma) or math.isnan(mb):
        return float("nan"), float("nan"), float("nan")
    r = ma / mb
    sa, sb = a.get("throughput") or {}, b.get("throughput") or {}
    n = min(sa.get("n", 0), sb.get("n", 0))
    if n < 2 or math.isnan(sa.get("sd", float("nan"))) or math.isnan(sb.get("sd", float("nan"))):
        return r, float("nan"), float("nan")
    from scipy.stats import t as student_t

    h = float(student_t.ppf(0.975, n - 1)) * math.sqrt(sa["sd"] ** 2 / (sa["n"] * ma ** 2)
                                                       + sb["sd"] ** 2 / (sb["n"] * mb ** 2))
    return r, r * math.exp(-h), r * math.exp(h)


def _pcts(r: Dict[str, Any], name: str, scale: float = 1.0) -> str:
    return "/".join(_fmt(r.get(f"{name}_p{q}_s", float("nan")) * scale) for q in (50, 90, 99))


def markdown(results: Dict[str, Any]) -> str:
    """The results table, tokenrouter's ratios against each baseline (with spread) and diagnostics."""
    rows = results["rows"]
    which = ("started" if results["settings"].get("drain", "wait") == "wait"
             else "completed")  # runs before --drain waited for the requests in flight
    lines = [f"Settings: {results['settings']}", "",
             "tok/s and req/s: mean over the measurement windows, ± 95 % confidence half-width, [min–max] "
             f"(steady state); latencies of the requests that {which} in the measurement period; busy = share of "
             "the period each model spent in steps.", "",
             "| pair | mode | N | max tokens | tok/s | req/s | TTFT p50/p90/p99 s | ITL p50/p90/p99 ms | "
             "e2e p50/p90/p99 s | e2e p99/p50 | LLM share | handoffs/req | busy slm/llm | B* |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        th = r.get("throughput") or {}
        tps = _fmt(r["throughput_tok_s"])
        if th.get("n", 0) > 1:
            tps += f" ±{_fmt(th['ci95'])} [{_fmt(th['min'])}–{_fmt(th['max'])}]"
        busy = r.get("busy_share")
        busy_s = "/".join(_fmt(busy[m]["mean"]) for m in MODELS) if busy else "–"
        tail = (r["e2e_p99_s"] / r["e2e_p50_s"]) if r.get("e2e_p50_s") else float("nan")
        lines.append(f"| {r['pair']} | {r['mode']} | {r['N']} | {r['max_tokens']} | {tps} | "
                     f"{_fmt(r.get('requests_per_s', float('nan')))} | {_pcts(r, 'ttft')} | {_pcts(r, 'itl', 1e3)} | "
                     f"{_pcts(r, 'e2e')} | {_fmt(tail)} | {_fmt(r['llm_share'])} | "
                     f"{_fmt(r['handoffs_per_request'])} | {busy_s} | {r.get('B_star', '')}"
                     + (f" (the {r['same_run_as']} run)" if r.get("same_run_as") else "") + " |")
    by = {(r["pair"], r["N"], r["max_tokens"], r["mode"]): r for r in rows}
    present = [b for b in BASELINES if any(r["mode"] == b for r in rows)]
    # the ratios' subject: tokenrouter, else eager-async (e.g. --modes eager-async,no-triton)
    subject = next((m for m in ("tokenrouter", "eager-async") if any(r["mode"] == m for r in rows)), None)
    present = [b for b in present if b != subject]
    if subject and present:
        lines += ["", f"Throughput ratio {subject} / baseline (same server process; 95 % interval from the "
                  "windows' spread, or paired over the repeats with --repeats); the slm-only column is the "
                  "fraction of the SLM-only ceiling reached:", "",
                  "| pair | N | max tokens | " + " | ".join(present) + " |",
                  "|---|---|---|" + "---|" * len(present)]
        for r in rows:
            if r["mode"] != subject:
                continue
            k = (r["pair"], r["N"], r["max_tokens"])
            cells = []
            for b in present:
                if (*k, b) not in by:
                    cells.append("–")
                    continue
                x, lo, hi = ratio_interval(r, by[(*k, b)])
                cells.append(_fmt(x) + "×" + ("" if math.isnan(lo) else f" ({_fmt(lo)}–{_fmt(hi)})"))
            lines.append(f"| {k[0]} | {k[1]} | {k[2]} | " + " | ".join(cells) + " |")
    lengths = sorted({r["max_tokens"] for r in rows})
    if len(lengths) > 1:
        lo_l, hi_l = lengths[0], lengths[-1]
        paired = bool(results["settings"].get("interleave_lengths"))
        lines += ["", f"Throughput change from {lo_l} to {hi_l} output tokens, per mode (95 % interval; "
                  + ("paired over the interleaved repeats" if paired else
                     "from the windows' spread: the two lengths ran one after the other, so the host's drift "
                     "between them is in the figure; --repeats R --interleave-lengths pairs them") + "):", "",
                  "| pair | N | mode | change |", "|---|---|---|---|"]
        for r in rows:
            if r["max_tokens"] != hi_l or (r["pair"], r["N"], lo_l, r["mode"]) not in by:
                continue
            x, lo, hi = ratio_interval(r, by[(r["pair"], r["N"], lo_l, r["mode"])], paired=paired)
            pct = lambda v: f"{(v - 1) * 100:+.1f} %"  # noqa: E731
            lines.append(f"| {r['pair']} | {r['N']} | {r['mode']} | {pct(x)}"
                         + ("" if math.isnan(lo) else f" ({pct(lo)} to {pct(hi)})") + " |")
    tri = [r for r in rows if r["mode"] == "tokenrouter-triton"]
    if tri:
        lines += ["", "Transport: tokenrouter-triton (every segment a BLS request through the models' dynamic "
                  "batcher) / the ZeroMQ transport in the same server (tokenrouter, else eager-async); "
                  "compare at the same B (--triton-batcher against tokenrouter's B):", "",
                  "| pair | N | max tokens | zmq mode (B) | triton batcher B | triton / zmq |", "|---|---|---|---|---|---|"]
        for r in tri:
            k = (r["pair"], r["N"], r["max_tokens"])
            z = by.get((*k, "tokenrouter")) or by.get((*k, "eager-async"))
            if z is None:
                continue
            x, lo, hi = ratio_interval(r, z)
            lines.append(f"| {k[0]} | {k[1]} | {k[2]} | {z['mode']} ({z.get('B_star') or 'all 1'}) | "
                         f"{results['settings'].get('triton_batcher') or 'all 1'} | {_fmt(x)}×"
                         + ("" if math.isnan(lo) else f" ({_fmt(lo)}–{_fmt(hi)})") + " |")
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
    def folded(c: Dict[str, float]) -> Dict[str, float]:  # every router model's stub in one column
        out: Dict[str, float] = {}
        for k, v in c.items():
            k = "router stubs" if k.startswith("stub token_router") else k
            out[k] = out.get(k, 0.0) + v
        return out

    cpu = [(r, folded(r["cpu_share"])) for r in rows if r.get("cpu_share")]
    if cpu:
        order = ("stub slm", "stub llm", "router stubs", "tritonserver", "worker slm", "worker llm", "client")
        roles = sorted({k for _, c in cpu for k in c}, key=lambda k: (order.index(k) if k in order else 99, k))
        lines += ["", "CPU used during the measurement, by process, in cores (1.0 = one core busy; the "
                  f"machine had {results['settings'].get('cpu_count', '?')}); client = the load generator (and, in "
                  "no-triton, the router logic):", "",
                  "| pair | mode | N | max tokens | " + " | ".join(roles) + " | total |",
                  "|---|---|---|---|" + "---|" * (len(roles) + 1)]
        for r, c in cpu:
            lines.append(f"| {r['pair']} | {r['mode']} | {r['N']} | {r['max_tokens']} | "
                         + " | ".join(_fmt(c[k]) if k in c else "–" for k in roles)
                         + f" | {_fmt(sum(c.values()))} |")
    return "\n".join(lines)


def _plot(path: str, title: str, xlabel: str, series: Dict[str, List[tuple]]) -> str:
    """One PNG: ``series`` maps a label to points ``(x, y)`` or ``(x, y, y_min, y_max)`` (error bar)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 4))
    for label, pts in series.items():
        pts = sorted(pts)
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        if pts and all(len(p) == 4 and not math.isnan(p[2]) for p in pts):
            err = [[p[1] - p[2] for p in pts], [p[3] - p[1] for p in pts]]
            ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=label)
        else:
            ax.plot(xs, ys, marker="o", label=label)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("output tokens/s (bars: min–max over windows)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _pt(x, r) -> tuple:
    th = r.get("throughput") or {}
    return (x, r["throughput_tok_s"], th.get("min", float("nan")), th.get("max", float("nan")))


def plots(results: Dict[str, Any], out_dir: str) -> List[str]:
    """Throughput against N per mode (one PNG per pair and length) and against output length."""
    rows, files = results["rows"], []
    for pair in sorted({r["pair"] for r in rows}):
        pr = [r for r in rows if r["pair"] == pair]
        modes = [m for m in ALL_MODES + EXTRA_MODES if any(r["mode"] == m for r in pr)]
        for L in sorted({r["max_tokens"] for r in pr}):
            files.append(_plot(os.path.join(out_dir, f"throughput_vs_N_{pair}_{L}tok.png"),
                               f"{pair}: {L} output tokens", "concurrency N",
                               {m: [_pt(r["N"], r) for r in pr if r["mode"] == m and r["max_tokens"] == L]
                                for m in modes}))
        Nmax = max(r["N"] for r in pr)
        files.append(_plot(os.path.join(out_dir, f"throughput_vs_length_{pair}.png"), f"{pair}: N = {Nmax}",
                           "max output tokens",
                           {m: [_pt(r["max_tokens"], r) for r in pr if r["mode"] == m and r["N"] == Nmax]
                            for m in modes}))
    return files


def _scale_note(a) -> str:
    """Say in the output how these settings differ from the issue-size ones (--full)."""
    if a.full:
        return ""
    notes = []
    if max(a.max_tokens) < 512:
        notes.append(f"output lengths {'/'.join(map(str, a.max_tokens))} tokens instead of 128/512")
    if max(a.concurrency) < 16:
        notes.append("N = 16, 32 left to --full")
    if a.one_shot and a.requests_per_client < 3:
        notes.append(f"{a.requests_per_client} request(s) per client (--full: 3)")
    if not a.one_shot and a.duration < 120:
        notes.append(f"{a.duration:g} s of measurement per cell (--full: 120)")
    return "scaled for a 2-core CPU: " + ", ".join(notes) if notes else ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", default="demo,size-realistic")
    ap.add_argument("--modes", default=",".join(ALL_MODES))
    ap.add_argument("--concurrency", default=None, help="comma list (default 1,4,8; --full: 1,4,8,16,32)")
    ap.add_argument("--max-tokens", default=None, help="comma list (default 16,48; --full: 128,512)")
    ap.add_argument("--duration", type=float, default=None,
                    help="steady state (the default): seconds of measurement per cell, warm-up and drain "
                         "excluded (default 12; --full: 120)")
    ap.add_argument("--windows", type=int, default=3, help="steady state: consecutive windows per cell (default 3)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="steady state: run each (N, length)'s modes this many times, interleaved (A B A B …); "
                         "ratios are then paired per repeat (default 1)")
    ap.add_argument("--interleave-lengths", action="store_true",
                    help="steady state, with --repeats: alternate the output lengths inside every repeat of "
                         "an N, so that the throughput change from the shortest to the longest length is "
                         "paired per repeat as well (default: each length's cells in turn)")
    ap.add_argument("--warmup-s", type=float, default=0.0,
                    help="steady state: minimum warm-up in seconds (besides every client finishing one request "
                         "or 2N requests finishing)")
    ap.add_argument("--drain", choices=("cancel", "wait"), default="cancel",
                    help="steady state: at the end of a cell cancel the requests in flight and report the "
                         "latencies of the requests that completed in the measurement period (perf_analyzer's "
                         "convention; default), or wait for them and report those that started in it")
    ap.add_argument("--one-shot", action="store_true",
                    help="one-shot mode instead: every client sends --requests-per-client requests; "
                         "throughput = all tokens / the cell's wall time")
    ap.add_argument("--requests-per-client", type=int, default=None, help="--one-shot: default 1 (--full: 3)")
    ap.add_argument("--wait-factor", type=float, default=1.0,
                    help="delayed-batching wait bound in SLM step times (default 1)")
    ap.add_argument("--no-calibrate", dest="calibrate", action="store_false",
                    help="fit the DTMC's step latency to the eager run's steps only (default: also to a "
                         "calibration of each model at batch sizes up to max N, taken once after start)")
    ap.add_argument("--batch-override", default="",
                    help="use these B_i instead of the DTMC's B* in tokenrouter mode, e.g. slm=3 "
                         "(exploration; the table marks the B used)")
    ap.add_argument("--algorithm-params", default="",
                    help="JSON merged into the pair's routing-algorithm parameters, e.g. '{\"tau\": 0.3}' "
                         "(the size-realistic pair's τ 0.4 sends ~9 %% of tokens to the LLM)")
    ap.add_argument("--triton-batcher", default="",
                    help="mode tokenrouter-triton: the models' dynamic batcher preferred_batch_size, e.g. "
                         "llm=3 (default 1 each; fixed for the run: Triton reads it at load)")
    ap.add_argument("--triton-wait-us", type=int, default=0,
                    help="mode tokenrouter-triton: max_queue_delay_microseconds of a model whose "
                         "--triton-batcher B > 1 (required then)")
    ap.add_argument("--stream-interval", type=int, default=1,
                    help="the models' stream_interval: committed tokens per streamed message, the first "
                         "token at once (default 1; every mode, no-triton too, in the variant repository)")
    ap.add_argument("--prompts", choices=("generic", "humaneval", "gsm-symbolic", "math500"), default="generic",
                    help="the requests' prompts: generic = perf/prompts.txt with the chat template applied "
                         "by the server (default); humaneval = HumanEval's 164 problems as perf/quality.py "
                         "sends them, each request stopped where a quality run's stops (the code block's "
                         "end or EOS; --max-tokens is the cap), so the LLM-token share and output "
                         "lengths are those of the quality figures; gsm-symbolic / math500: the test "
                         "split of that task (perf/tasks.py), stopped at EOS")
    ap.add_argument("--full", action="store_true", help="issue-size settings for GPU hosts")
    ap.add_argument("--out", default=os.path.join(HERE, "results", time.strftime("matrix-%Y%m%d-%H%M%S")))
    a = ap.parse_args(argv)
    exit_on_termination()
    from tokenrouter.tools.repository import PAIRS

    a.pairs = [p for p in a.pairs.split(",") if p]
    if not a.pairs or set(a.pairs) - set(PAIRS):
        ap.error(f"--pairs: known pairs are {sorted(PAIRS)}")
    try:
        a.batch_override = _model_bs(a.batch_override)
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
    if a.one_shot and a.duration is not None:
        ap.error("--duration is the steady-state mode; --one-shot takes --requests-per-client")
    if not a.one_shot and a.requests_per_client is not None:
        ap.error("--requests-per-client is for --one-shot; the steady-state mode takes --duration")
    if a.duration is None:
        a.duration = 120.0 if a.full else 12.0
    if a.duration <= 0 or a.windows < 1 or a.warmup_s < 0 or a.repeats < 1 or a.stream_interval < 1:
        ap.error("--duration must be > 0, --windows >= 1, --warmup-s >= 0, --repeats >= 1, "
                 "--stream-interval >= 1")
    if a.one_shot and a.repeats > 1:
        ap.error("--repeats is for the steady-state mode")
    if a.interleave_lengths and a.repeats < 2:
        ap.error("--interleave-lengths pairs repeats: give --repeats 2 or more")
    a.modes = [m for m in a.modes.split(",") if m]
    bad = set(a.modes) - set(ALL_MODES) - set(EXTRA_MODES)
    if bad:
        ap.error(f"unknown modes {sorted(bad)}; known: {ALL_MODES + EXTRA_MODES}")
    try:
        a.triton_batcher = _model_bs(a.triton_batcher)
    except ValueError:
        ap.error("--triton-batcher takes model=B pairs, e.g. llm=3")
    if set(a.triton_batcher) - set(MODELS) or any(v < 1 for v in a.triton_batcher.values()):
        ap.error(f"--triton-batcher: models are {MODELS}, B >= 1")
    if any(v > 1 for v in a.triton_batcher.values()) and a.triton_wait_us <= 0:
        ap.error("--triton-batcher with B > 1 needs --triton-wait-us (the batcher's max queue delay)")
    try:
        a.concurrency = [int(x) for x in (a.concurrency or ("1,4,8,16,32" if a.full else "1,4,8")).split(",")]
        a.max_tokens = [int(x) for x in (a.max_tokens or ("128,512" if a.full else "16,48")).split(",")]
    except ValueError:
        ap.error("--concurrency and --max-tokens take comma-separated integers, e.g. 1,4,8")
    if a.requests_per_client is None:
        a.requests_per_client = 3 if a.full else 1
    if min(a.concurrency) < 1 or min(a.max_tokens) < 1 or a.requests_per_client < 1:
        ap.error("--concurrency, --max-tokens and --requests-per-client take positive integers")
    os.makedirs(a.out, exist_ok=True)
    settings = {"pairs": a.pairs, "modes": a.modes, "batch_override": a.batch_override,
                "triton_batcher": a.triton_batcher, "triton_wait_us": a.triton_wait_us,
                "algorithm_params": a.algorithm_params, "concurrency": a.concurrency, "max_tokens": a.max_tokens,
                "measurement": "one-shot" if a.one_shot else "steady-state",
                "requests_per_client": a.requests_per_client if a.one_shot else None,
                "duration_s": None if a.one_shot else a.duration, "windows": None if a.one_shot else a.windows,
                "repeats": a.repeats, "interleave_lengths": a.interleave_lengths,
                "warmup_s": None if a.one_shot else a.warmup_s, "wait_factor": a.wait_factor,
                "calibrate": a.calibrate, "full": a.full, "prompts": a.prompts, "stream_interval": a.stream_interval, "drain": a.drain,
                "cpu_count": os.cpu_count(),
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
