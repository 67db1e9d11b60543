"""The open segments and down marks both router-side transports keep (no server needed)."""

from __future__ import annotations

import threading
import time

import pytest

from tokenrouter.protocol import Failed, Handoff, Tokens
from tokenrouter.routing.segments import (TICK, DownMarks, PeerChannelError, PeerDown, PeerDownError, RequestRefused,
                                          Segments)

HANDOFF = Handoff(to="slm", to_index=0, peer_req="{}", committed=True)


def test_next_ticks_then_stalls():
    segs = Segments(tick_s=0.02, stall_timeout_s=0.15)
    seg, q = segs.open("llm")
    deadline = segs.deadline()
    t0 = time.monotonic()
    assert segs.next("llm", q, deadline) is None  # a tick: nothing came
    assert time.monotonic() - t0 >= 0.015
    with pytest.raises(PeerChannelError, match="model llm sent nothing"):
        while True:
            segs.next("llm", q, deadline)
    assert time.monotonic() - t0 >= 0.15


def test_no_stall_timeout_waits_forever():
    segs = Segments(tick_s=0.01, stall_timeout_s=0)
    _, q = segs.open("llm")
    deadline = segs.deadline()
    for _ in range(5):
        assert segs.next("llm", q, deadline) is None


def test_put_reaches_open_segments_only():
    segs = Segments(tick_s=0.01, stall_timeout_s=1)
    seg, q = segs.open("slm")
    assert segs.put(seg, ([7], Tokens()))
    assert segs.next("slm", q, segs.deadline()) == ([7], Tokens())
    segs.close(seg)
    assert not segs.put(seg, ([8], Tokens()))  # a late response is dropped
    assert q.empty()


def test_fail_ends_one_owners_segments():
    segs = Segments(tick_s=0.01, stall_timeout_s=1)
    _, q_llm = segs.open("llm")
    _, q_slm = segs.open("slm")
    segs.fail("model llm is down: gone", owner="llm")
    assert segs.next("llm", q_llm, segs.deadline()) == ([], PeerDown(message="model llm is down: gone"))
    assert segs.next("slm", q_slm, segs.deadline()) is None
    segs.fail("shutting down")  # every owner
    assert segs.next("slm", q_slm, segs.deadline())[1].message == "shutting down"


def test_interrupt_wakes_a_waiting_segment_at_once():
    segs = Segments(tick_s=30.0, stall_timeout_s=0)
    _, q = segs.open("llm")
    woke = []
    waiter = threading.Thread(target=lambda: woke.append(segs.next("llm", q, segs.deadline())))
    waiter.start()
    time.sleep(0.05)
    t0 = time.monotonic()
    segs.interrupt()
    waiter.join(5)
    assert woke == [None] and time.monotonic() - t0 < 5


def test_down_marks_call_on_down_once_per_mark():
    calls = []
    marks = DownMarks(on_down=lambda m, r: calls.append((m, r)))
    assert marks.mark("llm", "model llm is down: first")
    assert not marks.mark("llm", "model llm is down: second")  # already down: no second call
    assert calls == [("llm", "model llm is down: first")]
    assert marks.reason("llm") == "model llm is down: second" and "llm" in marks
    assert marks.snapshot() == {"llm": "model llm is down: second"}
    assert marks.clear("llm") and not marks.clear("llm") and "llm" not in marks
    assert marks.mark("llm", "again") and calls[-1] == ("llm", "again")


def test_a_failing_on_down_is_logged_not_raised(caplog):
    def boom(model, reason):
        raise RuntimeError("callback broke")

    marks = DownMarks(on_down=boom)
    assert marks.mark("slm", "model slm is down")
    assert "on_down(slm) failed" in caplog.text and marks.reason("slm") == "model slm is down"


def test_responses_until_final_seen_by_the_transport():
    segs = Segments(tick_s=0.01, stall_timeout_s=1)
    seg, q = segs.open("llm")
    for item in [([1], Tokens()), ([2], HANDOFF), ([3], Tokens())]:
        q.put(item)
    seen = []
    got = list(segs.responses("llm", seg, q, seen.append))
    assert got == [([1], Tokens()), ([2], HANDOFF)] and seen == [Tokens(), HANDOFF]  # stopped at the final one
    assert not segs.put(seg, ([4], Tokens()))  # and closed the segment


def test_responses_raise_for_down_and_error():
    """A model's refusal of the input is a RequestRefused (the router answers it INVALID_ARG, HTTP 400);
    its other errors a RuntimeError (INTERNAL)."""
    segs = Segments(tick_s=0.01, stall_timeout_s=1)
    for event, exc, text in [(PeerDown(message="model llm is down: x"), PeerDownError, "down: x"),
                             (Failed(message="model llm: bad"), RuntimeError, "bad"),
                             (Failed(message="model llm: top_p must be > 0", refused=True), RequestRefused, "top_p")]:
        seg, q = segs.open("llm")
        q.put(([], event))
        with pytest.raises(exc, match=text) as raised:
            list(segs.responses("llm", seg, q))
        assert isinstance(raised.value, RequestRefused) == (exc is RequestRefused)
        assert not segs.put(seg, ([], Tokens()))


def test_responses_close_the_segment_when_the_caller_stops():
    segs = Segments(tick_s=0.01, stall_timeout_s=0)
    seg, q = segs.open("slm")
    stream = segs.responses("slm", seg, q)
    assert next(stream) == ([], TICK)
    stream.close()  # e.g. the request was cancelled
    assert not segs.put(seg, ([1], Tokens()))
