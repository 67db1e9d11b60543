"""The benchmark harness: steady-state window accounting on synthetic records, token arrival times
and a steady load against the real server (speed itself is measured in perf/, not here;
bench_matrix end to end is in test_bench_matrix.py: it starts servers of its own)."""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from counters import counter_deltas, model_counters  # perf/ (pytest.ini)
from loadgen import (SteadyLoad, latency_stats, load_tokenizer, percentile, spread,  # perf/ (pytest.ini)
                     token_arrival_times, window_summary)

T975 = {2: 4.302652729911275, 3: 3.182446305284263}  # Student's t, 0.975 quantile, by degrees of freedom


def rec(t_start, token_t, ttft=None, e2e=None, models=("slm", "llm"), token_model=None, handoffs=0, error=""):
    """A RequestRecord dict as loadgen makes it (times in s)."""
    e2e = e2e if e2e is not None else (max(token_t) - t_start if token_t else 1.0)
    return {"ttft_s": ttft if ttft is not None else (min(token_t) - t_start if token_t else float("nan")),
            "itl_s": [], "e2e_s": e2e, "output_tokens": len(token_t) if not error else 0,
            "tokens_by_model": {"slm": len(token_t)}, "handoffs": handoffs, "error": error, "t_start_s": t_start,
            "token_t_s": list(token_t), "models": list(models),
            "token_model": list(token_model) if token_model is not None else [0] * len(token_t)}


def test_tokens_counted_in_the_window_they_arrived_in():
    # one request streaming across two window boundaries: 3 tokens in w0, 2 in w1, 1 in w2
    r = rec(9.5, [10.1, 10.5, 10.9, 11.0, 11.7, 12.2])
    s = window_summary([r], [10.0, 11.0, 12.0, 13.0])
    assert s["throughput_tok_s_windows"] == [3.0, 2.0, 1.0]
    assert s["throughput_tok_s"] == pytest.approx(2.0)
    assert s["output_tokens"] == 6 and s["windows"] == 3 and s["window_s"] == pytest.approx(1.0)
    # windows of unequal length: tokens / that window's length
    s2 = window_summary([r], [10.0, 11.0, 13.0])
    assert s2["throughput_tok_s_windows"] == [3.0, 1.5]


def test_warmup_and_drain_excluded():
    bounds = [100.0, 102.0, 104.0, 106.0]
    warm = rec(90.0, [95.0, 99.0, 100.5], ttft=5.0, e2e=10.6)       # started in the warm-up
    inside = rec(101.0, [101.5, 103.0, 105.9, 107.0, 108.0], ttft=0.5, e2e=7.0)  # ends in the drain
    drain = rec(106.5, [107.0, 108.0], ttft=0.5, e2e=2.0)           # started after the period
    failed = rec(103.0, [], error="boom")
    s = window_summary([warm, inside, drain, failed], bounds)
    # tokens: warm's 100.5; inside's 101.5, 103.0, 105.9; nothing at or after 106
    assert s["throughput_tok_s_windows"] == [1.0, 0.5, 0.5]
    assert s["output_tokens"] == 4
    # latencies only from requests that started in the period (inside; failed has no latency)
    assert s["requests_started"] == 2 and s["errors"] == 1
    assert s["ttft_p50_s"] == pytest.approx(0.5) and s["e2e_p99_s"] == pytest.approx(7.0)
    # requests/s counts completions inside a window: warm ends at 100.6 (w0); inside ends at 108 (drain)
    assert s["requests_per_s_windows"] == [0.5, 0.0, 0.0]
    # the request that started before the period is outside the latency figures even though it ended inside
    assert s["e2e_p50_s"] == pytest.approx(7.0)


def test_latencies_of_completed_requests_and_cancelled_ones_count_tokens_only():
    bounds = [100.0, 102.0, 104.0, 106.0]
    warm = {**rec(90.0, [95.0, 99.0, 100.5], ttft=5.0, e2e=10.6, token_model=[0, 0, 1]),
            "tokens_by_model": {"slm": 2, "llm": 1}}                  # started before, completed inside
    inside = rec(101.0, [101.5, 103.0], ttft=0.5, e2e=3.0)           # started and completed inside
    late = rec(104.0, [104.5, 105.0, 107.0], ttft=0.5, e2e=4.0)      # started inside, completes after
    cut = {**rec(105.0, [105.5, 105.9, 106.2]), "cancelled": True, "token_model": [], "models": [],
           "e2e_s": 1.3}                                              # cancelled at 106.3, no trace
    failed = rec(103.0, [], error="boom", e2e=0.5)                    # failed inside
    s = window_summary([warm, inside, late, cut, failed], bounds, latencies="completed")
    assert s["latencies_of"] == "completed"
    # latencies: warm and inside (completed in the period); late completes after, cut was cancelled
    assert s["e2e_p50_s"] == pytest.approx((10.6 + 3.0) / 2) and s["ttft_p99_s"] == pytest.approx(5.0, rel=0.05)
    assert s["errors"] == 1
    # the cancelled request's tokens streamed inside count (105.5, 105.9), as do everyone else's
    assert s["throughput_tok_s_windows"] == [1.0, 0.5, 2.0]
    # completions: warm (100.6) in w0, inside (104.0) in w2; the cancelled one is no completion
    assert s["requests_per_s_windows"] == [0.5, 0.0, 0.5]
    # the LLM share of the completed requests' output (warm: 1 of 3, inside: 0 of 2), not of the
    # streamed tokens: the requests cut at the end have no trace and are the long ones
    assert s["llm_share"] == pytest.approx(1 / 5)
    # the same with traces on every request: completed -> the finished outputs; started -> streamed tokens
    late_llm = {**late, "token_model": [1, 1, 1], "tokens_by_model": {"llm": 3}}
    assert window_summary([warm, inside, late_llm], bounds, latencies="completed")["llm_share"] == pytest.approx(1 / 5)
    assert window_summary([warm, inside, late_llm], bounds)["llm_share"] == pytest.approx(3 / 5)
    # started in the period: inside, late, cut, failed
    assert s["requests_started"] == 4
    # the same records the drain way: latencies of the requests that started inside, never the cancelled one
    s2 = window_summary([warm, inside, late, cut, failed], bounds)
    assert s2["latencies_of"] == "started" and s2["e2e_p50_s"] == pytest.approx(3.5) and s2["errors"] == 1
    with pytest.raises(ValueError, match="latencies"):
        window_summary([], bounds, latencies="finished")


def _fake_stream(durations, step_s=0.02):
    """A generate function (no server) streaming one token per ``step_s`` for the request's duration.

    ``durations``: callable (prompt) -> seconds.  It honours ``abort`` as token_router's client does:
    stops and raises once the event is set."""
    import threading

    def gen(prompt, sampling, on_text, abort: "threading.Event" = None):
        import time as _t

        n = 0
        end = _t.perf_counter() + durations(prompt)
        while _t.perf_counter() < end:
            if abort is not None and abort.is_set():
                raise RuntimeError("aborted")
            _t.sleep(step_s)
            n += 1
            on_text("x")
        return {"num_output_tokens": n, "routing_summary": {"tokens_by_model": {"slm": n}, "handoffs": 0}}
    return gen


def test_steady_load_warms_up_after_2n_completions_and_cancels_in_flight_requests():
    # one prompt takes 20 s, the other 0.1 s: waiting for every client's first request would take 20 s
    gen = _fake_stream(lambda p: 20.0 if p == "slow" else 0.1)
    load = SteadyLoad(gen, ["slow"] + ["fast"] * 20, 3, 8, tokens_per_chunk=2).start()
    try:
        m = load.measure(1.0, windows=2, since=load.t_started)
    finally:
        import time as _t

        t0 = _t.perf_counter()
        recs = load.stop(timeout_s=10, cancel=True)
        stopped_in = _t.perf_counter() - t0
    assert m["warmup_s"] < 5.0  # the 2N rule: 6 fast requests finished long before the slow one
    assert stopped_in < 5.0     # the slow request was cancelled, not awaited
    cut = [r for r in recs if r["cancelled"]]
    assert any(r["output_tokens"] > 20 for r in cut)  # the slow one streamed for seconds before its cut
    for r in cut:  # tokens_per_chunk tokens per chunk with text, at the chunk's arrival
        assert r["output_tokens"] == len(r["token_t_s"]) and r["output_tokens"] % 2 == 0 and not r["error"]
    s = window_summary(recs, m["bounds"], latencies="completed")
    assert s["errors"] == 0 and s["output_tokens"] > 0
    # a generate function without ``abort`` is drained, never cut
    plain = SteadyLoad(lambda p, sp, cb: gen(p, sp, cb), ["fast"], 2, 8).start()
    plain.wait_warm(plain.t_started)
    assert not any(r["cancelled"] for r in plain.stop(timeout_s=10, cancel=True))


def test_snapshot_counts_the_tokens_of_requests_still_running():
    """A window read while the load runs (perf/dtmc_vs_server.py's points) counts the tokens that
    requests still in flight streamed inside it; those requests give no latency or completion."""
    import time as _t

    gen = _fake_stream(lambda p: 30.0)  # every request outlives the test: no request finishes
    load = SteadyLoad(gen, ["slow"], 2, 8).start()
    try:
        _t.sleep(0.3)
        t0 = _t.perf_counter()
        _t.sleep(1.0)
        t1 = _t.perf_counter()
        snap = load.snapshot()
    finally:
        load.stop(timeout_s=10, cancel=True)
    assert len(snap) == 2 and all(r["in_flight"] and not r["cancelled"] for r in snap)
    for r in snap:
        assert r["output_tokens"] == len(r["token_t_s"]) > 10 and r["t_start_s"] < min(r["token_t_s"])
    s = window_summary(snap, [t0, t1], latencies="completed")
    inside = sum(1 for r in snap for t in r["token_t_s"] if t0 <= t < t1)
    assert s["output_tokens"] == inside > 20  # one second of 20 ms steps from each client
    assert s["requests_per_s"] == 0 and s["errors"] == 0 and math.isnan(s["ttft_p50_s"])


def test_llm_share_of_tokens_streamed_in_the_period_and_handoffs():
    bounds = [0.0, 1.0, 2.0]
    a = rec(-0.5, [-0.1, 0.2, 0.4, 0.6], token_model=[1, 1, 0, 0], handoffs=1)  # 1 of its 3 in-period tokens by llm
    b = rec(0.1, [0.5, 1.5, 2.5], token_model=[0, 1, 1], handoffs=3)          # 1 of its 2 in-period tokens by llm
    s = window_summary([a, b], bounds)
    assert s["llm_share"] == pytest.approx(2 / 5)
    assert s["handoffs_per_request"] == pytest.approx(3.0)  # only b started in the period
    # without a trace: the routing summaries of the requests that started in the period
    b2 = dict(b, token_model=[], tokens_by_model={"slm": 1, "llm": 2})
    assert window_summary([b2], bounds)["llm_share"] == pytest.approx(2 / 3)


def test_busy_share_from_counter_probes():
    bounds = [0.0, 2.0, 4.0, 6.0]
    probes = [{"slm": {"step_time_s": v}, "llm": {"step_time_s": w}}
              for v, w in ((10.0, 1.0), (11.0, 3.0), (12.0, 5.0), (13.5, 6.0))]
    s = window_summary([rec(0.5, [1.0])], bounds, probes=probes)
    assert s["busy_share"]["slm"]["mean"] == pytest.approx((0.5 + 0.5 + 0.75) / 3)
    assert s["busy_share"]["llm"]["max"] == pytest.approx(1.0) and s["busy_share"]["llm"]["min"] == pytest.approx(0.5)
    with pytest.raises(ValueError):
        window_summary([], bounds, probes=probes[:2])
    with pytest.raises(ValueError):
        window_summary([], [1.0])
    with pytest.raises(ValueError):
        window_summary([], [1.0, 1.0])


def test_percentiles_latency_stats_and_spread():
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile(list(range(101)), 99) == pytest.approx(99.0)
    assert percentile([5.0], 90) == 5.0 and math.isnan(percentile([], 50))
    recs = [rec(0.0, [0.1 * (k + 1) + 0.2 * j for j in range(5)], e2e=0.1 * (k + 1) + 0.8) for k in range(10)]
    st = latency_stats(recs)
    assert st["ttft_p50_s"] == pytest.approx(0.55) and st["ttft_p90_s"] == pytest.approx(0.91)
    assert st["itl_p50_s"] == pytest.approx(0.2) and st["itl_p99_s"] == pytest.approx(0.2)  # (e2e-ttft)/(5-1)
    assert st["e2e_p99_s"] == pytest.approx(1.791)
    sp = spread([10.0, 12.0, 14.0])
    assert (sp["mean"], sp["min"], sp["max"], sp["n"]) == (12.0, 10.0, 14.0, 3)
    assert sp["sd"] == pytest.approx(2.0) and sp["ci95"] == pytest.approx(T975[2] * 2.0 / math.sqrt(3))
    one = spread([7.0])
    assert one["mean"] == 7.0 and math.isnan(one["ci95"])


def test_ratio_interval_from_window_spread():
    from bench_matrix import ratio_interval

    a = {"throughput_tok_s": 20.0, "throughput": spread([18.0, 20.0, 22.0])}
    b = {"throughput_tok_s": 10.0, "throughput": spread([10.0, 10.0, 10.0])}
    r, lo, hi = ratio_interval(a, b)
    h = T975[2] * math.sqrt(4.0 / (3 * 400.0))
    assert r == 2.0 and lo == pytest.approx(2 * math.exp(-h)) and hi == pytest.approx(2 * math.exp(h))
    r1, lo1, _ = ratio_interval({"throughput_tok_s": 20.0}, b)  # one-shot row: ratio without an interval
    assert r1 == 2.0 and math.isnan(lo1)


def test_ratio_of_a_row_to_the_run_it_reuses_is_exactly_one():
    from bench_matrix import ratio_interval

    eager = {"mode": "eager-async", "throughput_tok_s": 80.0, "throughput": spread([70.0, 80.0, 90.0])}
    other = {"mode": "lock-step", "throughput_tok_s": 40.0, "throughput": spread([35.0, 40.0, 45.0])}
    same = {**eager, "mode": "tokenrouter", "same_run_as": "eager-async"}
    assert ratio_interval(same, eager) == (1.0, 1.0, 1.0) == ratio_interval(eager, same)
    r, lo, hi = ratio_interval(same, other)  # against any other mode: the eager run's own ratio
    assert (r, lo, hi) == ratio_interval(eager, other) and lo < 2.0 < hi


def test_interleaved_repeats_merge_and_pair():
    from bench_matrix import merge_repeats, ratio_interval

    def row(tps, ttft, started, steps, busy):
        return {"mode": "m", "throughput_tok_s": statistics.fmean(tps), "throughput_tok_s_windows": tps,
                "requests_per_s": 1.0, "requests_per_s_windows": [1.0] * len(tps), "ttft_p50_s": ttft,
                "llm_share": 0.1 * started, "requests_started": started, "model_stats": {"slm": {"steps": steps}},
                "busy_share": {"slm": spread([busy])}, "B_star": {"slm": 1}}

    slow, fast = [row([9.0, 11.0], 1.0, 2, 3, 0.5), row([19.0, 21.0], 3.0, 4, 5, 0.7)], []
    m = merge_repeats(slow)
    assert m["repeats"] == 2 and m["throughput_tok_s"] == 15.0 and m["throughput"]["n"] == 4
    assert m["throughput_repeats"] == [10.0, 20.0] and m["ttft_p50_s"] == 2.0  # median over repeats
    assert m["llm_share"] == pytest.approx(0.3) and m["requests_started"] == 6  # mean; sum
    assert m["model_stats"]["slm"]["steps"] == 8 and m["busy_share"]["slm"]["mean"] == pytest.approx(0.6)
    assert m["B_star"] == {"slm": 1}
    # a machine that drifts between repeats: each repeat of b is 1.25x its a; the pair cancels the drift
    fast = merge_repeats([row([x * 1.25 for x in r["throughput_tok_s_windows"]], 1.0, 1, 1, 0.5) for r in slow])
    r, lo, hi = ratio_interval(fast, m)
    assert r == pytest.approx(1.25) and lo == pytest.approx(1.25) and hi == pytest.approx(1.25)
    # unpaired (delta method over the windows) the drift widens the interval
    r2, lo2, hi2 = ratio_interval({**fast, "throughput_repeats": None}, {**m, "throughput_repeats": None})
    assert r2 == pytest.approx(1.25) and lo2 < 1.0 < hi2
    # tokenrouter's first repeat reused the eager profile (B* = 1); its later repeats were measured
    reused = [{**r, "same_run_as": "eager-async"} for r in slow]
    assert merge_repeats(reused)["same_run_as"] == "eager-async"
    assert "same_run_as" not in merge_repeats([reused[0], slow[1]])
    with pytest.raises(ValueError):
        merge_repeats([])


def test_interleaved_lengths_alternate_inside_each_repeat_and_pair_the_length_change():
    from bench_matrix import cell_schedule, main, markdown, merge_repeats

    assert cell_schedule([8], [128, 512], 2) == [(8, 128, 0), (8, 128, 1), (8, 512, 0), (8, 512, 1)]
    assert cell_schedule([8, 32], [128, 512], 2, interleave_lengths=True) == [
        (8, 128, 0), (8, 512, 0), (8, 128, 1), (8, 512, 1), (32, 128, 0), (32, 512, 0), (32, 128, 1), (32, 512, 1)]

    # a host that drifts: repeat 0 runs at full speed, repeat 1 at 60 %; the long outputs lose 10 % in each
    def merged(L, scale):
        return merge_repeats([{"pair": "p", "mode": "slm-only", "N": 8, "max_tokens": L, "llm_share": 0.0,
                               "handoffs_per_request": 0.0, "throughput_tok_s": 100.0 * s * scale,
                               "throughput_tok_s_windows": [100.0 * s * scale * f for f in (0.95, 1.05)],
                               "requests_per_s_windows": [1.0, 1.0]} for s in (1.0, 0.6)])

    rows = [merged(128, 1.0), merged(512, 0.9)]
    paired = markdown({"settings": {"interleave_lengths": True}, "rows": rows})
    assert "from 128 to 512 output tokens" in paired and "paired over the interleaved repeats" in paired
    assert "| p | 8 | slm-only | -10.0 % (-10.0 % to -10.0 %) |" in paired  # the drift cancels in the pairs
    unpaired = markdown({"settings": {"interleave_lengths": False}, "rows": rows})
    line = next(x for x in unpaired.splitlines() if x.startswith("| p | 8 | slm-only |"))
    low, high = (float(v.strip(" %|)")) for v in line.split("(")[1].split(" to "))
    assert low < -10.0 < high and high - low > 20  # one after the other: the drift widens the interval
    with pytest.raises(SystemExit):  # pairing needs repeats
        main(["--pairs", "demo", "--max-tokens", "4,8", "--interleave-lengths"])


def test_dtmc_confirmation_pairs_b_star_with_the_sweeps_best():
    import dtmc_vs_server as dvs

    # a machine that slows by 10 % per measurement; B* is truly 0.96x of the best.  The order
    # within a pair alternates (ABBA), so over an even number of pairs the drift cancels in the
    # paired geometric mean: 0.96 exactly, whatever the drift
    calls = []

    def run_at(B):
        calls.append(dict(B))
        base = 100.0 if B["llm"] == 3 else 96.0
        return {"throughput_tok_s": base * 0.9 ** (len(calls) - 1)}

    star, best = {"slm": 1, "llm": 1}, {"slm": 1, "llm": 3}
    c = dvs.confirm_pair(run_at, star, best, 4, N=8)
    assert [b["llm"] for b in calls] == [1, 3, 3, 1, 1, 3, 3, 1]
    assert c["B_star"] == pytest.approx([96.0, 96.0 * 0.9 ** 3, 96.0 * 0.9 ** 4, 96.0 * 0.9 ** 7])
    assert c["ratio"] == pytest.approx(0.96) and c["low"] < 0.96 < c["high"]
    assert dvs.within(c["ratio"], 1.0) and not dvs.within(0.94, 1.0)
    one = dvs.confirm_pair(run_at, star, best, 1, N=8)       # one pair: a ratio without an interval
    assert one["ratio"] > 0 and math.isnan(one["low"])
    assert dvs.confirm_pair(run_at, star, best, 0, N=8) is None and len(calls) == 10
    assert dvs.grid(8, 5) == [1, 2, 3, 4, 5, 6, 8] and dvs.grid(2, 1) == [1, 2]


def test_dtmc_replay_predicts_a_recorded_sweep_with_and_without_the_wait_bound(tmp_path):
    """``dtmc_vs_server.py --replay DIR``: the stored profile is solved again without and with the
    run's wait bound; the table lists every measured point with both predictions.  B_llm = N
    waits for N requests without the bound (a collapse), not with it."""
    prof = {"models": ["slm", "llm"], "concurrency": 4,
            "step_latency_s": {"slm": {"1": 0.06, "4": 0.07}, "llm": {"1": 0.2, "4": 0.3}},
            "transition": [[0.9, 0.1], [0.7, 0.3]], "committed_tokens": [[1, 1], [1, 0]], "quantum_s": 0.005}
    (tmp_path / "profile-N4.json").write_text(json.dumps(prof))
    point = lambda llm, tok: {"B": {"slm": 1, "llm": llm}, "throughput_tok_s": tok,  # noqa: E731
                              "throughput": {"mean": tok, "ci95": 1.0}}
    run = {"rows": [{"N": 4, "wait_us": 60000, "points": [point(1, 30.0), point(4, 29.0)]}]}
    (tmp_path / "dtmc_vs_server.json").write_text(json.dumps(run))
    out = subprocess.run([sys.executable, str(Path(__file__).resolve().parent.parent / "perf" / "dtmc_vs_server.py"),
                          "--replay", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = {ln.split("|")[1].strip(): [c.strip() for c in ln.split("|")[2:5]]
            for ln in out.stdout.splitlines() if ln.startswith("| slm=")}
    assert set(rows) == {"slm=1,llm=1", "slm=1,llm=4"}, out.stdout
    free1, bound1 = float(rows["slm=1,llm=1"][1]), float(rows["slm=1,llm=1"][2])
    free4, bound4 = float(rows["slm=1,llm=4"][1]), float(rows["slm=1,llm=4"][2])
    assert free1 == bound1  # B = 1: the bound never decides
    assert bound4 > 1.2 * free4, out.stdout
    assert "wait bound 60000 us" in out.stdout
    bad = subprocess.run([sys.executable, str(Path(__file__).resolve().parent.parent / "perf" / "dtmc_vs_server.py"),
                          "--replay", str(tmp_path / "nothing")], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "not a dtmc_vs_server run" in bad.stderr


@pytest.fixture(scope="module")
def tokenizer():
    from tokenrouter.triton.common import resolve_model_path

    return load_tokenizer(resolve_model_path("smollm2-135m-instruct"))


def test_token_arrival_times_replay_the_router_detokeniser(tokenizer):
    from tokenrouter.engine.detok import IncrementalDetokenizer

    ids = tokenizer._tokenizer.encode("Hello wörld ✓ and more ✓").ids
    d, chunks = IncrementalDetokenizer(tokenizer), []
    for i, t in enumerate(ids):  # the router streams one chunk per text-producing step
        x = d.add([t])
        if x:
            chunks.append((float(i), x))
    times = token_arrival_times(chunks, ids, 99.0, tokenizer)
    assert len(times) == len(ids)
    assert all(t >= i for i, t in enumerate(times))  # never before the token was written
    # a token whose text is part of a character arrives with the chunk that completes it
    assert times == [float(min(j for j, _ in chunks if j >= i)) for i in range(len(ids))]
    # tokens whose text never came in a chunk arrive with the final response
    assert token_arrival_times(chunks[:-1], ids, 99.0, tokenizer)[-1] == 99.0
    # no tokenizer: spread over the chunks by characters, still one time per token
    prop = token_arrival_times(chunks, ids, 99.0, None)
    assert len(prop) == len(ids) and prop == sorted(prop) and prop[-1] == chunks[-1][0]


def test_cut_requests_count_the_tokens_of_multi_token_chunks(tokenizer):
    """A speculative or draft-verify stream sends several tokens per chunk (one round each): a request
    cut at a measurement's end (or read in flight) counts the tokens of its streamed text, re-encoded,
    not one per chunk, so those settings are not undercounted against one-token-per-step ones."""
    import time as _t

    ids = tokenizer._tokenizer.encode(" the answer is forty two, and then some more words" * 20,
                                      add_special_tokens=False).ids
    rounds = [ids[i:i + 4] for i in range(0, len(ids), 4)]

    def gen(prompt, sampling, on_text, abort=None):
        for r in rounds:  # one chunk per round of 4 tokens, every 10 ms
            if abort is not None and abort.is_set():
                raise RuntimeError("aborted")
            _t.sleep(0.01)
            on_text(tokenizer._tokenizer.decode(r))
        raise AssertionError("the test cuts it before its end")

    load = SteadyLoad(gen, ["p"], 1, 8, tokenizer=tokenizer).start()
    try:
        _t.sleep(0.5)
        snap = load.snapshot()
    finally:
        recs = load.stop(timeout_s=10, cancel=True)
    cut = snap + [x for x in recs if x["cancelled"]]
    assert len(cut) == 2
    for r in cut:
        assert r["output_tokens"] == len(r["token_t_s"]) > 8
        # about 4 tokens per chunk (not 1): the count of the text streamed
        n_chunks = len(set(r["token_t_s"]))
        assert 3.0 <= r["output_tokens"] / n_chunks <= 4.0, (r["output_tokens"], n_chunks)


def test_steady_load_against_the_server(triton_server, tokenizer):
    from tokenrouter.tools import admin

    url = triton_server.grpc_url
    prompts = ["Name a colour.", "Count to five."]
    load = SteadyLoad(url, prompts, 2, 6, tokenizer=tokenizer).start()
    try:
        m = load.measure(3.0, windows=2, probe=lambda: model_counters(url, ("steps", "step_time_s", "no_such")))
    finally:
        recs = load.stop()
    ok = [r for r in recs if not r["error"]]
    assert ok and len(ok) == len(recs), [r["error"] for r in recs]
    for r in ok:  # every token of every request got an arrival time inside the request's life
        assert r["output_tokens"] == 6 and len(r["token_t_s"]) == 6 and len(r["token_model"]) == 6
        assert r["t_start_s"] < min(r["token_t_s"]) and max(r["token_t_s"]) <= r["t_start_s"] + r["e2e_s"] + 1e-6
    # warm-up: both clients finished a request before the period began
    assert sum(1 for r in ok if r["t_start_s"] + r["e2e_s"] <= m["bounds"][0]) >= 2
    s = window_summary(recs, m["bounds"], probes=m["probes"])
    assert s["output_tokens"] > 0 and len(s["throughput_tok_s_windows"]) == 2
    assert s["output_tokens"] < sum(r["output_tokens"] for r in ok)  # warm-up and drain tokens left out
    assert s["errors"] == 0 and 0 <= s["llm_share"] <= 1
    started = [r for r in ok if m["bounds"][0] <= r["t_start_s"] < m["bounds"][-1]]
    assert s["requests_started"] == len(started)
    if started:  # latencies come from the requests that started in the period (a loaded machine may have none)
        assert s["ttft_p50_s"] == pytest.approx(percentile([r["ttft_s"] for r in started], 50)) and s["ttft_p50_s"] > 0
    else:
        assert math.isnan(s["ttft_p50_s"])
    assert 0 < s["busy_share"]["slm"]["mean"] <= 1.05
    d = counter_deltas(m["probes"][0], m["probes"][-1])  # the models' counters over the period
    assert d["slm"]["steps"] > 0 and d["slm"]["step_time_s"] > 0 and d["slm"]["no_such"] == 0.0
    for x in ("slm", "llm"):
        assert admin.model_stats(url, x)["kv_tokens_in_use"] == 0


def test_steady_load_cancel_ends_the_server_requests(triton_server, tokenizer):
    """stop(cancel=True) cancels the requests in flight on the server: the stop returns long before a
    request could have finished, the records keep the tokens streamed so far, every model frees its KV."""
    import time as _t

    from tr_client import generate, wait_kv_released

    url = triton_server.grpc_url
    load = SteadyLoad(url, ["Tell me a long story.", "Describe the sea."], 2, 400, tokenizer=tokenizer).start()
    _t.sleep(2.0)
    t0 = _t.perf_counter()
    recs = load.stop(timeout_s=120, cancel=True)
    assert _t.perf_counter() - t0 < 20.0  # one 400-token request takes far longer on this CPU
    cut = [r for r in recs if r["cancelled"]]
    assert len(cut) == 2 and not any(r["error"] for r in recs), recs
    for r in cut:
        assert r["output_tokens"] == len(r["token_t_s"]) < 400
        assert all(r["t_start_s"] < t <= r["t_start_s"] + r["e2e_s"] for t in r["token_t_s"])
    st = wait_kv_released(triton_server)
    assert all(s["kv_tokens_in_use"] == 0 and s["active"] == 0 for s in st.values()), st
    out = generate(triton_server, "Name a colour.", {"max_tokens": 4, "temperature": 0})
    assert out["text_output"]


def test_contention_table_splits_steps_by_overlap_with_the_other_model():
    from contention import contention_table, overlap_shares

    slm = [{"t": 1.0, "latency_s": 1.0, "batch_size": 2}, {"t": 2.0, "latency_s": 1.0, "batch_size": 2},
           {"t": 3.5, "latency_s": 1.5, "batch_size": 2}, {"t": 4.0, "latency_s": 0.5, "batch_size": 2,
                                                            "extend_tokens": 9}]  # not a pure decode step
    llm = [{"t": 1.75, "latency_s": 0.5}, {"t": 3.6, "latency_s": 1.6}]  # [1.25, 1.75], [2.0, 3.6]
    assert overlap_shares(slm, llm) == pytest.approx([0.0, 0.5, 1.0, 0.2])
    (row,) = contention_table(slm[:3], llm, alone=0.05, during=0.95, min_steps=1)
    assert row["batch_size"] == 2 and row["alone_s"] == 1.0 and row["during_s"] == 1.5 and row["ratio"] == 1.5
    assert row["n_alone"] == 1 and row["n_during"] == 1  # the half-overlapped step is in neither group
    assert contention_table(slm, llm, min_steps=2) == []  # the extend step is left out: too few steps


def test_speculative_speedup_interval_is_paired_over_repeats():
    from speculative import ratio_interval  # perf/

    lo, mid, hi = ratio_interval([1.45, 1.40, 1.50])
    assert mid == pytest.approx((1.45 * 1.40 * 1.50) ** (1 / 3))
    # t-interval on the log scale, 2 degrees of freedom
    sd = statistics.stdev([math.log(x) for x in (1.45, 1.40, 1.50)])
    assert hi / mid == pytest.approx(math.exp(T975[2] * sd / math.sqrt(3)))
    assert lo * hi == pytest.approx(mid * mid)
    assert ratio_interval([1.2]) is None  # one repeat: no spread to measure


def test_a_second_interrupt_while_stopping_kills_the_server_session():
    """perf/'s TritonServer.stop(): a second interrupt during the graceful wait (Ctrl-C twice, a
    second SIGTERM) kills the server's session at once instead of leaving it running with no
    owner. The "server" here ignores SIGINT, as tritonserver 2.51 does while it loads models."""
    import os
    import signal

    from tritonserver import TritonServer  # perf/ (pytest.ini)

    proc = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGINT, "
                             "signal.SIG_IGN); print('up', flush=True); time.sleep(120)"],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout.readline().strip() == "up"
    server = object.__new__(TritonServer)  # stop() needs only the process and its timeout
    server.process, server.stop_timeout = proc, 60.0

    def interrupt(_signum, _frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.alarm(1)
    try:
        with pytest.raises(KeyboardInterrupt):
            server.stop()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL and server.process is None


def test_step_weight_gb_counts_what_a_decoding_step_reads(tmp_path):
    """perf/speculative.py's weight traffic per step: every parameter in the served dtype, an untied
    input embedding left out (Qwen2.5-Coder-1.5B: 1.54 G parameters, 3.09 GB in bfloat16), a tied
    one counted once (SmolLM2-135M in float32: 0.54 GB)."""
    from speculative import step_weight_gb
    from tokenrouter.tools.repository import make_variant

    root = Path(__file__).resolve().parent.parent
    demo = make_variant(str(root / "model_repository"), str(tmp_path / "demo"))
    assert step_weight_gb(demo, "llm") == pytest.approx(134_515_008 * 4 / 1e9)  # float32 in the demo's config
    pair = make_variant(str(root / "model_repository"), str(tmp_path / "pair"), pair="qwen-coder")
    from tokenrouter.engine.device import resolve_dtype

    width = 2 if resolve_dtype("auto", "cpu") == "bfloat16" else 4
    assert step_weight_gb(pair, "llm") == pytest.approx(1_543_714_304 * width / 1e9)
    assert step_weight_gb(pair, "slm") == pytest.approx(494_032_768 * width / 1e9)
