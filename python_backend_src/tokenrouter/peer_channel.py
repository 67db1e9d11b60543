"""ZeroMQ inter-model channel: the router's handoffs without Triton round trips.

Paper §Design, "Three decoupled loops": the inter-model loop forwards a
handing-off model's PeerReq to the peer over ZeroMQ.  Here each model
subserver listens on its own endpoint (:class:`PeerServer`, a PULL socket
inside the model's Triton stub process) and the router drives requests through
a :class:`PeerClient` — the *transport* of :func:`tokenrouter.router_core.drive`.

Wire format (multipart messages, two frames each):

* command, router → model: ``[meta JSON, tokens]`` with meta
  ``{"op": "run"|"release"|"stats"|"configure"|"events"|"ping", "seg": int, "reply": endpoint,
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

__all__ = ["PeerServer", "PeerClient", "PeerChannelError", "PeerDownError", "default_endpoint",
           "process_start_time", "process_alive", "advert_path", "write_advert", "read_advert"]

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


def process_start_time(pid: int) -> Optional[int]:
    """Start time of process ``pid`` in clock ticks since boot (``/proc/<pid>/stat`` field 22),
    or None when there is no such process or it is a zombie (exited, not yet reaped).

    Together with the pid it identifies one process (a pid can be reused).
    """
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            stat = f.read()
    except (OSError, ValueError):
        return None
    fields = stat[stat.rfind(b")") + 2:].split()
    if not fields or fields[0] in (b"Z", b"X"):
        return None
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def process_alive(pid: int, start_time: Optional[int]) -> bool:
    """True while process ``pid`` (started at ``start_time``, see :func:`process_start_time`) runs."""
    now = process_start_time(pid)
    return now is not None and (start_time is None or now == start_time)


def default_endpoint(role: str) -> str:
    """A fresh ``ipc://`` endpoint in the temporary directory, unique to this process.

    Args:
        role: a short label (model name or ``router``) included in the file name.
    """
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in role)[:40]
    return f"ipc://{tempfile.gettempdir()}/tokenrouter-{os.getpid()}-{safe}-{uuid.uuid4().hex[:8]}"


def advert_path(model: str, server_pid: Optional[int] = None, kind: str = "peer") -> str:
    """Path of the file in which ``model`` advertises its endpoint and process.

    One per model and tritonserver process (``server_pid``, default the parent
    of this Triton stub), in the temporary directory; ``kind`` is ``peer`` (an
    LLM model, read by the router) or ``router`` (a router, watched by the models).
    """
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in model)[:80]
    pid = os.getppid() if server_pid is None else int(server_pid)
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

    pid = os.getppid() if server_pid is None else int(server_pid)
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
    request's state (fire and forget); ``stats``, ``configure`` and ``events``
    answer one ``result`` (``configure`` takes the keyword arguments of
    ``Subserver.reconfigure`` or, when ``configure_fn`` is given, whatever it
    accepts; ``events`` is answered by ``events_fn``).

    Args:
        subserver: the model's subserver.
        endpoint: ZeroMQ endpoint to bind (default: a fresh ``ipc://`` path).
        configure_fn: optional callable(settings dict) applying a ``configure`` command.
        events_fn: optional callable(settings) → result dict answering an ``events``
            command (the model's recent routing events, see
            :class:`tokenrouter.event_ring.EventRing`); without it ``events`` is an
            unknown op.

    Raises:
        zmq.ZMQError: the endpoint cannot be bound.
    """

    def __init__(self, subserver, endpoint: Optional[str] = None,
                 configure_fn: Optional[Callable[[Dict[str, Any]], None]] = None,
                 events_fn: Optional[Callable[[Any], Dict[str, Any]]] = None):
        self.subserver = subserver
        self._events = events_fn
        self.endpoint = endpoint or default_endpoint(subserver.name)
        self._configure = configure_fn or (lambda s: subserver.reconfigure(**s))
        self._ctx = zmq.Context.instance()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(self.endpoint)
        self._replies: Dict[str, Any] = {}
        self._send_lock = threading.Lock()
        self._stop = threading.Event()
        # requests by the router process that sent them: released when that process dies
        self._routers: Dict[Tuple[int, Optional[int]], set] = {}
        self._routers_lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name=f"peer-io-{subserver.name}", daemon=True)
        self._thread.start()
        self._watch = threading.Thread(target=self._watch_routers, name=f"peer-watch-{subserver.name}",
                                       daemon=True)
        self._watch.start()

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

    def _sink(self, reply: str, seg: int, meta: Optional[Dict[str, Any]] = None, rid: str = ""):
        def sink(kind: str, tokens: List[int], info: Dict[str, Any]) -> None:
            if rid and kind in ("finished", "cancelled", "error"):
                self._forget(meta or {}, rid)  # the request's state is gone on this model
            self._send(reply, {"seg": seg, "kind": kind, **info}, tokens)
        return sink

    # ------------------------------------------------------------- I/O loop
    def _loop(self) -> None:
        _recv_loop(self._pull, self._stop, self._handle, f"peer channel of {self.subserver.name}")

    def _handle(self, frames: List[bytes]) -> None:
        from .protocol import PeerReq

        meta = json.loads(frames[0])
        op, seg, reply = meta.get("op"), int(meta.get("seg", 0)), meta.get("reply")
        if op == "ping":
            if reply:
                self._send(reply, {"seg": seg, "kind": "result", "result": {"pid": os.getpid()}}, [])
            return
        if op == "release":
            self._forget(meta, str(meta["rid"]))
            self.subserver.release(str(meta["rid"]))
            return
        if not reply:
            raise ValueError(f"command {op!r} without a reply endpoint")
        try:
            if op == "run":
                pr = PeerReq.from_wire(meta.get("header") or "{}", _tokens_list(frames[1] if len(frames) > 1 else b""))
                if meta.get("rid") and pr.rid != meta["rid"]:
                    pr.rid = str(meta["rid"])
                self._remember(meta, pr.rid)
                self.subserver.submit(pr, self._sink(reply, seg, meta, pr.rid))
            elif op == "stats":
                self._send(reply, {"seg": seg, "kind": "result", "result": self.subserver.stats()}, [])
            elif op == "configure":
                self._configure(meta.get("settings") or {})
                self._send(reply, {"seg": seg, "kind": "result", "result": {}}, [])
            elif op == "events" and self._events is not None:
                self._send(reply, {"seg": seg, "kind": "result", "result": self._events(meta.get("settings"))}, [])
            else:
                ops = "run, release, stats, configure" + (", events" if self._events is not None else "")
                raise ValueError(f"unknown op {op!r}; expected {ops} or ping")
        except Exception as e:  # noqa: BLE001 - answer this command only
            self._send(reply, {"seg": seg, "kind": "error", "message": f"model {self.subserver.name}: {e}"}, [])

    # ------------------------------------------------ routers that went away
    @staticmethod
    def _router_key(meta: Dict[str, Any]) -> Optional[Tuple[int, Optional[int]]]:
        pid = meta.get("router_pid")
        return (int(pid), meta.get("router_start")) if pid else None

    def _remember(self, meta: Dict[str, Any], rid: str) -> None:
        key = self._router_key(meta)
        if key is not None:
            with self._routers_lock:
                self._routers.setdefault(key, set()).add(rid)

    def _forget(self, meta: Dict[str, Any], rid: str) -> None:
        key = self._router_key(meta)
        with self._routers_lock:
            for k, rids in list(self._routers.items()):
                if key is None or k == key:
                    rids.discard(rid)
                    if not rids:
                        del self._routers[k]

    def _watch_routers(self, interval_s: float = 0.5) -> None:
        """Release every request of a router process that died (its KV would otherwise stay held)."""
        while not self._stop.wait(interval_s):
            with self._routers_lock:
                gone = [k for k in self._routers if not process_alive(*k)]
                rids = [rid for k in gone for rid in self._routers.pop(k)]
            for rid in rids:
                try:
                    self.subserver.release(rid)
                except Exception:  # noqa: BLE001
                    logger.exception("release of %s (router gone) failed", rid)
            if rids:
                logger.warning("model %s: released %d request(s) of a router process that exited",
                               self.subserver.name, len(rids))

    def close(self) -> None:
        """Stop the I/O thread and close the sockets (the subserver is left running)."""
        self._stop.set()
        self._thread.join(timeout=5)
        self._watch.join(timeout=2)
        with self._send_lock:
            for s in self._replies.values():
                s.close(0)
            self._replies.clear()
        self._pull.close(0)
        _unlink_ipc(self.endpoint)


class PeerClient:
    """Router side of the channel: the transport of :func:`tokenrouter.router_core.drive`.

    Liveness: when ``resolve`` reports the model's process id (same host, as
    with ``ipc://`` endpoints), a monitor thread checks every
    ``liveness_interval_s`` seconds that the process still runs.  When it has
    gone, the model is marked *down*: every open segment on it ends at once
    with :class:`PeerDownError` naming the model, new commands to it raise the
    same error without waiting, and ``on_down(model, reason)`` is called (the
    router starts its recovery there).  :meth:`mark_up` / :meth:`rediscover`
    bring it back with a freshly resolved endpoint.

    Args:
        resolve: callable(model name) → that model's endpoint, either a string
            or a dict ``{"endpoint": str, "pid": int, "start": int}`` (called
            once per model, then cached until the model is marked down).
        stall_timeout_s: a segment whose model sends nothing for this long fails
            with :class:`PeerChannelError` (seconds; 0 = wait forever).
        tick_s: while waiting, :meth:`segment` yields a ``{"kind": "tick"}``
            event every ``tick_s`` seconds so the caller can check cancellation.
        on_down: optional callable(model, reason) called once each time a model
            is marked down (from the monitor thread).
        liveness_interval_s: seconds between two liveness checks (detection
            latency is at most about this).
    """

    def __init__(self, resolve: Callable[[str], Any], stall_timeout_s: float = 600.0, tick_s: float = 0.05,
                 on_down: Optional[Callable[[str, str], None]] = None, liveness_interval_s: float = 0.25):
        self._resolve = resolve
        self.stall_timeout_s = float(stall_timeout_s)
        self.tick_s = float(tick_s)
        self._on_down = on_down
        self.liveness_interval_s = float(liveness_interval_s)
        self._ctx = zmq.Context.instance()
        self.reply_endpoint = default_endpoint("router")
        self._me = {"router_pid": os.getpid(), "router_start": process_start_time(os.getpid())}
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(self.reply_endpoint)
        self._cmd: Dict[str, Tuple[Any, threading.Lock]] = {}
        self._cmd_lock = threading.Lock()
        self._procs: Dict[str, Tuple[int, Optional[int]]] = {}  # model -> (pid, start time)
        self._down: Dict[str, str] = {}  # model -> reason
        self._segs: Dict[int, Tuple[str, "queue.Queue"]] = {}
        self._segs_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._demux, name="peer-demux", daemon=True)
        self._thread.start()
        self._monitor = threading.Thread(target=self._watch, name="peer-liveness", daemon=True)
        self._monitor.start()

    # ------------------------------------------------------------ internals
    def _demux(self) -> None:
        _recv_loop(self._pull, self._stop, self._dispatch, "peer channel (router)")

    def _dispatch(self, frames: List[bytes]) -> None:
        meta = json.loads(frames[0])
        toks = _tokens_list(frames[1] if len(frames) > 1 else b"")
        with self._segs_lock:
            entry = self._segs.get(int(meta.pop("seg", 0)))
        if entry is not None:  # else: a response of a segment already closed
            entry[1].put((toks, meta))

    def _socket(self, model: str):
        with self._cmd_lock:
            if model in self._down:
                raise PeerDownError(model, self._down[model])
            entry = self._cmd.get(model)
            if entry is None:
                entry = self._connect(model, self._resolve(model))
            return entry

    def _connect(self, model: str, resolved: Any):
        """Connect to a resolved endpoint (caller holds ``_cmd_lock``)."""
        if isinstance(resolved, dict):
            endpoint = str(resolved["endpoint"])
            if resolved.get("pid"):
                pid = int(resolved["pid"])
                start = resolved.get("start")
                if start is None:
                    start = process_start_time(pid)
                self._procs[model] = (pid, start)
        else:
            endpoint = str(resolved)
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        entry = self._cmd[model] = (sock, threading.Lock())
        return entry

    def _command(self, model: str, meta: Dict[str, Any], tokens=()) -> None:
        sock, lock = self._socket(model)
        data = [json.dumps({**meta, **self._me}, separators=(",", ":")).encode(), _tokens_frame(list(tokens))]
        with lock:
            sock.send_multipart(data, copy=False)

    def _open(self, model: str) -> Tuple[int, "queue.Queue"]:
        seg, q = next(self._ids), queue.Queue()
        with self._segs_lock:
            self._segs[seg] = (model, q)
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

    # ------------------------------------------------------------ liveness
    def _watch(self) -> None:
        while not self._stop.wait(self.liveness_interval_s):
            with self._cmd_lock:
                procs = list(self._procs.items())
            for model, (pid, start) in procs:
                if not process_alive(pid, start):
                    self.mark_down(model, f"model {model} is down: its process (pid {pid}) exited")

    def mark_down(self, model: str, reason: str) -> bool:
        """Mark ``model`` down: fail its open segments with :class:`PeerDownError` and refuse new commands.

        Returns:
            True when the model was up until now (``on_down`` is then called).
        """
        with self._cmd_lock:
            was_up = model not in self._down
            self._down[model] = reason
            self._procs.pop(model, None)
            entry = self._cmd.pop(model, None)
            if entry is not None:
                entry[0].close(0)
        with self._segs_lock:
            queues = [q for m, q in self._segs.values() if m == model]
        for q in queues:
            q.put(([], {"kind": "peer_down", "model": model, "message": reason}))
        if was_up:
            logger.error("%s", reason)
            if self._on_down is not None:
                try:
                    self._on_down(model, reason)
                except Exception:  # noqa: BLE001
                    logger.exception("on_down(%s) failed", model)
        return was_up

    def mark_up(self, model: str, resolved: Any) -> None:
        """Use a freshly resolved endpoint for ``model`` (same forms as ``resolve`` returns) and clear its down mark."""
        with self._cmd_lock:
            old = self._cmd.pop(model, None)
            if old is not None:
                old[0].close(0)
            self._procs.pop(model, None)
            self._connect(model, resolved)
            self._down.pop(model, None)
        logger.warning("model %s is up again", model)

    def down(self) -> Dict[str, str]:
        """Models marked down now: ``{model: reason}``."""
        with self._cmd_lock:
            return dict(self._down)

    def is_down(self, model: str) -> bool:
        """True while ``model`` is marked down."""
        with self._cmd_lock:
            return model in self._down

    # ----------------------------------------------------------- transport
    def segment(self, model: str, rid: str, tokens: List[int], header: str) -> Iterator[Tuple[List[int], dict]]:
        """One visit of ``rid`` to ``model``: yield ``(committed token ids, event)`` until a final event.

        Between responses a ``([], {"kind": "tick"})`` is yielded every ``tick_s`` seconds.

        Raises:
            RuntimeError: the model reported an error.
            PeerDownError: the model is down, or went down during the segment.
            PeerChannelError: the model sent nothing for ``stall_timeout_s``.
        """
        seg, q = self._open(model)
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
                if ev.get("kind") == "peer_down":
                    raise PeerDownError(model, ev.get("message") or f"model {model} is down")
                if ev.get("kind") == "error":
                    raise RuntimeError(ev.get("message") or f"model {model}: error")
                yield toks, ev
                if ev.get("kind") in FINAL:
                    return
        finally:
            self._close_seg(seg)

    def release(self, model: str, rid: str) -> None:
        """Free ``rid``'s state on ``model`` (ends its running segment there, if any).

        Nothing is sent to a model marked down (its state went with its process).
        """
        if self.is_down(model):
            return
        try:
            self._command(model, {"op": "release", "rid": rid})
        except PeerDownError:
            pass
        except Exception:  # noqa: BLE001 - best effort, like a dropped connection
            logger.exception("release of %s on %s failed", rid, model)

    def call(self, model: str, op: str, settings: Optional[Dict[str, Any]] = None,
             timeout_s: float = 60.0) -> Dict[str, Any]:
        """``stats``, ``configure``, ``events`` or ``ping`` on ``model``; returns the result dict.

        Raises:
            RuntimeError: the model reported an error.
            PeerDownError: the model is down.
            PeerChannelError: no answer within ``timeout_s`` seconds.
        """
        seg, q = self._open(model)
        try:
            self._command(model, {"op": op, "seg": seg, "reply": self.reply_endpoint,
                                  "settings": settings or {}})
            try:
                toks, ev = q.get(timeout=timeout_s)
            except queue.Empty:
                raise PeerChannelError(f"model {model} did not answer {op!r} in {timeout_s:.0f} s") from None
            if ev.get("kind") == "peer_down":
                raise PeerDownError(model, ev.get("message") or f"model {model} is down")
            if ev.get("kind") == "error":
                raise RuntimeError(ev.get("message") or f"model {model}: error")
            return ev.get("result") or {}
        finally:
            self._close_seg(seg)

    def fail_all(self, message: str) -> None:
        """End every open segment with :class:`PeerDownError` ``message`` (used at shutdown)."""
        with self._segs_lock:
            entries = list(self._segs.values())
        for model, q in entries:
            q.put(([], {"kind": "peer_down", "model": model, "message": message}))

    def close(self) -> None:
        """Stop the demultiplexer and the liveness monitor and close every socket."""
        self._stop.set()
        self._thread.join(timeout=5)
        self._monitor.join(timeout=2)
        with self._cmd_lock:
            for sock, _ in self._cmd.values():
                sock.close(0)
            self._cmd.clear()
        self._pull.close(0)
        _unlink_ipc(self.reply_endpoint)
