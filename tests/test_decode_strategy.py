"""The decode loop's strategies: when a model steps (own pace with delayed batching, or lock-step turns).

The policy checks need no engine; the last test runs a real :class:`Subserver` on the session's
in-process SGLang engine, in lock-step with the test as the ring's other member.
"""

from __future__ import annotations

import collections
import queue
import time
from types import SimpleNamespace

import pytest

from tokenrouter.engine.lockstep import LockStep, TurnRing
from tokenrouter.engine.config import SubserverConfig
from tokenrouter.engine.strategy import Autonomous


def _holder(ready: int, held: int, *, b: int = 4, max_wait_s: float = 30.0, ready_since: float = 0.0):
    """What a strategy reads of a subserver: its ready and held requests and its settings."""
    rs = collections.OrderedDict((f"r{i}", SimpleNamespace(ready_since=ready_since)) for i in range(ready))
    return SimpleNamespace(ready=rs, requests={f"r{i}": None for i in range(held)},
                           config=SubserverConfig(delayed_batch_size=b, max_wait_s=max_wait_s), _wait_deadline={})


def test_autonomous_steps_when_b_requests_are_ready_or_every_held_one_is():
    a, steps = Autonomous(), []
    now = time.perf_counter()
    for ready, held, due in [(4, 9, True),    # B_i = 4 ready
                             (3, 3, True),    # all it holds are ready: nobody can come back
                             (3, 9, False),   # 6 pending at a peer: wait for them (up to max_wait_s)
                             (0, 0, False)]:  # nothing ready
        h = _holder(ready, held, ready_since=now)
        before = len(steps)
        a.run(h, lambda: steps.append((ready, held)))
        assert (len(steps) == before + 1) is due, (ready, held)
        assert (a.wait_timeout(h) == 0.0) is due, (ready, held)
    assert a.wait_timeout(_holder(0, 0)) is None  # nothing to do: block until a message comes
    h = _holder(0, 1)
    h._wait_deadline["q"] = 1.0  # a request waits for KV: its queue deadline is checked
    assert a.wait_timeout(h) == 0.5


def test_autonomous_bounds_the_delayed_batching_wait():
    a, steps = Autonomous(), []
    fresh = _holder(1, 5, max_wait_s=30.0, ready_since=time.perf_counter())
    assert 0.0 < a.wait_timeout(fresh) <= 30.0
    a.run(fresh, lambda: steps.append("fresh"))
    old = _holder(1, 5, max_wait_s=0.01, ready_since=time.perf_counter() - 1.0)  # waited past max_wait_s
    assert a.wait_timeout(old) == 0.0
    a.run(old, lambda: steps.append("old"))
    assert steps == ["old"]


def test_lockstep_members_step_in_turn(tmp_path):
    path = str(tmp_path / "ring")
    members = [LockStep(TurnRing(path, i, 3)) for i in range(3)]
    holders = [_holder(1, 1), _holder(0, 0), _holder(2, 2)]  # member 1 has nothing ready
    steps = []
    ring = members[0].ring
    while ring.turn() < 6:  # two global steps (six turns)
        for i in (2, 1, 0):  # polled out of ring order: only the member holding the turn acts
            if ring.turn() < 6:
                members[i].run(holders[i], lambda i=i: steps.append(i))
    assert steps == [0, 2, 0, 2]  # member 1 passed its turns at once, without a step
    assert members[0].ring.turn() == 6 and members[0].ring.mine()
    assert all(m.wait_timeout(h) > 0 for m, h in zip(members, holders))  # they poll the ring
    with pytest.raises(ValueError, match="outside a ring"):
        TurnRing(path, 3, 3)


@pytest.mark.slow  # an SGLang engine in the test process
def test_subserver_in_lockstep_waits_for_its_turn(tmp_path, smollm2_engine):
    from tokenrouter.algorithms import configure
    from tokenrouter.engine.subserver import Subserver
    from tokenrouter.protocol import PeerReq

    path = str(tmp_path / "ring")
    me = TurnRing(path, 1, 2)  # the test is member 1; the subserver member 0
    sub = Subserver(smollm2_engine, "m", SubserverConfig(lockstep=TurnRing(path, 0, 2)),
                    configure_algorithm=configure)
    events: "queue.Queue" = queue.Queue()

    def wait_turn():
        end = time.monotonic() + 120
        while not me.mine():
            assert time.monotonic() < end, "the subserver never passed the turn"
            time.sleep(0.001)

    try:
        wait_turn()  # nothing ready: it passed its first turn without a step
        assert sub.stats()["steps"] == 0
        prompt = smollm2_engine.tokenizer.encode("The capital of France is")
        sub.submit(PeerReq(rid="a", tokens=prompt, max_tokens=3, algorithm="none", models=["m", "peer"],
                           sampling={"temperature": 0}), lambda kind, toks, info: events.put((kind, toks)))
        s = sub.stats()  # answered after the submit was received: the request is ready, not run
        assert (s["steps"], s["ready"], s["active"]) == (0, 1, 1)
        for n in (1, 2):  # each turn given: exactly one step (the prefill, then one decode step)
            me.pass_turn()
            wait_turn()
            assert sub.stats()["steps"] == n
            assert events.get(timeout=5)[0] == "tokens"
        assert events.empty()
        sub.reconfigure(lockstep=None)  # own pace: it finishes without the ring
        kind, toks = events.get(timeout=120)
        assert kind == "finished" and len(toks) == 1, (kind, toks)
        s = sub.stats()
        assert s["steps"] == 3 and s["active"] == 0 and s["kv_tokens_in_use"] == 0, s
    finally:
        sub.stop()
        smollm2_engine.flush_prefix_cache()
