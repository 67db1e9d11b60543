"""A model that dies must not take routed requests down with it (real tritonserver).

One server for the module, serving the repository's models plus a second router,
``token_router_fallback`` (``on_peer_failure: fallback``), beside ``token_router``
(``fail``, the default).  Each test kills a Triton Python stub of THIS server with
SIGKILL (as an out-of-memory kill would) — the stub is found in the process list
by its instance name in argv and this server's pid as its parent — and checks:
in-flight requests end at once with an error naming the model (fail) or go on on
the SLM (fallback, ``"degraded": ["llm"]``), new requests are refused with the
reason (fail) or degraded (fallback), and the model comes back without a server
restart.  After each test KV is zero on every model.  The last test stops the
server with SIGTERM under load and checks that nothing of it is left behind:
no stub process, /dev/shm region, ipc socket or advert file.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import tempfile
import threading
import time
from pathlib import Path

import pytest
import requests
import tritonclient.grpc as grpcclient

from tokenrouter.tools import admin
from tokenrouter.tools.repository import make_variant
from tr_client import router_inputs, wait_kv_released
from tr_server import is_stub, python_stubs, running_server

REPO_ROOT = Path(__file__).resolve().parent.parent
#: seconds within which a killed model must be back (a reload is one model initialisation: ~10 s on an idle
#: host, minutes on a loaded 2-core runner; the bound only catches a recovery that never happens)
RECOVERY_S = float(os.environ.get("TOKENROUTER_TEST_RECOVERY_S", "300"))
#: the LLM's drain_timeout_s here (seconds): an unload ends the requests it holds after this long (the
#: default, 30 s, would only lengthen the test that unloads it under a request)
DRAIN_S = 5
#: every token goes to the LLM: a request is almost always waiting on it
ALL_LLM = {"max_tokens": 200, "temperature": 0, "ignore_eos": True, "routing_threshold": 0.0}


class _Seen:
    """Everything of the server that must be gone after it stops: stub pids, shm regions."""

    def __init__(self):
        self.pids, self.regions = set(), {}  # regions: {name: stub instance}

    def note(self, server):
        for instance, stub in python_stubs(server).items():
            self.pids.add(stub.pid)
            self.regions[stub.region] = instance


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    work = tmp_path_factory.mktemp("failure")
    fb = work / "token_router_fallback"
    fb.mkdir()
    (fb / "1").mkdir()
    cfg = (REPO_ROOT / "model_repository" / "token_router" / "config.pbtxt").read_text()
    cfg = re.sub(r'name:\s*"token_router"', 'name: "token_router_fallback"', cfg)
    cfg = re.sub(r'parameters \{ key: "on_peer_failure"[^\n]*\n', "", cfg)
    cfg += '\nparameters { key: "on_peer_failure" value { string_value: "fallback" } }\n'
    (fb / "config.pbtxt").write_text(cfg)
    # the LLM's unload drains its requests for DRAIN_S (test_llm_unloaded_under_a_request waits it out)
    repo = make_variant(str(REPO_ROOT / "model_repository"), str(work / "repo"),
                        model_params={"llm": {"drain_timeout_s": DRAIN_S}})
    with running_server(repo, work, models={"token_router_fallback": fb}, copy=True,
                        extra_args=["--model-control-mode=explicit", "--load-model=*"]) as s:
        s.seen = _Seen()
        s.seen.note(s)
        yield s


class _Stream:
    """One gRPC streaming request in the background: ``first`` is set at the first chunk."""

    def __init__(self, server, model: str, sampling, prompt: str = "Tell me a long story about a dragon."):
        self.first, self.done = threading.Event(), threading.Event()
        self.chunks, self.error, self.summary, self.t_end = [], None, None, None
        self.times = []  # monotonic arrival time of each text chunk
        self._q: "queue.Queue" = queue.Queue()
        self._c = grpcclient.InferenceServerClient(server.grpc_url)
        self._c.start_stream(callback=lambda result, error: self._q.put((result, error)))
        self._c.async_stream_infer(model, router_inputs(prompt, sampling, True, trace=False),
                                   enable_empty_final_response=True)
        self._t = threading.Thread(target=self._read, daemon=True)
        self._t.start()

    def _read(self):
        try:
            while True:
                result, error = self._q.get(timeout=600)
                if error is not None:
                    self.error = str(error)
                    return
                t = result.as_numpy("text_output")
                if t is not None and t.size:
                    self.chunks.append(t.reshape(-1)[0].decode())
                    self.times.append(time.monotonic())
                    self.first.set()
                s = result.as_numpy("routing_summary")
                if s is not None and s.size:
                    self.summary = json.loads(s.reshape(-1)[0])
                p = result.get_response().parameters.get("triton_final_response")
                if p is not None and p.bool_param:
                    return
        except queue.Empty:
            self.error = "no response in 600 s"
        finally:
            self.t_end = time.monotonic()
            self.first.set()
            self.done.set()
            self._c.stop_stream()
            self._c.close()

    def wait(self, timeout: float):
        assert self.done.wait(timeout), f"stream still running after {timeout} s"
        return self


def _generate(server, model: str, sampling, prompt: str = "What is the capital of France?"):
    body = {"text_input": prompt, "exclude_input_in_output": True,
            "sampling_parameters": json.dumps(sampling)}
    r = requests.post(f"http://{server.http_url}/v2/models/{model}/generate", json=body, timeout=300)
    out = r.json()
    out["_status"] = r.status_code
    if isinstance(out.get("routing_summary"), str):
        out["routing_summary"] = json.loads(out["routing_summary"])
    return out


def _kill(server, instance: str) -> int:
    server.seen.note(server)
    stubs = python_stubs(server)
    assert instance in stubs, f"no stub {instance} of this server: {sorted(stubs)}"
    pid = stubs[instance].pid
    os.kill(pid, signal.SIGKILL)
    return pid


def _wait_llm_back(server, model: str, t_kill: float):
    """Poll with requests routed to the LLM until one gets LLM tokens; return it."""
    last = None
    while time.monotonic() - t_kill < RECOVERY_S:
        last = _generate(server, model, {"max_tokens": 4, "temperature": 0, "routing_threshold": 0.0})
        summ = last.get("routing_summary") or {}
        if last["_status"] == 200 and summ.get("tokens_by_model", {}).get("llm", 0) > 0 \
                and not summ.get("degraded"):
            server.seen.note(server)
            return last
        time.sleep(1)
    pytest.fail(f"llm not back {RECOVERY_S} s after the kill; last answer {last}; log:\n{server.log_tail(40)}")


def _kv_zero(server, models=("slm", "llm")):
    st = wait_kv_released(server, models)
    for m, s in st.items():
        assert s["kv_tokens_in_use"] == 0 and s["active"] == 0, (m, s)


#: a long SLM-only request: it never needs the LLM, so a dead LLM must not stall it
SLM_ONLY = {"max_tokens": 600, "temperature": 0, "ignore_eos": True, "routing_threshold": 1.0}


def test_llm_killed_before_the_router_first_reaches_it(server):
    """First test of the module: no request has been routed, so the router has never reached the
    LLM (it connects lazily) and finds only the dead stub's advert; the model must still be
    marked down, the request told so, and the model reloaded."""
    t_kill = time.monotonic()
    pid = _kill(server, "llm_0_0")
    r = _generate(server, "token_router", {"max_tokens": 4, "temperature": 0, "routing_threshold": 0.0})
    if r["_status"] != 200:  # (unless the reload was already done: then it must have worked)
        assert "llm" in r.get("error", "") and ("down" in r["error"] or "not ready" in r["error"]), r
        assert "not healthy" not in r["error"], r
        assert str(pid) in r["error"] or "not ready" in r["error"], r
    back = _wait_llm_back(server, "token_router", t_kill)
    assert back["routing_summary"]["tokens_by_model"]["llm"] > 0
    _wait_llm_back(server, "token_router_fallback", t_kill)  # the other router finds the new stub
    _kv_zero(server)


def test_llm_killed_fail_mode(server):
    bystander = _Stream(server, "token_router", SLM_ONLY)
    s = _Stream(server, "token_router", ALL_LLM)
    assert s.first.wait(120) and s.error is None, s.error
    assert bystander.first.wait(120) and bystander.error is None, bystander.error
    t_kill = time.monotonic()
    pid = _kill(server, "llm_0_0")
    s.wait(60)  # far below peer_timeout_s (600 s): the death is detected, not timed out
    assert s.error is not None and "llm" in s.error and "down" in s.error, (s.error, s.summary)
    assert str(pid) in s.error
    # while it is down, requests are refused at once with the reason
    r = _generate(server, "token_router", {"max_tokens": 4})
    if r["_status"] != 200:  # (unless the restart was already done: then it must have worked)
        assert "not ready" in r.get("error", "") and "llm" in r["error"], r
        probe = admin.router_ready(server.grpc_url)  # the orchestrator's readiness probe agrees
        assert not probe["ready"] and "llm" in probe["reason"], probe
    back = _wait_llm_back(server, "token_router", t_kill)
    t_back = time.monotonic()
    assert back["routing_summary"]["tokens_by_model"]["llm"] > 0
    # the reload does not hold the router's responses: the SLM-only stream kept streaming
    # while the LLM was loaded again (no gap of half the outage between two of its chunks)
    bystander.wait(600)
    assert bystander.error is None, bystander.error
    during = [t for t in bystander.times if t_kill <= t <= t_back]
    gaps = [b - a for a, b in zip([t_kill] + during, during + [min(t_back, bystander.t_end)])]
    assert max(gaps) < 0.5 * (t_back - t_kill), (max(gaps), t_back - t_kill, len(during))
    _kv_zero(server)


def test_llm_killed_fallback_mode(server):
    s = _Stream(server, "token_router_fallback", ALL_LLM)
    assert s.first.wait(120) and s.error is None, s.error
    t_kill = time.monotonic()
    _kill(server, "llm_0_0")
    s.wait(240)
    assert s.error is None, s.error
    assert s.summary["degraded"] == ["llm"], s.summary
    assert s.summary["tokens_by_model"]["slm"] > 0, s.summary
    assert sum(s.summary["tokens_by_model"].values()) == ALL_LLM["max_tokens"], s.summary
    # a new request while it is down: routed the same way (unless the model is already back)
    r = _generate(server, "token_router_fallback", {"max_tokens": 4, "routing_threshold": 0.0})
    assert r["_status"] == 200, r
    if r["routing_summary"].get("degraded"):
        assert r["routing_summary"]["tokens_by_model"]["llm"] == 0, r
    text = requests.get(server.metrics_url, timeout=10).text
    m = re.search(r'^tokenrouter_degraded_requests_total\{model="token_router_fallback"\}\s+(\S+)$', text, re.M)
    assert m and float(m.group(1)) >= 1, text[-2000:]
    _wait_llm_back(server, "token_router_fallback", t_kill)
    _kv_zero(server)


def test_router_killed(server):
    t_kill = time.monotonic()
    _kill(server, "token_router_0_0")
    time.sleep(1)
    assert requests.get(f"http://{server.http_url}/v2/health/live", timeout=10).status_code == 200
    last = None
    while time.monotonic() - t_kill < RECOVERY_S:
        last = _generate(server, "token_router", {"max_tokens": 4, "temperature": 0, "routing_threshold": 0.0})
        if last["_status"] == 200:
            break
        time.sleep(1)
    assert last["_status"] == 200, (last, server.log_tail(40))
    assert last["routing_summary"]["tokens_by_model"]["llm"] > 0
    server.seen.note(server)
    _kv_zero(server)


def test_llm_unloaded_under_a_request(server):
    """An explicit unload of the LLM while a routed request rides on it: the model drains for
    ``drain_timeout_s`` (``DRAIN_S``) and then the request ends with "server is shutting down"
    naming the unload (not "retry later": an unloaded model is not restarted); a load brings it
    back."""
    s = _Stream(server, "token_router", {"max_tokens": 4000, "temperature": 0, "ignore_eos": True,
                                         "routing_threshold": 0.0})
    assert s.first.wait(180), s.error
    r = requests.post(f"http://{server.http_url}/v2/repository/models/llm/unload", timeout=30)
    assert r.status_code == 200, r.text
    s.wait(120)
    assert s.error is not None and "shutting down" in s.error and "llm was unloaded" in s.error, s.error
    deadline = time.monotonic() + 60  # the error comes as the drain ends; the unload finishes after it
    while True:
        idx = requests.post(f"http://{server.http_url}/v2/repository/index", timeout=30).json()
        state = {m["name"]: m["state"] for m in idx}["llm"]
        if state != "UNLOADING" or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert state == "UNAVAILABLE", idx  # unloaded, and not restarted by the router
    r = requests.post(f"http://{server.http_url}/v2/repository/models/llm/load", timeout=600)
    assert r.status_code == 200, r.text
    _wait_llm_back(server, "token_router", time.monotonic())
    _kv_zero(server)


def test_sigterm_under_load(server):
    streams = [_Stream(server, "token_router", {"max_tokens": 48, "temperature": 0, "ignore_eos": True,
                                                 "routing_threshold": 0.2}) for _ in range(3)]
    for s in streams:
        assert s.first.wait(180), s.error
    server.seen.note(server)
    pid = server.process.pid
    server.process.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    late = None
    try:
        late = _generate(server, "token_router", {"max_tokens": 4})
    except requests.RequestException as e:  # the front end may already be closed
        late = {"_status": None, "error": str(e)}
    for s in streams:
        s.wait(120)
        # drained (Triton waits up to exit_timeout for them) or ended with a clear message
        assert s.error is None or "shutting down" in s.error, s.error
    assert late["_status"] != 200, late
    server.process.wait(120)
    # nothing of this server is left behind
    alive = [p for p in server.seen.pids if is_stub(p)]
    assert not alive, f"stub processes left: {alive}"
    # a killed stub's region is removed by its reaper, which polls once a second for the server's exit
    deadline = time.monotonic() + 10
    while True:
        left = {r: i for r, i in server.seen.regions.items() if Path("/dev/shm", r).exists()}
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not left, f"/dev/shm regions left (region: stub instance): {left}"
    tmp = tempfile.gettempdir()
    adverts = [f for f in os.listdir(tmp) if f.startswith(f"tokenrouter-{pid}-")]
    assert not adverts, adverts
    socks = [f for f in os.listdir(tmp) if f.startswith("tokenrouter-") and
             any(f.startswith(f"tokenrouter-{p}-") for p in server.seen.pids)]
    assert not socks, socks
