"""The ZeroMQ inter-model channel on its own (host-side, no tritonserver, no model).

The channel (:class:`PeerServer` / :class:`PeerClient`, sockets, CURVE, heartbeats,
replica choice) is the real one; the subserver behind each :class:`PeerServer` is
:class:`_EchoSubserver`, which answers a ``run`` at once, so these checks take
seconds.  Served end to end by real tritonservers in tests/test_remote.py.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import zmq

from tokenrouter.engine.op_dispatch import OpDispatcher
from tokenrouter.routing.curve import CurveClient, CurveServer, CurveSettings, curve_enabled, make_keys
from tokenrouter.routing.peer import PeerClient, PeerDownError, PeerServer, parse_remote_models
from tokenrouter.routing.segments import Tick
from tokenrouter.protocol import Finished, Handoff, PeerReq, Ping, Stats


class _EchoSubserver:
    """Answers ``run`` with two chunks and a final ``finished`` (or ``handoff`` when the request's
    params say so, keeping its state), counts what it holds; what a Subserver offers the channel."""

    def __init__(self, name: str = "llm"):
        self.name = name
        self.held: set = set()
        self.lock = threading.Lock()

    def submit(self, pr: PeerReq, sink) -> None:
        with self.lock:
            self.held.add(pr.rid)

        def run():
            if pr.params.get("silent"):  # holds the request and answers nothing
                return
            sink("tokens", [1, 2], {})
            if pr.params.get("handoff"):
                sink("handoff", [3], {"to": "llm", "to_index": 0, "peer_req": "{}", "committed": True})
            else:
                with self.lock:
                    self.held.discard(pr.rid)
                sink("finished", [3], {"finish_reason": "length"})

        threading.Thread(target=run, daemon=True).start()

    def release(self, rid: str) -> None:
        with self.lock:
            self.held.discard(rid)

    def stats(self):
        time.sleep(getattr(self, "stats_delay_s", 0.0))
        with self.lock:
            return {"held": sorted(self.held)}

    def reconfigure(self, **_):
        pass


def _req(rid: str, tokens=(1,), **params) -> PeerReq:
    return PeerReq(rid=rid, tokens=list(tokens), models=["llm"], params=params)


def _wait(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


@pytest.fixture
def keys(tmp_path):
    return make_keys(str(tmp_path / "keys"))


def _tcp_server(keys, endpoint="tcp://127.0.0.1:*"):
    return PeerServer(OpDispatcher(_EchoSubserver()), endpoint, curve=CurveServer(keys["server_secret"], keys["authorized_keys_dir"]))


def test_ipc_round_trip():
    sub = _EchoSubserver()
    server = PeerServer(OpDispatcher(sub))
    client = PeerClient(lambda m: server.endpoint)
    try:
        out = [(ids, ev) for ids, ev in client.segment("llm", _req("r1", [5, 6])) if not isinstance(ev, Tick)]
        assert [ids for ids, _ in out] == [[1, 2], [3]] and isinstance(out[-1][1], Finished)  # ticks: a slow host
        assert client.call("llm", Ping())["instance"] == server.instance
        assert client.call("llm", Stats()) == {"held": []}
    finally:
        client.close()
        server.close()


def test_interrupt_wakes_a_waiting_segment_at_once():
    """With a long tick, a request waiting on a silent model sees a tick only when woken."""
    server = PeerServer(OpDispatcher(_EchoSubserver()))
    client = PeerClient(lambda m: server.endpoint, tick_s=60.0)
    events, first = [], threading.Event()

    def waiting():
        for ids, ev in client.segment("llm", _req("r1", [5], silent=True)):
            events.append((time.monotonic(), ev))
            first.set()
            return

    t = threading.Thread(target=waiting, daemon=True)
    try:
        t.start()
        _wait(lambda: server.subserver.held == {"r1"})
        assert not first.wait(0.5), "a tick came before the interrupt"
        t0 = time.monotonic()
        client.interrupt()
        assert first.wait(5), "interrupt() did not wake the segment"
        assert isinstance(events[0][1], Tick) and events[0][0] - t0 < 2.0
        t.join(5)
        # a call() waiting for its answer ignores the wake-up meant for the segments
        server.subserver.stats_delay_s = 1.0
        answer = {}
        c = threading.Thread(target=lambda: answer.update(client.call("llm", Stats())), daemon=True)
        c.start()
        time.sleep(0.3)
        client.interrupt()
        c.join(10)
        assert answer == {"held": ["r1"]}
    finally:
        client.close()
        server.close()


def test_tcp_curve_replicas_keep_each_request_on_its_replica(keys):
    servers = [_tcp_server(keys), _tcp_server(keys)]
    client = PeerClient(lambda m: None, remote={"llm": [s.endpoint for s in servers]},
                        curve=CurveClient(keys["router_secret"], keys["server_public"]))
    try:
        assert client.wait_connected(10) == []
        for i in range(4):  # each keeps its state on the replica it went to (a handoff)
            assert isinstance(list(client.segment("llm", _req(f"h{i}", [1], handoff=True)))[-1][1], Handoff)
        held = [s.subserver.stats()["held"] for s in servers]
        assert sorted(held[0] + held[1]) == ["h0", "h1", "h2", "h3"] and len(held[0]) == 2, held
        # the next segment of h0 goes where h0's state is, and so does its release
        home = 0 if "h0" in held[0] else 1
        list(client.segment("llm", _req("h0", [4], handoff=True)))
        assert "h0" in servers[home].subserver.stats()["held"]
        for i in range(4):
            client.release("llm", f"h{i}")
        _wait(lambda: all(not s.subserver.stats()["held"] for s in servers))
    finally:
        client.close()
        for s in servers:
            s.close()


def test_wrong_key_gets_nothing(keys):
    server = _tcp_server(keys)
    ctx = zmq.Context()
    try:
        for keyed in (True, False):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            if keyed:
                sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
                sock.curve_serverkey = CurveClient(keys["router_secret"], keys["server_public"]).server_key("llm")
            sock.connect(server.endpoint)
            sock.send_multipart([json.dumps({"op": "ping", "seg": 1}).encode(), b""])
            assert sock.poll(1000) == 0
            sock.close(0)
        assert server._handshakes.refused >= 2  # both attempts were seen and refused
        client = PeerClient(lambda m: None, remote={"llm": [server.endpoint]},
                            curve=CurveClient(keys["router_secret"], keys["server_public"]))
        try:
            assert isinstance(list(client.segment("llm", _req("ok", [1])))[-1][1], Finished)
        finally:
            client.close()
    finally:
        ctx.term()
        server.close()


def test_replica_down_by_heartbeat_and_back(keys):
    servers = [_tcp_server(keys), _tcp_server(keys)]
    downs, ups = [], []
    client = PeerClient(lambda m: None, remote={"llm": [s.endpoint for s in servers]},
                        curve=CurveClient(keys["router_secret"], keys["server_public"]),
                        heartbeat_s=0.1, heartbeat_timeout_s=0.6,
                        on_down=lambda m, r: downs.append(m), on_up=ups.append)
    try:
        assert client.wait_connected(10) == []
        endpoint = servers[0].endpoint
        servers[0].close()
        _wait(lambda: not client.replicas("llm")[0]["up"])
        assert not client.is_down("llm") and downs == []  # one replica left: the model is up
        for i in range(3):  # new requests go to the live replica
            assert isinstance(list(client.segment("llm", _req(f"n{i}", [1])))[-1][1], Finished)
        servers[1].close()
        _wait(lambda: downs == ["llm"])  # on_down runs just after the mark
        assert client.is_down("llm") and "llm" in client.down()["llm"]
        with pytest.raises(PeerDownError) as e:
            list(client.segment("llm", _req("x", [1])))
        assert e.value.model == "llm"
        servers[0] = _tcp_server(keys, endpoint)  # a new process on the same endpoint
        _wait(lambda: ups == ["llm"])
        assert not client.is_down("llm")
        assert isinstance(list(client.segment("llm", _req("y", [1])))[-1][1], Finished)
    finally:
        client.close()
        for s in servers:
            s.close()


def test_parse_remote_models():
    assert parse_remote_models("") == {}
    assert parse_remote_models('{"llm": "tcp://h:1"}') == {"llm": ["tcp://h:1"]}
    assert parse_remote_models('{"llm": ["tcp://a:1", "tcp://b:1"]}') == {"llm": ["tcp://a:1", "tcp://b:1"]}
    for bad in ('["tcp://h:1"]', '{"llm": []}', '{"llm": "h:1"}', '{"llm": ["tcp://a:1", "tcp://a:1"]}', "{"):
        with pytest.raises(ValueError):
            parse_remote_models(bad)


def test_curve_settings_are_required_on_tcp(keys):
    with pytest.raises(ValueError, match="curve_secret_key_file"):
        CurveServer.from_settings(CurveSettings(), "tcp://0.0.0.0:5555", "llm")
    assert CurveServer.from_settings(CurveSettings(enabled=False), "tcp://0.0.0.0:5555", "llm") is None
    assert CurveServer.from_settings(CurveSettings(), "ipc:///tmp/x", "llm") is None
    with pytest.raises(ValueError, match="curve_server_public_keys"):
        CurveClient.from_settings(CurveSettings(secret_key_file=keys["router_secret"]), {"llm": ["tcp://h:1"]})
    with pytest.raises(ValueError, match="no key for model"):
        CurveClient.from_settings(CurveSettings(secret_key_file=keys["router_secret"],
                                                server_public_keys=json.dumps({"slm": keys["server_public"]})),
                                  {"llm": ["tcp://h:1"]})
    assert curve_enabled("") and curve_enabled("On") and not curve_enabled("off")
    with pytest.raises(ValueError, match="on or off"):
        curve_enabled("maybe")


def test_drive_visits_no_model_for_a_request_already_cancelled():
    """A request cancelled before its worker starts (it waited in the pool) sends nothing to a model."""
    from tokenrouter.routing.router_core import drive

    class NoModels:
        def segment(self, *a):
            raise AssertionError("a model was visited")

        def release(self, *a):
            raise AssertionError("nothing to release")

    r = drive(NoModels(), PeerReq(rid="r1", models=["slm", "llm"]), [1, 2, 3], 0, detok=None,
              cancelled=lambda: True)
    assert r.finish == "cancelled" and r.tokens == [1, 2, 3] and r.handoffs == 0
