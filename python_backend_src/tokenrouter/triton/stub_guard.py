"""Leave nothing behind when tritonserver goes away without unloading this Triton stub.

A Triton Python stub is a child of tritonserver.  When the server exits
without finalising the stub (it was killed, or its ``exit_timeout`` ran out
while a request was still in flight), the stub used to live on as an orphan
(parent pid 1) holding its shared-memory region in ``/dev/shm``.
:func:`install` starts a daemon thread that notices the parent's death within
``interval_s`` seconds, runs the model's cleanup callbacks (sockets, adverts,
turn files), removes the stub's own ``/dev/shm`` region (named in its command
line) and ends the process.

That thread needs the GIL.  When tritonserver dies while the stub is loading, the stub's
main thread can be left blocked in the Python backend's C++ code with the GIL held,
waiting on a shared-memory mutex or semaphore the dead server will never release, and
the stub's own parent check (``pb_stub.cc``: ``Stub::DestroyInstance(); exit(1)``) then
waits for the GIL too.  No Python thread runs again in such a stub, so
:func:`start_reaper` also starts a small ``/bin/sh`` process outside it
(``stub_reaper.sh``), which kills a stub still alive ``grace_s`` seconds after its server
died and removes what the stub and the server left behind.
"""

from __future__ import annotations

import logging
import math
import os
import subprocess
import tempfile
import threading
from typing import Callable, List, Optional

from ..proc import server_pid, stub_argv, stub_parent_pid

logger = logging.getLogger(__name__)

__all__ = ["install", "shm_region_path", "start_reaper", "stub_model"]

_reaper: "Optional[subprocess.Popen]" = None  # this stub's reaper (start_reaper)


def stub_model(cmdline: Optional[List[bytes]] = None) -> Optional[str]:
    """Name of the model a Triton Python stub serves, from its command line (``argv[1]`` is
    ``<repository>/<model>/<version>/model.py``); None when ``cmdline`` is not a stub's."""
    argv = stub_argv(cmdline)
    if argv is None:
        return None
    return os.path.basename(os.path.dirname(os.path.dirname(argv[1].decode(errors="replace"))))


def shm_region_path(cmdline: Optional[List[bytes]] = None) -> Optional[str]:
    """``/dev/shm`` path of this stub's shared-memory region, from its command line
    (``triton_python_backend_stub <model.py> <region name> …``), or None when this is not a stub."""
    argv = stub_argv(cmdline)
    if argv is None:
        return None
    name = argv[2].decode(errors="replace")
    if not name or "/" in name:
        return None
    return os.path.join("/dev/shm", name)


def install(cleanup: Callable[[], None], interval_s: float = 0.5) -> threading.Thread:
    """Watch the server process (:func:`tokenrouter.proc.server_pid`); when it is gone, call ``cleanup()``,
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


#: The reaper script, next to this module (its header describes it).
REAPER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stub_reaper.sh")


def _start_time(pid: int) -> Optional[str]:
    """Start time of process ``pid`` (field 22 of ``/proc/PID/stat``, clock ticks since boot),
    or None when it is gone.  The fields are read after the last ``)``: the process name
    before it may hold spaces."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def start_reaper(grace_s: float = 10.0) -> Optional[subprocess.Popen]:
    """Start the out-of-process reaper of this Triton stub (``stub_reaper.sh``; see the
    module docstring).

    Call it as early as the stub runs this package's code (the backend's ``model.py`` does,
    at import; a stub that hangs before that is not covered).  The reaper is one ``/bin/sh``
    process per stub, in its own session (signals sent to the server's process group do not
    reach it), reading ``/proc`` once a second; it exits within a second of the stub, or, when the
    stub was killed and its region stays (its instance cannot finish unloading), once the region
    or the server is gone (it then removes the region).

    Not started (returns None) where it could not work: this process is not a Triton stub;
    the server is pid 1 (a container whose entrypoint execs tritonserver: when it dies the
    kernel ends every process of the container, and nothing would wait for the reaper);
    ``/proc`` belongs to another pid namespace; ``/bin/sh`` cannot be started (logged).

    Args:
        grace_s: seconds (rounded up to whole seconds) after the server's death before a
            stub still alive is killed; its own clean-up (:func:`install`) normally ends it
            within a second.

    Returns:
        the reaper process, or None.
    """
    global _reaper
    server = stub_parent_pid()
    if server is None or server == 1:
        return None
    if _reaper is not None and _reaper.poll() is None:
        return _reaper
    try:
        if os.readlink("/proc/self") != str(os.getpid()):
            return None
    except OSError:
        return None
    born = _start_time(os.getpid())
    if born is None:
        return None
    try:
        _reaper = subprocess.Popen(
            ["/bin/sh", REAPER_SCRIPT, str(server), _start_time(server) or "", str(os.getpid()), born,
             shm_region_path() or "", tempfile.gettempdir(), str(max(0, math.ceil(grace_s)))],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True,
            start_new_session=True)
        return _reaper
    except OSError as e:
        logger.warning("no reaper for this stub (%s): a stub left hanging by a dead server stays", e)
        return None
