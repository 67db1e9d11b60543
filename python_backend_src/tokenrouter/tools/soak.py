"""Sustained-load robustness check of a running TokenRouter server (a soak test).

N client threads send requests back to back for a fixed time: gRPC streams and
non-streamed requests, routing thresholds drawn per request so that handoffs
are frequent, random output lengths, a fraction of streams cancelled by the
client mid-way and a fraction of malformed requests.  It then checks that

* every request ended (text, a clean error for bad input, or cancelled), none going
  ``request_timeout_s`` without a response (a stream's clock restarts at each chunk) — none hung;
* no valid request failed;
* the server is live and still answers, and every model's KV usage and active
  requests return to zero (``stats`` op).

With ``--hostile-fraction F`` that share of the requests are oversized or hostile
(:data:`HOSTILE`: a ``--hostile-mib`` MiB prompt, 50,000 stop strings, a 10 MB stop string,
sampling parameters nested 100,000 deep, 5,000 stop token ids); each must be refused with an error
naming its limit ("the limit is"), and with ``--server-pid`` the stubs must neither die nor
grow: their resident memory (RSS) at the start and end is reported, and a stub that was
restarted during the run is a failure.  A valid request answered "busy" (the server's queues
were full: a 503 / UNAVAILABLE naming the limit) is counted apart, as answered.

With ``--kill-stub MODEL`` a killer thread also SIGKILLs that model's Triton
Python stub (found in the process list: a ``triton_python_backend_stub`` child of
``--server-pid`` with ``MODEL_0_0`` in its arguments) at random intervals
(``--kill-every`` mean seconds); requests that then end with an error naming a
model that is down count as answered (a clear error), and at the end the stubs'
memory (RSS) is reported so that growth across restarts shows.

Usage (server already running, e.g. ``deploy/serve --background``)::

    python -m tokenrouter.tools.soak --url localhost:8001 --seconds 300 --concurrency 8
    python -m tokenrouter.tools.soak --seconds 600 --kill-stub llm --kill-every 90 \
        --server-pid "$(cat ~/.cache/tokenrouter/run/tritonserver.pid)"
    python -m tokenrouter.tools.soak --seconds 600 --hostile-fraction 0.1 \
        --server-pid "$(cat ~/.cache/tokenrouter/run/tritonserver.pid)"

Exit status 0 when every check passed, 1 otherwise (the report says which).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import signal
import threading
import time
from collections import Counter
from typing import Any, Dict, List, Optional, Sequence

from . import GRPC_URL_HELP, default_grpc_url, memwatch

__all__ = ["run_soak", "main", "find_stub", "stub_rss_mb", "HOSTILE"]

#: oversized and hostile inputs of ``--hostile-fraction`` (name -> what it sends); each must be
#: refused with an error naming the limit it exceeds
HOSTILE = {
    "huge_prompt": "a prompt of --hostile-mib MiB (max_input_bytes)",
    "many_stops": "50,000 stop strings (max_sampling_parameters_bytes)",
    "long_stop": "one stop string of 10 MB (max_sampling_parameters_bytes)",
    "deep_json": "sampling_parameters nested 100,000 levels deep (max_sampling_parameters_bytes / max_json_depth)",
    "many_stop_ids": "5,000 stop token ids (max_stop_token_ids)",
}

PROMPTS = [
    "Explain why the sky is blue.", "Write a short poem about the sea.", "List three uses of copper.",
    "What is a hash table?", "Describe a cat to someone who has never seen one.",
    "Give two tips for learning a language.", "Summarise the plot of Romeo and Juliet.",
    "How do vaccines work?", "Name the planets of the solar system.", "Why do leaves change colour?",
]


#: a paragraph repeated to make long prompts (``--long-fraction``): about 60 tokens a copy
_CONTEXT = ("The report below describes a small town's water system: two reservoirs, a treatment plant "
            "built in 1962, eleven pumping stations and about 140 km of pipes, some of them cast iron. ")


def _prompt(rng: random.Random, long_fraction: float) -> str:
    """A short prompt, or with probability ``long_fraction`` one of 2-30 context paragraphs (~120-1,800
    tokens) followed by a question."""
    q = rng.choice(PROMPTS)
    if rng.random() < long_fraction:
        return _CONTEXT * rng.randint(2, 30) + "\n" + q
    return q


def _hostile(rng: random.Random, mib: float, names: Optional[Sequence[str]] = None):
    """(name, prompt bytes, sampling_parameters text) of one hostile input (see :data:`HOSTILE`),
    drawn from ``names`` (default: all of them)."""
    name = rng.choice(sorted(names or HOSTILE))
    text, sp = rng.choice(PROMPTS).encode(), json.dumps({"max_tokens": 8})
    if name == "huge_prompt":
        text = b"a" * int(mib * 2**20)
    elif name == "many_stops":
        sp = json.dumps({"max_tokens": 8, "stop": ["x"] * 50000})
    elif name == "long_stop":
        sp = json.dumps({"max_tokens": 8, "stop": "y" * 10**7})
    elif name == "deep_json":
        sp = "[" * 100000
    elif name == "many_stop_ids":
        sp = json.dumps({"max_tokens": 8, "stop_token_ids": [2] * 5000})
    return name, text, sp


def _one(url: str, model: str, rng: random.Random, kind: str, request_timeout_s: float,
         thresholds: Sequence[float], hostile_mib: float = 32.0, max_tokens: Sequence[int] = (4, 48),
         long_fraction: float = 0.0, hostile_names: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    import numpy as np
    import tritonclient.grpc as grpcclient

    prompt = _prompt(rng, long_fraction)
    sampling: Dict[str, Any] = {"max_tokens": rng.randint(*max_tokens), "temperature": rng.choice([0.0, 0.8]),
                                "seed": rng.randint(0, 2**31), "ignore_eos": rng.random() < 0.5}
    if thresholds:
        sampling["routing_threshold"] = rng.choice(list(thresholds))
    if kind in ("cancel", "disconnect"):  # long enough to be left mid-way (after 1-6 chunks)
        sampling["max_tokens"], sampling["ignore_eos"] = max(sampling["max_tokens"], 16), True
    stream = kind != "plain"
    text = prompt.encode()
    if kind == "bad":
        sampling = rng.choice([{"max_tokens": 0}, {"max_tokens": 4, "nonsense": 1}, {"temperature": -1}])
        if rng.random() < 0.3:
            text = b"\xff\xfe"
    sp_text = json.dumps(sampling)
    hostile = ""
    if kind == "hostile":
        hostile, text, sp_text = _hostile(rng, hostile_mib, hostile_names)
    ins = []
    for name, arr, dt in (("text_input", np.array([text], dtype=np.object_), "BYTES"),
                          ("stream", np.array([stream]), "BOOL"),
                          ("apply_chat_template", np.array([True]), "BOOL"),
                          ("sampling_parameters", np.array([sp_text.encode()], dtype=np.object_),
                           "BYTES")):
        x = grpcclient.InferInput(name, list(arr.shape), dt)
        x.set_data_from_numpy(arr)
        ins.append(x)
    cancel_after = rng.randint(1, 6) if kind in ("cancel", "disconnect") else None
    q: "queue.Queue" = queue.Queue()
    c = grpcclient.InferenceServerClient(url)
    t0 = time.perf_counter()
    out: Dict[str, Any] = {"kind": kind, "outcome": "", "handoffs": 0, "tokens": 0, "error": "", "hostile": hostile}
    try:
        c.start_stream(callback=lambda result, error: q.put((result, error)))
        c.async_stream_infer(model, ins, enable_empty_final_response=True)
        chunks, last = 0, t0
        while True:
            try:  # hung: no response for request_timeout_s (a stream's clock restarts at each chunk)
                result, error = q.get(timeout=max(0.1, last + request_timeout_s - time.perf_counter()))
            except queue.Empty:
                if not stream and not out.get("late"):
                    # a plain request sends nothing before its end: wait as long again, so that an
                    # answer that comes late is told apart from none ("slow", not "hung")
                    out["late"], last = True, time.perf_counter()
                    continue
                out["outcome"], out["chunks"] = "hung", chunks
                return out
            last = time.perf_counter()
            if error is not None:
                out["outcome"], out["error"] = "error", str(error)
                if "busy: " in out["error"]:
                    out["outcome"] = "busy"
                return out
            chunks += 1
            if cancel_after is not None and chunks >= cancel_after:
                if kind == "disconnect":  # the client goes away: its channel closes, no cancel sent
                    c.close()
                else:
                    c.stop_stream(cancel_requests=True)
                out["outcome"] = "cancelled"
                return out
            p = result.get_response().parameters.get("triton_final_response")
            if p is not None and p.bool_param:
                s = result.as_numpy("routing_summary")
                if s is not None and s.size:
                    summ = json.loads(s.reshape(-1)[0])
                    out["handoffs"] = int(summ.get("handoffs", 0))
                    n = result.as_numpy("num_output_tokens")
                    out["tokens"] = int(n.reshape(-1)[0]) if n is not None and n.size else 0
                    out["outcome"] = "slow" if out.get("late") else "ok"
                else:
                    out["outcome"] = "ok-no-summary" if kind == "cancel" else "bad-final"
                return out
    except Exception as e:  # noqa: BLE001
        out["outcome"], out["error"] = "client-error", str(e)
        return out
    finally:
        out["e2e_s"] = time.perf_counter() - t0
        try:
            c.stop_stream()
            c.close()
        except Exception:  # noqa: BLE001
            pass


def find_stub(server_pid: int, model: str) -> Optional[int]:
    """pid of the live Triton Python stub of ``model`` (instance ``<model>_0_0``) whose
    parent is ``server_pid``, or None."""
    return memwatch.server_processes(server_pid).get(f"{model}_0_0")


def stub_rss_mb(server_pid: int, models: Sequence[str]) -> Dict[str, float]:
    """Resident memory (MiB) of each model's stub under ``server_pid`` (absent when not running)."""
    procs = memwatch.server_processes(server_pid)
    rss = {m: memwatch.rss_mb(procs[f"{m}_0_0"]) for m in models if f"{m}_0_0" in procs}
    return {m: r for m, r in rss.items() if r is not None}


HEAP_KEYS = ("python_allocated_blocks", "malloc_in_use_bytes", "malloc_free_bytes", "malloc_mmapped_bytes",
             "kv_tokens_in_use", "prefix_cache_tokens", "malloc_trim_released_bytes")


def _heap_probe(url: str, models: Sequence[str]) -> Dict[str, Any]:
    """Each model's heap statistics and KV use from its ``stats`` op (``HEAP_KEYS``), or
    ``{"error": ...}`` for a model that does not answer (down for a kill)."""
    from . import admin

    out: Dict[str, Any] = {}
    for m in models:
        try:
            s = admin.model_stats(url, m)
            out[m] = {k: s[k] for k in HEAP_KEYS if k in s}
        except Exception as e:  # noqa: BLE001
            out[m] = {"error": str(e)[:200]}
    return out


def heap_change(samples: Sequence[Dict[str, Any]], models: Sequence[str], since_s: float,
                until_s: float, settle_s: float = 0.0) -> Dict[str, Dict[str, Any]]:
    """How each model's heap statistics (:data:`HEAP_KEYS`, from :func:`_heap_probe`) changed over
    ``[since_s, until_s]`` of the samples' clock, within the process that answered last (a
    restarted stub starts again), leaving out its first ``settle_s`` seconds (its warm-up).

    Returns:
        ``{model: {"from_s", "to_s", "pid", key: last - first, ...}}``, byte counts in MiB
        (``*_bytes`` becomes ``*_mib``); a model with fewer than two answers in the span is left out.
    """
    out: Dict[str, Dict[str, Any]] = {}
    for m in models:
        born: Dict[Any, float] = {}  # pid -> its first sample's time
        for s in samples:
            born.setdefault(s["pid"].get(f"{m}_0_0"), s["t_s"])
        rows = [(s["t_s"], s["pid"].get(f"{m}_0_0"), s["probe"][m]) for s in samples
                if since_s <= s["t_s"] <= until_s and isinstance(s.get("probe", {}).get(m), dict)
                and "error" not in s["probe"][m] and s["t_s"] - born[s["pid"].get(f"{m}_0_0")] >= settle_s]
        if not rows:
            continue
        pid = rows[-1][1]
        rows = [r for r in rows if r[1] == pid]
        if len(rows) < 2:
            continue
        (t0, _, a), (t1, _, b) = rows[0], rows[-1]
        d: Dict[str, Any] = {"from_s": t0, "to_s": t1, "pid": pid}
        for k in HEAP_KEYS:
            if k in a and k in b:
                if k.endswith("_bytes"):
                    d[k[:-len("_bytes")] + "_mib"] = round((b[k] - a[k]) / 2**20, 1)
                else:
                    d[k] = b[k] - a[k]
        out[m] = d
    return out


def _killer(server_pid: int, models: Sequence[str], every_s: float, periodic: bool, stop: threading.Event,
            rng: random.Random, log: List[Dict[str, Any]], progress: bool) -> None:
    """SIGKILL the stubs of ``models`` in turn, every ``every_s`` seconds (``periodic``) or at
    exponential random intervals of that mean."""
    t0 = time.monotonic()
    turn = 0
    while not stop.wait(every_s if periodic else rng.expovariate(1.0 / every_s)):
        model = models[turn % len(models)]
        pid = find_stub(server_pid, model)
        if pid is None:  # still restarting from the previous kill
            continue
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            continue
        turn += 1
        log.append({"t_s": round(time.monotonic() - t0, 1), "model": model, "pid": pid})
        if progress:
            print(f"  killed the stub of {model} (pid {pid})", flush=True)


def run_soak(url: str, seconds: float, concurrency: int, *, models: Sequence[str] = ("slm", "llm"),
             router: str = "token_router", cancel_fraction: float = 0.15, bad_fraction: float = 0.05,
             plain_fraction: float = 0.2, thresholds: Sequence[float] = (0.1, 0.2, 0.3),
             request_timeout_s: float = 300.0, seed: int = 0, progress: bool = False,
             kill_stub: str = "", kill_every_s: float = 60.0, server_pid: int = 0,
             hostile_fraction: float = 0.0, hostile_mib: float = 32.0, disconnect_fraction: float = 0.0,
             max_tokens: Sequence[int] = (4, 48), long_fraction: float = 0.0, kill_periodic: bool = False,
             rss_every_s: float = 0.0, warmup_s: float = 0.0, window_s: float = 2400.0,
             rss_tolerance_mb: float = 0.0) -> Dict[str, Any]:
    """Run the soak and return the report (see module docstring).

    Args:
        url: gRPC address ``host:port`` of the server.
        seconds: how long clients keep sending new requests (s).
        concurrency: client threads, each with one request in flight.
        models: LLM models whose KV must return to zero.
        cancel_fraction, bad_fraction, plain_fraction, disconnect_fraction: shares of cancelled
            streams, malformed requests, non-streamed requests and streams whose client closes
            its connection mid-way without cancelling. Each kind with a share (and ``hostile``)
            is sent at least once: client ``i``'s first request is the ``i``-th such kind when
            ``i`` is below their number, so ``concurrency`` should be at least that number.
        max_tokens: (low, high) of the uniformly drawn ``max_tokens`` of a valid request.
        long_fraction: share of prompts of 2-30 paragraphs (~120-1,800 tokens) instead of one line.
        thresholds: routing thresholds drawn per request (``routing_threshold``);
            empty to use the server's.
        request_timeout_s: a request that gets no response for this long (s; a stream's clock
            starts again at each chunk) is "hung"; a non-streamed request, which has no response
            before its end, gets twice as long, and one answered in the second half is "slow"
            (its end-to-end seconds in ``slow_answers_e2e_s``; not a problem).
        kill_stub: models (comma-separated) whose stubs are SIGKILLed in turn ("" = none).
        kill_every_s: seconds between two kills (the mean of random intervals, or the period
            with ``kill_periodic``).
        kill_periodic: kill every ``kill_every_s`` seconds exactly instead of at random.
        server_pid: the tritonserver's pid (required with ``kill_stub``; with it the stubs'
            memory is reported, and without ``kill_stub`` a stub restarted during the run fails it).
        hostile_fraction: share of oversized / hostile requests (:data:`HOSTILE`).
        hostile_mib: size of the oversized prompt (MiB).
        rss_every_s: with ``server_pid``, sample every process's resident memory this often (s;
            0 = only at the start and the end) into ``rss`` (:mod:`tokenrouter.tools.memwatch`).
        warmup_s, window_s: the samples before ``warmup_s`` (and a restarted stub's first
            ``warmup_s``) are warm-up; the flatness figure is each process's range over the last
            ``window_s`` seconds (:func:`~tokenrouter.tools.memwatch.summarize`: one pid's range, a
            restarted stub being a new process; the range across its processes is reported too).
        rss_tolerance_mb: a process whose range over that window exceeds this (MiB) fails the
            soak (0 = report only).

    Returns:
        dict: ``passed`` (bool), ``problems`` (list of str), ``outcomes`` per
        kind, ``requests``, ``handoffs``, ``output_tokens``, ``seconds``,
        ``final_stats`` per model; with ``kill_stub`` also ``kills``; with ``server_pid``
        ``stub_rss_mb`` (``start`` / ``end`` per model) and ``rss`` (``samples`` and
        :func:`~tokenrouter.tools.memwatch.summarize`'s ``summary``, the models' heap statistics per
        sample and :func:`heap_change` over the window); with ``hostile_fraction``
        ``hostile`` (outcomes per hostile input).

    Raises:
        ValueError: ``kill_stub`` without ``server_pid``, or no such stub.
    """
    from . import admin

    kills: List[Dict[str, Any]] = []
    rss_start: Dict[str, float] = {}
    kill_stop = threading.Event()
    kill_models = [m for m in kill_stub.split(",") if m]
    for m in kill_models:
        if not server_pid or find_stub(server_pid, m) is None:
            raise ValueError(f"no stub of model {m!r} under tritonserver pid {server_pid}")
    if kill_models:
        threading.Thread(target=_killer, args=(server_pid, kill_models, kill_every_s, kill_periodic, kill_stop,
                                               random.Random(seed + 7), kills, progress), daemon=True).start()
    sampler = memwatch.RSSSampler(server_pid, rss_every_s or 1e9,
                                  probe=lambda: _heap_probe(url, models)).start() if server_pid else None

    pids_start: Dict[str, Optional[int]] = {}
    if server_pid:
        rss_start = stub_rss_mb(server_pid, [*models, router])
        pids_start = {m: find_stub(server_pid, m) for m in [*models, router]}
    stop_at = time.monotonic() + seconds
    records: List[Dict[str, Any]] = []
    lock = threading.Lock()

    edges = [("bad", bad_fraction), ("cancel", cancel_fraction), ("disconnect", disconnect_fraction),
             ("plain", plain_fraction)]
    # every kind with a share is sent at least once however short the run: client i's first request is
    # the i-th of them (a short soak of few requests would otherwise miss a kind of small share)
    first_kinds = [k for k, share in edges if share > 0] + (["hostile"] if hostile_fraction > 0 else [])

    def client(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        first = True
        while time.monotonic() < stop_at:
            x = rng.random()
            kind = "stream"
            for k, share in edges:
                if x < share:
                    kind = k
                    break
                x -= share
            if hostile_fraction and rng.random() < hostile_fraction:
                kind = "hostile"
            if first and i < len(first_kinds):
                kind = first_kinds[i]
            first = False
            started = time.monotonic() - (stop_at - seconds)
            r = _one(url, router, rng, kind, request_timeout_s, thresholds, hostile_mib, max_tokens, long_fraction)
            r["t_start_s"] = round(started, 1)
            with lock:
                records.append(r)
                n = len(records)
            if progress and n % 20 == 0:
                print(f"  {n} requests, {max(0, stop_at - time.monotonic()):.0f} s left", flush=True)

    t0 = time.monotonic()
    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + request_timeout_s + 60)
    kill_stop.set()
    traffic_end_s = sampler.elapsed_s() if sampler is not None else None
    wall = time.monotonic() - t0
    problems: List[str] = []
    if any(t.is_alive() for t in threads):
        problems.append("a client thread did not finish")
    outcomes: Dict[str, Counter] = {}
    for r in records:
        outcomes.setdefault(r["kind"], Counter())[r["outcome"]] += 1
        if r["outcome"] == "hung":
            wait = "twice that: no response for" if r.get("late") else "no response for"
            problems.append(f"a {r['kind']} request started at {r['t_start_s']:.0f} s got {wait} "
                            f"{request_timeout_s:.0f} s (after {r.get('chunks', 0)} chunks, {r['e2e_s']:.0f} s in all)")
        elif r["kind"] == "bad" and r["outcome"] != "error":
            problems.append(f"a malformed request was not rejected: {r}")
        elif r["kind"] == "hostile" and not (r["outcome"] == "error" and (
                "the limit is" in r["error"] or (kill_stub and _down_error(r["error"])))):  # refused either way
            problems.append(f"a hostile request ({r['hostile']}) was not refused naming its limit: "
                            f"{r['outcome']} {r['error'][:200]}")
        elif r["kind"] in ("stream", "plain") and r["outcome"] == "busy":
            pass  # overload answered as overload
        elif r["kind"] in ("stream", "plain") and r["outcome"] not in ("ok", "slow") and not (
                kill_stub and r["outcome"] == "error" and _down_error(r["error"])):
            problems.append(f"a valid {r['kind']} request failed: {r['outcome']} {r['error'][:200]}")
        elif r["kind"] in ("cancel", "disconnect") and r["outcome"] not in ("cancelled", "ok", "ok-no-summary") and not (
                kill_stub and r["outcome"] == "error" and _down_error(r["error"])):
            problems.append(f"a cancelled stream ended badly: {r['outcome']} {r['error'][:200]}")
    final: Dict[str, Any] = {}
    try:
        if kill_stub:  # the last kill's restart must be over before the checks
            back = admin.router_ready(url, router, timeout_s=30)
            deadline = time.monotonic() + 180
            while not back["ready"] and time.monotonic() < deadline:
                time.sleep(2)
                back = admin.router_ready(url, router, timeout_s=30)
            if not back["ready"]:
                problems.append(f"{router} not ready 180 s after the soak: {back['reason']}")
        deadline = time.monotonic() + 60
        while True:
            final = {m: admin.model_stats(url, m) for m in models}
            if all(s["kv_tokens_in_use"] == 0 and s["active"] == 0 for s in final.values()) \
                    or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        for m, s in final.items():
            if s["kv_tokens_in_use"] or s["active"]:
                problems.append(f"model {m} still holds KV after the soak: {s['kv_tokens_in_use']} tokens, "
                                f"{s['active']} requests")
        probe = _one(url, router, random.Random(seed), "stream", request_timeout_s, ())
        if probe["outcome"] != "ok":
            problems.append(f"the server no longer answers: {probe}")
    except Exception as e:  # noqa: BLE001
        problems.append(f"server unreachable after the soak: {e}")
    extra: Dict[str, Any] = {}
    if server_pid:
        extra["stub_rss_mb"] = {"start": rss_start, "end": stub_rss_mb(server_pid, [*models, router])}
        samples = sampler.stop()
        # the flatness figures cover the load; the samples after it (checks, the last kill's
        # recovery) show what an idle server gives back, in end_mb
        summary = memwatch.summarize(samples, warmup_s, window_s, settle_s=max(warmup_s, 60.0),
                                     until_s=traffic_end_s)
        extra["rss"] = {"every_s": rss_every_s, "warmup_s": warmup_s, "window_s": window_s,
                        "traffic_end_s": round(traffic_end_s, 1), "summary": summary,
                        "summary_anon": memwatch.summarize(samples, warmup_s, window_s, max(warmup_s, 60.0),
                                                           key="anon_mb", until_s=traffic_end_s),
                        "summary_shmem": memwatch.summarize(samples, warmup_s, window_s, max(warmup_s, 60.0),
                                                            key="shmem_mb", until_s=traffic_end_s),
                        "samples": samples}
        extra["rss"]["heap_change"] = heap_change(samples, models, traffic_end_s - window_s, traffic_end_s,
                                                  settle_s=max(warmup_s, 60.0))
        for name, d in summary.items():  # growth of a running process: a restarted stub is a new one
            grown = d.get("process_range_mb", d.get("window_range_mb", 0.0))
            if rss_tolerance_mb and grown > rss_tolerance_mb:
                problems.append(f"{name} grew: one process's resident memory ranged over {grown} MiB in "
                                f"{d.get('process_span_s', window_s):.0f} s of the last {window_s:.0f} s (all its "
                                f"processes: min {d['window_min_mb']}, max {d['window_max_mb']}; the tolerance is "
                                f"{rss_tolerance_mb} MiB)")
        if not kill_stub:
            restarted = [m for m, pid in pids_start.items() if find_stub(server_pid, m) != pid]
            if restarted:
                problems.append(f"stubs died or were restarted during the soak: {restarted}")
    if kill_stub:
        extra.update({"kills": kills,
                      "down_errors": sum(1 for r in records if r["outcome"] == "error" and _down_error(r["error"]))})
    if hostile_fraction:
        hostile: Dict[str, Counter] = {}
        for r in records:
            if r["kind"] == "hostile":
                hostile.setdefault(r["hostile"], Counter())[r["outcome"]] += 1
        extra["hostile"] = {k: dict(v) for k, v in hostile.items()}
    extra["busy"] = sum(1 for r in records if r["outcome"] == "busy")
    slow = sorted(round(r["e2e_s"], 1) for r in records if r["outcome"] == "slow")
    if slow:  # plain requests answered after request_timeout_s (end-to-end seconds): slow, not lost
        extra["slow_answers_e2e_s"] = slow
    answered = sorted(r["e2e_s"] for r in records if r["outcome"] in ("ok", "slow"))
    if answered:  # how long an answer took, end to end (s)
        extra["answer_e2e_s"] = {"p50": round(answered[len(answered) // 2], 1),
                                 "p90": round(answered[int(0.9 * (len(answered) - 1))], 1),
                                 "max": round(answered[-1], 1)}
    return {**extra, "passed": not problems, "problems": problems[:50],
            "outcomes": {k: dict(v) for k, v in outcomes.items()}, "requests": len(records),
            "handoffs": sum(r["handoffs"] for r in records),
            "output_tokens": sum(r["tokens"] for r in records), "seconds": round(wall, 1),
            "final_stats": {m: {k: s.get(k) for k in ("kv_tokens_in_use", "active", "handoffs_out", "errors")}
                            for m, s in final.items()}}


def _down_error(message: str) -> bool:
    """A clear error about a model that is down (expected while stubs are being killed)."""
    return " is down" in message or "not ready" in message or "not healthy" in message


def main(argv=None) -> int:
    """Command line entry point (see module docstring)."""
    ap = argparse.ArgumentParser(prog="python -m tokenrouter.tools.soak", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--url", default=default_grpc_url(), help=GRPC_URL_HELP)
    ap.add_argument("--seconds", type=float, default=300, help="time during which new requests are sent")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--models", default="slm,llm", help="LLM models whose KV must return to zero")
    ap.add_argument("--router", default="token_router")
    ap.add_argument("--cancel-fraction", type=float, default=0.15)
    ap.add_argument("--bad-fraction", type=float, default=0.05)
    ap.add_argument("--thresholds", default="0.1,0.2,0.3",
                    help="routing thresholds drawn per request ('' = the server's)")
    ap.add_argument("--request-timeout", type=float, default=300, help="seconds before a request counts as hung")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--disconnect-fraction", type=float, default=0.0,
                    help="share of streams whose client closes its connection mid-way without cancelling")
    ap.add_argument("--max-tokens", default="4,48", metavar="LOW,HIGH",
                    help="range of a valid request's max_tokens (drawn uniformly)")
    ap.add_argument("--long-fraction", type=float, default=0.0,
                    help="share of long prompts (2-30 paragraphs, ~120-1,800 tokens) instead of one line")
    ap.add_argument("--kill-stub", default="", metavar="MODEL[,MODEL...]",
                    help="SIGKILL these models' Triton stubs in turn (needs --server-pid)")
    ap.add_argument("--kill-every", type=float, default=60.0,
                    help="seconds between two kills: the mean of random intervals, or the period with --kill-periodic")
    ap.add_argument("--kill-periodic", action="store_true", help="kill every --kill-every seconds exactly")
    ap.add_argument("--rss-every", type=float, default=0.0,
                    help="with --server-pid: sample every process's resident memory this often (s; 0 = start and end)")
    ap.add_argument("--warmup", type=float, default=0.0,
                    help="seconds of warm-up left out of the memory window and slope")
    ap.add_argument("--window", type=float, default=2400.0,
                    help="final window (s) over which each process's memory range is the flatness figure")
    ap.add_argument("--rss-tolerance-mb", type=float, default=0.0,
                    help="fail when a process's memory ranges over more than this in the window (0 = report only)")
    ap.add_argument("--out", default="", metavar="FILE", help="also write the report (with the memory samples) here")
    ap.add_argument("--server-pid", type=int, default=0,
                    help="pid of the tritonserver (for --kill-stub; with it the stubs' memory is reported)")
    ap.add_argument("--hostile-fraction", type=float, default=0.0,
                    help="share of oversized / hostile requests mixed into the traffic, each of which must be "
                         "refused naming its limit")
    ap.add_argument("--hostile-mib", type=float, default=32.0, help="size of the oversized prompt (MiB)")
    a = ap.parse_args(argv)
    if a.kill_stub and not a.server_pid:
        ap.error("--kill-stub needs --server-pid (the tritonserver whose stub is killed)")
    try:
        lo, hi = (int(x) for x in a.max_tokens.split(","))
    except ValueError:
        ap.error(f"--max-tokens takes LOW,HIGH (two integers), got {a.max_tokens!r}")
    if not 1 <= lo <= hi:
        ap.error(f"--max-tokens needs 1 <= LOW <= HIGH, got {a.max_tokens!r}")
    rep = run_soak(a.url, a.seconds, a.concurrency, models=[m for m in a.models.split(",") if m],
                   router=a.router, cancel_fraction=a.cancel_fraction, bad_fraction=a.bad_fraction,
                   thresholds=[float(x) for x in a.thresholds.split(",") if x.strip()],
                   request_timeout_s=a.request_timeout, seed=a.seed, progress=True,
                   kill_stub=a.kill_stub, kill_every_s=a.kill_every, server_pid=a.server_pid,
                   hostile_fraction=a.hostile_fraction, hostile_mib=a.hostile_mib,
                   disconnect_fraction=a.disconnect_fraction, max_tokens=(lo, hi), long_fraction=a.long_fraction,
                   kill_periodic=a.kill_periodic, rss_every_s=a.rss_every, warmup_s=a.warmup, window_s=a.window,
                   rss_tolerance_mb=a.rss_tolerance_mb)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rep, f, indent=1)
    brief = {k: v for k, v in rep.items() if k != "rss"}
    if "rss" in rep:
        brief["rss_summary"] = rep["rss"]["summary"]
    print(json.dumps(brief, indent=2))
    print("soak: PASSED" if rep["passed"] else "soak: FAILED")
    return 0 if rep["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
