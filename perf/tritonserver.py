"""Run a real Triton Inference Server for benchmarks and tests: ``TritonServer`` context manager.

Needs the environment of ``deploy/env.sh`` (``TRITONSERVER``, ``TRITON_BACKEND_DIR``,
``LD_LIBRARY_PATH``, the venv first on ``PATH``); ``tests/run`` provides it.  The scripts of
perf/ import it as a sibling; the tests through pytest.ini's ``pythonpath``.

    with TritonServer(model_repository="model_repository") as server:
        client = tritonclient.grpc.InferenceServerClient(server.grpc_url)

    # or: a copy of a repository, or models written by the test itself
    with TritonServer(models={"echo": "/path/to/echo"}, copy=True) as server: ...
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Mapping, Sequence

from tokenrouter.tools.allocator import tritonserver_env

__all__ = ["TritonServer", "TritonServerError", "free_ports"]


class TritonServerError(RuntimeError):
    pass


# What Triton 2.51's Python backend prints when a stub start-up aborts (see start()).
_STUB_START_ABORT = "boost::interprocess::lock_exception"
# The error of a start whose load stalled after a model's initialize (see _wait_ready()).
_LOAD_STALL = "never finished loading after its initialize returned"
#: seconds a model may stay between its stub's "load done" and Triton's "successfully loaded"
#: (normally a few milliseconds) before the start counts as stalled
LOAD_STALL_S = 120.0
_LOAD_DONE = re.compile(r'"(\S+): load done in ')
_LOADED = re.compile(r"successfully loaded '(\S+)'")


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_ports(n: int) -> list[int]:
    """n distinct TCP ports that are free right now, chosen below the ephemeral range.

    tritonserver binds its ports only after loading its models (tens of seconds);
    a port from the kernel's ephemeral range (what binding port 0 returns) can be
    taken in the meantime by any outgoing connection, so ports are drawn at random
    from 20000 up to the start of that range and checked by binding them.
    """
    import random

    lo, hi = 20000, _ephemeral_range()[0] - 1
    if hi - lo < 10 * n:
        lo, hi = 1024, 65535
    ports: list[int] = []
    for _ in range(1000):
        port = random.randint(lo, hi)
        if port in ports:
            continue
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == n:
            return ports
    raise TritonServerError(f"no {n} free TCP ports found in {lo}-{hi}")


def _tail(path: Path, lines: int = 60) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 64 * 1024))
            return b"\n".join(fh.read().splitlines()[-lines:]).decode(errors="replace")
    except OSError as e:
        return f"(no log: {e})"


def _kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL the session ``proc`` leads (the server and its stubs) and reap ``proc``."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def exit_on_termination() -> None:
    """Make SIGTERM and SIGHUP raise ``SystemExit`` (status 128 + signal) in the main thread.

    The server runs in its own session, so only leaving a ``with TritonServer(...)``
    block stops it; scripts that call this before starting one (perf/) then stop
    their server when killed or timed out, not only on Ctrl-C.
    """
    def _exit(signum, _frame):
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _exit)


#: tritonserver's ``--grpc-infer-allocation-pool-size`` (Triton's default 8), as deploy/serve sets it:
#: a pooled gRPC request state keeps the last request it carried, however large, until it is
#: reused (docs/reliability.md, "Memory over time"); ``extra_args`` may set it again (the last wins)
GRPC_INFER_ALLOCATION_POOL_SIZE = 0


class TritonServer:
    """A tritonserver process on free ports; ``start()`` returns once it is ready.

    model_repository: a repository folder to serve (used in place unless ``copy``).
    models: ``{name: folder}`` to place into a fresh temporary repository (copied).
    copy: serve a temporary copy of model_repository (tests may then edit it).
    ready_timeout: seconds to wait for ``/v2/health/ready``; on timeout or an early
        exit a ``TritonServerError`` carries the log tail.
    extra_args: more tritonserver flags (e.g. ``["--log-verbose=1"]``).
    env: extra environment variables for the server (and its Python stubs).
    """

    def __init__(
        self,
        model_repository: str | os.PathLike | None = None,
        *,
        models: Mapping[str, str | os.PathLike] | None = None,
        copy: bool = False,
        ready_timeout: float = 300.0,
        stop_timeout: float = 60.0,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        log_path: str | os.PathLike | None = None,
        tritonserver: str | None = None,
        backend_directory: str | None = None,
    ):
        if model_repository is None and not models:
            raise ValueError("give model_repository or models")
        self._src_repo = Path(model_repository) if model_repository is not None else None
        self._models = dict(models or {})
        self._copy = copy
        self.ready_timeout = ready_timeout
        self.stop_timeout = stop_timeout
        self.extra_args = list(extra_args)
        self.env = dict(env or {})
        self.tritonserver = tritonserver or os.environ.get("TRITONSERVER")
        self.backend_directory = backend_directory or os.environ.get("TRITON_BACKEND_DIR")
        if not self.tritonserver or not self.backend_directory:
            raise TritonServerError(
                "TRITONSERVER / TRITON_BACKEND_DIR are not set: run through tests/run "
                "or `source deploy/env.sh && bash deploy/assemble_backends.sh`"
            )
        self._workdir: Path | None = None
        self._log_arg = Path(log_path) if log_path else None
        self.log_path: Path | None = None
        self.model_repository: Path | None = None
        self.process: subprocess.Popen | None = None
        self.http_port = self.grpc_port = self.metrics_port = 0

    # -- urls -----------------------------------------------------------------
    @property
    def http_url(self) -> str:
        """host:port, as tritonclient.http expects (no scheme)."""
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    # -- lifecycle --------------------------------------------------------------
    def _prepare_repository(self) -> Path:
        assert self._workdir is not None
        if self._src_repo is not None and not self._copy and not self._models:
            if not self._src_repo.is_dir():
                raise TritonServerError(f"model repository {self._src_repo} does not exist")
            return self._src_repo.resolve()
        repo = self._workdir / "model_repository"
        repo.mkdir()
        ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
        if self._src_repo is not None:
            shutil.copytree(self._src_repo, repo, dirs_exist_ok=True, ignore=ignore)
        for name, folder in self._models.items():
            shutil.copytree(folder, repo / name, dirs_exist_ok=True, ignore=ignore)
        return repo

    def _assemble_backends(self) -> None:
        """Build ``TRITON_BACKEND_DIR`` with ``deploy/assemble_backends.sh`` if it is not built.

        A fresh checkout has the directory's path from ``deploy/env.sh`` but not its
        contents (``deploy/serve`` and ``tests/run`` assemble it on their own); the
        script is idempotent. Raises ``TritonServerError`` with its output if it fails.
        """
        built = Path(self.backend_directory)
        if (built / "python" / ".tokenrouter-complete").is_file() and (built / "tokenrouter").exists():
            return
        script = Path(__file__).resolve().parent.parent / "deploy" / "assemble_backends.sh"
        done = subprocess.run(["bash", str(script)], capture_output=True, text=True)
        if done.returncode != 0:
            raise TritonServerError(f"{script} failed:\n{done.stdout}{done.stderr}")

    def start(self) -> "TritonServer":
        """Start the server and wait until it is ready; returns ``self``.

        Models load two at a time (a six-model server is ready in about 0.6x the time
        of one at a time). About one start in 30 on a busy 2-core host aborted in
        Triton's Python backend while two stubs started (``terminate called after
        throwing an instance of 'boost::interprocess::lock_exception'``), and a few
        stalled: two models' ``initialize`` returned but Triton never logged them loaded,
        nor started the third (:data:`LOAD_STALL_S`). Such a start is retried once,
        loading one model at a time (as ``deploy/serve`` always does), with a warning on
        stderr. Any other failure raises ``TritonServerError`` with the log tail.
        """
        if self.process is not None:
            raise TritonServerError("already started")
        self._assemble_backends()
        for load_threads in (2, 1):
            try:
                self._launch(load_threads)
                self._wait_ready()
                return self
            except TritonServerError as e:
                tail = self.log_tail(200)
                self.stop()
                stalled = _LOAD_STALL in str(e)
                if load_threads == 1 or (_STUB_START_ABORT not in tail and not stalled):
                    raise
                why = "stalled" if stalled else f"aborted ({_STUB_START_ABORT})"
                sys.stderr.write(
                    f"tritonserver {why} while loading two models at once; "
                    "retrying one model at a time. Log tail:\n" + "\n".join(tail.splitlines()[-20:]) + "\n")
            except BaseException:
                self.stop()
                raise

    def _launch(self, load_threads: int) -> None:
        self._workdir = Path(tempfile.mkdtemp(prefix="tritonserver-test-"))
        self.model_repository = self._prepare_repository()
        self.log_path = self._log_arg or (self._workdir / "tritonserver.log")
        self.http_port, self.grpc_port, self.metrics_port = free_ports(3)
        cmd = [
            self.tritonserver,
            "--backend-directory", str(self.backend_directory),
            "--model-repository", str(self.model_repository),
            "--http-port", str(self.http_port),
            "--grpc-port", str(self.grpc_port),
            "--metrics-port", str(self.metrics_port),
            f"--model-load-thread-count={load_threads}",
            # as deploy/serve: no pool of gRPC request states, each of which keeps the last
            # request it carried (a huge one for as long as the state waits in the pool)
            f"--grpc-infer-allocation-pool-size={GRPC_INFER_ALLOCATION_POOL_SIZE}",
            # as deploy/serve: the configs are complete, so Triton's Python backend starts no
            # short-lived stub per model to auto-complete them (one stub start less per load)
            "--disable-auto-complete-config",
            *self.extra_args,
        ]
        # as deploy/serve: tritonserver's allocator ($TOKENROUTER_MALLOC, else auto: jemalloc where the host
        # has it, else glibc with large buffers unmapped when freed); the stubs keep glibc's
        env = {**os.environ, **self.env}
        env.update(tritonserver_env(env.get("TOKENROUTER_MALLOC") or "auto", env))
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=env, start_new_session=True,
            )

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(
                f"http://{self.http_url}/v2/health/ready", timeout=2
            ) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def _wait_ready(self) -> None:
        """Poll readiness every 0.5 s until ``ready_timeout``.

        Raises:
            TritonServerError: the process exited, the timeout passed, or a model stalled: its
                stub logged "load done" :data:`LOAD_STALL_S` seconds ago and Triton has not
                logged it loaded (the message then holds :data:`_LOAD_STALL`).
        """
        deadline = time.monotonic() + self.ready_timeout
        done_at: dict[str, float] = {}
        next_look = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            code = self.process.poll()
            if code is not None:
                raise TritonServerError(
                    f"tritonserver exited with code {code} before it was ready; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            if self.is_ready():
                return
            now = time.monotonic()
            if self.log_path and now >= next_look:
                next_look = now + 5.0
                stalled = self._stalled_models(done_at, now)
                if stalled:
                    raise TritonServerError(
                        f"model(s) {', '.join(stalled)} {_LOAD_STALL} ({LOAD_STALL_S:.0f} s); "
                        f"log {self.log_path}:\n{self.log_tail()}")
            time.sleep(0.5)
        raise TritonServerError(
            f"tritonserver not ready after {self.ready_timeout:.0f} s; "
            f"log {self.log_path}:\n{self.log_tail()}"
        )

    def _stalled_models(self, done_at: dict, now: float) -> list:
        """Models whose stub logged "load done" (first seen in ``done_at``, monotonic s) over
        :data:`LOAD_STALL_S` before ``now`` without Triton's "successfully loaded"."""
        try:
            text = Path(self.log_path).read_text(errors="replace")
        except OSError:
            return []
        loaded = set(_LOADED.findall(text))
        for name in _LOAD_DONE.findall(text):
            done_at.setdefault(name, now)
        return sorted(m for m, t in done_at.items() if m not in loaded and now - t > LOAD_STALL_S)

    def log_tail(self, lines: int = 60) -> str:
        return _tail(self.log_path, lines) if self.log_path else ""

    def stop(self) -> int | None:
        """SIGINT (graceful), then SIGKILL to the server's session (its stubs with it) after
        ``stop_timeout`` s. A second interrupt while it waits (Ctrl-C again, another SIGTERM) kills
        the session at once and is then raised, so the server never outlives this process.
        Returns the exit code."""
        proc, self.process = self.process, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                _kill_session(proc)
            except BaseException:
                _kill_session(proc)
                raise
        return proc.returncode

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return (f"TritonServer(http={self.http_url}, grpc={self.grpc_url}, "
                f"repo={self.model_repository}, log={self.log_path})")
