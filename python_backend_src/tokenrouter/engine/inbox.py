"""The decode loop's inbox: one small message per kind, the only way other threads reach the loop."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Tuple

from ..protocol import PeerReq
from .request import Sink

__all__ = ["Submit", "SubmitGroup", "Release", "LoopCall", "Stop"]


@dataclass(frozen=True)
class Submit:
    """Inbox: run ``peer_req`` here (a new request, or the resume of a pending one); answers go to ``sink``."""

    peer_req: PeerReq
    sink: Sink


@dataclass(frozen=True)
class SubmitGroup:
    """Inbox: several :class:`Submit` received before the loop's next step decision (one step for them all).

    Attributes:
        items: ``(peer_req, sink)`` pairs, in arrival order.
    """

    items: List[Tuple[PeerReq, Sink]]


@dataclass(frozen=True)
class Release:
    """Inbox: end request ``rid`` here (its running segment closes as ``cancelled``) and free its KV."""

    rid: str


@dataclass(frozen=True)
class LoopCall:
    """Inbox: run ``fn()`` on the loop thread, between two steps (statistics, settings, calibration).

    ``fn`` reports its own result and errors (:meth:`~tokenrouter.engine.subserver.Subserver.call` wraps it so).
    """

    fn: Callable[[], None]


@dataclass(frozen=True)
class Stop:
    """Inbox: wake the loop so that it sees its stop flag (:meth:`~tokenrouter.engine.subserver.Subserver.stop`)."""
