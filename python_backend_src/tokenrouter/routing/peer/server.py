"""Model side of the channel: :class:`PeerServer` (a ROUTER socket in the model's Triton stub)."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from typing import Any, Callable, Dict, List, Optional

import zmq

from ...proc import process_alive
from ..curve import HandshakeLog, is_tcp
from .adverts import default_endpoint, unlink_ipc
from .wire import SharedSocket, handle_all, make_socket, meta_frame, tokens_frame, tokens_list

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
    """Model side of the channel: receives PeerReqs for one :class:`~tokenrouter.engine.subserver.Subserver`.

    A ROUTER socket bound at ``endpoint``; each router connects a DEALER socket
    per model replica and every answer goes back on the connection its command
    came from (no connection from the model to the router: fine behind NAT and
    Kubernetes services).  ``run`` submits the PeerReq with a sink that streams
    the segment's responses back; ``release`` frees the request's state (fire
    and forget); ``ping``, ``stats`` and ``configure`` answer one ``result``
    (``configure`` takes the keyword arguments of ``Subserver.reconfigure`` or,
    when ``configure_fn`` is given, whatever it accepts; ``events`` is answered
    by ``events_fn``).  ``ping`` answers
    ``{"pid", "instance", "model"}``: ``instance`` identifies this server object,
    so a router can tell a restarted model from one that was only slow.

    Requests of a router that went away are released: on ``ipc://`` endpoints
    when its process (pid and start time in each command) exits; on ``tcp://``
    endpoints, where pids mean nothing, when it has sent nothing (routers ping
    every half second) for ``router_timeout_s`` seconds.

    Args:
        subserver: the model's subserver.
        endpoint: ZeroMQ endpoint to bind (default: a fresh ``ipc://`` path);
            ``tcp://0.0.0.0:PORT`` for routers on other hosts.
        configure_fn: optional callable(settings dict) applying a ``configure`` command.
        events_fn: optional callable(settings) → result dict answering an ``events``
            command (the model's recent routing events, see
            :class:`tokenrouter.engine.event_ring.EventRing`); without it ``events`` is an
            unknown op.
        curve: :class:`~tokenrouter.routing.curve.CurveServer` settings (TCP only), or None.
        router_timeout_s: TCP: seconds of silence after which a router's requests are released.

    Raises:
        zmq.ZMQError: the endpoint cannot be bound.
    """

    def __init__(self, subserver, endpoint: Optional[str] = None,
                 configure_fn: Optional[Callable[[Dict[str, Any]], None]] = None,
                 events_fn: Optional[Callable[[Any], Dict[str, Any]]] = None,
                 curve=None, router_timeout_s: float = 10.0):
        self.subserver = subserver
        self._events = events_fn
        self.endpoint = endpoint or default_endpoint(subserver.name)
        self.instance = uuid.uuid4().hex
        self.router_timeout_s = float(router_timeout_s)
        self._tcp = is_tcp(self.endpoint)
        self._configure = configure_fn or (lambda s: subserver.reconfigure(**s))
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

    # -------------------------------------------------------------- sending
    def _reply(self, ident: bytes, meta: Dict[str, Any], tokens=()) -> None:
        self._shared.send([ident, meta_frame(meta), tokens_frame(list(tokens))])

    def _sink(self, ident: bytes, seg: int, rid: str):
        def sink(kind: str, tokens: List[int], info: Dict[str, Any]) -> None:
            if kind in ("finished", "cancelled", "error"):
                self._forget(ident, rid)  # the request's state is gone on this model
            self._reply(ident, {"seg": seg, "kind": kind, **info}, tokens)
        return sink

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
        from ...protocol import PeerReq

        ident, meta = frames[0], json.loads(frames[1])
        op, seg = meta.get("op"), int(meta.get("seg", 0))
        self._heard(ident, meta)
        if op == "ping":
            self._reply(ident, {"seg": seg, "kind": "result", "result": {
                "pid": os.getpid(), "instance": self.instance, "model": self.subserver.name}})
            return
        if op == "release":
            self._forget(ident, str(meta["rid"]))
            self.subserver.release(str(meta["rid"]))
            return
        try:
            if op == "run":
                pr = PeerReq.from_wire(meta.get("header") or "{}", tokens_list(frames[2] if len(frames) > 2 else b""))
                if meta.get("rid") and pr.rid != meta["rid"]:
                    pr.rid = str(meta["rid"])
                self._remember(ident, pr.rid)
                self.subserver.submit(pr, self._sink(ident, seg, pr.rid))
            elif op == "stats":
                self._reply(ident, {"seg": seg, "kind": "result", "result": self.subserver.stats()})
            elif op == "configure":
                self._configure(meta.get("settings") or {})
                self._reply(ident, {"seg": seg, "kind": "result", "result": {}})
            elif op == "events" and self._events is not None:
                self._reply(ident, {"seg": seg, "kind": "result", "result": self._events(meta.get("settings"))})
            else:
                ops = "run, release, ping, stats, configure" + (", events" if self._events is not None else "")
                raise ValueError(f"unknown op {op!r}; expected {ops}")
        except Exception as e:  # noqa: BLE001 - answer this command only
            self._reply(ident, {"seg": seg, "kind": "error", "message": f"model {self.subserver.name}: {e}"})

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
