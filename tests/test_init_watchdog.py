"""A model load that hangs is bounded (tokenrouter.triton.init_watchdog): its steps are logged, and
past init_timeout_s every thread's stack goes to the log and the stub ends, so the load fails."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest
from tritonserver import TritonServer, TritonServerError

from tokenrouter.triton.init_watchdog import InitWatchdog

_PROGRAM = textwrap.dedent("""
    import threading, time
    from tokenrouter.triton.init_watchdog import InitWatchdog

    def load_weights():
        pass

    def open_channel():
        if {hang}:
            lock = threading.Lock()
            lock.acquire()
            lock.acquire()  # never returns

    with InitWatchdog("m", {timeout}) as watch:
        watch.run(load_weights)
        watch.run(open_channel)
    time.sleep({after})  # past the bound: a finished load is not ended
    print("still alive")
""")


def _run(hang: bool, timeout: float, after: float = 0.0) -> subprocess.CompletedProcess:
    src = _PROGRAM.format(hang=hang, timeout=timeout, after=after)
    return subprocess.run([sys.executable, "-c", src], capture_output=True, text=True, timeout=60)


def test_a_hung_step_ends_the_process_with_every_stack():
    t0 = time.monotonic()
    done = _run(hang=True, timeout=1.0)
    assert done.returncode != 0 and "still alive" not in done.stdout
    assert time.monotonic() - t0 < 30
    err = done.stderr
    assert "m: load step load_weights at" in err and "m: load step open_channel at" in err
    assert "init_timeout_s" in err
    assert "Timeout (0:00:01)!" in err and "in open_channel" in err  # the stuck frame, named


def test_a_finished_load_is_not_ended_and_says_how_long_it_took():
    done = _run(hang=False, timeout=1.0, after=2.0)
    assert done.returncode == 0, done.stderr
    assert "still alive" in done.stdout
    assert "m: load done in" in done.stderr and "Timeout" not in done.stderr


def test_no_bound_and_a_bad_bound():
    lines = []
    with InitWatchdog("m", 0, log=lines.append) as watch:
        assert watch.run(lambda x: x + 1, 1) == 2
    assert lines[0].startswith("m: load step <lambda> at") and "init_timeout_s" not in lines[0]
    assert lines[-1].startswith("m: load done in")
    with pytest.raises(ValueError, match="init_timeout_s must be >= 0"):
        InitWatchdog("m", -1)


_MODEL = textwrap.dedent('''
    import threading
    import triton_python_backend_utils as pb_utils
    from tokenrouter.triton.init_watchdog import InitWatchdog

    def wait_for_peer():
        threading.Event().wait()  # a peer that never answers

    class TritonPythonModel:
        def initialize(self, args):
            with InitWatchdog(args["model_name"], 3, log=pb_utils.Logger.log_info) as watch:
                watch.run(wait_for_peer)

        def execute(self, requests):
            return []
''')

_CONFIG = """
name: "hangs"
backend: "python"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_INT64 dims: [1] } ]
output [ { name: "Y" data_type: TYPE_INT64 dims: [1] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]
"""


def test_triton_reports_a_hung_load_as_failed(tmp_path):
    """Real tritonserver: the model's load fails (it does not hang), with the stuck step's stack in the log."""
    model = tmp_path / "repo" / "hangs"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text(_CONFIG)
    (model / "1" / "model.py").write_text(_MODEL)
    server = TritonServer(tmp_path / "repo", ready_timeout=120, log_path=tmp_path / "tritonserver.log")
    t0 = time.monotonic()
    with pytest.raises(TritonServerError):
        server.start()
    assert time.monotonic() - t0 < 100  # well before the ready timeout: the load failed, it did not hang
    log = (tmp_path / "tritonserver.log").read_text()
    assert "hangs: load step wait_for_peer at" in log
    assert "Timeout (0:00:03)!" in log and "in wait_for_peer" in log
    assert "failed to load 'hangs'" in log
