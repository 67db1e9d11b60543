"""Wire framing of the channel and the socket every thread may send on.

The values are those of :mod:`tokenrouter.protocol`'s codec (the model's Triton interface
carries the same ones as tensors); the model's ROUTER socket adds/strips the connection
identity frame in front:

* a command, router → model (:func:`op_frames` / :func:`op_of_frames`):
  ``[envelope JSON, op, request id, payload, tokens]``, the envelope
  ``{"seg", "router_pid", "router_start"}``, then :class:`~tokenrouter.protocol.OpWire`'s values;
* a response, model → router (:func:`event_frames` / :func:`event_of_frames`):
  ``[seg, event JSON, tokens]``.

Tokens are int64 little-endian (:func:`tokens_frame` / :func:`tokens_list`).
:class:`SharedSocket` lets any thread send while one owner thread receives (ZeroMQ sockets are
not thread-safe).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import zmq

from ...protocol import ModelEvent, OpWire, decode_event, encode_event

logger = logging.getLogger("tokenrouter.routing.peer")

__all__ = ["tokens_frame", "tokens_list", "op_frames", "op_of_frames", "event_frames", "event_of_frames",
           "make_socket", "SharedSocket", "handle_all"]


def tokens_frame(tokens) -> bytes:
    """Token ids as one frame: int64 little-endian bytes."""
    return np.asarray(tokens, dtype="<i8").tobytes()


def tokens_list(frame: bytes) -> List[int]:
    """The token ids of a :func:`tokens_frame` (an empty frame: none)."""
    return np.frombuffer(frame, dtype="<i8").tolist() if frame else []


def op_frames(envelope: Dict[str, Any], wire: OpWire) -> List[bytes]:
    """A command's frames: the envelope (``seg``, the router's identity) and the op's wire values."""
    return [json.dumps(envelope, separators=(",", ":")).encode(), wire.op.encode(), wire.rid.encode(),
            wire.payload.encode(), tokens_frame(wire.tokens)]


def op_of_frames(frames: Sequence[bytes]) -> Tuple[Dict[str, Any], OpWire]:
    """Inverse of :func:`op_frames` (without the identity frame).

    Raises:
        ValueError: not the frames of a command.
    """
    if len(frames) != 5:
        raise ValueError(f"a command has 5 frames, got {len(frames)}")
    envelope = json.loads(frames[0])
    if not isinstance(envelope, dict):
        raise ValueError("a command's envelope must be a JSON object")
    return envelope, OpWire(frames[1].decode(), frames[2].decode(), frames[3].decode(), tokens_list(frames[4]))


def event_frames(seg: int, event: ModelEvent, tokens: Sequence[int] = ()) -> List[bytes]:
    """A response's frames: the segment id, the event, the token ids it carries."""
    return [str(int(seg)).encode(), encode_event(event), tokens_frame(list(tokens))]


def event_of_frames(frames: Sequence[bytes]) -> Tuple[int, List[int], ModelEvent]:
    """Inverse of :func:`event_frames`: ``(seg, token ids, event)``.

    Raises:
        ValueError: not the frames of a response, or an event that does not decode.
    """
    if len(frames) != 3:
        raise ValueError(f"a response has 3 frames, got {len(frames)}")
    return int(frames[0]), tokens_list(frames[2]), decode_event(frames[1])


def make_socket(ctx, kind: int, tcp: bool = False):
    """A socket that never blocks a sender nor drops a message for a full queue (no HWM),
    closes at once; on TCP with ZeroMQ heartbeats so a dead connection is noticed and redialled."""
    s = ctx.socket(kind)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, 0)
    s.setsockopt(zmq.RCVHWM, 0)
    if tcp:
        s.setsockopt(zmq.HEARTBEAT_IVL, 1000)
        s.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5000)
    return s


class SharedSocket:
    """A ZeroMQ socket that any thread sends on while one owner thread receives from it.

    ZeroMQ sockets are not thread-safe, so every use is under a lock; the owner
    never blocks in ``poll`` on the socket itself but on its file descriptor
    (``ZMQ_FD``, which signals "look at ``ZMQ_EVENTS``") and on a wake-up pipe,
    then receives what is waiting under the lock.  ``ZMQ_FD`` is edge-triggered
    and a send can consume its signal, so a sender that finds input waiting
    afterwards wakes the owner through the pipe.  Senders (the model's decode
    loop, the router's request workers) thus put their messages on the wire
    themselves, with no hand-off to another Python thread.

    Args:
        sock: the socket (configured and bound/connected; from now on used only through this object).
    """

    def __init__(self, sock):
        self.sock = sock
        self._lock = threading.Lock()
        self.fd = sock.getsockopt(zmq.FD)
        self.wake_fd, self._wake_w = os.pipe()
        os.set_blocking(self.wake_fd, False)
        os.set_blocking(self._wake_w, False)
        self.closed = False

    def send(self, frames: List[bytes]) -> bool:
        """Send one multipart message (any thread); False once closed (the message is dropped)."""
        with self._lock:
            if self.closed:
                return False
            self.sock.send_multipart(frames, copy=False)
            pending = self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN
        if pending:
            self.wake()
        return True

    def wake(self) -> None:
        """Make the owner's wait on :attr:`wake_fd` return."""
        try:
            os.write(self._wake_w, b"\0")
        except (BlockingIOError, OSError):
            pass  # already signalled (pipe full) or closed

    def receive(self, limit: int = 256) -> List[List[bytes]]:
        """The messages waiting now, at most ``limit`` (owner thread)."""
        try:
            while os.read(self.wake_fd, 4096):
                pass
        except (BlockingIOError, OSError):
            pass
        out: List[List[bytes]] = []
        with self._lock:
            while not self.closed and len(out) < limit and self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                out.append(self.sock.recv_multipart(zmq.NOBLOCK))
        if len(out) == limit:
            self.wake()  # more may be waiting: come back at once
        return out

    def close(self, before_close: Optional[Callable[[], None]] = None) -> None:
        """Close the socket (``before_close`` runs under the lock first, e.g. to stop its monitor)."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            if before_close is not None:
                before_close()
            self.sock.close(0)
        for fd in (self.wake_fd, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass


def handle_all(messages: List[List[bytes]], handle: Callable[[List[bytes]], None], what: str) -> None:
    """``handle`` each message; one that raises is logged and dropped (``what`` names the channel)."""
    for frames in messages:
        try:
            handle(frames)
        except Exception:  # noqa: BLE001 - one bad message must not stop the channel
            logger.exception("%s: bad message dropped", what)
