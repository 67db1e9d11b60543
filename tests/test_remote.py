"""Models served by other tritonservers (``remote_models``), over TCP with CURVE (real servers).

Two (or three) extra tritonserver processes on loopback, beside the session's
single server (``triton_server``, the reference):

* server B (and B2, a second replica, when memory allows): ``llm`` only, its
  inter-model channel on ``tcp://127.0.0.1:PORT`` with CURVE keys;
* server A: ``token_router`` and ``slm``; ``remote_models`` points ``llm`` at B
  (and B2).

Checks: greedy output equals the single server's token for token; cancelled
requests free KV on both servers; a client with a wrong CURVE key gets nothing
and the model goes on serving; replicas share the requests; killing server B
fails requests with a clear error naming ``llm`` and the readiness probe says
so; a new server B on the same port brings ``llm`` back without touching A.

The extra servers run with a smaller KV pool (``kv_pool_tokens``) than the
repository's: it changes no output, only memory.  ``TOKENROUTER_TEST_REPLICAS``
= 1 / 0 forces the second replica on / off (default: on when at least
``REPLICA_MIN_AVAILABLE_GIB`` of memory is available once B is up).
Run alone, this module starts the session's reference server too: four servers at most.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import queue
import signal
import tempfile
import time
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
import zmq

from tokenrouter.routing.curve import make_keys
from tokenrouter.tools import admin
from tokenrouter.tools.repository import make_variant
from tr_client import generate, model_stats, router_inputs, stream_then_cancel, wait_kv_released
from tr_server import python_stubs
from tritonserver import TritonServer, free_ports

REPO_ROOT = Path(__file__).resolve().parent.parent
READY_S = float(os.environ.get("TOKENROUTER_TEST_READY_TIMEOUT", "600"))
#: memory (GiB) that must be available, with B up, to start the second llm replica
REPLICA_MIN_AVAILABLE_GIB = 5.0
#: a small KV pool for the extra servers (tokens): memory only, outputs are unchanged
KV_POOL = "4096"
#: a remote replica silent this long is down (the default 2 s, raised: test hosts are often overloaded)
HEARTBEAT_TIMEOUT_S = "5"
PROMPTS = ["What is the capital of France?", "Name three planets.", "Write a haiku about the sea."]
GREEDY = {"max_tokens": 24, "temperature": 0}

pytestmark = pytest.mark.server  # the cluster's servers start in a helper class


def _available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return 0.0


def _stub_files(server):
    """/dev/shm regions of ``server``'s Python stubs (left behind when the server is SIGKILLed)."""
    return [Path("/dev/shm", stub.region) for stub in python_stubs(server).values()]


def _kill_server(server) -> None:
    """SIGKILL a server and its stubs (a host failure), then remove what they left in /dev/shm and /tmp."""
    regions, pid = _stub_files(server), server.process.pid
    os.killpg(pid, signal.SIGKILL)
    server.stop()
    for r in regions:
        r.unlink(missing_ok=True)
    for f in Path(tempfile.gettempdir()).glob(f"tokenrouter-{pid}-*"):
        f.unlink(missing_ok=True)


class _Cluster:
    """Servers A (router + slm), B (llm) and optionally B2 (llm), sharing one CURVE key set."""

    def __init__(self, work: Path):
        self.work = work
        self.keys = make_keys(str(work / "keys"))
        self.ports = free_ports(2)
        self.servers = {}
        env = os.environ.get("TOKENROUTER_TEST_REPLICAS", "")
        self.b = self.start_b("b", self.ports[0])
        if env == "1" or (env != "0" and _available_gib() >= REPLICA_MIN_AVAILABLE_GIB):
            self.b2 = self.start_b("b2", self.ports[1])
            self.replica_skip = None
        else:
            self.b2 = None
            self.replica_skip = "second llm replica turned off (TOKENROUTER_TEST_REPLICAS=0)" if env == "0" else (
                f"second llm replica not started: {_available_gib():.1f} GiB available with B up, "
                f"{REPLICA_MIN_AVAILABLE_GIB} GiB needed (TOKENROUTER_TEST_REPLICAS=1 forces it)")
        self.endpoints = [f"tcp://127.0.0.1:{p}" for p in self.ports[:2 if self.b2 else 1]]
        repo = make_variant(str(REPO_ROOT / "model_repository"), str(self.work / "repo_a"), model_params={
            "slm": {"kv_pool_tokens": KV_POOL},
            "token_router": {"remote_models": json.dumps({"llm": self.endpoints}),
                             "curve_secret_key_file": self.keys["router_secret"],
                             "curve_server_public_keys": self.keys["server_public"],
                             "heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S}})
        self.a = self._start("a", repo, ["slm", "token_router"])

    def _start(self, name: str, repo: str, models) -> TritonServer:
        s = TritonServer(repo, ready_timeout=READY_S, log_path=self.work / f"{name}.log",
                         extra_args=["--model-control-mode=explicit", *[f"--load-model={m}" for m in models]])
        s.start()
        self.servers[name] = s
        return s

    def start_b(self, name: str, port: int) -> TritonServer:
        """A server with ``llm`` only, its channel on tcp://127.0.0.1:``port`` (CURVE on)."""
        repo = make_variant(str(REPO_ROOT / "model_repository"), str(self.work / f"repo_{name}"), model_params={
            "llm": {"peer_endpoint": f"tcp://127.0.0.1:{port}", "kv_pool_tokens": KV_POOL,
                    "curve_secret_key_file": self.keys["server_secret"],
                    "curve_authorized_keys_dir": self.keys["authorized_keys_dir"]}})
        return self._start(name, repo, ["llm"])

    def llm_servers(self):
        return [s for s in (self.b, self.b2) if s is not None and s.process is not None]

    def stop(self) -> None:
        for s in self.servers.values():
            s.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if not os.environ.get("TRITON_BACKEND_DIR"):
        pytest.fail("TRITON_BACKEND_DIR not set: run the tests with tests/run", pytrace=False)
    work = tmp_path_factory.mktemp("remote")
    c = None
    try:
        c = _Cluster(work)
        yield c
    finally:
        if c is not None:
            c.stop()
        print(f"\nserver logs: {work}")


def _kv_zero(cluster) -> None:
    for server, models in [(cluster.a, ["slm"])] + [(s, ["llm"]) for s in cluster.llm_servers()]:
        st = wait_kv_released(server, models, timeout=60)
        for m, s in st.items():
            assert s["kv_tokens_in_use"] == 0 and s["active"] == 0, (server, m, s)


def test_greedy_output_equals_single_server(triton_server, cluster):
    llm_tokens = 0
    for prompt in PROMPTS:
        ref = generate(triton_server, prompt, GREEDY, chat=True)
        got = generate(cluster.a, prompt, GREEDY, chat=True)
        assert ref["_status"] == 200 and got["_status"] == 200, (ref, got)
        assert got["routing_trace"]["token_ids"] == ref["routing_trace"]["token_ids"], (prompt, ref, got)
        assert got["routing_trace"]["trace"] == ref["routing_trace"]["trace"], prompt
        assert got["text_output"] == ref["text_output"]
        llm_tokens += got["routing_summary"]["tokens_by_model"]["llm"]
    assert llm_tokens > 0, "no token was written by the remote llm: the test routes nothing to it"
    _kv_zero(cluster)


def test_cancellation_frees_kv_on_both_servers(cluster):
    sp = {"max_tokens": 300, "temperature": 0, "ignore_eos": True, "routing_threshold": 0.0}  # all on llm

    def cancel_one(i: int) -> int:
        return stream_then_cancel(cluster.a, "token_router", f"Tell a very long story number {i}.", sp)

    with cf.ThreadPoolExecutor(3) as ex:
        assert [f.result() for f in [ex.submit(cancel_one, i) for i in range(3)]] == [3, 3, 3]
    _kv_zero(cluster)
    cancelled = sum(model_stats(s, "llm")["cancelled"] for s in cluster.llm_servers())
    assert cancelled >= 3, cancelled


def test_wrong_curve_key_is_refused(cluster):
    import zmq.auth

    server_key, _ = zmq.auth.load_certificate(cluster.keys["server_public"])
    ctx = zmq.Context()
    try:
        for name, keyed in (("random key", True), ("no CURVE", False)):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            if keyed:
                sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
                sock.curve_serverkey = server_key
            sock.connect(cluster.endpoints[0])
            sock.send_multipart([json.dumps({"op": "stats", "seg": 7}).encode(), b""])
            assert sock.poll(3000) == 0, f"{name}: the model answered a client it must refuse"
            sock.close(0)
    finally:
        ctx.term()
    deadline = time.monotonic() + 30
    while "connection refused (key not authorised)" not in cluster.b.log_tail(400):
        assert time.monotonic() < deadline, f"refusal not logged; log:\n{cluster.b.log_tail(40)}"
        time.sleep(0.5)
    ok = generate(cluster.a, PROMPTS[0], {**GREEDY, "routing_threshold": 0.0}, chat=True)
    assert ok["_status"] == 200 and ok["routing_summary"]["tokens_by_model"]["llm"] > 0, ok


def test_replicas_share_requests(cluster):
    if cluster.b2 is None:
        pytest.skip(cluster.replica_skip)
    before = [model_stats(s, "llm")["requests_in"] for s in cluster.llm_servers()]
    sp = {"max_tokens": 8, "temperature": 0, "routing_threshold": 0.0}
    with cf.ThreadPoolExecutor(4) as ex:
        outs = list(ex.map(lambda i: generate(cluster.a, f"Count to {i + 3}.", sp, chat=True), range(8)))
    assert all(o["_status"] == 200 and o["routing_summary"]["tokens_by_model"]["llm"] > 0 for o in outs), outs
    after = [model_stats(s, "llm")["requests_in"] for s in cluster.llm_servers()]
    assert all(a > b for a, b in zip(after, before)), (before, after)
    _kv_zero(cluster)


def test_llm_server_killed_then_back(cluster):
    """Kill every llm server: requests fail naming llm, readiness says not ready; a new B brings it back."""
    s = {"max_tokens": 400, "temperature": 0, "ignore_eos": True, "routing_threshold": 0.0}
    q: "queue.Queue" = queue.Queue()
    c = grpcclient.InferenceServerClient(cluster.a.grpc_url)
    c.start_stream(callback=lambda result, error: q.put((result, error)))
    c.async_stream_infer("token_router", router_inputs("Tell me a long story about a dragon.", s, True))
    result, error = q.get(timeout=180)
    assert error is None, error
    if cluster.b2 is not None:  # one replica left: new requests go on on it
        _kill_server(cluster.b2)
        cluster.b2 = None
        deadline = time.monotonic() + 60
        while not (probe := admin.router_ready(cluster.a.grpc_url))["ready"]:
            assert time.monotonic() < deadline, probe
            time.sleep(0.5)
    _kill_server(cluster.b)
    error = None
    deadline = time.monotonic() + 120  # far below peer_timeout_s (600 s): found by the heartbeats
    while error is None:
        result, error = q.get(timeout=max(1.0, deadline - time.monotonic()))
    c.stop_stream()
    c.close()
    assert "llm" in str(error) and "down" in str(error), error
    # once the heartbeats have found B gone, the readiness probe and new requests say why
    deadline = time.monotonic() + 120
    while (probe := admin.router_ready(cluster.a.grpc_url))["ready"]:
        assert time.monotonic() < deadline, probe
        time.sleep(0.5)
    assert "llm" in probe["reason"] and "down" in probe["reason"], probe
    r = generate(cluster.a, PROMPTS[0], GREEDY)
    assert r["_status"] != 200 and "llm" in r.get("error", "") and "not ready" in r["error"], r
    st = wait_kv_released(cluster.a, ["slm"], timeout=60)
    assert st["slm"]["kv_tokens_in_use"] == 0, st
    # a new server B on the same port: the router finds it by its heartbeat answers
    cluster.b = cluster.start_b("b_again", cluster.ports[0])
    deadline = time.monotonic() + 120
    while not (probe := admin.router_ready(cluster.a.grpc_url))["ready"]:
        assert time.monotonic() < deadline, probe
        time.sleep(0.5)
    back = generate(cluster.a, PROMPTS[0], GREEDY, chat=True)
    assert back["_status"] == 200 and back["routing_summary"]["tokens_by_model"]["llm"] > 0, back
    _kv_zero(cluster)
