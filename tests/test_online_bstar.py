"""B* adapted while serving (router parameter ``online_adaptation``), on a real tritonserver.

One server for the module: the repository's models plus ``token_router_online``, a copy
of ``token_router`` with ``online_adaptation: true``, a 1 s interval, a 20 s window and
the SLM's threshold held at 1 (``online_fixed_thresholds``).  Checked:

* the models' ``events`` op (Triton requests and the ZeroMQ channel the router uses)
  returns the routing events after a cursor with the next cursor, and bad input gets
  an error on that request only;
* under load through the adapting router, the thresholds are re-solved
  (``tokenrouter_batch_threshold_solves_total`` > 0), both models have a
  ``tokenrouter_batch_threshold`` gauge, each model's ``stats`` show the B the gauge shows,
  and a threshold set against ``online_fixed_thresholds`` (SLM at 2) is put back to 1;
* a malformed ``online_*`` parameter makes the router fail to load, naming the parameter.
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import requests

from tokenrouter.protocol import EventsQuery
from tokenrouter.routing.peer import PeerClient
from tokenrouter.tools import admin
from tokenrouter.tools.repository import read_config, write_config
from tr_client import generate, metric_values, wait_kv_released
from tr_server import running_server

REPO_ROOT = Path(__file__).resolve().parent.parent
ROUTER = "token_router_online"
MODELS = ("slm", "llm")
#: a mix of SLM and LLM tokens with frequent handoffs (R-Stitch's threshold on the demo pair)
MIXED = {"max_tokens": 32, "temperature": 0, "ignore_eos": True, "routing_threshold": 0.1}
#: bound on the load phase: it ends as soon as the adapter has solved (seconds)
LOAD_LIMIT_S = float(os.environ.get("TOKENROUTER_TEST_ONLINE_LOAD_S", "300"))


def _router_dir(work: Path, name: str, params: dict) -> Path:
    """A copy of the repository's token_router named ``name`` with ``params`` set."""
    dst = work / name
    (dst / "1").mkdir(parents=True)
    cfg = read_config(str(REPO_ROOT / "model_repository" / "token_router" / "config.pbtxt"))
    cfg.name = name
    for k, v in params.items():
        cfg.parameters[k].string_value = v
    write_config(str(dst / "config.pbtxt"), cfg)
    return dst


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    work = tmp_path_factory.mktemp("online")
    online = _router_dir(work, ROUTER, {"online_adaptation": "true", "online_interval_s": "1",
                                        "online_window_s": "20", "online_fixed_thresholds": '{"slm": 1}'})
    with running_server(REPO_ROOT / "model_repository", work, models={ROUTER: online}, copy=True,
                        extra_args=["--model-control-mode=explicit", "--load-model=*"]) as s:
        s.work = work
        yield s


def _zmq_client(server) -> PeerClient:
    """A PeerClient of the test process reaching the models over the channel the router uses."""
    ends = {m: admin.model_op(server.grpc_url, m, "endpoint") for m in MODELS}
    return PeerClient(lambda m: {"endpoint": ends[m]["endpoint"], "pid": ends[m]["pid"],
                                 "start": ends[m]["start"]})


def test_events_op_returns_events_after_a_cursor(server):
    out = generate(server, "Tell me about the moon.", {**MIXED, "max_tokens": 8}, model="token_router")
    assert out["_status"] == 200, out
    for m in MODELS:
        first = admin.events(server.grpc_url, m)
        assert first["kind"] == "events" and first["model"] == m
        assert isinstance(first["cursor"], int) and first["cursor"] == len(first["events"]) > 0, first
        steps = [e for e in first["events"] if e["event"] == "step"]
        assert steps and all(e["model"] == m and e["batch_size"] >= 1 and e["latency_s"] > 0
                             and isinstance(e["t"], float) for e in steps), first["events"][:3]
        assert first["delayed_batch_size"] >= 1 and first["delayed_batch_max_wait_us"] >= 0
        # from the cursor on: nothing new yet; one at a time: the cursor moves by one
        assert admin.events(server.grpc_url, m, since=first["cursor"])["events"] == []
        one = admin.events(server.grpc_url, m, since=0, limit=1)
        assert one["events"] == first["events"][:1] and one["cursor"] == 1
        # a cursor beyond this model's events (an earlier process of it): read from the start
        again = admin.events(server.grpc_url, m, since=first["cursor"] + 10**6)
        assert again["reset"] is True and again["events"][:1] == first["events"][:1]


@pytest.mark.parametrize("bad,needle", [
    ({"since": -1}, "since must be an integer cursor >= 0"),
    ({"since": "0"}, "since must be an integer cursor >= 0"),
    ({"since": 0, "limit": 0}, "limit must be an integer in 1..5000"),
    ({"from": 0}, "unknown events keys ['from']"),
])
def test_events_op_bad_input_is_an_error_on_that_request(server, bad, needle):
    with pytest.raises(RuntimeError) as err:
        admin.model_op(server.grpc_url, "llm", "events", bad)
    assert needle in str(err.value)
    client = _zmq_client(server)
    try:
        with pytest.raises(RuntimeError) as err:
            client.call("slm", EventsQuery(args=bad), timeout_s=30)
        assert needle in str(err.value)
        ok = client.call("slm", EventsQuery(args={"since": 0, "limit": 2}), timeout_s=30)  # the channel still answers
        assert ok["cursor"] <= 2 and len(ok["events"]) == ok["cursor"]
    finally:
        client.close()
    assert admin.model_stats(server.grpc_url, "llm")["active"] == 0


def _metric(server, name: str) -> dict:
    """{(label tuple): value} of one metric on the server's metrics endpoint."""
    import re

    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    out = {}
    for m in re.finditer(r'^' + re.escape(name) + r'\{([^}]*)\}\s+([0-9.eE+-]+)$', text, re.M):
        out[tuple(sorted(re.findall(r'(\w+)="([^"]*)"', m.group(1))))] = float(m.group(2))
    return out


class _Load:
    """``n`` client threads sending MIXED requests to ``model`` back to back until stopped."""

    def __init__(self, server, model: str, n: int):
        self.server, self.model = server, model
        self.stop, self.done, self.errors = threading.Event(), 0, []
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(n)]
        for t in self.threads:
            t.start()

    def _client(self, i: int) -> None:
        prompts = ["Write a poem about the sea.", "Explain how rain forms.", "List three uses of copper.",
                   "Describe a busy market."]
        while not self.stop.is_set():
            out = generate(self.server, prompts[i % len(prompts)], MIXED, model=self.model, trace=False)
            with self._lock:
                if out["_status"] != 200:
                    self.errors.append(out)
                self.done += 1

    def join(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=600)


def test_thresholds_adapted_under_load(server):
    url = server.grpc_url
    # against online_fixed_thresholds {"slm": 1}: the adapter must put the SLM back to 1
    admin.configure(url, "slm", delayed_batch_size=2, delayed_batch_max_wait_us=5000)
    assert admin.model_stats(url, "slm")["delayed_batch_size"] == 2
    load = _Load(server, ROUTER, 12)
    try:
        deadline = time.monotonic() + LOAD_LIMIT_S
        while time.monotonic() < deadline:
            solves = _metric(server, "tokenrouter_batch_threshold_solves_total")
            gauges = metric_values(server, "tokenrouter_batch_threshold")
            if sum(solves.values()) > 0 and gauges.get("slm") == 1:
                break
            time.sleep(1)
    finally:
        load.join()
    assert not load.errors, load.errors[:2]
    assert load.done > 0
    solves = _metric(server, "tokenrouter_batch_threshold_solves_total")
    assert solves.get((("router", ROUTER),), 0) > 0, solves
    assert _metric(server, "tokenrouter_batch_threshold_changes_total").get((("router", ROUTER),), 0) >= 1
    thresholds = _metric(server, "tokenrouter_batch_threshold")
    assert {dict(k)["model"] for k in thresholds} == set(MODELS), thresholds
    assert all(dict(k)["router"] == ROUTER for k in thresholds)
    # the router is idle now, so the thresholds stay; the gauges show what the models use
    # (the last round may still be publishing: read until two reads agree)
    for _ in range(30):
        g1 = metric_values(server, "tokenrouter_batch_threshold")
        st = {m: admin.model_stats(url, m) for m in MODELS}
        g2 = metric_values(server, "tokenrouter_batch_threshold")
        if g1 == g2 and all(st[m]["delayed_batch_size"] == g2[m] for m in MODELS):
            break
        time.sleep(1)
    assert all(st[m]["delayed_batch_size"] == g2[m] for m in MODELS), (st, g2)
    assert st["slm"]["delayed_batch_size"] == 1  # the fixed threshold
    assert st["llm"]["delayed_batch_size"] >= 1
    pred = _metric(server, "tokenrouter_batch_threshold_predicted_tokens_per_s")
    assert pred.get((("router", ROUTER),), 0) > 0, pred
    wait_kv_released(server)


def test_malformed_online_parameter_fails_the_router_load(server):
    bad = _router_dir(Path(server.model_repository), "token_router_online_bad",
                      {"online_adaptation": "true", "online_interval_s": "0"})
    assert bad.is_dir()
    r = requests.post(f"http://{server.http_url}/v2/repository/models/token_router_online_bad/load", timeout=600)
    assert r.status_code != 200
    assert "online_interval_s" in json.dumps(r.json()), r.text
    # the serving routers are untouched
    assert generate(server, "Hi", {**MIXED, "max_tokens": 2}, model=ROUTER)["_status"] == 200
