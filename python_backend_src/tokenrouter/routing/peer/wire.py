"""Wire framing of the channel and the socket every thread may send on.

A message is ``[meta JSON, tokens]`` (the model's ROUTER socket adds/strips the connection
identity frame): :func:`meta_frame` compact JSON, :func:`tokens_frame` / :func:`tokens_list`
int64 little-endian token ids.  :class:`SharedSocket` lets any thread send while one owner
thread receives (ZeroMQ sockets are not thread-safe).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import zmq

logger = logging.getLogger("tokenrouter.routing.peer")

__all__ = ["tokens_frame", "tokens_list", "meta_frame", "make_socket", "SharedSocket", "handle_all"]


def tokens_frame(tokens) -> bytes:
    """Token ids as one frame: int64 little-endian bytes."""
    return np.asarray(tokens, dtype="<i8").tobytes()


def tokens_list(frame: bytes) -> List[int]:
    """The token ids of a :func:`tokens_frame` (an empty frame: none)."""
    return np.frombuffer(frame, dtype="<i8").tolist() if frame else []


def meta_frame(meta: Dict[str, Any]) -> bytes:
    """A message's meta dict as one frame: compact JSON."""
    return json.dumps(meta, separators=(",", ":")).encode()


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
