"""The router's replicas of each model over ZeroMQ: which are up, and which holds which request.

:class:`~tokenrouter.routing.peer.PeerClient` owns the sockets and the I/O thread;
this module owns the bookkeeping they act on (no sockets are opened or closed here):

* a request's first segment on a model goes to the live replica holding the fewest
  requests (ties in turn); its later segments and its release go to the same replica,
  which holds its state (KV, pending state; paper §Design, "pending" and "resumed");
* a replica found down ends its open segments at once; the model is down when no
  replica of it is left (new commands then fail at once with :class:`PeerDownError`);
* a remote replica that answers again is up again; the requests it held are released
  there if it is the same instance (it was only slow), forgotten if it restarted.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from .segments import DownMarks, PeerDownError, Segments

logger = logging.getLogger(__name__)

__all__ = ["Link", "Replicas"]


class Link:
    """The router's connection to one model replica: a DEALER socket (received on by the client's I/O thread).

    Attributes:
        id: the link's number.
        model, endpoint: the model and the replica's endpoint.
        remote: a replica from the static ``remote`` map (found down by heartbeats,
            never restarted by this router, kept connected while down).
        heartbeat: pinged every ``heartbeat_s`` (remote replicas and any ``tcp://`` endpoint).
        proc: ``(pid, start time)`` of a local model's process (watched), or None.
        down: why the replica is down, or None while it is up.
        heard: ``time.monotonic()`` of the last message from it.
        instance: the replica's ``PeerServer.instance`` (from its pings).
        homes: requests whose state this replica holds (they stay on it).
        orphans: requests it held when it was found down: released there if it comes
            back as the same instance (it was only slow), forgotten if it restarted.
        shared: its socket (a ``_SharedSocket``), None when it could not connect;
            monitor: the handshake-failure log of a TCP socket.
    """

    __slots__ = ("id", "model", "endpoint", "remote", "heartbeat", "proc", "down", "heard", "instance",
                 "homes", "orphans", "shared", "monitor")

    def __init__(self, lid: int, model: str, endpoint: str, remote: bool, heartbeat: bool, proc=None):
        self.id, self.model, self.endpoint, self.remote = lid, model, endpoint, remote
        self.heartbeat = heartbeat
        self.proc: Optional[Tuple[int, Optional[int]]] = proc
        self.down: Optional[str] = None
        self.heard = time.monotonic()
        self.instance: Optional[str] = None
        self.homes: set = set()
        self.orphans: set = set()
        self.shared = None
        self.monitor = None


class Replicas:
    """Every model's links, the requests each holds, and the models' down marks (thread-safe).

    Args:
        segments: the client's open segments (a replica found down ends its own).
        marks: the client's down marks (``on_down`` runs when a model loses its last replica).
        wake: callable() that makes the I/O thread re-read :meth:`connected` (a link was
            added or retired).
        on_up: optional callable(model), run when a remote model that was down answers again.
    """

    def __init__(self, segments: Segments, marks: DownMarks, wake: Callable[[], None],
                 on_up: Optional[Callable[[str], None]] = None):
        self._segments, self.marks, self._wake, self._on_up = segments, marks, wake, on_up
        self._lock = threading.Lock()
        self._links: Dict[str, List[Link]] = {}
        self._by_id: Dict[int, Link] = {}  # connected links: the I/O thread polls these
        self._home: Dict[Tuple[str, str], Link] = {}
        self._version = 0  # bumped when _by_id changes
        self._retired: List[Link] = []  # links whose socket the I/O thread closes
        self._turn = itertools.count()

    # ------------------------------------------------------------ membership
    def _register(self, link: Link) -> None:
        if link.shared is not None:
            self._by_id[link.id] = link
            self._version += 1

    def _retire(self, link: Link) -> None:
        if self._by_id.pop(link.id, None) is not None:
            self._retired.append(link)
            self._version += 1

    def set_remote(self, model: str, links: List[Link]) -> None:
        """Install a remote model's replicas (created down when they could not connect)."""
        with self._lock:
            self._links[model] = list(links)
            for link in links:
                self._register(link)
            if links and all(l.down for l in links):
                self.marks.set(model, links[-1].down)
        self._wake()

    def install_local(self, model: str, link: Link, replace: bool) -> bool:
        """Make ``link`` local ``model``'s only replica.

        ``replace``: retire the old links and clear the model's down mark (a model marked
        up again); else install only when the model has no link and no down mark.

        Returns:
            False when nothing was installed (the caller closes ``link``'s socket).
        """
        with self._lock:
            if not replace and (self._links.get(model) or model in self.marks):
                return False
            for old in self._links.pop(model, []):
                old.down = old.down or "replaced"
                self._retire(old)
            self._links[model] = [link]
            self._register(link)
            if replace:
                self.marks.clear(model)
        self._wake()
        return True

    def known(self, model: str) -> bool:
        """True when ``model`` has links or is marked down (no need to resolve it)."""
        with self._lock:
            return bool(self._links.get(model)) or model in self.marks

    def connected(self, version: int) -> Tuple[int, Optional[List[Link]], List[Link]]:
        """For the I/O thread: ``(version, links to poll or None when unchanged, links to close)``."""
        with self._lock:
            retired, self._retired = self._retired, []
            if self._version == version:
                return version, None, retired
            return self._version, list(self._by_id.values()), retired

    def drain(self) -> List[Link]:
        """Every link with a socket (connected or retired), forgotten: for the I/O thread's exit."""
        with self._lock:
            left = list(self._by_id.values()) + self._retired
            self._by_id.clear()
            self._retired = []
            return left

    def heartbeat_links(self) -> List[Link]:
        """Connected links to ping."""
        with self._lock:
            return [l for l in self._by_id.values() if l.heartbeat]

    def watched_links(self) -> List[Link]:
        """Links that are up and whose local process is known (to check it still runs)."""
        with self._lock:
            return [l for l in self._by_id.values() if l.proc is not None and l.down is None]

    # ------------------------------------------------------------ placement
    def pick(self, model: str, rid: Optional[str]) -> Link:
        """The replica for ``rid`` on ``model``: the one holding its state, else the least busy live one.

        ``rid`` None (a control call): any live replica, nothing recorded.

        Raises:
            PeerDownError: no replica of ``model`` is up.
        """
        with self._lock:
            reason = self.marks.reason(model)
            if reason is not None:
                raise PeerDownError(model, reason)
            link = self._home.get((model, rid)) if rid is not None else None
            if link is None:
                live = [l for l in self._links.get(model, []) if l.down is None]
                if not live:
                    raise PeerDownError(model, f"model {model} is down")
                n, k = len(live), next(self._turn)
                link = min((live[(k + i) % n] for i in range(n)), key=lambda l: len(l.homes))
                if rid is not None:
                    self._home[(model, rid)] = link
                    link.homes.add(rid)
            return link

    def unhome(self, link: Link, rid: str) -> None:
        """``rid`` has no state on ``link`` any more (finished, cancelled or released there)."""
        with self._lock:
            if self._home.get((link.model, rid)) is link:
                del self._home[(link.model, rid)]
            link.homes.discard(rid)

    def take_home(self, model: str, rid: str) -> Optional[Link]:
        """Forget where ``rid`` lives on ``model`` and return that replica (None if none holds it)."""
        with self._lock:
            link = self._home.pop((model, rid), None)
            if link is not None:
                link.homes.discard(rid)
            return link

    def replicas(self, model: str) -> List[Dict[str, Any]]:
        """State of ``model``'s replicas: ``[{"endpoint", "up", "requests", "reason"}]``."""
        with self._lock:
            return [{"endpoint": l.endpoint, "up": l.down is None, "requests": len(l.homes), "reason": l.down}
                    for l in self._links.get(model, [])]

    def silent_remote(self) -> List[str]:
        """``"model at endpoint"`` of the remote replicas that have never answered a ping."""
        with self._lock:
            return [f"{l.model} at {l.endpoint}" for ls in self._links.values() for l in ls
                    if l.remote and l.instance is None]

    # ------------------------------------------------------------ down / up
    def link_down(self, link: Link, reason: str) -> bool:
        """Mark one replica down: fail its open segments; the model is down when none is left.

        A local replica is retired (a new one comes with :meth:`install_local`); a remote
        one stays connected, waiting for its answer.

        Returns:
            True when this made the model down (``on_down`` was then called).
        """
        with self._lock:
            if link.down is not None:
                return False
            link.down = reason
            for rid in link.homes:
                self._home.pop((link.model, rid), None)
            link.orphans |= link.homes
            link.homes = set()
            if not link.remote:
                link.proc = None
                link.orphans = set()
                if link in self._links.get(link.model, []):
                    self._links[link.model].remove(link)
                self._retire(link)
            links = self._links.get(link.model, [])
            left = sum(1 for l in links if l.down is None)
            model_down = left == 0 and self.marks.set(link.model, reason)
        self._wake()
        self._segments.fail(reason, owner=link)
        if model_down:
            self.marks.notify(link.model, reason)
        elif left:
            logger.error("%s (%d of %d replicas left)", reason, left, len(links))
        return model_down

    def mark_down(self, model: str, reason: str) -> bool:
        """Mark every replica of ``model`` down (or the model itself when it has none up).

        Returns:
            True when the model was up until now (``on_down`` is then called).
        """
        with self._lock:
            links = [l for l in self._links.get(model, []) if l.down is None]
        if not links:
            return self.marks.mark(model, reason)
        return any([self.link_down(l, reason) for l in links])

    def answered(self, link: Link, instance: str) -> List[str]:
        """A heartbeat answer from ``link``'s replica, which names its ``instance``.

        A replica that answers as another instance restarted: it is found down (the
        requests it held are lost).  A remote replica that was down is up again.

        Returns:
            the requests to release on it: those it held when found down, if it is
            the same instance as before.
        """
        if link.down is None and link.instance not in (None, instance):
            self.link_down(link, f"model {link.model} (replica at {link.endpoint}) is down: it restarted "
                                 "(the requests it held are lost)")
        releases: List[str] = []
        back = False
        with self._lock:
            if link.down is not None and link.remote:
                releases = sorted(link.orphans) if link.instance == instance else []
                link.orphans = set()
                link.down = None
                back = self.marks.clear(link.model)
                logger.warning("model %s: replica at %s answers again", link.model, link.endpoint)
            if link.down is None:
                link.instance = instance
        if back:
            logger.warning("model %s is up again", link.model)
            if self._on_up is not None:
                try:
                    self._on_up(link.model)
                except Exception:  # noqa: BLE001
                    logger.exception("on_up(%s) failed", link.model)
        return releases
