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
from tokenrouter.engine.cpu import install as _cpu_compat  # noqa: E402
from tokenrouter.engine.cpu.kernel_caches import bound_kernel_caches  # noqa: E402
from tokenrouter.engine.config import EngineConfig  # noqa: E402

_cpu_compat()
# The libraries read their kernel-cache capacities once, at the process's first oneDNN primitive: a
# model process bounds them as its engine loads (before any other torch work); in this process other
# tests run torch first, so the engines built here get the same bound now.
bound_kernel_caches(EngineConfig.__dataclass_fields__["cpu_kernel_cache_entries"].default)


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


# ------------------------------------------------------------------ markers and timings
# `server`: the test starts a tritonserver; `slow`: it runs for seconds without one (long
# simulations, or an SGLang engine in the test process).  Found from the source of the test and
# of its fixtures (a TritonServer or an SGLangEngine built there, or a server started with
# tr_server.running_server), so a new test is marked without anyone remembering to; the other cases
# are marked by hand (a subprocess that starts a server, a long simulation).  `tests/run --quick`
# runs the rest: -m "not server and not slow".
_BUILDS = {"server": ("TritonServer(", "running_server("), "slow": ("SGLangEngine(",)}


def _source(fn) -> str:
    import inspect

    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return ""


def _builds(item, calls) -> bool:
    """True when the test or one of its fixtures makes one of ``calls`` (e.g. ``TritonServer(``)."""
    if any(c in _source(getattr(item, "function", None)) for c in calls):
        return True
    info = getattr(item, "_fixtureinfo", None)
    for name in getattr(item, "fixturenames", ()):
        for fd in (info.name2fixturedefs.get(name, ()) if info is not None else ()):
            if any(c in _source(fd.func) for c in calls):
                return True
    return False


def pytest_collection_modifyitems(config, items):
    for item in items:
        for marker, calls in _BUILDS.items():
            if item.get_closest_marker(marker) is None and _builds(item, calls):
                item.add_marker(getattr(pytest.mark, marker))


_FILE_SECONDS: dict = {}


def pytest_runtest_logreport(report):
    """Seconds per test file: setup (module fixtures, servers), call and teardown of its tests."""
    path = report.nodeid.split("::", 1)[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    if not _FILE_SECONDS:
        return
    terminalreporter.section("seconds per test file")
    for path, s in sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{s:8.1f}  {path}")
    terminalreporter.write_line(f"{sum(_FILE_SECONDS.values()):8.1f}  total")


@pytest.fixture(scope="session")
def smollm2_engine():
    """One in-process SGLang engine (SmolLM2-135M, 2,048-token KV pool, prefix cache off) for the whole session.

    SGLang's runner initialises its process-wide parallel state once, so a second engine in
    the same pytest process fails ("init_parallel_runtime() ran twice"): every test file that
    needs an engine in the test process shares this one and releases what it adds.
    """
    from tokenrouter.engine.config import EngineConfig
    from tokenrouter.engine.sglang_engine import SGLangEngine

    path = os.path.join(os.environ["TOKENROUTER_WEIGHTS"], "smollm2-135m-instruct")
    return SGLangEngine(EngineConfig(model_path=path, kv_pool_tokens=2048, max_running_requests=8, torch_threads=2,
                                     prefix_cache=False))

