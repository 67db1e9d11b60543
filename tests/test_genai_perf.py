"""perf/genai_perf.sh: NVIDIA genai-perf against token_router (KServe gRPC, vllm backend, streaming).

genai-perf sends ``sampling_parameters`` with string values (``{"max_tokens": "4"}``),
as vllm_backend clients do; token_router must accept those forms for this test to pass.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest


@pytest.fixture(scope="module")
def genai_perf(repo_root):
    """Create genai-perf's environment (skip if that is impossible here, e.g. no package index)."""
    p = subprocess.run(["bash", str(repo_root / "perf/genai_perf.sh"), "--setup-only"],
                       capture_output=True, text=True, timeout=1200)
    if p.returncode != 0:
        pytest.skip(f"genai-perf's environment could not be created: {p.stderr.strip()[-400:]}")
    return p.stdout.strip()


def test_genai_perf_profiles_token_router(genai_perf, triton_server, repo_root, tmp_path):
    n, out_tokens = 3, 4
    p = subprocess.run(
        ["bash", str(repo_root / "perf/genai_perf.sh"), "-u", triton_server.grpc_url, "-n", str(n),
         "--input-tokens", "16", "--output-tokens", str(out_tokens), "--artifact-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    exports = list(tmp_path.rglob("*genai_perf.json"))
    assert exports, f"no genai-perf export under {tmp_path}: {os.listdir(tmp_path)}"
    stats = json.loads(exports[0].read_text())
    assert stats["request_count"]["avg"] == n
    assert stats["time_to_first_token"]["avg"] > 0
    # genai-perf counts output tokens by re-tokenising the streamed text
    assert 0 < stats["output_sequence_length"]["max"] <= out_tokens + 1
