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

__all__ = ["install", "server_pid", "shm_region_path", "stub_model", "stub_parent_pid"]

_server = (None, None)  # (this process's pid, the server's pid found for it)


def _stub_argv(cmdline: Optional[List[bytes]] = None) -> Optional[List[bytes]]:
    """This process's argv when it is a Triton Python stub (``triton_python_backend_stub …``), else None."""
    if cmdline is None:
        try:
            with open("/proc/self/cmdline", "rb") as f:
                cmdline = f.read().split(b"\0")
        except OSError:
            return None
    if len(cmdline) < 3 or not cmdline[0].endswith(b"triton_python_backend_stub"):
        return None
    return cmdline


def stub_model(cmdline: Optional[List[bytes]] = None) -> Optional[str]:
    """Name of the model a Triton Python stub serves, from its command line (``argv[1]`` is
    ``<repository>/<model>/<version>/model.py``); None when ``cmdline`` is not a stub's."""
    argv = _stub_argv(cmdline)
    if argv is None:
        return None
    return os.path.basename(os.path.dirname(os.path.dirname(argv[1].decode(errors="replace"))))


def stub_parent_pid(cmdline: Optional[List[bytes]] = None) -> Optional[int]:
    """pid of the tritonserver that started this stub, from its command line (``argv[5]``:
    ``triton_python_backend_stub <model.py> <shm region> <shm size> <shm growth> <server pid> …``,
    python_backend's ``pb_stub.cc``), or None when this is not a stub or the field is missing."""
    argv = _stub_argv(cmdline)
    if argv is None or len(argv) < 6 or not argv[5].isdigit():
        return None
    return int(argv[5])


def server_pid() -> int:
    """pid of the process that serves this one: for a Triton stub, its tritonserver.

    A stub reads it from its command line (:func:`stub_parent_pid`), which stays right at
    any time; any other process takes ``os.getppid()`` at its first call.  A stub whose
    tritonserver died is re-parented, after which ``os.getppid()`` names another process;
    files named after the server (adverts, lock and turn files) must still be found then,
    so they use this.
    """
    global _server
    me = os.getpid()
    if _server[0] != me:
        pid = stub_parent_pid()
        _server = (me, os.getppid() if pid is None else pid)
    return _server[1]


def shm_region_path(cmdline: Optional[List[bytes]] = None) -> Optional[str]:
    """``/dev/shm`` path of this stub's shared-memory region, from its command line
    (``triton_python_backend_stub <model.py> <region name> …``), or None when this is not a stub."""
    argv = _stub_argv(cmdline)
    if argv is None:
        return None
    name = argv[2].decode(errors="replace")
    if not name or "/" in name:
        return None
    return os.path.join("/dev/shm", name)


def install(cleanup: Callable[[], None], interval_s: float = 0.5) -> threading.Thread:
    """Watch the server process (:func:`server_pid`); when it is gone, call ``cleanup()``,
    unlink the stub's shared-memory region and ``os._exit(0)``.  A server that died before
    this call (while the model was loading) is noticed at the first check.

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
