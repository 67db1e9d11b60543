"""ZeroMQ inter-model channel: the router's handoffs without Triton round trips.

Paper §Design, "Three decoupled loops": the inter-model loop forwards a
handing-off model's PeerReq to the peer over ZeroMQ.  Here each model
subserver listens on its own endpoint (:class:`PeerServer`, a PULL socket
inside the model's Triton stub process) and the router drives requests through
a :class:`PeerClient` — the *transport* of :func:`tokenrouter.router_core.drive`.

Wire format (multipart messages, two frames each):

* command, router → model: ``[meta JSON, tokens]`` with meta
  ``{"op": "run"|"release"|"stats"|"configure", "seg": int, "reply": endpoint,
  "rid": str, "header": PeerReq header JSON | "settings": {...}}`` and tokens the
  int64 little-endian token suffix the model has not seen (``run`` only);
* response, model → router: ``[meta JSON, tokens]`` with meta
  ``{"seg": int, "kind": "tokens"|"handoff"|"finished"|"cancelled"|"error"|"result", …}``
  and tokens the committed token ids of this chunk.

``seg`` identifies one visit of a request to a model (a *segment*); responses
of a segment the router has already closed are dropped.

Threading: a model's PULL socket belongs to its I/O thread; the reply sockets
(one PUSH per router endpoint) are shared by the decode loop and the I/O thread
under a lock and are only ever sent on.  On the router side, the PULL reply
socket belongs to one demultiplexing thread; command sockets (one PUSH per
model) are only sent on, under a lock.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import queue
import tempfile
import threading
import time
import uuid
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np
import zmq

logger = logging.getLogger(__name__)

__all__ = ["PeerServer", "PeerClient", "PeerChannelError", "default_endpoint"]

#: segment-final response kinds
FINAL = ("handoff", "finished", "cancelled", "error", "result")


class PeerChannelError(RuntimeError):
    """A model could not be reached or did not answer in time."""


def default_endpoint(role: str) -> str:
    """A fresh ``ipc://`` endpoint in the temporary directory, unique to this process.

    Args:
        role: a short label (model name or ``router``) included in the file name.
    """
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in role)[:40]
    return f"ipc://{tempfile.gettempdir()}/tokenrouter-{os.getpid()}-{safe}-{uuid.uuid4().hex[:8]}"


def _tokens_frame(tokens) -> bytes:
    return np.asarray(tokens, dtype="<i8").tobytes()


def _tokens_list(frame: bytes) -> List[int]:
    return np.frombuffer(frame, dtype="<i8").tolist() if frame else []


def _recv_loop(sock, stop: threading.Event, handle: Callable[[List[bytes]], None], what: str) -> None:
    """Receive multipart messages on ``sock`` until ``stop`` is set; ``handle`` each (errors logged)."""
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    while not stop.is_set():
        if not poller.poll(100):
            continue
        try:
            frames = sock.recv_multipart()
        except zmq.ZMQError:
            if stop.is_set():
                return
            raise
        try:
            handle(frames)
        except Exception:  # noqa: BLE001 - one bad message must not stop the channel
            logger.exception("%s: bad message dropped", what)


def _unlink_ipc(endpoint: str) -> None:
    if endpoint.startswith("ipc://"):
        try:
            os.unlink(endpoint[len("ipc://"):])
        except OSError:
            pass


class PeerServer:
    """Model side of the channel: receives PeerReqs for one :class:`~tokenrouter.subserver.Subserver`.

    ``run`` submits the PeerReq with a sink that streams the segment's
    responses to the command's ``reply`` endpoint; ``release`` frees the
    request's state (fire and forget); ``stats`` and ``configure`` answer one
    ``result`` (``configure`` takes the keyword arguments of
    ``Subserver.reconfigure`` or, when ``configure_fn`` is given, whatever it
    accepts).

    Args:
        subserver: the model's subserver.
        endpoint: ZeroMQ endpoint to bind (default: a fresh ``ipc://`` path).
        configure_fn: optional callable(settings dict) applying a ``configure`` command.

    Raises:
        zmq.ZMQError: the endpoint cannot be bound.
    """

    def __init__(self, subserver, endpoint: Optional[str] = None,
                 configure_fn: Optional[Callable[[Dict[str, Any]], None]] = None):
        self.subserver = subserver
        self.endpoint = endpoint or default_endpoint(subserver.name)
        self._configure = configure_fn or (lambda s: subserver.reconfigure(**s))
        self._ctx = zmq.Context.instance()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(self.endpoint)
        self._replies: Dict[str, Any] = {}
        self._send_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"peer-io-{subserver.name}", daemon=True)
        self._thread.start()

    # -------------------------------------------------------------- sending
    def _send(self, reply: str, meta: Dict[str, Any], tokens) -> None:
        data = [json.dumps(meta, separators=(",", ":")).encode(), _tokens_frame(tokens)]
        with self._send_lock:
            sock = self._replies.get(reply)
            if sock is None:
                sock = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(reply)
                self._replies[reply] = sock
            sock.send_multipart(data, copy=False)

    def _sink(self, reply: str, seg: int):
        def sink(kind: str, tokens: List[int], info: Dict[str, Any]) -> None:
            self._send(reply, {"seg": seg, "kind": kind, **info}, tokens)
        return sink

    # ------------------------------------------------------------- I/O loop
    def _loop(self) -> None:
        _recv_loop(self._pull, self._stop, self._handle, f"peer channel of {self.subserver.name}")

    def _handle(self, frames: List[bytes]) -> None:
        from .protocol import PeerReq

        meta = json.loads(frames[0])
        op, seg, reply = meta.get("op"), int(meta.get("seg", 0)), meta.get("reply")
        if op == "release":
            self.subserver.release(str(meta["rid"]))
            return
        if not reply:
            raise ValueError(f"command {op!r} without a reply endpoint")
        try:
            if op == "run":
                pr = PeerReq.from_wire(meta.get("header") or "{}", _tokens_list(frames[1] if len(frames) > 1 else b""))
                if meta.get("rid") and pr.rid != meta["rid"]:
                    pr.rid = str(meta["rid"])
                self.subserver.submit(pr, self._sink(reply, seg))
            elif op == "stats":
                self._send(reply, {"seg": seg, "kind": "result", "result": self.subserver.stats()}, [])
            elif op == "configure":
                self._configure(meta.get("settings") or {})
                self._send(reply, {"seg": seg, "kind": "result", "result": {}}, [])
            else:
                raise ValueError(f"unknown op {op!r}; expected run, release, stats or configure")
        except Exception as e:  # noqa: BLE001 - answer this command only
            self._send(reply, {"seg": seg, "kind": "error", "message": f"model {self.subserver.name}: {e}"}, [])

    def close(self) -> None:
        """Stop the I/O thread and close the sockets (the subserver is left running)."""
        self._stop.set()
        self._thread.join(timeout=5)
        with self._send_lock:
            for s in self._replies.values():
                s.close(0)
            self._replies.clear()
        self._pull.close(0)
        _unlink_ipc(self.endpoint)


class PeerClient:
    """Router side of the channel: the transport of :func:`tokenrouter.router_core.drive`.

    Args:
        resolve: callable(model name) → that model's endpoint (called once per
            model, then cached).
        stall_timeout_s: a segment whose model sends nothing for this long fails
            with :class:`PeerChannelError` (seconds; 0 = wait forever).
        tick_s: while waiting, :meth:`segment` yields a ``{"kind": "tick"}``
            event every ``tick_s`` seconds so the caller can check cancellation.
    """

    def __init__(self, resolve: Callable[[str], str], stall_timeout_s: float = 600.0, tick_s: float = 0.05):
        self._resolve = resolve
        self.stall_timeout_s = float(stall_timeout_s)
        self.tick_s = float(tick_s)
        self._ctx = zmq.Context.instance()
        self.reply_endpoint = default_endpoint("router")
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(self.reply_endpoint)
        self._cmd: Dict[str, Tuple[Any, threading.Lock]] = {}
        self._cmd_lock = threading.Lock()
        self._segs: Dict[int, "queue.Queue"] = {}
        self._segs_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._demux, name="peer-demux", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ internals
    def _demux(self) -> None:
        _recv_loop(self._pull, self._stop, self._dispatch, "peer channel (router)")

    def _dispatch(self, frames: List[bytes]) -> None:
        meta = json.loads(frames[0])
        toks = _tokens_list(frames[1] if len(frames) > 1 else b"")
        with self._segs_lock:
            q = self._segs.get(int(meta.pop("seg", 0)))
        if q is not None:  # else: a response of a segment already closed
            q.put((toks, meta))

    def _socket(self, model: str):
        with self._cmd_lock:
            entry = self._cmd.get(model)
            if entry is None:
                endpoint = self._resolve(model)
                sock = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(endpoint)
                entry = self._cmd[model] = (sock, threading.Lock())
            return entry

    def _command(self, model: str, meta: Dict[str, Any], tokens=()) -> None:
        sock, lock = self._socket(model)
        data = [json.dumps(meta, separators=(",", ":")).encode(), _tokens_frame(list(tokens))]
        with lock:
            sock.send_multipart(data, copy=False)

    def _open(self) -> Tuple[int, "queue.Queue"]:
        seg, q = next(self._ids), queue.Queue()
        with self._segs_lock:
            self._segs[seg] = q
        return seg, q

    def _close_seg(self, seg: int) -> None:
        with self._segs_lock:
            self._segs.pop(seg, None)

    def _next(self, model: str, q: "queue.Queue", deadline: float):
        """Next response of a segment, or None after ``tick_s`` without one."""
        try:
            return q.get(timeout=self.tick_s)
        except queue.Empty:
            if self.stall_timeout_s and time.monotonic() > deadline:
                raise PeerChannelError(f"model {model} sent nothing for {self.stall_timeout_s:.0f} s") from None
            return None

    # ----------------------------------------------------------- transport
    def segment(self, model: str, rid: str, tokens: List[int], header: str) -> Iterator[Tuple[List[int], dict]]:
        """One visit of ``rid`` to ``model``: yield ``(committed token ids, event)`` until a final event.

        Between responses a ``([], {"kind": "tick"})`` is yielded every ``tick_s`` seconds.

        Raises:
            RuntimeError: the model reported an error.
            PeerChannelError: the model sent nothing for ``stall_timeout_s``.
        """
        seg, q = self._open()
        try:
            self._command(model, {"op": "run", "seg": seg, "reply": self.reply_endpoint, "rid": rid,
                                  "header": header}, tokens)
            deadline = time.monotonic() + self.stall_timeout_s
            while True:
                item = self._next(model, q, deadline)
                if item is None:
                    yield [], {"kind": "tick"}
                    continue
                deadline = time.monotonic() + self.stall_timeout_s
                toks, ev = item
                if ev.get("kind") == "error":
                    raise RuntimeError(ev.get("message") or f"model {model}: error")
                yield toks, ev
                if ev.get("kind") in FINAL:
                    return
        finally:
            self._close_seg(seg)

    def release(self, model: str, rid: str) -> None:
        """Free ``rid``'s state on ``model`` (ends its running segment there, if any)."""
        try:
            self._command(model, {"op": "release", "rid": rid})
        except Exception:  # noqa: BLE001 - best effort, like a dropped connection
            logger.exception("release of %s on %s failed", rid, model)

    def call(self, model: str, op: str, settings: Optional[Dict[str, Any]] = None,
             timeout_s: float = 60.0) -> Dict[str, Any]:
        """``stats`` or ``configure`` on ``model``; returns the result dict.

        Raises:
            RuntimeError: the model reported an error.
            PeerChannelError: no answer within ``timeout_s`` seconds.
        """
        seg, q = self._open()
        try:
            self._command(model, {"op": op, "seg": seg, "reply": self.reply_endpoint,
                                  "settings": settings or {}})
            try:
                toks, ev = q.get(timeout=timeout_s)
            except queue.Empty:
                raise PeerChannelError(f"model {model} did not answer {op!r} in {timeout_s:.0f} s") from None
            if ev.get("kind") == "error":
                raise RuntimeError(ev.get("message") or f"model {model}: error")
            return ev.get("result") or {}
        finally:
            self._close_seg(seg)

    def close(self) -> None:
        """Stop the demultiplexer and close every socket."""
        self._stop.set()
        self._thread.join(timeout=5)
        with self._cmd_lock:
            for sock, _ in self._cmd.values():
                sock.close(0)
            self._cmd.clear()
        self._pull.close(0)
        _unlink_ipc(self.reply_endpoint)
