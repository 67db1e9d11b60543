"""One model's answers to the ops of :mod:`tokenrouter.protocol`, whichever transport brought them.

The Triton model (:mod:`tokenrouter.triton.llm_model`, each request's inputs) and the ZeroMQ
channel (:class:`tokenrouter.routing.peer.PeerServer`, each command's frames) both hand their
ops here as :class:`~tokenrouter.protocol.OpWire` values with a *reply* callable, and send
what it is given: ``reply(event, tokens)`` with a :data:`~tokenrouter.protocol.ModelEvent`
and the token ids it carries.  A ``run`` streams :class:`~tokenrouter.protocol.Tokens` and one
final segment event; any other op gets one :class:`~tokenrouter.protocol.Answer` (``calibrate``
later, from its own thread); a bad op gets :class:`~tokenrouter.protocol.Failed` on its own reply only.
"""

from __future__ import annotations

import os
import threading
import uuid
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from ..protocol import (SEGMENT_EVENTS, Answer, Calibrate, Configure, Endpoint, EventsQuery, Failed,
                        Flush, ModelEvent, OpWire, Ping, Release, Run, SpecRound, Stats, decode_op)

__all__ = ["OpDispatcher", "Reply", "segment_event"]

#: ``reply(event, tokens)``: send one event and the token ids it carries (thread-safe)
Reply = Callable[[ModelEvent, Sequence[int]], None]


def segment_event(kind: str, info: Dict[str, Any]):
    """A subserver sink's ``(kind, info)`` as its typed event (:data:`~tokenrouter.protocol.SEGMENT_EVENTS`).

    Raises:
        KeyError: an unknown kind.  TypeError: a field the event type does not have.
    """
    spec = info.get("spec")
    if isinstance(spec, dict):
        info = {**info, "spec": SpecRound(**spec)}
    return SEGMENT_EVENTS[kind](**info)


class OpDispatcher:
    """Answers the ops for one :class:`~tokenrouter.engine.subserver.Subserver`.

    ``run`` submits the PeerReq with a sink that turns the subserver's ``(kind, tokens, info)``
    calls into segment events on the op's reply; the ``run`` ops of one :meth:`handle` call enter
    the decode loop together (:meth:`Subserver.submit_group`: the arrivals Triton's batcher grouped
    share a step).  ``release`` frees the request; ``stats``, ``flush``, ``ping`` and ``calibrate``
    ask the subserver; ``configure``, ``events`` and ``endpoint`` go to the hooks below.

    Args:
        subserver: the model's subserver (``name``, ``submit``, ``submit_group``, ``release``,
            ``stats``, ``flush_prefix_cache``, ``calibrate``, ``reconfigure``).
        configure: callable(args) applying a ``configure`` op; default
            ``subserver.reconfigure(**args)`` (the :class:`SubserverConfig` field names).
        events: callable(args) → the ``events`` answer's fields; None: op ``events`` is not served.
        endpoint: callable() → the ``endpoint`` answer's fields; None: op ``endpoint`` is not served.

    Attributes:
        instance: a random id of this object, answered by ``ping`` (a restarted model has another).
    """

    def __init__(self, subserver, *, configure: Optional[Callable[[Any], None]] = None,
                 events: Optional[Callable[[Any], Dict[str, Any]]] = None,
                 endpoint: Optional[Callable[[], Dict[str, Any]]] = None):
        self.subserver = subserver
        self.name = subserver.name
        self.instance = uuid.uuid4().hex
        self._configure = configure or (lambda args: subserver.reconfigure(**args))
        self._events, self._endpoint = events, endpoint

    def handle(self, batch: Iterable[Tuple[OpWire, Reply]]) -> None:
        """Decode and answer each op; a ``release`` after a ``run`` of the same request keeps that order."""
        runs: List[tuple] = []
        for wire, reply in batch:
            try:
                op = decode_op(*wire)
                if isinstance(op, Run):
                    runs.append((op.peer_req, self._sink(reply)))
                    continue
                if isinstance(op, Release) and any(pr.rid == op.rid for pr, _ in runs):
                    self._submit(runs)  # its run came first
                    runs = []
                answer = self._answer(op, reply)
                if answer is not None:
                    reply(answer, ())
            except Exception as e:  # noqa: BLE001 - answer this op only
                reply(Failed(message=f"model {self.name}: {e}"), ())
        self._submit(runs)

    def _submit(self, runs: List[tuple]) -> None:
        if len(runs) == 1:
            self.subserver.submit(*runs[0])
        elif runs:
            self.subserver.submit_group(runs)

    def _answer(self, op, reply: Reply) -> Optional[Answer]:
        match op:
            case Release(rid=rid):
                self.subserver.release(rid)
                return Answer("released")
            case Configure(args=args):
                if not isinstance(args, dict):
                    raise ValueError("configure expects a JSON object")
                self._configure(args)
                return Answer("configured")
            case Stats():
                return Answer("stats", self.subserver.stats())
            case Flush():
                return Answer("flushed", self.subserver.flush_prefix_cache())
            case Ping():
                return Answer("pong", {"pid": os.getpid(), "instance": self.instance, "model": self.name})
            case EventsQuery(args=args) if self._events is not None:
                return Answer("events", self._events(args))
            case Endpoint() if self._endpoint is not None:
                return Answer("endpoint", self._endpoint())
            case Calibrate(args=args):
                self._calibrate(args, reply)
                return None
        raise ValueError(f"unknown op {op.name!r}; expected {', '.join(self.ops())}")

    def ops(self) -> List[str]:
        """The op names this model serves."""
        return ["run", "release", "stats", "configure", "calibrate", "flush", "ping"] + \
            (["events"] if self._events is not None else []) + (["endpoint"] if self._endpoint is not None else [])

    def _sink(self, reply: Reply):
        """A segment sink (decode-loop thread): the subserver's calls as typed events on ``reply``."""
        def sink(kind: str, tokens: List[int], info: Dict[str, Any]) -> None:
            reply(segment_event(kind, info), tokens)
        return sink

    def _calibrate(self, args: Any, reply: Reply) -> None:
        """Op ``calibrate``: time synthetic steps (:meth:`Subserver.calibrate`) on a thread of its own,
        then answer ``calibration`` with the table (or fail: model not idle, KV pool too small).

        ``args``: ``{"batch_sizes": [1, 2, 4, …], "context": 256, "decode_steps": 8}`` (defaults:
        1, 2, 4, 8; 256; 8).

        Raises:
            ValueError: malformed arguments (answered as that op's error).
        """
        if not isinstance(args, dict):
            raise ValueError("calibrate expects a JSON object")
        unknown = set(args) - {"batch_sizes", "context", "decode_steps"}
        if unknown:
            raise ValueError(f"unknown calibrate keys {sorted(unknown)}; allowed: batch_sizes, context, decode_steps")
        bs = args.get("batch_sizes", [1, 2, 4, 8])
        if not isinstance(bs, list) or not bs or any(isinstance(b, bool) or not isinstance(b, int) or b < 1
                                                     for b in bs):
            raise ValueError("batch_sizes must be a non-empty list of integers >= 1")
        ctx, steps = args.get("context", 256), args.get("decode_steps", 8)
        for key, v in (("context", ctx), ("decode_steps", steps)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{key} must be an integer >= 1")

        def run() -> None:
            try:
                reply(Answer("calibration", self.subserver.calibrate(bs, context=ctx, decode_steps=steps)), ())
            except Exception as e:  # noqa: BLE001 - answer this op only
                reply(Failed(message=f"model {self.name}: calibrate: {e}"), ())

        threading.Thread(target=run, name=f"calibrate-{self.name}", daemon=True).start()
