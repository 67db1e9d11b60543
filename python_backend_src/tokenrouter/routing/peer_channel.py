"""ZeroMQ inter-model channel: the router's handoffs without Triton round trips.

Paper §Design, "Three decoupled loops": the inter-model loop forwards a
handing-off model's PeerReq to the peer over ZeroMQ.  Here each model
subserver listens on its own endpoint (:class:`PeerServer`, a ROUTER socket
inside the model's Triton stub process) and the router drives requests through
a :class:`PeerClient` — the *transport* of :func:`tokenrouter.routing.router_core.drive`.

Endpoints: ``ipc://`` (default: a fresh path in the temporary directory; the
router finds it through the model's advert file or a BLS call) for models in
the router's tritonserver, ``tcp://`` for models served by other servers (the
router's ``remote_models``; CURVE-authenticated and encrypted by default, see
:mod:`tokenrouter.routing.curve`).

Connections: the router connects one DEALER socket per model replica; every
answer comes back on the connection its command went out on, so only the
router dials (no connection from a model to a router: NAT and Kubernetes
services are fine).

Wire format (multipart messages; the model's ROUTER socket adds/strips the
connection identity frame):

* command, router → model: ``[meta JSON, tokens]`` with meta
  ``{"op": "run"|"release"|"ping"|"stats"|"configure"|"events", "seg": int, "rid": str,
  "header": PeerReq header JSON | "settings": {...}, "router_pid", "router_start"}``
  and tokens the int64 little-endian token suffix the model has not seen
  (``run`` only);
* response, model → router: ``[meta JSON, tokens]`` with meta
  ``{"seg": int, "kind": "tokens"|"handoff"|"finished"|"cancelled"|"error"|"result", …}``
  and tokens the committed token ids of this chunk.

``seg`` identifies one visit of a request to a model (a *segment*); responses
of a segment the router has already closed are dropped.  ``seg`` 0 is the
router's heartbeat (``ping``; see :class:`PeerClient`).

Threading: a ZeroMQ socket is not thread-safe, so each is used under a lock
(:class:`_SharedSocket`): the threads that produce messages (the model's decode
loop, the router's request workers) send them themselves; one I/O thread per
side waits on the sockets' file descriptors and receives.
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

from ..proc import process_alive, process_start_time
from ..proc import server_pid as stub_server_pid
from .curve import HandshakeLog, is_tcp
from .replicas import Link, Replicas
from .segments import DownMarks, PeerChannelError, PeerDownError, Segments

logger = logging.getLogger(__name__)

__all__ = ["PeerServer", "PeerClient", "PeerChannelError", "PeerDownError", "default_endpoint",
           "advert_path", "write_advert", "read_advert", "parse_remote_models"]


def default_endpoint(role: str) -> str:
    """A fresh ``ipc://`` endpoint in the temporary directory, unique to this process.

    Args:
        role: a short label (model name or ``router``) included in the file name.
    """
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in role)[:40]
    return f"ipc://{tempfile.gettempdir()}/tokenrouter-{os.getpid()}-{safe}-{uuid.uuid4().hex[:8]}"


def advert_path(model: str, server_pid: Optional[int] = None, kind: str = "peer") -> str:
    """Path of the file in which ``model`` advertises its endpoint and process.

    One per model and tritonserver process (``server_pid``, default the
    tritonserver of this Triton stub, :func:`tokenrouter.proc.server_pid`, still
    right after that server died), in the temporary directory; ``kind`` is ``peer`` (an
    LLM model, read by the router) or ``router`` (a router, watched by the models).
    """
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in model)[:80]
    pid = stub_server_pid() if server_pid is None else int(server_pid)
    return os.path.join(tempfile.gettempdir(), f"tokenrouter-{pid}-{safe}.{kind}.json")


def write_advert(model: str, endpoint: str, kind: str = "peer") -> str:
    """Advertise ``endpoint`` and this process (pid, start time) for ``model``; returns the file's path.

    A previous advert of the same model whose process is gone (a killed stub
    that Triton restarted) is replaced, and its ``ipc://`` socket file removed.
    """
    path = advert_path(model, kind=kind)
    old = read_advert(model, alive_only=False, kind=kind)
    if old and old.get("pid") != os.getpid() and not process_alive(old["pid"], old.get("start")):
        _unlink_ipc(str(old.get("endpoint", "")))
    me = {"endpoint": endpoint, "pid": os.getpid(), "start": process_start_time(os.getpid()), "model": model}
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(me, f)
    os.replace(tmp, path)
    return path


def read_advert(model: str, server_pid: Optional[int] = None, alive_only: bool = True,
                kind: str = "peer") -> Optional[Dict[str, Any]]:
    """The advert of ``model`` (``{"endpoint", "pid", "start", "model"}``), or None when there
    is none or (``alive_only``) its process is gone."""
    try:
        with open(advert_path(model, server_pid, kind), encoding="utf-8") as f:
            adv = json.load(f)
        int(adv["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if alive_only and not process_alive(int(adv["pid"]), adv.get("start")):
        return None
    return adv


def remove_advert(model: str, kind: str = "peer") -> None:
    """Remove this process's advert of ``model`` (at finalize); another process's is left alone."""
    adv = read_advert(model, alive_only=False, kind=kind)
    if adv and adv.get("pid") == os.getpid():
        try:
            os.unlink(advert_path(model, kind=kind))
        except OSError:
            pass


def dead_routers(server_pid: Optional[int] = None) -> List[str]:
    """Names of router models of this tritonserver whose advertised process is gone
    (killed or crashed without being unloaded)."""
    import glob

    pid = stub_server_pid() if server_pid is None else int(server_pid)
    out = []
    for path in glob.glob(os.path.join(tempfile.gettempdir(), f"tokenrouter-{pid}-*.router.json")):
        try:
            with open(path, encoding="utf-8") as f:
                adv = json.load(f)
            if not process_alive(int(adv["pid"]), adv.get("start")):
                out.append(str(adv["model"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


def _tokens_frame(tokens) -> bytes:
    return np.asarray(tokens, dtype="<i8").tobytes()


def _tokens_list(frame: bytes) -> List[int]:
    return np.frombuffer(frame, dtype="<i8").tolist() if frame else []


def _meta_frame(meta: Dict[str, Any]) -> bytes:
    return json.dumps(meta, separators=(",", ":")).encode()


def _unlink_ipc(endpoint: str) -> None:
    if endpoint.startswith("ipc://"):
        try:
            os.unlink(endpoint[len("ipc://"):])
        except OSError:
            pass


def _socket(ctx, kind: int, tcp: bool = False):
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


class _SharedSocket:
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


def _handle_all(messages: List[List[bytes]], handle: Callable[[List[bytes]], None], what: str) -> None:
    for frames in messages:
        try:
            handle(frames)
        except Exception:  # noqa: BLE001 - one bad message must not stop the channel
            logger.exception("%s: bad message dropped", what)


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
        self._sock = _socket(self._ctx, zmq.ROUTER, self._tcp)
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
        self._shared = _SharedSocket(self._sock)
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
        self._shared.send([ident, _meta_frame(meta), _tokens_frame(list(tokens))])

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
            _handle_all(self._shared.receive(), self._handle, what)  # also after a timeout: cheap, never stuck
            if self._handshakes is not None and self._handshakes.socket in events:
                self._handshakes.handle()

    def _handle(self, frames: List[bytes]) -> None:
        from ..protocol import PeerReq

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
                pr = PeerReq.from_wire(meta.get("header") or "{}", _tokens_list(frames[2] if len(frames) > 2 else b""))
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
        _unlink_ipc(self.endpoint)


def parse_remote_models(text: str) -> Dict[str, List[str]]:
    """The router's ``remote_models`` parameter: ``{"llm": "tcp://h:p"}`` or ``{"llm": ["tcp://h1:p", …]}``.

    Returns:
        ``{model: [endpoint, …]}`` (one endpoint per replica, order kept).

    Raises:
        ValueError: not a JSON object of endpoint strings or non-empty lists of them,
            an endpoint without a ``tcp://``/``ipc://`` scheme, or one listed twice.
    """
    if not str(text or "").strip():
        return {}
    try:
        raw = json.loads(text)
    except ValueError as e:
        raise ValueError(f"remote_models is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError('remote_models must be a JSON object like {"llm": "tcp://host:port"}')
    out: Dict[str, List[str]] = {}
    for model, eps in raw.items():
        eps = [eps] if isinstance(eps, str) else eps
        if not isinstance(eps, list) or not eps or not all(isinstance(e, str) for e in eps):
            raise ValueError(f"remote_models[{model!r}] must be an endpoint or a non-empty list of endpoints")
        for e in eps:
            if not e.startswith(("tcp://", "ipc://")):
                raise ValueError(f"remote_models[{model!r}]: endpoint {e!r} must start with tcp:// or ipc://")
        if len(set(eps)) != len(eps):
            raise ValueError(f"remote_models[{model!r}] lists an endpoint twice")
        out[str(model)] = list(eps)
    return out


class PeerClient:
    """Router side of the channel: the transport of :func:`tokenrouter.routing.router_core.drive`.

    One DEALER connection per model replica: request workers send their
    commands on it themselves, one I/O thread receives every model's answers
    (which come back on the connection the command went out on) and sends the
    heartbeats.

    Models: a model of the static ``remote`` map is reached at its listed
    endpoints (one per replica); any other model's endpoint comes from
    ``resolve`` (once, then cached until the model is marked down and up again).

    Replicas: a request's first segment on a model goes to the live replica
    holding the fewest requests (ties in turn); later segments and its release
    go to the same replica, which holds its state (KV, pending state).

    Liveness: a local model whose process id is known (``resolve`` reports it,
    same host as with ``ipc://`` endpoints) is watched every
    ``liveness_interval_s`` seconds.  Remote replicas (and any ``tcp://``
    endpoint) are pinged every ``heartbeat_s`` seconds and found down after
    ``heartbeat_timeout_s`` seconds without any message; a remote replica is up
    again at its first answer (nothing is restarted: that is its own server's
    job).  A replica found down ends every open segment on it at once with
    :class:`PeerDownError` naming the model; when no replica of a model is left,
    the model is *down*: new commands to it raise the same error without waiting,
    and ``on_down(model, reason)`` is called; ``on_up(model)`` when a remote model
    is back.  :meth:`mark_down` / :meth:`mark_up` do the same for local models.

    Args:
        resolve: callable(model name) → that model's endpoint, either a string
            or a dict ``{"endpoint": str, "pid": int, "start": int}``.
        stall_timeout_s: a segment whose model sends nothing for this long fails
            with :class:`PeerChannelError` (seconds; 0 = wait forever).
        tick_s: while waiting, :meth:`segment` yields a ``{"kind": "tick"}``
            event every ``tick_s`` seconds so the caller can check cancellation
            (and at once on :meth:`interrupt`).
        on_down: optional callable(model, reason) called once each time a model
            is marked down (from the I/O thread or the caller of ``mark_down``).
        liveness_interval_s: seconds between two process checks of local models.
        remote: ``{model: [endpoint, …]}`` of models served elsewhere (see
            :func:`parse_remote_models`).
        curve: :class:`~tokenrouter.routing.curve.CurveClient` for ``tcp://`` endpoints, or None.
        heartbeat_s: seconds between two pings of a remote replica.
        heartbeat_timeout_s: seconds without an answer after which a remote replica is down.
        on_up: optional callable(model) called when a remote model that was down answers again.
    """

    def __init__(self, resolve: Callable[[str], Any], stall_timeout_s: float = 600.0, tick_s: float = 0.05,
                 on_down: Optional[Callable[[str, str], None]] = None, liveness_interval_s: float = 0.25,
                 remote: Optional[Dict[str, List[str]]] = None, curve=None, heartbeat_s: float = 0.5,
                 heartbeat_timeout_s: float = 2.0, on_up: Optional[Callable[[str], None]] = None):
        if not 0 < heartbeat_s < heartbeat_timeout_s:
            raise ValueError(f"need 0 < heartbeat_s ({heartbeat_s}) < heartbeat_timeout_s ({heartbeat_timeout_s})")
        self._resolve = resolve
        self.liveness_interval_s = float(liveness_interval_s)
        self.heartbeat_s, self.heartbeat_timeout_s = float(heartbeat_s), float(heartbeat_timeout_s)
        self._curve = curve
        self._me = {"router_pid": os.getpid(), "router_start": process_start_time(os.getpid())}
        self._ctx = zmq.Context()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._resolve_lock = threading.Lock()
        self._link_ids = itertools.count(1)
        self._segments = Segments(tick_s, stall_timeout_s)
        self._replicas = Replicas(self._segments, DownMarks(on_down), self._wake, on_up)
        self.remote = dict(remote or {})
        for model, eps in self.remote.items():
            self._replicas.set_remote(model, [self._connect(model, ep, remote=True) for ep in eps])
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._io_loop, name="peer-io", daemon=True)
        self._thread.start()

    @property
    def tick_s(self) -> float:
        """Seconds between two ``tick`` events of a waiting :meth:`segment`."""
        return self._segments.tick_s

    @property
    def stall_timeout_s(self) -> float:
        """Seconds of silence after which a segment fails (0 = wait forever)."""
        return self._segments.stall_timeout_s

    # ------------------------------------------------------------ sockets
    def _connect(self, model: str, endpoint: str, remote: bool, proc=None) -> Link:
        """A new link with its socket connected (the I/O thread polls it once it is installed).

        A remote replica whose endpoint cannot be used (bad address, CURVE key error) is
        returned down, with the reason and no socket.

        Raises:
            PeerChannelError: the same for a local model.
        """
        tcp = is_tcp(endpoint)
        link = Link(next(self._link_ids), model, endpoint, remote, heartbeat=remote or tcp, proc=proc)
        sock = _socket(self._ctx, zmq.DEALER, tcp)
        sock.setsockopt(zmq.ROUTING_ID, b"r" + uuid.uuid4().bytes)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        monitor = None
        try:
            if tcp and self._curve is not None:
                self._curve.secure(sock, model)
            if tcp:
                monitor = HandshakeLog(sock, f"router: connection to model {model} at {endpoint}")
            sock.connect(endpoint)
        except Exception as e:  # noqa: BLE001 - this replica is unusable; the others go on
            if monitor is not None:
                monitor.close()
            sock.close(0)
            reason = f"model {model} (replica at {endpoint}) is down: cannot connect: {e}"
            if not remote:
                raise PeerChannelError(reason) from None
            logger.error("%s", reason)
            link.down = reason
            return link
        link.shared, link.monitor = _SharedSocket(sock), monitor
        return link

    def _connect_local(self, model: str, resolved: Any) -> Link:
        """A link to a resolved local endpoint (a string, or a dict with ``endpoint`` and ``pid``)."""
        proc = None
        if isinstance(resolved, dict):
            endpoint = str(resolved["endpoint"])
            if resolved.get("pid"):
                pid = int(resolved["pid"])
                start = resolved.get("start")
                proc = (pid, process_start_time(pid) if start is None else start)
        else:
            endpoint = str(resolved)
        return self._connect(model, endpoint, remote=False, proc=proc)

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except (BlockingIOError, OSError):
            pass

    @staticmethod
    def _close_link(link: Link) -> None:
        if link.shared is not None:
            link.shared.close(link.monitor.close if link.monitor is not None else None)

    # ------------------------------------------------------------ I/O thread
    def _io_loop(self) -> None:
        """Receive every model's answers, send heartbeats, watch local processes."""
        version, links, poller = -1, [], None
        next_beat = next_proc = time.monotonic()
        try:
            while not self._stop.is_set():
                version, changed, retired = self._replicas.connected(version)
                if changed is not None:
                    links, poller = changed, None
                for link in retired:
                    self._close_link(link)
                if poller is None:
                    poller = zmq.Poller()
                    poller.register(self._wake_r, zmq.POLLIN)
                    for link in links:
                        poller.register(link.shared.fd, zmq.POLLIN)
                        poller.register(link.shared.wake_fd, zmq.POLLIN)
                        if link.monitor is not None:
                            poller.register(link.monitor.socket, zmq.POLLIN)
                now = time.monotonic()
                wait_ms = max(0, min(100, int(1000 * (min(next_beat, next_proc) - now)) + 1))
                events = dict(poller.poll(wait_ms))
                if self._wake_r in events:
                    try:
                        while os.read(self._wake_r, 4096):
                            pass
                    except (BlockingIOError, OSError):
                        pass
                for link in links:
                    _handle_all(link.shared.receive(), lambda f, link=link: self._dispatch(link, f),
                                f"peer channel ({link.model})")
                    if link.monitor is not None and link.monitor.socket in events:
                        link.monitor.handle()
                now = time.monotonic()
                if now >= next_beat:
                    next_beat = now + self.heartbeat_s
                    self._heartbeats(now)
                if now >= next_proc:
                    next_proc = now + self.liveness_interval_s
                    self._check_procs()
        finally:
            for link in self._replicas.drain():
                self._close_link(link)

    def _dispatch(self, link: Link, frames: List[bytes]) -> None:
        meta = json.loads(frames[0])
        link.heard = time.monotonic()
        seg = int(meta.pop("seg", 0))
        if seg == 0:  # a heartbeat's answer
            if meta.get("kind") == "result":
                instance = str((meta.get("result") or {}).get("instance") or "")
                for rid in self._replicas.answered(link, instance):  # it was only slow: free what
                    self._send(link, {"op": "release", "rid": rid})  # the failed requests held there
            return
        # a response of a segment already closed is dropped
        self._segments.put(seg, (_tokens_list(frames[1] if len(frames) > 1 else b""), meta))

    def _heartbeats(self, now: float) -> None:
        """Ping every heartbeat link; find silent ones down (I/O thread)."""
        ping = [_meta_frame({"op": "ping", "seg": 0, **self._me}), b""]
        for link in self._replicas.heartbeat_links():
            link.shared.send(ping)
            if link.down is None and now - link.heard > self.heartbeat_timeout_s:
                self._replicas.link_down(link, f"model {link.model} (replica at {link.endpoint}) is down: "
                                               f"no answer for {self.heartbeat_timeout_s:g} s")

    def _check_procs(self) -> None:
        for link in self._replicas.watched_links():
            pid, start = link.proc
            if not process_alive(pid, start):
                self._replicas.link_down(link, f"model {link.model} is down: its process (pid {pid}) exited")

    # ------------------------------------------------------------ down / up
    def mark_down(self, model: str, reason: str) -> bool:
        """Mark ``model`` down: fail its open segments with :class:`PeerDownError` and refuse new commands.

        Returns:
            True when the model was up until now (``on_down`` is then called).
        """
        return self._replicas.mark_down(model, reason)

    def mark_up(self, model: str, resolved: Any) -> None:
        """Use a freshly resolved endpoint for local ``model`` (same forms as ``resolve`` returns)
        and clear its down mark.

        Raises:
            ValueError: ``model`` is a remote model (it comes back by answering heartbeats).
            PeerChannelError: the endpoint cannot be connected to (the model stays as it was).
        """
        if model in self.remote:
            raise ValueError(f"model {model} is remote: it is up again when it answers heartbeats")
        self._replicas.install_local(model, self._connect_local(model, resolved), replace=True)
        logger.warning("model %s is up again", model)

    def down(self) -> Dict[str, str]:
        """Models marked down now (no replica left): ``{model: reason}``."""
        return self._replicas.marks.snapshot()

    def is_down(self, model: str) -> bool:
        """True while ``model`` is marked down."""
        return model in self._replicas.marks

    def replicas(self, model: str) -> List[Dict[str, Any]]:
        """State of ``model``'s replicas: ``[{"endpoint", "up", "requests", "reason"}]``."""
        return self._replicas.replicas(model)

    def wait_connected(self, timeout_s: float) -> List[str]:
        """Wait up to ``timeout_s`` seconds until every remote replica has answered a ping once.

        Returns:
            ``"model at endpoint"`` of the replicas that have not answered (empty: all have).
        """
        deadline = time.monotonic() + timeout_s
        while True:
            silent = self._replicas.silent_remote()
            if not silent or time.monotonic() >= deadline:
                return silent
            time.sleep(0.05)

    # ------------------------------------------------------------ commands
    def _ensure_local(self, model: str) -> None:
        """Resolve a local model's endpoint once (no lock held while ``resolve`` runs: a BLS call may take a while)."""
        if model in self.remote or self._replicas.known(model):
            return
        with self._resolve_lock:
            if self._replicas.known(model):
                return
            link = self._connect_local(model, self._resolve(model))
            if not self._replicas.install_local(model, link, replace=False):
                self._close_link(link)  # marked down meanwhile; never polled

    def _send(self, link: Link, meta: Dict[str, Any], tokens=()) -> None:
        """Send a command on ``link`` from this thread (dropped if the link was closed meanwhile:
        it is down then, and its segments have been told so)."""
        if link.shared is not None:
            link.shared.send([_meta_frame({**meta, **self._me}), _tokens_frame(list(tokens))])

    def _open(self, model: str, rid: Optional[str]) -> Tuple[Link, int, "queue.Queue"]:
        """Pick the replica and register a segment on it (then check its down mark: no lost wake-up).

        Raises:
            PeerDownError: no replica of ``model`` is up.
        """
        self._ensure_local(model)
        link = self._replicas.pick(model, rid)
        seg, q = self._segments.open(link)
        if link.down is not None:
            self._segments.close(seg)
            raise PeerDownError(link.model, link.down)
        return link, seg, q

    def interrupt(self) -> None:
        """Wake every segment waiting for a response: each yields one tick now.

        For a caller whose ``tick_s`` is long: when one of its requests is cancelled it
        calls this instead of having every waiting request poll.  A :meth:`call` waiting
        for its answer ignores the wake-up.
        """
        self._segments.interrupt()

    # ----------------------------------------------------------- transport
    def segment(self, model: str, rid: str, tokens: List[int], header: str) -> Iterator[Tuple[List[int], dict]]:
        """One visit of ``rid`` to ``model``: yield ``(committed token ids, event)`` until a final event.

        Between responses a ``([], {"kind": "tick"})`` is yielded every ``tick_s`` seconds.

        Raises:
            RuntimeError: the model reported an error.
            PeerDownError: the model (the replica holding the request) is down, or went down
                during the segment.
            PeerChannelError: the model sent nothing for ``stall_timeout_s``.
        """
        link, seg, q = self._open(model, rid)
        try:
            self._send(link, {"op": "run", "seg": seg, "rid": rid, "header": header}, tokens)
        except BaseException:
            self._segments.close(seg)
            raise

        def check(_toks, ev) -> bool:
            if ev.get("kind") in ("finished", "cancelled"):
                self._replicas.unhome(link, rid)  # its state there is gone
            return True

        yield from self._segments.responses(model, seg, q, check)

    def release(self, model: str, rid: str) -> None:
        """Free ``rid``'s state on ``model`` (on the replica holding it; ends its running segment there).

        Nothing is sent when no replica holds it or the one that did is down (its
        state went with its process, or is released when it answers again).
        """
        link = self._replicas.take_home(model, rid)
        if link is not None and link.down is None:
            self._send(link, {"op": "release", "rid": rid})

    def call(self, model: str, op: str, settings: Optional[Dict[str, Any]] = None,
             timeout_s: float = 60.0) -> Dict[str, Any]:
        """``stats``, ``configure``, ``events`` or ``ping`` on ``model`` (a live replica of it); returns the result dict.

        Raises:
            RuntimeError: the model reported an error.
            PeerDownError: the model is down.
            PeerChannelError: no answer within ``timeout_s`` seconds.
        """
        link, seg, q = self._open(model, None)
        try:
            self._send(link, {"op": op, "seg": seg, "settings": settings or {}})
            deadline = time.monotonic() + timeout_s
            item = None
            while item is None:  # None: an interrupt() meant for the waiting segments
                try:
                    item = q.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    raise PeerChannelError(f"model {model} did not answer {op!r} in {timeout_s:.0f} s") from None
            toks, ev = item
            if ev.get("kind") == "peer_down":
                raise PeerDownError(model, ev.get("message") or f"model {model} is down")
            if ev.get("kind") == "error":
                raise RuntimeError(ev.get("message") or f"model {model}: error")
            return ev.get("result") or {}
        finally:
            self._segments.close(seg)

    def fail_all(self, message: str) -> None:
        """End every open segment with :class:`PeerDownError` ``message`` (used at shutdown)."""
        self._segments.fail(message)

    def close(self) -> None:
        """Stop the I/O thread and close every socket."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake()
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            for fd in (self._wake_r, self._wake_w):
                os.close(fd)
            self._ctx.term()
