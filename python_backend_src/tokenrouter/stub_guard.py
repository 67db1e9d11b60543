"""Leave nothing behind when tritonserver goes away without unloading this Triton stub.

A Triton Python stub is a child of tritonserver.  When the server exits
without finalising the stub (it was killed, or its ``exit_timeout`` ran out
while a request was still in flight), the stub used to live on as an orphan
(parent pid 1) holding its shared-memory region in ``/dev/shm``.
:func:`install` starts a daemon thread that notices the parent's death within
``interval_s`` seconds, runs the model's cleanup callbacks (sockets, adverts,
turn files), removes the stub's own ``/dev/shm`` region (named in its command
line) and ends the process.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Callable, List, Optional

logger = logging.getLogger(__name__)

__all__ = ["install", "server_pid", "shm_region_path"]

_server = (None, None)  # (this process's pid, its parent's pid at the first call)


def server_pid() -> int:
    """pid of the process that started this one: for a Triton stub, its tritonserver.

    Taken from ``os.getppid()`` at the first call in this process (and again in a forked
    child).  A stub whose tritonserver died is re-parented, after which ``os.getppid()``
    names another process; files named after the server (adverts, lock and turn files)
    must still be found then, so they use this.  :func:`install` calls it at start-up.
    """
    global _server
    me = os.getpid()
    if _server[0] != me:
        _server = (me, os.getppid())
    return _server[1]


def shm_region_path(cmdline: Optional[List[bytes]] = None) -> Optional[str]:
    """``/dev/shm`` path of this stub's shared-memory region, from its command line
    (``triton_python_backend_stub <model.py> <region name> …``), or None when this is not a stub."""
    if cmdline is None:
        try:
            with open("/proc/self/cmdline", "rb") as f:
                cmdline = f.read().split(b"\0")
        except OSError:
            return None
    if len(cmdline) < 3 or not cmdline[0].endswith(b"triton_python_backend_stub"):
        return None
    name = cmdline[2].decode(errors="replace")
    if not name or "/" in name:
        return None
    return os.path.join("/dev/shm", name)


def install(cleanup: Callable[[], None], interval_s: float = 0.5) -> threading.Thread:
    """Watch the parent process; when it is gone, call ``cleanup()``, unlink the stub's
    shared-memory region and ``os._exit(0)``.

    Args:
        cleanup: best-effort cleanup of the model (exceptions are logged, not raised).
        interval_s: seconds between two checks of the parent.

    Returns:
        the (daemon) watchdog thread.
    """
    parent = server_pid()

    def watch() -> None:
        ev = threading.Event()
        while not ev.wait(interval_s):
            if os.getppid() == parent:
                continue
            logger.error("tritonserver (pid %d) is gone: this stub cleans up and exits", parent)
            try:
                cleanup()
            except Exception:  # noqa: BLE001
                logger.exception("cleanup after the server's exit failed")
            region = shm_region_path()
            if region:
                try:
                    os.unlink(region)
                except OSError:
                    pass
            os._exit(0)

    t = threading.Thread(target=watch, name="stub-guard", daemon=True)
    t.start()
    return t
