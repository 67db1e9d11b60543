"""Router side of the channel: :class:`PeerClient` (one DEALER connection per model replica) and
the router's ``remote_models`` parameter (:func:`parse_remote_models`)."""

from __future__ import annotations

import itertools
import json
import logging
import os
import queue
import threading
import time
import uuid
from typing import Any, Callable, Dict, List, Optional, Tuple

import zmq

from ...proc import process_alive, process_start_time
from ...protocol import Answer, Cancelled, Event, Finished, OpWire, Ping, encode_op
from ..curve import HandshakeLog, is_tcp
from ..replicas import Link, Replicas
from ..segments import DownMarks, PeerChannelError, PeerDownError, SegmentTransport
from .wire import SharedSocket, event_of_frames, handle_all, make_socket, op_frames

logger = logging.getLogger("tokenrouter.routing.peer")

__all__ = ["PeerClient", "parse_remote_models"]


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


class PeerClient(SegmentTransport):
    """Router side of the channel: a :class:`~tokenrouter.routing.segments.Transport` of
    :func:`tokenrouter.routing.router_core.drive` (segments and calls from
    :class:`~tokenrouter.routing.segments.SegmentTransport`).

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
        tick_s: while waiting, :meth:`segment` yields a ``TICK`` event every
            ``tick_s`` seconds so the caller can check cancellation (and at once on
            :meth:`interrupt`).
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
        super().__init__(tick_s, stall_timeout_s)
        self._replicas = Replicas(self._segments, DownMarks(on_down), self._wake, on_up)
        self.remote = dict(remote or {})
        for model, eps in self.remote.items():
            self._replicas.set_remote(model, [self._connect(model, ep, remote=True) for ep in eps])
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._io_loop, name="peer-io", daemon=True)
        self._thread.start()

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
        sock = make_socket(self._ctx, zmq.DEALER, tcp)
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
        link.shared, link.monitor = SharedSocket(sock), monitor
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
                    handle_all(link.shared.receive(), lambda f, link=link: self._dispatch(link, f),
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
        seg, toks, ev = event_of_frames(frames)
        link.heard = time.monotonic()
        if seg == 0:  # a heartbeat's answer
            if isinstance(ev, Answer) and ev.kind == "pong":
                instance = str(ev.result.get("instance") or "")
                for rid in self._replicas.answered(link, instance):  # it was only slow: free what
                    self._send(link, 0, OpWire("release", rid))  # the failed requests held there
            return
        # a response of a segment already closed is dropped
        self._segments.put(seg, (toks, ev))

    def _heartbeats(self, now: float) -> None:
        """Ping every heartbeat link; find silent ones down (I/O thread)."""
        ping = op_frames({"seg": 0, **self._me}, encode_op(Ping()))
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

    def _send(self, link: Link, seg: int, wire: OpWire) -> None:
        """Send a command on ``link`` from this thread (dropped if the link was closed meanwhile:
        it is down then, and its segments have been told so)."""
        if link.shared is not None:
            link.shared.send(op_frames({"seg": seg, **self._me}, wire))

    # ----------------------------------------------------------- transport
    def _start(self, model: str, wire: OpWire) -> Tuple[int, "queue.Queue", Optional[Callable[[Event], None]]]:
        """Pick the replica (a ``run``: the one holding the request, if any; a call: any live one),
        register a segment on it (then check its down mark: no lost wake-up) and send ``wire``.

        Raises:
            PeerDownError: no replica of ``model`` is up (the replica holding the request, for a ``run``).
        """
        self._ensure_local(model)
        rid = wire.rid if wire.op == "run" else None
        link = self._replicas.pick(model, rid)
        seg, q = self._segments.open(link)
        try:
            if link.down is not None:
                raise PeerDownError(link.model, link.down)
            self._send(link, seg, wire)
        except BaseException:
            self._segments.close(seg)
            raise

        def seen(ev: Event) -> None:
            if rid is not None and isinstance(ev, (Finished, Cancelled)):
                self._replicas.unhome(link, rid)  # its state there is gone
        return seg, q, seen

    def release(self, model: str, rid: str) -> None:
        """Free ``rid``'s state on ``model`` (on the replica holding it; ends its running segment there).

        Nothing is sent when no replica holds it or the one that did is down (its
        state went with its process, or is released when it answers again).
        """
        link = self._replicas.take_home(model, rid)
        if link is not None and link.down is None:
            self._send(link, 0, OpWire("release", rid))

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
