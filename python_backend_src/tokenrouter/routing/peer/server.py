"""Model side of the channel: :class:`PeerServer` (a ROUTER socket in the model's Triton stub)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Dict, List, Optional, Sequence

import zmq

from ...proc import process_alive
from ...protocol import Cancelled, Failed, Finished, ModelEvent
from ..curve import HandshakeLog, is_tcp
from .adverts import default_endpoint, unlink_ipc
from .wire import SharedSocket, event_frames, handle_all, make_socket, op_of_frames

logger = logging.getLogger("tokenrouter.routing.peer")

__all__ = ["PeerServer"]


class _RouterConn:
    """A router connected to a :class:`PeerServer` (one ROUTER identity): its process and requests."""

    __slots__ = ("pid", "start", "rids", "heard")

    def __init__(self, meta: Dict[str, Any]):
        self.pid = int(meta["router_pid"]) if meta.get("router_pid") else None
        self.start = meta.get("router_start")
        self.rids: set = set()
        self.heard = time.monotonic()


class PeerServer:
    """Model side of the channel: the ops of the routers connected to it, for one model.

    A ROUTER socket bound at ``endpoint``; each router connects a DEALER socket
    per model replica and every answer goes back on the connection its command
    came from (no connection from the model to the router: fine behind NAT and
    Kubernetes services).  Each command's op goes to the model's
    :class:`~tokenrouter.engine.op_dispatch.OpDispatcher` (the one its Triton
    interface uses too), whose events go back tagged with the command's ``seg``;
    ``release`` is fire and forget (its answer is not sent).  ``ping`` answers
    ``{"pid", "instance", "model"}``: ``instance`` identifies the dispatcher,
    so a router can tell a restarted model from one that was only slow.

    Requests of a router that went away are released: on ``ipc://`` endpoints
    when its process (pid and start time in each command) exits; on ``tcp://``
    endpoints, where pids mean nothing, when it has sent nothing (routers ping
    every half second) for ``router_timeout_s`` seconds.

    Args:
        dispatcher: the model's :class:`~tokenrouter.engine.op_dispatch.OpDispatcher`.
        endpoint: ZeroMQ endpoint to bind (default: a fresh ``ipc://`` path);
            ``tcp://0.0.0.0:PORT`` for routers on other hosts.
        curve: :class:`~tokenrouter.routing.curve.CurveServer` settings (TCP only), or None.
        router_timeout_s: TCP: seconds of silence after which a router's requests are released.

    Raises:
        zmq.ZMQError: the endpoint cannot be bound.
    """

    def __init__(self, dispatcher, endpoint: Optional[str] = None, curve=None, router_timeout_s: float = 10.0):
        self.dispatcher = dispatcher
        self.subserver = subserver = dispatcher.subserver
        self.endpoint = endpoint or default_endpoint(subserver.name)
        self.router_timeout_s = float(router_timeout_s)
        self._tcp = is_tcp(self.endpoint)
        self._curve = curve
        self._ctx = zmq.Context()  # its own: the ZAP handler (CURVE) belongs to a context
        self._sock = make_socket(self._ctx, zmq.ROUTER, self._tcp)
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a router's redialled connection takes its place
        try:
            if curve is not None:
                curve.secure(self._ctx, self._sock)
            self._sock.bind(self.endpoint)
        except Exception:
            self._sock.close(0)
            if curve is not None:
                curve.stop()
            self._ctx.term()
            raise
        if self._tcp:
            self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)  # a "*" port resolved
        self._handshakes = HandshakeLog(self._sock, f"model {subserver.name} at {self.endpoint}") \
            if self._tcp else None
        self._shared = SharedSocket(self._sock)
        self._stop = threading.Event()
        self._routers: Dict[bytes, _RouterConn] = {}
        self._routers_lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name=f"peer-io-{subserver.name}", daemon=True)
        self._thread.start()
        self._watch = threading.Thread(target=self._watch_routers, name=f"peer-watch-{subserver.name}",
                                       daemon=True)
        self._watch.start()

    @property
    def instance(self) -> str:
        """The id ``ping`` answers (the dispatcher's)."""
        return self.dispatcher.instance

    # -------------------------------------------------------------- sending
    def _reply(self, ident: bytes, seg: int, rid: str):
        """The reply of one command: its events go back tagged with ``seg`` (any thread)."""
        def reply(event: ModelEvent, tokens: Sequence[int] = ()) -> None:
            if rid and isinstance(event, (Finished, Cancelled, Failed)):
                self._forget(ident, rid)  # the request's state is gone on this model
            self._shared.send([ident, *event_frames(seg, event, tokens)])
        return reply

    @staticmethod
    def _unanswered(event: ModelEvent, tokens: Sequence[int] = ()) -> None:
        """The reply of a ``release``: fire and forget."""

    # ------------------------------------------------------------- I/O loop
    def _loop(self) -> None:
        poller = zmq.Poller()
        for s in (self._shared.fd, self._shared.wake_fd) + ((self._handshakes.socket,) if self._handshakes else ()):
            poller.register(s, zmq.POLLIN)
        what = f"peer channel of {self.subserver.name}"
        while not self._stop.is_set():
            events = dict(poller.poll(100))
            handle_all(self._shared.receive(), self._handle, what)  # also after a timeout: cheap, never stuck
            if self._handshakes is not None and self._handshakes.socket in events:
                self._handshakes.handle()

    def _handle(self, frames: List[bytes]) -> None:
        ident = frames[0]
        envelope, wire = op_of_frames(frames[1:])
        self._heard(ident, envelope)
        if wire.op == "release":
            self._forget(ident, wire.rid)
            reply = self._unanswered
        else:
            if wire.op == "run" and wire.rid:
                self._remember(ident, wire.rid)
            reply = self._reply(ident, int(envelope.get("seg", 0)), wire.rid if wire.op == "run" else "")
        self.dispatcher.handle([(wire, reply)])

    # ------------------------------------------------ routers that went away
    def _heard(self, ident: bytes, meta: Dict[str, Any]) -> None:
        with self._routers_lock:
            conn = self._routers.get(ident)
            if conn is None:
                conn = self._routers[ident] = _RouterConn(meta)
            conn.heard = time.monotonic()

    def _remember(self, ident: bytes, rid: str) -> None:
        with self._routers_lock:
            conn = self._routers.get(ident)
            if conn is not None:
                conn.rids.add(rid)

    def _forget(self, ident: bytes, rid: str) -> None:
        with self._routers_lock:
            conn = self._routers.get(ident)
            if conn is not None:
                conn.rids.discard(rid)

    def _gone(self, conn: _RouterConn, now: float) -> bool:
        if self._tcp:
            return now - conn.heard > self.router_timeout_s
        return conn.pid is not None and not process_alive(conn.pid, conn.start)

    def _watch_routers(self, interval_s: float = 0.5) -> None:
        """Release every request of a router that went away (its KV would otherwise stay held)."""
        while not self._stop.wait(interval_s):
            now = time.monotonic()
            with self._routers_lock:
                gone = [k for k, c in self._routers.items() if self._gone(c, now)]
                rids = [rid for k in gone for rid in self._routers.pop(k).rids]
            for rid in rids:
                try:
                    self.subserver.release(rid)
                except Exception:  # noqa: BLE001
                    logger.exception("release of %s (router gone) failed", rid)
            if rids:
                logger.warning("model %s: released %d request(s) of a router that went away",
                               self.subserver.name, len(rids))

    def close(self) -> None:
        """Stop the I/O thread and close the sockets (the subserver is left running)."""
        self._stop.set()
        self._thread.join(timeout=5)
        self._watch.join(timeout=2)
        self._shared.close(self._handshakes.close if self._handshakes is not None else None)
        if self._curve is not None:
            self._curve.stop()
        if not self._thread.is_alive():
            self._ctx.term()
        unlink_ipc(self.endpoint)
