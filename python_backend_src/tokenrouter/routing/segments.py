"""What both router-side transports share: the :class:`Transport` interface, its ops over
segments (:class:`SegmentTransport`), the open segments' queues and the models' down marks.

A *segment* is one visit of a request to a model (:func:`tokenrouter.routing.router_core.drive`):
the transport opens a queue for it, its receiving side puts the model's responses in,
and the request's worker reads them.  :class:`Segments` holds those queues, wakes or ends
them, and turns a silent queue into ticks and, at the stall timeout, an error.  A call
(``stats``, ``configure``, ...) is a segment with one answer.  :class:`DownMarks` holds
which models are down and why (paper §Design: a request that cannot reach its next model
fails alone; the others go on).

A queue's items are ``(token ids, event)``: the model's events (:mod:`tokenrouter.protocol`)
and the router's own :class:`Tick` and :class:`PeerDown`, or ``None`` (a wake-up).

Used by :class:`tokenrouter.routing.peer.PeerClient` (ZeroMQ) and
:class:`tokenrouter.triton.transport.TritonTransport` (BLS).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from typing import Any, Callable, Dict, Hashable, Iterator, List, Optional, Protocol, Tuple

from ..protocol import Answer, Event, Failed, Op, OpWire, PeerReq, Run, encode_op, is_final

logger = logging.getLogger(__name__)

__all__ = ["Transport", "SegmentTransport", "Segments", "DownMarks", "PeerChannelError", "PeerDownError",
           "RequestRefused",
           "Tick", "PeerDown", "TICK"]


class Tick(Event, tag="tick"):
    """Nothing came for ``tick_s`` seconds (or a wake-up): the reader checks cancellation.  Router only."""


class PeerDown(Event, tag="peer_down", kw_only=True):
    """The model went down while the segment was open (router only; the reader raises
    :class:`PeerDownError`).

    Attributes:
        message: why, naming the model.
    """

    message: str


#: the one tick event
TICK = Tick()


class PeerChannelError(RuntimeError):
    """A model could not be reached or did not answer in time."""


class PeerDownError(PeerChannelError):
    """The model's process is gone (killed, crashed) or the model is marked down.

    Attributes:
        model: name of the model that is down.
    """

    def __init__(self, model: str, message: str):
        super().__init__(message)
        self.model = model


class Transport(Protocol):
    """How the router reaches the models (:func:`~tokenrouter.routing.router_core.drive` needs
    ``segment`` and ``release``).

    Raises (every method): :class:`PeerDownError` (it has a ``model`` attribute) when a model's
    process is gone or the model is marked down.
    """

    def segment(self, model: str, peer_req: PeerReq) -> Iterator[Tuple[List[int], Event]]:
        """One visit of ``peer_req`` (its ``tokens``: the suffix ``model`` has not seen) to ``model``:
        yield ``(committed token ids, event)`` up to a final event (``Handoff``, ``Finished``,
        ``Cancelled``), and ``([], TICK)`` while nothing comes so that cancellation is noticed.

        Raises:
            RuntimeError: the model reported an error (:class:`~tokenrouter.protocol.Failed`).
            PeerChannelError: the model sent nothing for the stall timeout.
        """

    def release(self, model: str, rid: str) -> None:
        """Free ``rid``'s state on ``model`` (ends its running segment there); does not wait."""

    def call(self, model: str, op: Op, timeout_s: float = 60.0) -> Dict[str, Any]:
        """Any other op on ``model``; returns its :class:`~tokenrouter.protocol.Answer`'s fields.

        Raises:
            RuntimeError: the model reported an error.  PeerChannelError: no answer in ``timeout_s`` seconds.
        """


class SegmentTransport:
    """:meth:`segment`, :meth:`call`, :meth:`interrupt` and :meth:`fail_all` of a :class:`Transport`
    whose subclass sends ops (:meth:`_start`); its receiving side puts each response on the
    segment's queue.

    Args:
        tick_s: while waiting, :meth:`segment` yields a :data:`TICK` every ``tick_s`` seconds
            (and at once on :meth:`interrupt`).
        stall_timeout_s: a segment whose model sends nothing this long fails with
            :class:`PeerChannelError` (seconds; 0 = wait forever).
    """

    def __init__(self, tick_s: float, stall_timeout_s: float):
        self._segments = Segments(tick_s, stall_timeout_s)

    @property
    def tick_s(self) -> float:
        """Seconds between two ticks of a waiting :meth:`segment`."""
        return self._segments.tick_s

    @property
    def stall_timeout_s(self) -> float:
        """Seconds of silence after which a segment fails (0 = wait forever)."""
        return self._segments.stall_timeout_s

    def _start(self, model: str, wire: OpWire) -> Tuple[int, "queue.Queue", Optional[Callable[[Event], None]]]:
        """Open a segment for ``wire`` (an op's wire values) on ``model`` and send it.

        Returns:
            the segment id, its queue, and an optional callable that sees each response
            before the reader (e.g. to note that the request's state there is gone).

        Raises:
            PeerDownError: the model is down.
        """
        raise NotImplementedError

    def segment(self, model: str, peer_req: PeerReq) -> Iterator[Tuple[List[int], Event]]:
        """See :meth:`Transport.segment` (the PeerReq is encoded at the first ``next``, on the caller's thread)."""
        seg, q, seen = self._start(model, encode_op(Run(peer_req=peer_req)))
        yield from self._segments.responses(model, seg, q, seen)

    def call(self, model: str, op: Op, timeout_s: float = 60.0) -> Dict[str, Any]:
        """See :meth:`Transport.call`; a wake-up from :meth:`interrupt` is ignored.

        Raises:
            PeerDownError: the model is down, or went down before it answered.
            RuntimeError: the model reported an error.
            PeerChannelError: no answer within ``timeout_s`` seconds.
        """
        seg, q, _ = self._start(model, encode_op(op))
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    item = q.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    raise PeerChannelError(f"model {model} did not answer {op.name!r} in {timeout_s:.0f} s") from None
                if item is None:  # an interrupt() meant for the waiting segments
                    continue
                _toks, ev = item
                _raise_for(model, ev)
                if isinstance(ev, Answer):
                    return ev.result
                raise RuntimeError(f"model {model} answered {op.name!r} with {type(ev).__name__}")
        finally:
            self._segments.close(seg)

    def interrupt(self) -> None:
        """Wake every segment waiting for a response: each yields one tick now.

        For a caller whose ``tick_s`` is long: when one of its requests is cancelled it
        calls this instead of having every waiting request poll.  A :meth:`call` waiting
        for its answer ignores the wake-up.
        """
        self._segments.interrupt()

    def fail_all(self, message: str) -> None:
        """End every open segment with :class:`PeerDownError` ``message`` (used at shutdown)."""
        self._segments.fail(message)


class RequestRefused(ValueError):
    """A model refused the request's input (:attr:`~tokenrouter.protocol.Failed.refused`): the client's
    error; the message is the model's."""


def _raise_for(model: str, ev: Event) -> None:
    """Raise for a :class:`PeerDown` (:class:`PeerDownError`) or a :class:`~tokenrouter.protocol.Failed`
    (:class:`RequestRefused` where the model refused the input, else RuntimeError; the model's message)."""
    if isinstance(ev, PeerDown):
        raise PeerDownError(model, ev.message or f"model {model} is down")
    if isinstance(ev, Failed):
        raise (RequestRefused if ev.refused else RuntimeError)(ev.message or f"model {model}: error")


class Segments:
    """The open segments of one transport: ``seg id → (owner, response queue)``.

    A queue receives ``(token ids, event)`` items, or ``None`` from :meth:`interrupt`.
    The owner is what the transport sent the segment to (a model name, or a replica's
    link); :meth:`fail` ends the segments of one owner.

    Args:
        tick_s: seconds :meth:`next` waits before it returns None (a tick: the caller
            checks cancellation).
        stall_timeout_s: seconds without any response after which :meth:`next` raises
            (0 = wait forever).
    """

    def __init__(self, tick_s: float, stall_timeout_s: float):
        self.tick_s = float(tick_s)
        self.stall_timeout_s = float(stall_timeout_s)
        self._lock = threading.Lock()
        self._open: Dict[int, Tuple[Any, "queue.Queue"]] = {}
        self._ids = itertools.count(1)  # 0 is left to the transports (the ZeroMQ heartbeat)

    def open(self, owner: Any) -> Tuple[int, "queue.Queue"]:
        """Register a segment sent to ``owner``; returns its id and its response queue."""
        seg, q = next(self._ids), queue.Queue()
        with self._lock:
            self._open[seg] = (owner, q)
        return seg, q

    def close(self, seg: int) -> None:
        """Forget segment ``seg`` (its later responses are dropped by :meth:`put`)."""
        with self._lock:
            self._open.pop(seg, None)

    def put(self, seg: int, item: Tuple[List[int], Event]) -> bool:
        """Hand a response to segment ``seg``; False when it is no longer open (dropped)."""
        with self._lock:
            entry = self._open.get(seg)
        if entry is None:
            return False
        entry[1].put(item)
        return True

    def deadline(self) -> float:
        """``time.monotonic()`` after which a segment that hears nothing has stalled."""
        return time.monotonic() + self.stall_timeout_s

    def next(self, model: str, q: "queue.Queue", deadline: float) -> Optional[Tuple[List[int], Event]]:
        """The next response on ``q``, or None after ``tick_s`` without one (or at once on :meth:`interrupt`).

        Raises:
            PeerChannelError: nothing came before ``deadline`` (see :meth:`deadline`) and
                ``stall_timeout_s`` is not 0.
        """
        try:
            item = q.get(timeout=self.tick_s)
            if item is not None:
                return item
        except queue.Empty:
            pass
        if self.stall_timeout_s and time.monotonic() > deadline:
            raise PeerChannelError(f"model {model} sent nothing for {self.stall_timeout_s:.0f} s")
        return None

    def responses(self, model: str, seg: int, q: "queue.Queue",
                  seen: Optional[Callable[[Event], None]] = None) -> Iterator[Tuple[List[int], Event]]:
        """Yield segment ``seg``'s responses ``(token ids, event)`` up to and including a final one.

        Between responses ``([], TICK)`` every ``tick_s`` seconds.  ``seen`` (the transport's
        own bookkeeping) sees each response after the :class:`PeerDown` and ``Failed`` checks.
        The segment is closed when this ends, however it ends (also when the caller stops
        iterating).

        Raises:
            PeerDownError: a :class:`PeerDown` (the model went down).
            RuntimeError: a :class:`~tokenrouter.protocol.Failed` (the model reported an error).
            PeerChannelError: nothing came for ``stall_timeout_s``.
        """
        try:
            deadline = self.deadline()
            while True:
                item = self.next(model, q, deadline)
                if item is None:
                    yield [], TICK
                    continue
                deadline = self.deadline()
                toks, ev = item
                _raise_for(model, ev)
                if seen is not None:
                    seen(ev)
                yield toks, ev
                if is_final(ev):
                    return
        finally:
            self.close(seg)

    def interrupt(self) -> None:
        """Wake every waiting segment: its :meth:`next` returns None (a tick) now."""
        for q in self._queues(None):
            q.put(None)

    def fail(self, message: str, owner: Optional[Hashable] = None) -> None:
        """End the open segments sent to ``owner`` (all when None) with a :class:`PeerDown`."""
        for q in self._queues(owner):
            q.put(([], PeerDown(message=message)))

    def _queues(self, owner) -> List["queue.Queue"]:
        with self._lock:
            return [q for o, q in self._open.values() if owner is None or o == owner]


class DownMarks:
    """Models marked down, ``{model: reason}``, with the ``on_down`` call once per mark.

    Thread-safe; never calls out while holding its lock, so a caller may hold its own
    lock around :meth:`set` (but not around :meth:`notify`, which runs ``on_down``).

    Args:
        on_down: optional callable(model, reason) run by :meth:`notify`; its exceptions
            are logged, not raised.
    """

    def __init__(self, on_down: Optional[Callable[[str, str], None]] = None):
        self._on_down = on_down
        self._lock = threading.Lock()
        self._down: Dict[str, str] = {}

    def set(self, model: str, reason: str) -> bool:
        """Mark ``model`` down with ``reason`` (kept up to date); True when it was up until now."""
        with self._lock:
            was_up = model not in self._down
            self._down[model] = reason
            return was_up

    def notify(self, model: str, reason: str) -> None:
        """Log that ``model`` went down and run ``on_down(model, reason)``."""
        logger.error("%s", reason)
        if self._on_down is not None:
            try:
                self._on_down(model, reason)
            except Exception:  # noqa: BLE001 - the transport goes on
                logger.exception("on_down(%s) failed", model)

    def mark(self, model: str, reason: str) -> bool:
        """:meth:`set`, then :meth:`notify` when the model was up; True in that case."""
        was_up = self.set(model, reason)
        if was_up:
            self.notify(model, reason)
        return was_up

    def clear(self, model: str) -> bool:
        """Clear ``model``'s mark; True when it was marked."""
        with self._lock:
            return self._down.pop(model, None) is not None

    def reason(self, model: str) -> Optional[str]:
        """Why ``model`` is down, or None while it is up."""
        with self._lock:
            return self._down.get(model)

    def __contains__(self, model: str) -> bool:
        with self._lock:
            return model in self._down

    def snapshot(self) -> Dict[str, str]:
        """``{model: reason}`` of the models marked down now (a copy)."""
        with self._lock:
            return dict(self._down)
