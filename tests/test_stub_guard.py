"""A stub whose tritonserver died still finds the files named after that server.

Real processes, no Triton: a "server" process forks a "stub" that advertises itself, then
the server exits and the stub is re-parented, as a Triton stub is when tritonserver is
killed.  Before ``stub_guard.server_pid`` the stub looked for its advert under its new
parent's pid and left the file behind.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python_backend_src")


def test_advert_removed_after_the_server_died(tmp_path):
    result = tmp_path / "result.txt"
    script = textwrap.dedent(f"""
        import os, sys, tempfile, time
        sys.path.insert(0, {SRC!r})
        tempfile.tempdir = {str(tmp_path)!r}
        from tokenrouter import lockstep, peer_channel, stub_guard

        r, w = os.pipe()
        if os.fork():  # the "server": exits once its stub has advertised
            os.close(w)
            os.read(r, 1)
            os._exit(0)
        os.close(r)
        server = os.getppid()
        path = peer_channel.write_advert("llm", "ipc://" + os.path.join(tempfile.gettempdir(), "none.sock"))
        ring = lockstep.default_ring_path("g")
        os.write(w, b"x")
        for _ in range(500):
            if os.getppid() != server:
                break
            time.sleep(0.01)
        lines = [f"reparented {{os.getppid() != server}}",
                 f"server_pid {{stub_guard.server_pid() == server}}",
                 f"same_path {{peer_channel.advert_path('llm') == path}}",
                 f"same_ring {{lockstep.default_ring_path('g') == ring}}"]
        peer_channel.remove_advert("llm")
        lines.append(f"removed {{not os.path.exists(path)}}")
        with open({str(result)!r} + ".tmp", "w") as f:
            f.write("\\n".join(lines) + "\\n")
        os.replace({str(result)!r} + ".tmp", {str(result)!r})
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    deadline = time.monotonic() + 30
    while not result.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert result.exists(), f"the stub process did not report: {proc.stderr}"
    got = dict(line.split(" ", 1) for line in result.read_text().splitlines())
    assert got == {"reparented": "True", "server_pid": "True", "same_path": "True", "same_ring": "True",
                   "removed": "True"}, got
    assert not list(tmp_path.glob("tokenrouter-*.json")), "an advert was left behind"


def test_stub_parent_pid_from_the_command_line():
    """A Triton stub takes its server's pid from argv[5], whatever its parent is now."""
    from tokenrouter.stub_guard import shm_region_path, stub_model, stub_parent_pid

    argv = [b"/x/triton_python_backend_stub", b"/m/model.py", b"region_1", b"1048576", b"1048576", b"4242",
            b"/x", b"336", b"llm_0_0", b"/x/tokenrouter"]
    assert stub_parent_pid(argv) == 4242
    assert shm_region_path(argv) == "/dev/shm/region_1"
    assert stub_model([argv[0], b"/repo/token_router/1/model.py", *argv[2:]]) == "token_router"
    assert stub_model([b"/usr/bin/python3", b"-c", b"x"]) is None
    assert stub_parent_pid([b"/usr/bin/python3", b"-c", b"x", b"1", b"2", b"4242"]) is None
    assert stub_parent_pid(argv[:5]) is None
