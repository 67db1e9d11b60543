"""The typed messages between processes (no server, no model): the codec of ops and events, the
model-side dispatcher both transports use, and ``drive``'s bookkeeping over the real ZeroMQ
channel, with a scripted subserver behind it (served end to end by tests/test_transport.py)."""

from __future__ import annotations

import threading
import time

import msgspec
import numpy as np
import pytest

from tokenrouter.engine.op_dispatch import OpDispatcher
from tokenrouter.protocol import (OPS, Answer, Calibrate, Cancelled, Configure, Endpoint, EventsQuery, Failed,
                                  Finished, Flush, Handoff, OpWire, PeerReq, Ping, Release, Run, SpecRound, Stats,
                                  TokenLogprobs, Tokens, decode_event, decode_op, encode_event, encode_op, is_final)
from tokenrouter.routing.peer import PeerClient, PeerServer
from tokenrouter.routing.router_core import drive


def test_every_op_survives_its_wire_values():
    pr = PeerReq(rid="r1", tokens=[5, 6, 7], max_tokens=9, models=["slm", "llm"], params={"tau": 0.1}, resume=True)
    ops = [Run(peer_req=pr), Release(rid="r1"), Ping(), Stats(), Flush(), Endpoint(),
           Configure(args={"delayed_batch_size": 2}), EventsQuery(args={"since": 3}), Calibrate(args={"context": 8})]
    assert sorted(op.name for op in ops) == sorted(OPS)
    for op in ops:
        assert decode_op(*encode_op(op)) == op
    assert encode_op(Run(peer_req=pr)) == OpWire("run", "r1", pr.header_json(), [5, 6, 7])
    # the Triton interface's conventions: an empty op is run, the request id wins over the header's
    assert decode_op("", "r9", pr.header_json(), [1]).peer_req.rid == "r9"


@pytest.mark.parametrize("wire,needle", [
    (OpWire("bogus"), "unknown op 'bogus'"),
    (OpWire("run", "", "{}"), "request_id is required"),
    (OpWire("release"), "request_id is required"),
    (OpWire("run", "r1", '{"rid": "r1", "colour": 1}'), "unknown peer_req fields"),
    (OpWire("run", "r1", "{"), "peer_req is not JSON"),
    (OpWire("configure", "", "{"), "configure: peer_req is not JSON"),
])
def test_bad_op_wire_values_are_refused(wire, needle):
    with pytest.raises(ValueError, match=needle):
        decode_op(*wire)


def test_events_keep_their_json_shape():
    hdr = PeerReq(rid="r1", models=["slm", "llm"]).header_json()
    events = [Tokens(scores=[0.5, None], first_step_t=12.25),
              Tokens(scores=[0.1], logprobs=[-0.5], spec=SpecRound(drafted=4, accepted=2, drafter=0),
                     top_logprobs=[TokenLogprobs(rank=3, ids=[7, 2], logprobs=[-0.25, -0.375])]),
              Handoff(to="llm", to_index=1, peer_req=hdr, committed=True, scores=[0.9]),
              Finished(finish_reason="length", num_generated=16, scores=[]),
              Cancelled(message="released by the router", finish_reason="cancelled"),
              Failed(message="model slm: bad"),
              Answer("stats", {"kv_tokens_in_use": 0, "active": 0}), Answer("released")]
    for ev in events:
        assert decode_event(encode_event(ev)) == ev
    # the JSON a client of the model's Triton interface reads: unset fields are absent, answers flat
    assert msgspec.json.decode(encode_event(events[0])) == {"kind": "tokens", "scores": [0.5, None],
                                                            "first_step_t": 12.25}
    assert msgspec.json.decode(encode_event(events[1]))["top_logprobs"] == [[3, [7, 2], [-0.25, -0.375]]]
    assert msgspec.json.decode(encode_event(events[6])) == {"kind": "stats", "kv_tokens_in_use": 0, "active": 0}
    # a step's numpy scalars encode as numbers
    assert decode_event(encode_event(Tokens(scores=[np.float32(0.25), np.float64(0.5)]))).scores == [0.25, 0.5]
    assert [is_final(ev) for ev in events] == [False, False] + [True] * 6
    assert events[2].header() == PeerReq.from_wire(hdr, [])
    for bad in (b"[1]", b'{"kind": "finished"}', b'{"scores": []}', b"{"):
        with pytest.raises(ValueError):
            decode_event(bad)


class _ScriptedSubserver:
    """Answers each ``run`` with the sink calls its script gives for that model; what a Subserver
    offers the dispatcher.  ``script(pr)`` returns ``[(kind, tokens, info), ...]``."""

    def __init__(self, name: str, script):
        self.name, self.script = name, script
        self.released, self.submitted, self.groups = [], [], 0
        self.configured = []

    def submit(self, pr, sink) -> None:
        self.submitted.append(pr)
        steps = self.script(pr)
        threading.Thread(target=lambda: [sink(k, t, i) for k, t, i in steps], daemon=True).start()

    def submit_group(self, items) -> None:
        self.groups += 1
        for pr, sink in items:
            self.submit(pr, sink)

    def release(self, rid: str) -> None:
        self.released.append(rid)

    def stats(self):
        return {"released": list(self.released)}

    def reconfigure(self, **changes):
        self.configured.append(changes)


def _wait(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def _replies():
    got = []
    return got, lambda ev, toks=(): got.append((ev, list(toks)))


def test_dispatcher_answers_each_op_on_its_own_reply():
    sub = _ScriptedSubserver("slm", lambda pr: [("tokens", [1], {"scores": [0.5]}),
                                                ("finished", [2], {"finish_reason": "stop", "num_generated": 2})])
    d = OpDispatcher(sub)
    pr = PeerReq(rid="a", tokens=[9], models=["slm"])
    run_got, run_reply = _replies()
    stats_got, stats_reply = _replies()
    bad_got, bad_reply = _replies()
    conf_got, conf_reply = _replies()
    d.handle([(encode_op(Run(peer_req=pr)), run_reply), (encode_op(Stats()), stats_reply),
              (OpWire("events"), bad_reply), (encode_op(Configure(args={"delayed_batch_size": 3})), conf_reply)])
    assert stats_got == [(Answer("stats", {"released": []}), [])]
    # no events hook: op events is not served; the other ops of the batch are unharmed
    assert len(bad_got) == 1 and isinstance(bad_got[0][0], Failed)
    assert bad_got[0][0].message.startswith("model slm: unknown op 'events'")
    assert conf_got == [(Answer("configured"), [])] and sub.configured == [{"delayed_batch_size": 3}]
    _wait(lambda: len(run_got) == 2)
    assert run_got == [(Tokens(scores=[0.5]), [1]), (Finished(finish_reason="stop", num_generated=2), [2])]
    pong = []
    d.handle([(encode_op(Ping()), lambda ev, toks=(): pong.append(ev))])
    assert pong[0].kind == "pong" and pong[0].result["instance"] == d.instance and pong[0].result["model"] == "slm"


def test_dispatcher_groups_runs_and_keeps_a_release_after_its_run():
    sub = _ScriptedSubserver("slm", lambda pr: [])
    d = OpDispatcher(sub)
    reqs = [PeerReq(rid=r, tokens=[1], models=["slm"]) for r in ("a", "b", "c")]
    got, reply = _replies()
    d.handle([(encode_op(Run(peer_req=reqs[0])), reply), (encode_op(Run(peer_req=reqs[1])), reply),
              (encode_op(Release(rid="b")), reply), (encode_op(Run(peer_req=reqs[2])), reply)])
    # a and b entered together, before b's release; c after it
    assert [pr.rid for pr in sub.submitted] == ["a", "b", "c"] and sub.groups == 1
    assert sub.released == ["b"] and got == [(Answer("released"), [])]


def test_drive_books_tokens_writers_and_handoffs_over_the_channel():
    """slm writes 2 tokens and hands off; llm verifies 3 drafts (2 kept) and writes its own, hands
    back; slm finishes.  The RoutedRequest's trace, counts, scores and logs follow the events."""
    def slm(pr):
        if not pr.resume:
            nxt = PeerReq(rid=pr.rid, models=pr.models, num_generated=2).header_json()
            return [("tokens", [10], {"scores": [0.1], "first_step_t": 5.0}),
                    ("handoff", [11], {"to": "llm", "to_index": 1, "peer_req": nxt, "committed": True,
                                       "scores": [0.9]})]
        return [("finished", [14], {"finish_reason": "length", "num_generated": 6, "scores": [0.2]})]

    def llm(pr):
        back = PeerReq(rid=pr.rid, models=pr.models, num_generated=5).header_json()
        return [("handoff", [12, 13, 20], {"to": "slm", "to_index": 0, "peer_req": back, "committed": True,
                                            "scores": [None, None, 0.3],
                                            "spec": {"drafted": 3, "accepted": 2, "drafter": 0}})]

    subs = {"slm": _ScriptedSubserver("slm", slm), "llm": _ScriptedSubserver("llm", llm)}
    servers = {m: PeerServer(OpDispatcher(s)) for m, s in subs.items()}
    client = PeerClient(lambda m: servers[m].endpoint)

    class Detok:
        stopped = False

        def add(self, ids):
            return "".join(f"<{i}>" for i in ids)

    deltas = []
    try:
        r = drive(client, PeerReq(rid="q1", models=["slm", "llm"]), [1, 2, 3], 0, Detok(), on_delta=lambda d, _r: deltas.append(d))
        _wait(lambda: subs["llm"].released)  # a release does not wait for the model
    finally:
        client.close()
        for s in servers.values():
            s.close()
    assert r.finish == "length" and r.output_ids == [10, 11, 12, 13, 20, 14]
    assert r.trace == [0, 0, 0, 0, 1, 0]  # the two accepted drafts are the slm's
    assert r.tokens_by_model == {"slm": 5, "llm": 1} and r.handoffs == 2
    assert r.pairs == {"slm->llm": 1, "llm->slm": 1}
    assert r.scores == [0.1, 0.9, None, None, 0.3, 0.2] and r.first_step_t == 5.0
    assert r.handoff_log == [{"pos": 2, "from": 0, "to": 1, "committed": True, "score": 0.9},
                             {"pos": 5, "from": 1, "to": 0, "committed": True, "score": 0.3}]
    assert r.spec_rounds == [{"pos": 2, "drafted": 3, "accepted": 2}] and (r.drafted, r.accepted) == (3, 2)
    assert len(r.handoff_gaps_s) == 2 and "".join(deltas) == "<10><11><12><13><20><14>"
    # each visit sent only the suffix the model had not seen; the resume said so
    assert [(p.tokens, p.resume) for p in subs["slm"].submitted] == [([1, 2, 3], False), ([12, 13, 20], True)]
    assert [(p.tokens, p.resume) for p in subs["llm"].submitted] == [([1, 2, 3, 10, 11], False)]
    # the llm still held the request (pending): drive released it there; the slm had finished it
    assert subs["llm"].released == ["q1"] and subs["slm"].released == []
