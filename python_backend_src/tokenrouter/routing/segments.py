"""What both router-side transports keep: the open segments' queues and the models' down marks.

A *segment* is one visit of a request to a model (:func:`tokenrouter.routing.router_core.drive`):
the transport opens a queue for it, its receiving side puts the model's responses in,
and the request's worker reads them.  :class:`Segments` holds those queues, wakes or ends
them, and turns a silent queue into ticks and, at the stall timeout, an error.
:class:`DownMarks` holds which models are down and why (paper §Design: a request that
cannot reach its next model fails alone; the others go on).

Used by :class:`tokenrouter.routing.peer.PeerClient` (ZeroMQ) and
:class:`tokenrouter.triton.transport.TritonTransport` (BLS).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from typing import Any, Callable, Dict, Hashable, Iterator, List, Optional, Tuple

logger = logging.getLogger(__name__)

__all__ = ["Segments", "DownMarks", "PeerChannelError", "PeerDownError", "FINAL"]

#: segment-final response kinds
FINAL = ("handoff", "finished", "cancelled", "error", "result")


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


class Segments:
    """The open segments of one transport: ``seg id → (owner, response queue)``.

    A queue receives ``(token ids, event dict)`` items, or ``None`` from :meth:`interrupt`.
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

    def put(self, seg: int, item: Tuple[List[int], Dict[str, Any]]) -> bool:
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

    def next(self, model: str, q: "queue.Queue", deadline: float) -> Optional[Tuple[List[int], Dict[str, Any]]]:
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
                  check: Optional[Callable[[List[int], Dict[str, Any]], bool]] = None,
                  ) -> Iterator[Tuple[List[int], Dict[str, Any]]]:
        """Yield segment ``seg``'s responses ``(token ids, event)`` up to and including a final one.

        Between responses ``([], {"kind": "tick"})`` every ``tick_s`` seconds.  ``check``
        (the transport's own event kinds) sees each response after the ``peer_down`` and
        ``error`` checks; it returns False to skip one and may raise.  The segment is
        closed when this ends, however it ends (also when the caller stops iterating).

        Raises:
            PeerDownError: a ``peer_down`` event (the model went down).
            RuntimeError: an ``error`` event (the model reported an error).
            PeerChannelError: nothing came for ``stall_timeout_s``.
        """
        try:
            deadline = self.deadline()
            while True:
                item = self.next(model, q, deadline)
                if item is None:
                    yield [], {"kind": "tick"}
                    continue
                deadline = self.deadline()
                toks, ev = item
                kind = ev.get("kind")
                if kind == "peer_down":
                    raise PeerDownError(model, ev.get("message") or f"model {model} is down")
                if kind == "error":
                    raise RuntimeError(ev.get("message") or f"model {model}: error")
                if check is not None and not check(toks, ev):
                    continue
                yield toks, ev
                if kind in FINAL:
                    return
        finally:
            self.close(seg)

    def interrupt(self) -> None:
        """Wake every waiting segment: its :meth:`next` returns None (a tick) now."""
        for q in self._queues(None):
            q.put(None)

    def fail(self, message: str, owner: Optional[Hashable] = None) -> None:
        """End the open segments sent to ``owner`` (all when None) with a ``peer_down`` event."""
        for q in self._queues(owner):
            q.put(([], {"kind": "peer_down", "message": message}))

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
