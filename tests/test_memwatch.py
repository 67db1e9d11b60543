"""The soak's memory figures (tokenrouter.tools.memwatch): process discovery and the summary."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tokenrouter.tools import memwatch


def _samples(series):
    """samples of one process "m" from (t_s, MiB, pid) triples"""
    return [{"t_s": t, "rss_mb": {"m": r}, "anon_mb": {"m": r - 100}, "pid": {"m": p}} for t, r, p in series]


def test_summary_leaves_out_warmup_and_restarts():
    # grows during warm-up (0-100 s), flat after, then a restart at 300 s reloads from 10 MiB
    s = _samples([(0, 100, 1), (50, 400, 1), (100, 500, 1), (200, 505, 1), (300, 10, 2), (350, 480, 2),
                  (450, 500, 2), (550, 502, 2)])
    d = memwatch.summarize(s, warmup_s=100, window_s=1000, settle_s=100)["m"]
    assert d["restarts"] == 1 and d["samples"] == 8
    assert d["start_mb"] == 100 and d["end_mb"] == 502 and d["after_warmup_mb"] == 500
    # 300 s and 350 s are within 100 s of the restart: left out
    assert (d["window_min_mb"], d["window_max_mb"], d["window_range_mb"]) == (500, 505, 5)
    anon = memwatch.summarize(s, warmup_s=100, window_s=1000, settle_s=100, key="anon_mb")["m"]
    assert anon["window_max_mb"] == 405


def test_process_range_is_one_pids_and_the_window_range_spans_restarts():
    # the first process levels off at 500, its successor (restarted at 300 s) at 560: 60 MiB apart,
    # neither grows by more than 4 MiB; the range of one process is the growth figure
    s = _samples([(0, 480, 1), (100, 500, 1), (200, 504, 1), (300, 10, 2), (400, 558, 2), (500, 560, 2),
                  (600, 561, 2)])
    d = memwatch.summarize(s, warmup_s=100, window_s=1000, settle_s=100)["m"]
    assert d["window_range_mb"] == 61 and (d["window_min_mb"], d["window_max_mb"]) == (500, 561)
    assert d["process_range_mb"] == 4 and d["process_span_s"] == 100  # pid 1, 100-200 s
    # a process that grows inside the window
    g = memwatch.summarize(_samples([(t, 500 + t / 10, 3) for t in range(0, 1001, 100)]), 0, 600)["m"]
    assert g["process_range_mb"] == g["window_range_mb"] == 60 and g["process_span_s"] == 600


def test_slope_is_per_hour_and_window_is_the_tail():
    s = _samples([(t, 1000 + t / 36, 7) for t in range(0, 3601, 60)])  # +100 MiB an hour
    d = memwatch.summarize(s, warmup_s=0, window_s=600)["m"]
    assert d["slope_mb_per_h"] == pytest.approx(100, abs=0.5)
    assert d["window_range_mb"] == pytest.approx(600 / 36, abs=0.2)


def test_samples_after_the_load_count_for_the_end_only():
    # flat under load until 600 s; idle afterwards, the process gives 120 MiB back
    s = _samples([(0, 500, 1), (100, 520, 1), (300, 525, 1), (600, 522, 1), (660, 400, 1)])
    d = memwatch.summarize(s, warmup_s=100, window_s=1000, until_s=610)["m"]
    assert d["end_mb"] == 400 and d["window_range_mb"] == d["process_range_mb"] == 5
    assert d["process_span_s"] == 500
    every = memwatch.summarize(s, warmup_s=100, window_s=1000)["m"]
    assert every["window_range_mb"] == 125  # the drop after the load counted as a range


def test_processes_of_a_server_and_their_memory(tmp_path):
    # a fake server: a parent whose child runs under the stub's program name with an instance argument
    stub = tmp_path / "triton_python_backend_stub"
    stub.symlink_to(os.path.realpath(sys.executable))
    child = [str(stub), "-c", "import time; time.sleep(60)", "llm_0_0"]
    parent = subprocess.Popen([sys.executable, "-c",
                               f"import subprocess,sys; p=subprocess.Popen({child!r}); sys.stdin.read(); p.kill()"],
                              stdin=subprocess.PIPE)
    try:
        for _ in range(100):
            procs = memwatch.server_processes(parent.pid)
            if "llm_0_0" in procs:
                break
            time.sleep(0.05)
        assert set(procs) == {"tritonserver", "llm_0_0"} and procs["tritonserver"] == parent.pid
        assert memwatch.rss_mb(procs["llm_0_0"]) > 1 and memwatch.rss_mb(procs["llm_0_0"], "RssAnon") > 0
        calls = []

        def probe():  # every other call fails, as a stats op to a model down for a kill does
            calls.append(1)
            if len(calls) % 2 == 0:
                raise RuntimeError("llm is down")
            return {"llm": {"n": len(calls)}}

        sampler = memwatch.RSSSampler(parent.pid, every_s=0.1, probe=probe).start()
        time.sleep(0.35)
        samples = sampler.stop()
        assert len(samples) >= 3 and all("llm_0_0" in s["rss_mb"] for s in samples)
        for s in samples:  # VmRSS is the sum of its anonymous, file-backed and shared pages (+-1 page)
            parts = sum(s[k]["llm_0_0"] for k in ("anon_mb", "file_mb", "shmem_mb"))
            assert abs(s["rss_mb"]["llm_0_0"] - parts) <= 0.2 and s["file_mb"]["llm_0_0"] > 0, s
        assert [s["probe"] for s in samples[:2]] == [{"llm": {"n": 1}}, {"error": "llm is down"}]
        assert len(calls) == len(samples)
    finally:
        parent.stdin.close()
        parent.wait(10)
    assert memwatch.server_processes(parent.pid) == {} and memwatch.rss_mb(parent.pid) is None
    with pytest.raises(ValueError):
        memwatch.RSSSampler(os.getpid(), every_s=0)


def test_heap_change_follows_the_last_process_over_the_window():
    from tokenrouter.tools.soak import heap_change

    def sample(t, pid, blocks, in_use_mib, error=False):
        probe = {"error": "down"} if error else {"python_allocated_blocks": blocks,
                                                  "malloc_in_use_bytes": in_use_mib * 2**20}
        return {"t_s": t, "pid": {"slm_0_0": pid}, "probe": {"slm": probe}}

    samples = [sample(0, 1, 10, 100), sample(30, 1, 50, 900),  # before the window
               sample(60, 1, 60, 950), sample(90, 2, 0, 0, error=True),  # killed: no answer
               sample(120, 2, 100, 400), sample(150, 2, 130, 410.5), sample(180, 2, 999, 999)]
    got = heap_change(samples, ["slm", "llm"], since_s=40, until_s=150)
    assert got == {"slm": {"from_s": 120, "to_s": 150, "pid": 2, "python_allocated_blocks": 30,
                           "malloc_in_use_mib": 10.5}}
    # pid 2 appeared at 90 s: with 40 s of warm-up left out, 120 s is its first sample; with 50 s, 150 s
    assert heap_change(samples, ["slm"], 40, 150, settle_s=30) == got
    assert heap_change(samples, ["slm"], 40, 150, settle_s=50) == {}  # one sample left: no change


def test_drift_is_growth_without_the_step_in_flight():
    # flat at 500 MiB with a step's buffers (+80 MiB) caught in two samples: a wide range, no drift
    flat = _samples([(t, 500 + (80 if t in (200, 700) else 0), 1) for t in range(0, 901, 100)])
    d = memwatch.summarize(flat, warmup_s=0, window_s=1000)["m"]
    assert d["process_range_mb"] == 80 and d["process_drift_mb"] == 0
    # +10 MiB every 100 s: the last third's median minus the first's (3 samples each)
    grows = memwatch.summarize(_samples([(t, 500 + t / 10, 1) for t in range(0, 801, 100)]), 0, 1000)["m"]
    assert grows["process_drift_mb"] == 60  # 570 - 510
    shrinks = memwatch.summarize(_samples([(t, 500 - t / 10, 1) for t in range(0, 801, 100)]), 0, 1000)["m"]
    assert shrinks["process_drift_mb"] == -60
