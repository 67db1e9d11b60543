"""The benchmark harness runs end to end on a tiny setting (speed itself is measured in perf/, not here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_bench_matrix_tiny(repo_root, tmp_path):
    out = tmp_path / "matrix"
    modes = ["tokenrouter", "eager-async", "std-serving", "lock-step", "llm-only", "no-triton"]
    p = subprocess.run([sys.executable, str(repo_root / "perf" / "bench_matrix.py"), "--pairs", "demo",
                        "--concurrency", "2", "--max-tokens", "4", "--modes", ",".join(modes), "--out", str(out),
                        "--algorithm-params", '{"tau": 0.25}'],
                       cwd=repo_root, capture_output=True, text=True, timeout=1500, env=os.environ.copy())
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    rows = {r["mode"]: r for r in res["rows"]}
    assert sorted(rows) == sorted(modes)
    for mode, r in rows.items():
        assert r["errors"] == 0, (mode, r)
        assert r["throughput_tok_s"] > 0 and r["N"] == 2 and r["max_tokens"] == 4, (mode, r)
    # every mode ran its own configuration: llm-only routes nothing to the SLM, tokenrouter got a B*
    assert rows["llm-only"]["llm_share"] == 1.0 and rows["llm-only"]["handoffs_per_request"] == 0
    assert set(rows["tokenrouter"]["B_star"]) == {"slm", "llm"}
    # --algorithm-params is merged into the router's parameters (the demo's max_llm_run etc. kept)
    from tokenrouter.repository import read_config

    cfg = read_config(str(out / "run-demo" / "model_repository" / "token_router" / "config.pbtxt"))
    params = json.loads(cfg.parameters["algorithm_params"].string_value)
    base = json.loads(read_config(str(repo_root / "model_repository" / "token_router" / "config.pbtxt"))
                      .parameters["algorithm_params"].string_value)
    assert params == {**base, "tau": 0.25} and res["settings"]["algorithm_params"] == {"tau": 0.25}
    md = (out / "results.md").read_text()
    assert "Throughput ratio tokenrouter / baseline" in md and "no-triton" in md
    assert list(out.glob("throughput_vs_N_demo_*.png")) and (out / "throughput_vs_length_demo.png").exists()
