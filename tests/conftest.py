"""Shared pytest setup. Run the suite with tests/run (it sources deploy/env.sh)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

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


# ------------------------------------------------------------------ shared servers
#: Session servers that several test modules share.  The modules that use none run first (their own
#: servers, if any, one at a time), then the modules of each shared server together, in this order;
#: each shared server is stopped after its last test, so that no module's own server runs beside a
#: shared one (a server of the demo pair takes several GB).  Within a group, a module with a test
#: marked ``breaks_server`` (it kills part of the server, or loads it hard) runs last.
SHARED_SERVERS = ("triton_server", "routing_server")
_STARTED: dict = {}  # fixture name -> its TritonServer while it runs
_LAST_USER: dict = {}  # fixture name -> node id of the last selected test that uses it
_START_S: dict = {}  # fixture name -> (test file whose setup started it, seconds its start took)
_SETUP_OF = [""]  # node id of the test being set up


def _timed_start(name: str, server_cm):
    """Enter ``server_cm`` (a :func:`tr_server.running_server`) and note how long the start took and
    in which test file's setup, so that the summary lists a shared server's start apart from that
    file's own seconds."""
    import time

    t0 = time.monotonic()
    server = server_cm.__enter__()
    _START_S[name] = (_SETUP_OF[0].split("::", 1)[0], time.monotonic() - t0)
    _STARTED[name] = server
    return server


@pytest.fixture(scope="session")
def triton_server(tmp_path_factory):
    """One real tritonserver serving the repository's model_repository, shared by the test modules
    that use it (stopped after the last of them).

    Readiness timeout: $TOKENROUTER_TEST_READY_TIMEOUT (default 600 s). Its log is kept under
    pytest's temp folder; the path is in ``triton_server.log_path``.
    """
    from tr_server import running_server

    cm = running_server(REPO_ROOT / "model_repository", tmp_path_factory.mktemp("tritonserver"))
    server = _timed_start("triton_server", cm)
    try:
        yield server
    finally:
        cm.__exit__(None, None, None)


@pytest.fixture(scope="session")
def routing_server(tmp_path_factory):
    """One real tritonserver with a router model for speculative decoding, draft-verify and
    structured output on several routes (:func:`tr_server.routing_repository`), shared by the
    modules that use it (stopped after the last of them).

    The last test kills the LLM's stub, whose instance then never unloads: the server's stop does
    not wait Triton's default exit timeout (30 s) for it.
    """
    from tr_server import routing_repository, running_server

    work = tmp_path_factory.mktemp("routing_server")
    cm = running_server(routing_repository(work / "repo"), work, extra_args=["--exit-timeout-secs=5"])
    server = _timed_start("routing_server", cm)
    try:
        yield server
    finally:
        cm.__exit__(None, None, None)


def _module(item) -> str:
    return item.nodeid.split("::", 1)[0]


def _order_by_shared_server(items) -> None:
    """Sort ``items`` in place: modules without a shared server first, then the users of each shared
    server (:data:`SHARED_SERVERS`) together, a module with a ``breaks_server`` test last among them;
    modules otherwise in their collection order, and a module's tests in theirs."""
    first, group, breaks = {}, {}, set()
    for i, item in enumerate(items):
        mod = _module(item)
        first.setdefault(mod, i)
        names = getattr(item, "fixturenames", ())
        for g, name in enumerate(SHARED_SERVERS, 1):
            if name in names:
                group[mod] = min(group.get(mod, g), g)
        if item.get_closest_marker("breaks_server") is not None:
            breaks.add(mod)
    items.sort(key=lambda it: (group.get(_module(it), 0), _module(it) in breaks, first[_module(it)]))
    for mod, g in group.items():  # the workers' scopes (pytest_xdist_make_scheduler) read the files' text
        if _server_group(mod) != SHARED_SERVERS[g - 1]:
            raise pytest.UsageError(f"{mod} uses {SHARED_SERVERS[g - 1]} but _server_group() puts it in "
                                    f"{_server_group(mod)!r}: name the fixture in the file")


# ------------------------------------------------------------------ several workers (pytest-xdist)
def _server_group(module: str) -> str:
    """The shared server whose users ``module`` (a test file's path, as in a node id) belongs with, or
    the module itself: the scope that one worker runs whole under ``-n N``."""
    import re

    try:
        src = (REPO_ROOT / module).read_text()
    except OSError:
        return module
    for name in SHARED_SERVERS:
        if re.search(rf"\b{name}\b", src):
            return name
    return module


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``tests/run -n 2``: each worker runs whole scopes, a scope being one test file, or all the files
    that use one shared server (:data:`SHARED_SERVERS`), so that each shared server starts in one worker
    only and is stopped after its last user there; within a scope the order is the serial one
    (``breaks_server`` modules last)."""
    from xdist.scheduler import LoadScopeScheduling

    class SharedServerScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _server_group(nodeid.split("::", 1)[0])

    return SharedServerScheduling(config, log)


def pytest_collection_finish(session):
    """Note the last selected test of each shared server (after -k / -m deselection)."""
    for item in session.items:
        for name in SHARED_SERVERS:
            if name in getattr(item, "fixturenames", ()):
                _LAST_USER[name] = item.nodeid


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """Stop a shared server after its last test (and that module's fixtures): the modules after it
    start their own servers."""
    for name, nodeid in _LAST_USER.items():
        if nodeid == item.nodeid and name in _STARTED:
            _STARTED.pop(name).stop()


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
    _order_by_shared_server(items)


_FILE_SECONDS: dict = {}


def pytest_runtest_setup(item):
    _SETUP_OF[0] = item.nodeid


def pytest_runtest_logreport(report):
    """Seconds per test file: setup (module fixtures, its own servers), call and teardown of its tests.
    A shared server's start is counted apart (:data:`SHARED_SERVERS`), not in the file whose first
    test happened to start it."""
    path = report.nodeid.split("::", 1)[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    if not _FILE_SECONDS:
        return
    rows = dict(_FILE_SECONDS)
    for name, (path, secs) in _START_S.items():
        if path in rows:
            rows[path] -= secs
        rows[f"(start of the shared {name}, in {path or '?'}'s setup)"] = secs
    terminalreporter.section("seconds per test file")
    for path, s in sorted(rows.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{s:8.1f}  {path}")
    terminalreporter.write_line(f"{sum(rows.values()):8.1f}  total")


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

