"""Shared pytest setup. Run the suite with tests/run (it sources deploy/env.sh)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from tritonserver import TritonServer  # perf/tritonserver.py (pytest.ini's pythonpath)

REPO_ROOT = Path(__file__).resolve().parent.parent

# The venv holds PyPI's torchvision (a CUDA build sglang imports) beside the CPU
# torch; without this, `import transformers` fails in host-side tests with
# "operator torchvision::nms does not exist". No-op where CUDA is present.
from tokenrouter.engine.sglang_cpu_compat import install as _cpu_compat  # noqa: E402

_cpu_compat()


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def triton_server(tmp_path_factory):
    """One real tritonserver for the session, serving the repository's model_repository.

    Readiness timeout: $TOKENROUTER_TEST_READY_TIMEOUT (default 600 s). Its log is
    kept under pytest's temp folder; the path is in ``triton_server.log_path``.
    """
    if not os.environ.get("TRITON_BACKEND_DIR"):
        pytest.fail("TRITON_BACKEND_DIR not set: run the tests with tests/run", pytrace=False)
    log = tmp_path_factory.mktemp("tritonserver") / "tritonserver.log"
    server = TritonServer(
        REPO_ROOT / "model_repository",
        ready_timeout=float(os.environ.get("TOKENROUTER_TEST_READY_TIMEOUT", "600")),
        log_path=log,
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()
        print(f"\ntritonserver log: {log}", file=sys.stderr)
