"""Bounded buffer of a model's recent routing events, read with a cursor (op ``events``).

Each LLM model keeps the routing events its :class:`~tokenrouter.engine.subserver.Subserver`
emits (``step`` and ``handoff``, the format of :mod:`scheduler_model.profile`; ``t`` is
``time.time()`` in seconds, comparable across the models of one host) in an
:class:`EventRing`.  A reader — the router's online B* adaptation
(:mod:`tokenrouter.routing.online_bstar`) — asks for the events after its cursor and gets the
new cursor back, so each event is read once without the model tracking readers.

Cursors are sequence numbers: event k (0-based, counted since the model started) has
sequence number k; a cursor is the sequence number of the next event to read.
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Deque, Dict, Mapping, Optional

__all__ = ["EventRing", "DEFAULT_CAPACITY", "MAX_EVENTS_PER_ANSWER"]

#: events a model keeps (a CPU model makes tens of steps per second, a GPU one hundreds)
DEFAULT_CAPACITY = 20_000
#: most events one ``events`` answer carries (the reader asks again for the rest)
MAX_EVENTS_PER_ANSWER = 5_000


class EventRing:
    """Thread-safe ring of the last ``capacity`` events with sequence-number cursors.

    Args:
        capacity: events kept (older ones are dropped, and counted as ``dropped`` by a
            reader whose cursor points before the oldest one kept).

    Raises:
        ValueError: ``capacity`` < 1.
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be an integer >= 1, got {capacity!r}")
        self.capacity = capacity
        self._events: Deque[Dict[str, Any]] = collections.deque(maxlen=capacity)
        self._next = 0  # sequence number of the next event appended
        self._lock = threading.Lock()

    def __call__(self, event: Dict[str, Any]) -> None:
        """Append one event (the Subserver's ``event_sink``)."""
        with self._lock:
            self._events.append(event)
            self._next += 1

    @property
    def cursor(self) -> int:
        """Sequence number of the next event to be appended."""
        with self._lock:
            return self._next

    def read(self, since: int, limit: int = MAX_EVENTS_PER_ANSWER) -> Dict[str, Any]:
        """Events with sequence number >= ``since``, oldest first, at most ``limit``.

        Returns:
            ``{"events": [...], "cursor": c, "dropped": d, "reset": r}``: ``cursor`` is the
            ``since`` of the next read; ``dropped`` counts events after ``since`` that were
            no longer kept; ``reset`` is true when ``since`` lies beyond every event this
            model emitted (the reader's cursor belongs to an earlier process of the model,
            e.g. before a restart): the answer then starts at the oldest event kept.
        """
        with self._lock:
            oldest = self._next - len(self._events)
            reset = since > self._next
            start = oldest if reset else max(since, oldest)
            dropped = 0 if reset else start - since
            n = min(limit, self._next - start)
            skip = start - oldest
            events = [self._events[skip + k] for k in range(n)]
            return {"events": events, "cursor": start + n, "dropped": dropped, "reset": reset}

    def answer(self, request: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
        """Op ``events``: validate ``{"since": cursor, "limit": n}`` and :meth:`read`.

        ``since`` defaults to 0 (every event kept), ``limit`` to :data:`MAX_EVENTS_PER_ANSWER`.

        Raises:
            ValueError: not a JSON object, unknown keys, ``since`` not an integer >= 0, or
                ``limit`` not an integer in 1 … MAX_EVENTS_PER_ANSWER (answered as that
                request's error).
        """
        if request is None:
            request = {}
        if not isinstance(request, Mapping):
            raise ValueError("events expects a JSON object {\"since\": cursor, \"limit\": n}")
        unknown = set(request) - {"since", "limit"}
        if unknown:
            raise ValueError(f"unknown events keys {sorted(unknown)}; allowed: since, limit")
        since = request.get("since", 0)
        if isinstance(since, bool) or not isinstance(since, int) or since < 0:
            raise ValueError(f"events: since must be an integer cursor >= 0, got {since!r}")
        limit = request.get("limit", MAX_EVENTS_PER_ANSWER)
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_EVENTS_PER_ANSWER:
            raise ValueError(f"events: limit must be an integer in 1..{MAX_EVENTS_PER_ANSWER}, got {limit!r}")
        return self.read(since, limit)
