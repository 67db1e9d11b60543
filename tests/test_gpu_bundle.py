"""The GPU benchmark's bundle and run script (perf/gpu/): their planning, checks and JSON, on the CPU.

No GPU and no download here: the bundle check runs on wheel files named like PyPI's, the
run script's pure parts (shapes, tokenizer, cell plan, time caps, figures, JSON) on small
inputs, and the ``sgl_kernel`` stand-ins in a fresh interpreter. The whole dry run
(``python perf/gpu/run.py --dry-run``) takes minutes on 2 cores and runs by hand.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GPU = ROOT / "perf" / "gpu"
sys.path.insert(0, str(GPU))

import build_bundle  # noqa: E402
import run as gpu_run  # noqa: E402


def _name(req: str) -> str:
    return req.split("==")[0].lower().replace("-", "_")


def test_carry_is_pinned_and_disjoint_from_the_host():
    assert all("==" in r for r in build_bundle.CARRY)
    carried = {_name(r) for r in build_bundle.CARRY}
    host = {_name(r) for r in build_bundle.HOST_HAS + build_bundle.HOST_HAS_NODEPS}
    assert "sglang" in carried and "pyzmq" in carried
    assert not carried & host
    assert len(carried) == len(build_bundle.CARRY)  # one version of each


def test_download_command_targets_cpython_312_manylinux_wheels_without_deps(tmp_path):
    cmd = build_bundle.download_command(["sglang==0.5.23"], str(tmp_path))
    assert cmd[-1] == "sglang==0.5.23"
    for flag in ("--no-deps", "--only-binary=:all:"):
        assert flag in cmd
    assert cmd[cmd.index("--python-version") + 1] == "3.12"
    assert cmd[cmd.index("--implementation") + 1] == "cp"
    plats = [cmd[i + 1] for i, x in enumerate(cmd) if x == "--platform"]
    assert plats and all(p.endswith("x86_64") and p.startswith("manylinux") for p in plats)


def _fake_bundle(d: Path, reqs, size: int = 1000):
    for r in reqs:
        name, ver = r.split("==")
        (d / f"{name.replace('-', '_')}-{ver}-py3-none-any.whl").write_bytes(b"\0" * size)


def test_check_bundle_names_missing_and_extra_wheels_and_the_size_limit(tmp_path):
    reqs = ["sglang==0.5.23", "pyzmq==27.3.0", "partial-json-parser==0.2.1.1.post7"]
    _fake_bundle(tmp_path, reqs)
    res = build_bundle.check_bundle(str(tmp_path), reqs, max_mib=1)
    assert res["ok"] and not res["missing"] and not res["extra"] and len(res["wheels"]) == 3
    (tmp_path / "numpy-2.0.0-cp312-cp312-manylinux_2_17_x86_64.whl").write_bytes(b"x")
    (tmp_path / "pyzmq-27.3.0-py3-none-any.whl").unlink()
    res = build_bundle.check_bundle(str(tmp_path), reqs, max_mib=1)
    assert not res["ok"] and res["missing"] == ["pyzmq"] and res["extra"] == ["numpy"]
    _fake_bundle(tmp_path, ["pyzmq==27.3.0"], size=2 * 2**20)
    (tmp_path / "numpy-2.0.0-cp312-cp312-manylinux_2_17_x86_64.whl").unlink()
    res = build_bundle.check_bundle(str(tmp_path), reqs, max_mib=1)
    assert res["mib"] > 1 and not res["missing"] and not res["extra"] and not res["ok"]


def test_param_counts_match_the_published_qwen2_sizes():
    # Qwen2-1.5B: 1.54 B parameters (vocab 151936, tied); Qwen2.5-32B: 32.8 B (vocab 152064)
    assert gpu_run.param_count(gpu_run.SHAPES["qwen2-1.5b"], 151936) == pytest.approx(1.54e9, rel=0.01)
    assert gpu_run.param_count(gpu_run.SHAPES["qwen2-32b"], 152064) == pytest.approx(32.76e9, rel=0.01)
    assert gpu_run.param_count(gpu_run.SHAPES["qwen2-7b"], 152064) == pytest.approx(7.62e9, rel=0.01)
    assert gpu_run.param_count(gpu_run.SHAPES["qwen2-0.5b"], 151936) == pytest.approx(0.494e9, rel=0.01)


def test_model_dir_and_tokenizer_cover_every_id(tmp_path):
    from transformers import AutoTokenizer

    d = gpu_run.write_model_dir(str(tmp_path / "m"), gpu_run.SHAPES["tiny-a"], 600, 512)
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["vocab_size"] == 600
    assert cfg["num_hidden_layers"] == 2 and cfg["max_position_embeddings"] == 512
    tok = AutoTokenizer.from_pretrained(d)
    assert len(tok) == 600
    ids = tok.encode("abc xyz")
    assert len(ids) == 7 and tok.decode(ids) == "abc xyz"  # one token per byte
    assert tok.decode([599]) == "x599" and tok.eos_token_id == cfg["eos_token_id"] == 256


def test_plan_and_time_caps():
    cells = gpu_run.plan_cells(["a", "b"], [8, 32], ["llm-only", "tokenrouter"])
    assert [(c["pair"], c["N"], c["mode"]) for c in cells[:3]] == [("a", 8, "llm-only"), ("a", 8, "tokenrouter"),
                                                                    ("a", 32, "llm-only")]
    assert len(cells) == 8
    assert gpu_run.cell_cap_s(400, 8, 100, 8, 60) == pytest.approx(300 / 8)
    assert gpu_run.cell_cap_s(1000, 2, 0, 8, 60) == 60  # ceiling
    assert gpu_run.cell_cap_s(120, 8, 100, 8, 60) == 8  # floor while the floor fits
    assert gpu_run.cell_cap_s(105, 8, 100, 8, 60) == 0  # skipped
    assert gpu_run._model_b("8:llm=2;32:llm=4,slm=2") == {8: {"slm": 1, "llm": 2}, 32: {"slm": 2, "llm": 4}}


def test_summary_ratios_and_json(tmp_path):
    recs = [{"t0": 0.0, "t_first": 0.5, "t_last": 5.5, "n": 11, "llm": 1},
            {"t0": 0.0, "t_first": 1.0, "t_last": 3.0, "n": 5, "llm": 2},
            {"t0": 0.0, "t_first": 2.0, "t_last": 2.0, "n": 1, "llm": 0}]
    s = gpu_run.summarize_requests(recs, wall_s=8.0)
    assert s["output_tokens"] == 17 and s["throughput_tok_s"] == pytest.approx(17 / 8)
    assert s["tpot_p50_s"] == pytest.approx(0.5) and s["tpot_p90_s"] == pytest.approx(0.5)  # 5/10 and 2/4
    assert s["ttft_p50_s"] == pytest.approx(1.0) and s["llm_share"] == pytest.approx(3 / 17)
    assert math.isnan(gpu_run.summarize_requests([], 1.0)["tpot_p50_s"])
    cells = [{"N": 8, "mode": "lock-step", "throughput_tok_s": 100.0},
             {"N": 8, "mode": "tokenrouter", "throughput_tok_s": 161.0},
             {"N": 8, "mode": "llm-only", "throughput_tok_s": 50.0},
             {"N": 32, "mode": "tokenrouter", "error": "x"}]
    r = gpu_run.ratios(cells)
    assert r == {"8": {"tokenrouter/lock-step": pytest.approx(1.61), "tokenrouter/llm-only": pytest.approx(3.22)}}
    path = gpu_run.save({"pairs": {"p": {"cells": cells}}, "x": float("nan")}, str(tmp_path / "out"))
    assert json.loads(Path(path).read_text())["pairs"]["p"]["cells"][1]["throughput_tok_s"] == 161.0


def test_sgl_kernel_stand_ins_import_and_refuse_calls():
    code = """
import sys; sys.path.insert(0, %r)
import sglang_gpu_compat as c
assert c.install(force=True) and c.installed()
import os; assert os.environ["SGLANG_FORCE_FUSED_OP_BACKEND"] == "torch"
import sgl_kernel
from sgl_kernel.flash_attn import flash_attn_varlen_func
from sgl_kernel import ScalarType, scalar_types
assert isinstance(ScalarType, type) and not scalar_types.uint4b8
try:
    flash_attn_varlen_func(1)
except NotImplementedError as e:
    assert "sgl_kernel.flash_attn.flash_attn_varlen_func" in str(e)
else:
    raise AssertionError("a stand-in ran")
print("ok")
""" % str(GPU)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_torch_native_on_a_gpu_runs_without_cuda_graphs():
    from tokenrouter.engine.config import EngineConfig
    from tokenrouter.engine.device import server_args_kwargs

    native = server_args_kwargs(EngineConfig(model_path="m", attention_backend="torch_native"), "cuda")
    assert native["disable_cuda_graph"] is True and native["attention_backend"] == "torch_native"
    triton = server_args_kwargs(EngineConfig(model_path="m", attention_backend="triton"), "cuda")
    assert "disable_cuda_graph" not in triton
