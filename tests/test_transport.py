"""The router's Triton transport (``transport: triton``) against the real tritonserver.

One server for the module serves a copy of model_repository plus a second router,
``token_router_triton``, with ``transport: triton``: each visit of a request to a
model is then a decoupled BLS request to it, so it passes Triton's scheduler.  The
LLM models' configs are written for that transport with scheduler_model's config
writer (B = ``B_TEST`` in the dynamic batcher, the decode loop's own delayed
batching off), with a generous queue delay so that the batcher's grouping shows in
Triton's statistics.  ``token_router`` (ZeroMQ) serves the same models.

The server runs with explicit model control, so that the router can reload a killed
model: the module's last two tests kill the LLM's stub under a request and then stop
the server.  A BLS request waiting on a model whose stub was killed is never completed
by Triton 2.51's Python backend, and the dead instance's unload waits for it (the
instance stays unloading; docs/transport.md): the server's stop does not wait Triton's
default exit timeout (30 s) for it.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import shutil
import time
from pathlib import Path

import pytest

from scheduler_model.config_writer import update_config_text
from tokenrouter.tools.repository import add_router
from tokenrouter.tools.soak import run_soak
from tr_client import generate, grpc_stream, stream_then_cancel, triton_stats, wait_kv_released
from test_failure import ALL_LLM, _kill, _Seen, _Stream, _wait_llm_back
from tr_server import is_stub, running_server

REPO_ROOT = Path(__file__).resolve().parent.parent
ROUTER = "token_router_triton"
#: B* written into the models' dynamic batcher for this module
B_TEST = 4
#: the batcher's queue delay (µs): long enough that a group of B_TEST forms under load; every visit
#: of a lone request waits it out, so it is most of the module's time
DELAY_US = 200_000
#: concurrent requests of the batcher test: a group of B_TEST forms at once, and the requests that
#: end last (whose arrivals wait out the delay in smaller groups) weigh little
BURST = 32
PROMPTS = ["The capital of France is", "Once upon a time, a little robot who lived in a lighthouse",
           "Three tips for staying healthy are"]


def _repository(dst: Path) -> Path:
    repo = dst / "model_repository"
    shutil.copytree(REPO_ROOT / "model_repository", repo, ignore=shutil.ignore_patterns("__pycache__"))
    for m in ("slm", "llm"):
        cfg = repo / m / "config.pbtxt"
        text, _ = update_config_text(cfg.read_text(), B_TEST, DELAY_US, name=m, transport="triton")
        cfg.write_text(text)
    add_router(str(repo), ROUTER, {"transport": "triton"})
    return repo


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    work = tmp_path_factory.mktemp("transport")
    repo = _repository(work)
    sems = set(Path("/dev/shm").glob("sem.mp-*"))
    with running_server(repo, work, extra_args=["--model-control-mode=explicit", "--load-model=*",
                                                "--exit-timeout-secs=5"]) as s:
        s.sems_before = sems
        s.seen = _Seen()
        s.seen.note(s)
        yield s


def _kv_zero(server):
    st = wait_kv_released(server, timeout=60)
    for m, s in st.items():
        assert s["kv_tokens_in_use"] == 0 and s["kv_rows_in_use"] == 0 and s["active"] == 0, (m, s)


@pytest.mark.parametrize("threshold", [None, 0.0])
def test_greedy_equal_to_zmq(server, threshold):
    """Same prompt, temperature 0: the same tokens, routing and handoffs over both transports."""
    handoffs = 0
    for p in PROMPTS:
        sp = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}
        if threshold is not None:
            sp["routing_threshold"] = threshold
        z = generate(server, p, sp)
        t = generate(server, p, sp, model=ROUTER)
        assert z["_status"] == 200 and t["_status"] == 200, (z, t)
        assert t["routing_trace"]["token_ids"] == z["routing_trace"]["token_ids"], p
        assert t["routing_trace"]["trace"] == z["routing_trace"]["trace"], p
        assert t["text_output"] == z["text_output"]
        assert t["routing_summary"]["tokens_by_model"] == z["routing_summary"]["tokens_by_model"]
        handoffs += t["routing_summary"]["handoffs"]
    assert handoffs > 0
    _kv_zero(server)


def test_streaming_equal_to_zmq(server):
    sp = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}
    z = grpc_stream(server, PROMPTS[1], sp)
    t = grpc_stream(server, PROMPTS[1], sp, model=ROUTER)
    assert z["error"] is None and t["error"] is None, (z, t)
    assert t["text"] == z["text"] and t["routing_summary"]["handoffs"] > 0


def test_cancel_mid_stream_frees_kv(server):
    """A client that cancels its stream: the router releases the request's KV on every model."""
    sp = {"max_tokens": 400, "temperature": 0, "ignore_eos": True}

    def cancel_one(i):
        return stream_then_cancel(server, ROUTER, f"Tell a very long story number {i}.", sp)

    with cf.ThreadPoolExecutor(3) as ex:
        assert [f.result() for f in [ex.submit(cancel_one, i) for i in range(3)]] == [3, 3, 3]
    _kv_zero(server)
    # the router still serves
    out = generate(server, PROMPTS[0], {"max_tokens": 4, "temperature": 0}, model=ROUTER)
    assert out["_status"] == 200 and out["num_output_tokens"] == 4


def test_bad_input_fails_alone(server):
    """Bad client input gets a clear error; garbage sent straight to a model, batched by Triton
    together with routed work, fails alone while the routed request is unharmed."""
    from tokenrouter.tools import admin

    bad = generate(server, PROMPTS[0], {"max_tokens": 4, "temperature": -1}, model=ROUTER)
    assert bad["_status"] != 200 and "temperature" in bad.get("error", ""), bad
    bad = generate(server, " ", {"max_tokens": 4}, model=ROUTER)
    assert bad["_status"] != 200 and "empty" in bad.get("error", ""), bad
    sp = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}
    reference = generate(server, PROMPTS[2], sp)
    garbage = [
        {"rid": "g1", "max_tokens": 4, "models": ["slm", "llm"], "resume": True},  # nothing to resume
        {"rid": "g2", "max_tokens": -1, "models": ["slm", "llm"]},                  # bad budget
        {"rid": "g3", "max_tokens": 4, "models": ["slm", "llm"], "params": {"tau": "x"}},
    ]
    with cf.ThreadPoolExecutor(4) as ex:
        victim = ex.submit(generate, server, PROMPTS[2], sp, model=ROUTER)
        errors = [ex.submit(admin.model_op, server.grpc_url, m, "run", hdr, request_id=hdr["rid"])
                  for hdr in garbage for m in ("slm", "llm")]
        for f in errors:
            with pytest.raises(RuntimeError):
                f.result()
        v = victim.result()
    assert v["_status"] == 200, v
    assert v["routing_trace"]["token_ids"] == reference["routing_trace"]["token_ids"]
    _kv_zero(server)


def test_dynamic_batcher_groups_arrivals(server):
    """Under load, Triton's batcher hands each model groups of ~B* arrivals per execute call.

    Measured from Triton's own statistics (``/v2/models/<m>/stats``): inference_count /
    execution_count from the start of a burst of BURST equal-length requests until the
    first of them ends — the window in which the load holds; after it, the last
    requests' arrivals wait out the queue delay in smaller groups.
    """
    sp = {"max_tokens": 32, "temperature": 0, "ignore_eos": True}
    before = {m: triton_stats(server, m) for m in ("slm", "llm")}
    with cf.ThreadPoolExecutor(BURST) as ex:
        futs = [ex.submit(generate, server, f"{PROMPTS[i % 3]} (variant {i})", sp, model=ROUTER)
                for i in range(BURST)]
        next(cf.as_completed(futs))
        under_load = {m: triton_stats(server, m) for m in ("slm", "llm")}
        outs = [f.result() for f in futs]
    assert all(o["_status"] == 200 and o["num_output_tokens"] == 32 for o in outs), outs
    assert sum(o["routing_summary"]["tokens_by_model"]["llm"] for o in outs) > 0
    ratio = {}
    for m in ("slm", "llm"):
        n = under_load[m]["inference_count"] - before[m]["inference_count"]
        e = under_load[m]["execution_count"] - before[m]["execution_count"]
        assert e > 0, (m, before[m], under_load[m])
        ratio[m] = n / e
        print(f"{m}: {n} requests in {e} executions")
    # without the batcher each execute call gets 1 request; the burst's first and last arrivals come
    # in smaller groups (a loaded host spreads the client's sends: 3.15 of 4 seen once)
    assert ratio["llm"] >= 0.7 * B_TEST and ratio["slm"] >= 0.7 * B_TEST, ratio
    _kv_zero(server)


def test_concurrent_stress(server):
    """16 concurrent clients for $TOKENROUTER_SOAK_SECONDS (30 s; streams, cancellations, bad input): all answered, no stub crash."""
    rep = run_soak(server.grpc_url, float(os.environ.get("TOKENROUTER_SOAK_SECONDS", "30")), concurrency=16,
                   router=ROUTER, thresholds=(0.1, 0.2, 0.3), request_timeout_s=300, seed=3)
    assert rep["passed"], rep["problems"]
    assert rep["handoffs"] > 50, rep
    log = server.log_tail(5000)
    assert "is not healthy" not in log and "Segmentation fault" not in log, log[-3000:]
    _kv_zero(server)


# ------------------------------------------------------------------ a killed model (the module's last tests)
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
