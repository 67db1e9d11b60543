"""perf/bench_matrix.py end to end on tiny settings (speed itself is measured in perf/, not here).

Each test runs the script, which starts a tritonserver of its own (and the no-triton workers); the
harness's parts are tested in test_perf_harness.py against the shared server.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.server  # bench_matrix.py starts a tritonserver (and the no-triton workers)
def test_bench_matrix_tiny(repo_root, tmp_path):
    """Every mode end to end, 2 interleaved repeats (no-triton's workers beside the server)."""
    out = tmp_path / "matrix"
    modes = ["tokenrouter", "eager-async", "std-serving", "lock-step", "llm-only", "no-triton"]
    p = subprocess.run([sys.executable, str(repo_root / "perf" / "bench_matrix.py"), "--pairs", "demo",
                        "--concurrency", "2", "--max-tokens", "4", "--modes", ",".join(modes), "--out", str(out),
                        "--duration", "1.5", "--algorithm-params", '{"tau": 0.25}', "--stream-interval", "2",
                        "--repeats", "2"],
                       cwd=repo_root, capture_output=True, text=True, timeout=1500, env=os.environ.copy())
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    assert res["settings"]["measurement"] == "steady-state" and res["settings"]["windows"] == 3
    rows = {r["mode"]: r for r in res["rows"]}
    assert sorted(rows) == sorted(modes)
    for mode, r in rows.items():
        assert r["errors"] == 0, (mode, r)
        assert r["throughput_tok_s"] > 0 and r["N"] == 2 and r["max_tokens"] == 4, (mode, r)
        assert len(r["throughput_tok_s_windows"]) == 6 and r["throughput"]["n"] == 6, (mode, r)  # 2 × 3
        assert r["repeats"] == 2 and len(r["throughput_repeats"]) == 2, (mode, r)
        # the default drain cancels the requests in flight: latencies of those that completed in the period
        assert r["latencies_of"] == "completed", (mode, r)
        if r["requests_per_s"] > 0:  # a request completed in the period (a loaded machine may have none)
            assert r["e2e_p99_s"] >= r["e2e_p50_s"] > 0, (mode, r)
    # every mode ran its own configuration: llm-only routes nothing to the SLM, tokenrouter got a B*
    assert rows["llm-only"]["llm_share"] == 1.0 and rows["llm-only"]["handoffs_per_request"] == 0
    assert rows["llm-only"]["busy_share"]["slm"]["max"] == 0.0 and rows["llm-only"]["busy_share"]["llm"]["mean"] > 0
    assert set(rows["tokenrouter"]["B_star"]) == {"slm", "llm"}
    if all(b == 1 for b in rows["tokenrouter"]["B_star"].values()):  # eager-async's settings: that very run
        assert rows["tokenrouter"]["same_run_as"] == "eager-async"
        assert rows["tokenrouter"]["throughput_repeats"] == rows["eager-async"]["throughput_repeats"]
    else:
        assert "same_run_as" not in rows["tokenrouter"]
    # --algorithm-params is merged into the router's parameters (the demo's max_llm_run etc. kept)
    from tokenrouter.tools.repository import read_config

    cfg = read_config(str(out / "run-demo" / "model_repository" / "token_router" / "config.pbtxt"))
    params = json.loads(cfg.parameters["algorithm_params"].string_value)
    base = json.loads(read_config(str(repo_root / "model_repository" / "token_router" / "config.pbtxt"))
                      .parameters["algorithm_params"].string_value)
    assert params == {**base, "tau": 0.25} and res["settings"]["algorithm_params"] == {"tau": 0.25}
    for m in ("slm", "llm"):  # --stream-interval reaches every model's config (no-triton reads it too)
        cfg = read_config(str(out / "run-demo" / "model_repository" / m / "config.pbtxt"))
        assert cfg.parameters["stream_interval"].string_value == "2"
    # CPU by process over the measurement: Triton's processes by role, no-triton's workers
    cpu = rows["tokenrouter"]["cpu_share"]
    assert {"client", "tritonserver", "stub slm", "stub llm", "stub token_router"} <= set(cpu), cpu
    assert cpu["stub slm"] > 0 and cpu["stub token_router"] > 0 and all(v >= 0 for v in cpu.values()), cpu
    assert rows["llm-only"]["cpu_share"]["stub token_router_llm_only"] > 0
    assert rows["llm-only"]["cpu_share"]["stub llm"] > rows["llm-only"]["cpu_share"]["stub slm"]
    # no-triton took its turn in each repeat, its workers beside the server; each side idles while
    # the other is measured, and the CPU table reads both sides' processes
    order = [r["mode"] for r in res["repeat_rows"]]
    assert order[:len(modes)] == order[len(modes):] and order[len(modes) - 1] == "no-triton", order
    triton, direct = rows["tokenrouter"]["cpu_share"], rows["no-triton"]["cpu_share"]
    assert triton["stub slm"] > triton["worker slm"] and direct["worker slm"] > direct["stub slm"], (triton, direct)
    md = (out / "results.md").read_text()
    assert "Throughput ratio tokenrouter / baseline" in md and "no-triton" in md and "p50/p90/p99" in md
    assert "CPU used during the measurement, by process" in md
    assert "latencies of the requests that completed in the measurement period" in md
    assert res["settings"]["drain"] == "cancel"
    assert list(out.glob("throughput_vs_N_demo_*.png")) and (out / "throughput_vs_length_demo.png").exists()
    # the DTMC's latency model was fitted to the served steps and to a calibration up to N
    calib = json.loads((out / "run-demo" / "calibration.json").read_text())
    assert res["settings"]["calibrate"] is True
    assert all([r["batch_size"] for r in calib["models"][m]["table"]] == [1, 2] for m in ("slm", "llm"))
    prof = out / "run-demo" / "profile-N2.json"
    if prof.exists():  # a profile needs a request that reached the LLM in the eager run
        fit = json.loads(prof.read_text())["step_latency_model"]["llm"]["fit"]
        assert fit["sources"]["calibration"] > 0 and fit["calibration_scale"] > 0



@pytest.mark.server
def test_bench_matrix_on_humaneval_prompts(repo_root, tmp_path):
    """--prompts humaneval: the problems as perf/quality.py renders them, sent without the server's
    chat template, each request stopped at the code block's end or EOS (max_tokens only caps it);
    every cell starts with the models' prefix caches emptied, so no cell finds its prompts cached
    by the cell before (the same prompts, in the same order)."""
    out = tmp_path / "matrix"
    p = subprocess.run([sys.executable, str(repo_root / "perf" / "bench_matrix.py"), "--pairs", "demo",
                        "--prompts", "humaneval", "--concurrency", "2", "--max-tokens", "64", "--modes",
                        "llm-only,slm-only", "--repeats", "2", "--out", str(out), "--duration", "1.5", "--no-calibrate"],
                       cwd=repo_root, capture_output=True, text=True, timeout=900, env=os.environ.copy())
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    assert res["settings"]["prompts"] == "humaneval"
    assert sorted(r["mode"] for r in res["repeat_rows"]) == ["llm-only", "llm-only", "slm-only", "slm-only"]
    for r in res["repeat_rows"]:
        mode = r["mode"]
        assert r["errors"] == 0 and r["throughput_tok_s"] > 0, (mode, r)
        st = r["model_stats"][{"llm-only": "llm", "slm-only": "slm"}[mode]]
        # a cold cache in each repeat: the second sends the first's prompts again, and prefills them
        # again (HumanEval prompts run to hundreds of tokens; a cached one would extend a few)
        assert st["extend_tokens"] > 100 * r["requests_started"] > 0, (mode, r["repeat"], st)
        # requests ended at the code block or EOS, not at max_tokens (with EOS ignored a request
        # brings 64 tokens): the demo model closes the block within a few tokens
        assert r["output_tokens"] < 32 * r["requests_started"], (mode, r)
