"""A killed model under the router's Triton transport (``transport: triton``), real tritonserver.

Its own server (explicit model control, so that the router can reload the killed
model): a BLS request waiting on a model whose stub was killed is never completed
by Triton 2.51's Python backend, and the dead instance's unload waits for it — a
server that hosted such a kill runs into its exit timeout when it stops.  So this
test does not share test_failure's server, whose last test checks a clean SIGTERM.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from tokenrouter.tools.repository import add_router
from test_failure import ALL_LLM, _kill, _kv_zero, _Seen, _Stream, _wait_llm_back
from tr_server import is_stub, running_server

REPO_ROOT = Path(__file__).resolve().parent.parent
ROUTER = "token_router_triton"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    work = tmp_path_factory.mktemp("transport_failure")
    repo = work / "model_repository"
    for m in ("slm", "llm"):
        shutil.copytree(REPO_ROOT / "model_repository" / m, repo / m)
    shutil.copytree(REPO_ROOT / "model_repository" / "token_router", repo / "token_router")
    add_router(str(repo), ROUTER, {"transport": "triton"})
    shutil.rmtree(repo / "token_router")
    sems = set(Path("/dev/shm").glob("sem.mp-*"))
    # the killed model's old instance stays unloading while BLS requests were in flight
    # (docs/transport.md): do not wait Triton's default 30 s for it at exit
    with running_server(repo, work, extra_args=["--model-control-mode=explicit", "--load-model=*",
                                                "--exit-timeout-secs=5"]) as s:
        s.sems_before = sems
        s.seen = _Seen()
        s.seen.note(s)
        yield s


def test_llm_killed_triton_transport(server):
    """A request waiting on a killed model's BLS stream ends at once with the reason (the advert's
    pid watch, not the 600 s peer timeout); new requests are refused; the model comes back."""
    s = _Stream(server, ROUTER, ALL_LLM)
    assert s.first.wait(120) and s.error is None, s.error
    t_kill = time.monotonic()
    pid = _kill(server, "llm_0_0")
    s.wait(60)
    assert s.error is not None and "llm" in s.error and "down" in s.error, (s.error, s.summary)
    assert str(pid) in s.error
    back = _wait_llm_back(server, ROUTER, t_kill)
    assert back["routing_summary"]["tokens_by_model"]["llm"] > 0
    _kv_zero(server)


def test_nothing_left_after_stop(server):
    """The killed stub's instance never finishes unloading (the BLS request that waited on it),
    so the server exits on its exit timeout without removing that instance's ``/dev/shm``
    region; the dead stub's reaper removes it once the server is gone.  Every other stub of the
    server is gone too, and no stub left a named semaphore (``sem.mp-*``: tqdm's multiprocessing
    lock under the spawn start method, which only Python's exit handlers unlink)."""
    server.seen.note(server)
    assert server.seen.regions, "no stub regions seen"
    server.stop()
    deadline = time.monotonic() + 10
    left = alive = None
    while time.monotonic() < deadline:
        left = [r for r in server.seen.regions if Path("/dev/shm", r).exists()]
        alive = [p for p in server.seen.pids if is_stub(p)]
        if not left and not alive:
            break
        time.sleep(0.5)
    assert not alive, f"stub processes left: {alive}"
    assert not left, f"/dev/shm regions left: {left}"
    sems = sorted(p.name for p in set(Path("/dev/shm").glob("sem.mp-*")) - server.sems_before)
    assert not sems, f"named semaphores left: {sems}"
