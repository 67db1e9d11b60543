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

logger = logging.getLogger(__name__)

__all__ = ["install", "server_pid", "shm_region_path", "start_reaper", "stub_model", "stub_parent_pid"]

_server = (None, None)  # (this process's pid, the server's pid found for it)
_reaper: "Optional[subprocess.Popen]" = None  # this stub's reaper (start_reaper)


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
