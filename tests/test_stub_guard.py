"""A stub whose tritonserver died still finds the files named after that server.

Real processes, no Triton: a "server" process forks a "stub" that advertises itself, then
the server exits and the stub is re-parented, as a Triton stub is when tritonserver is
killed.  Before ``tokenrouter.proc.server_pid`` the stub looked for its advert under its new
parent's pid and left the file behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python_backend_src")


def test_advert_removed_after_the_server_died(tmp_path):
    result = tmp_path / "result.txt"
    script = textwrap.dedent(f"""
        import os, sys, tempfile, time
        tempfile.tempdir = {str(tmp_path)!r}
        from tokenrouter import proc
        from tokenrouter.engine import lockstep
        from tokenrouter.routing.peer import adverts

        r, w = os.pipe()
        if os.fork():  # the "server": exits once its stub has advertised
            os.close(w)
            os.read(r, 1)
            os._exit(0)
        os.close(r)
        server = os.getppid()
        path = adverts.write_advert("llm", "ipc://" + os.path.join(tempfile.gettempdir(), "none.sock"))
        ring = lockstep.default_ring_path("g")
        os.write(w, b"x")
        for _ in range(500):
            if os.getppid() != server:
                break
            time.sleep(0.01)
        lines = [f"reparented {{os.getppid() != server}}",
                 f"server_pid {{proc.server_pid() == server}}",
                 f"same_path {{adverts.advert_path('llm') == path}}",
                 f"same_ring {{lockstep.default_ring_path('g') == ring}}"]
        adverts.remove_advert("llm")
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
    from tokenrouter.proc import stub_parent_pid
    from tokenrouter.triton.stub_guard import shm_region_path, stub_model

    argv = [b"/x/triton_python_backend_stub", b"/m/model.py", b"region_1", b"1048576", b"1048576", b"4242",
            b"/x", b"336", b"llm_0_0", b"/x/tokenrouter"]
    assert stub_parent_pid(argv) == 4242
    assert shm_region_path(argv) == "/dev/shm/region_1"
    assert stub_model([argv[0], b"/repo/token_router/1/model.py", *argv[2:]]) == "token_router"
    assert stub_model([b"/usr/bin/python3", b"-c", b"x"]) is None
    assert stub_parent_pid([b"/usr/bin/python3", b"-c", b"x", b"1", b"2", b"4242"]) is None
    assert stub_parent_pid(argv[:5]) is None


def _state(pid: int) -> str:
    """The process state letter from /proc/PID/stat ("" when the pid is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _start_fake_stub(tmp_path, body: str, grace_s: float, reap: bool = True):
    """A "server" process that starts a "stub" with Triton's stub command line
    (``triton_python_backend_stub <model.py> <shm region> <size> <growth> <server pid>``),
    the stub running ``body`` after ``stub_guard.start_reaper(grace_s)``.  With ``reap=False``
    the server never waits for its stub, which stays a zombie once it exits (tritonserver
    with a killed stub whose instance does not unload).
    Returns (server Popen, stub pid, reaper pid, shm region path)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub_exe = bin_dir / "triton_python_backend_stub"
    stub_exe.symlink_to(os.path.realpath(sys.executable))
    region = f"tokenrouter-test-region-{os.getpid()}-{time.monotonic_ns()}"
    with open(os.path.join("/dev/shm", region), "w"):
        pass
    ready = tmp_path / "ready.txt"
    model = tmp_path / "model.py"
    model.write_text(textwrap.dedent(f"""
        import ctypes, os, sys
        from tokenrouter.triton import stub_guard
        reaper = stub_guard.start_reaper(grace_s={grace_s!r})
        with open({str(ready)!r} + ".tmp", "w") as f:
            f.write(f"{{os.getpid()}} {{reaper.pid}}")
        os.replace({str(ready)!r} + ".tmp", {str(ready)!r})
    """) + textwrap.dedent(body))
    server_script = textwrap.dedent(f"""
        import os, subprocess, time
        stub = subprocess.Popen([{str(stub_exe)!r}, {str(model)!r}, {region!r}, "1048576", "1048576",
                                 str(os.getpid())])
        if {reap!r}:
            stub.wait()  # reaps its stub, as tritonserver does when the instance unloads
        time.sleep(600)
    """)
    # the fake stub is the base interpreter (not the venv's): it finds the package through PYTHONPATH
    server = subprocess.Popen([sys.executable, "-c", server_script],
                              env={**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": SRC})
    deadline = time.monotonic() + 30
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ready.exists(), "the fake stub did not start"
    stub_pid, reaper_pid = map(int, ready.read_text().split())
    return server, stub_pid, reaper_pid, os.path.join("/dev/shm", region)


def test_reaper_kills_a_stub_hung_with_the_gil_after_its_server_died(tmp_path):
    """The stub's main thread blocks in C with the GIL held (as the Python backend's stub does
    when its server dies while it loads), so no Python thread of it runs again: only the
    reaper, another process, can end it.  It leaves the stub alone while the server lives,
    whatever the stub's process name (one with a space and a parenthesis here)."""
    server, stub, reaper, region = _start_fake_stub(tmp_path, """
        stub_guard.install(lambda: None)  # the in-process guard: it never gets the GIL
        ctypes.CDLL(None).prctl(15, b"a b) c", 0, 0, 0)  # PR_SET_NAME: a name with a space and a ")"
        ctypes.PyDLL(None).pause()  # blocks with the GIL held
    """, grace_s=0.5)
    mine = tmp_path / f"tokenrouter-{server.pid}-llm.peer.json"
    other = tmp_path / "tokenrouter-1-llm.peer.json"  # another server's advert: kept
    mine.write_text("{}")
    other.write_text("{}")
    try:
        time.sleep(2.5)
        assert _state(stub) not in ("", "Z"), "the reaper killed a stub whose server is alive"
        assert os.getsid(reaper) == reaper, "the reaper shares a session with the server (group signals reach it)"
        server.kill()
        server.wait()
        deadline = time.monotonic() + 10
        while _state(stub) not in ("", "Z") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _state(stub) in ("", "Z"), "the hung stub outlived its server"
        while _state(reaper) not in ("", "Z") and time.monotonic() < deadline + 5:
            time.sleep(0.1)  # the reaper removes the files after the kill
        assert not os.path.exists(region), "the stub's /dev/shm region was left behind"
        assert not mine.exists(), "the dead server's advert was left behind"
        assert other.exists(), "another server's advert was removed"
    finally:
        for pid in (stub, reaper):
            if _state(pid) not in ("", "Z"):
                os.kill(pid, signal.SIGKILL)
        server.kill()
        server.wait()
        if os.path.exists(region):
            os.unlink(region)


def test_reaper_ends_with_its_stub(tmp_path):
    """A stub that exits and whose region the server removes (an unload) takes its reaper with
    it within a second or two; the reaper removes the ipc socket files a killed stub left."""
    server, stub, reaper, region = _start_fake_stub(tmp_path, """
        open(os.path.join(os.environ["TMPDIR"], f"tokenrouter-{os.getpid()}-llm-0123abcd"), "w").close()
        os._exit(0)
    """, grace_s=0.5)
    try:
        deadline = time.monotonic() + 5
        while not (tmp_path / f"tokenrouter-{stub}-llm-0123abcd").exists() and _state(stub) not in ("", "Z") \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        while (tmp_path / f"tokenrouter-{stub}-llm-0123abcd").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not (tmp_path / f"tokenrouter-{stub}-llm-0123abcd").exists(), "the stub's ipc socket was left"
        time.sleep(1.5)
        assert _state(reaper) not in ("", "Z"), "the reaper left while the dead stub's region stays"
        assert os.path.exists(region), "the reaper removed the region of a stub whose server is alive"
        os.unlink(region)  # the server unloads the instance
        deadline = time.monotonic() + 5
        while _state(reaper) not in ("", "Z") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _state(reaper) in ("", "Z"), "the reaper outlived its stub and its region"
    finally:
        server.kill()
        server.wait()
        if os.path.exists(region):
            os.unlink(region)


def test_reaper_removes_a_dead_stubs_region_when_its_server_exits(tmp_path):
    """A killed stub whose instance never finishes unloading (a BLS request waits on it) keeps
    its region; a server that then exits on its exit timeout never removes it.  The reaper
    waits for the server and removes the region then."""
    server, stub, reaper, region = _start_fake_stub(tmp_path, """
        os._exit(0)
    """, grace_s=0.5, reap=False)
    try:
        deadline = time.monotonic() + 5
        while _state(stub) not in ("", "Z") and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.5)
        assert os.path.exists(region), "the reaper removed the region of a stub whose server is alive"
        server.kill()
        server.wait()
        deadline = time.monotonic() + 5
        while _state(reaper) not in ("", "Z") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _state(reaper) in ("", "Z"), "the reaper outlived the server"
        assert not os.path.exists(region), "the dead stub's /dev/shm region was left behind"
    finally:
        server.kill()
        server.wait()
        if os.path.exists(region):
            os.unlink(region)
