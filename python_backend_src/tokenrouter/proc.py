"""Process identity helpers shared by every layer (standard library only).

* :func:`process_start_time` / :func:`process_alive`: one process told apart from a later one
  that reuses its pid (``/proc/<pid>/stat``);
* :func:`server_pid`: the process that serves this one — for a Triton Python stub its
  tritonserver, read from the stub's command line (:func:`stub_parent_pid`), which stays right
  after that server died and the stub was re-parented.  Files named after the server (the
  models' adverts, the lock-step turn files, model-control locks) use it.

The rest of the stub's life-cycle (the watchdog, the reaper) is Triton glue and lives in
:mod:`tokenrouter.triton.stub_guard`.
"""

from __future__ import annotations

import os
from typing import List, Optional

__all__ = ["process_alive", "process_start_time", "server_pid", "stub_argv", "stub_parent_pid"]

_server = (None, None)  # (this process's pid, the server's pid found for it)


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


def stub_argv(cmdline: Optional[List[bytes]] = None) -> Optional[List[bytes]]:
    """This process's argv (or ``cmdline``) when it is a Triton Python stub
    (``triton_python_backend_stub …``), else None."""
    if cmdline is None:
        try:
            with open("/proc/self/cmdline", "rb") as f:
                cmdline = f.read().split(b"\0")
        except OSError:
            return None
    if len(cmdline) < 3 or not cmdline[0].endswith(b"triton_python_backend_stub"):
        return None
    return cmdline


def stub_parent_pid(cmdline: Optional[List[bytes]] = None) -> Optional[int]:
    """pid of the tritonserver that started this stub, from its command line (``argv[5]``:
    ``triton_python_backend_stub <model.py> <shm region> <shm size> <shm growth> <server pid> …``,
    python_backend's ``pb_stub.cc``), or None when this is not a stub or the field is missing."""
    argv = stub_argv(cmdline)
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
