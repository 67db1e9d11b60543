"""Server-side helpers for the tests: a test module's own tritonserver, its Python stubs, and the
OpenAI front end in front of it.  (Client helpers are in tr_client.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, Optional, Tuple

import pytest

from tritonserver import TritonServer, free_ports

REPO_ROOT = Path(__file__).resolve().parent.parent
STUB_EXE = b"triton_python_backend_stub"


@contextmanager
def running_server(repo, work: Path, **kwargs) -> Iterator[TritonServer]:
    """A started tritonserver for a module fixture: ``with running_server(repo, work) as s: yield s``.

    Args:
        repo: the model repository it serves (or the base one, with ``models``/``copy``).
        work: the folder of its log, ``tritonserver.log``.
        kwargs: more of :class:`TritonServer`'s arguments (``models``, ``copy``, ``extra_args``).

    Readiness timeout: $TOKENROUTER_TEST_READY_TIMEOUT (default 600 s). The server is stopped on
    leaving the block, and its log's path printed.  (tests/conftest.py marks a test whose fixtures
    call this ``server``, as it does for ``TritonServer(``.)
    """
    if not os.environ.get("TRITON_BACKEND_DIR"):
        pytest.fail("TRITON_BACKEND_DIR not set: run the tests with tests/run", pytrace=False)
    s = TritonServer(repo, ready_timeout=float(os.environ.get("TOKENROUTER_TEST_READY_TIMEOUT", "600")),
                     log_path=Path(work) / "tritonserver.log", **kwargs)
    s.start()
    try:
        yield s
    finally:
        s.stop()
        print(f"\ntritonserver log: {s.log_path}")


def generate_error_status(server, status: int) -> int:
    """HTTP status of Triton 2.51's generate endpoint for a model's error whose code maps to
    ``status`` (503: UNAVAILABLE, busy; 500: INTERNAL): that status where tritonserver runs on
    jemalloc (tokenrouter.tools.allocator); on glibc that endpoint answers 400 for every error a
    model sends, whatever its code (docs/api.md, "Errors")."""
    with open(f"/proc/{server.process.pid}/maps") as f:
        return status if "libjemalloc" in f.read() else 400


# ------------------------------------------------------------------ Python stubs
@dataclass(frozen=True)
class Stub:
    """A Triton Python stub process: ``triton_python_backend_stub <model.py> <shm region> <size>
    <growth> <server pid> ...``, its model instance's name at ``argv[8]``."""

    pid: int
    instance: str  #: e.g. ``llm_0_0``
    region: str  #: its shared-memory region, a file under /dev/shm


def rss_bytes(pid: int) -> Optional[int]:
    """The resident memory (VmRSS) of process ``pid`` in bytes; None when it is gone (or a zombie)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _proc(pid: str) -> Optional[Tuple[list, list]]:
    """(argv, the fields of /proc/PID/stat after the command name) of a process; None when gone."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    return argv, stat[stat.rfind(b")") + 2:].split()


def python_stubs(server) -> Dict[str, Stub]:
    """{instance name: :class:`Stub`} of the live (not zombie) Python stubs whose parent is ``server``."""
    out = {}
    for d in os.listdir("/proc"):
        p = _proc(d) if d.isdigit() else None
        if p is None:
            continue
        argv, fields = p
        if not argv[0].endswith(STUB_EXE) or len(argv) < 9 or fields[0] == b"Z":
            continue
        if int(fields[1]) == server.process.pid:
            out[argv[8].decode()] = Stub(int(d), argv[8].decode(), argv[2].decode())
    return out


def is_stub(pid: int) -> bool:
    """Whether process ``pid`` exists and is a Python stub (a zombie is not)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].endswith(STUB_EXE)
    except OSError:
        return False


# ------------------------------------------------------------------ the OpenAI front end
def start_openai_frontend(triton_server, log: Path, *extra: str) -> Tuple[subprocess.Popen, str]:
    """Start ``python -m tokenrouter.tools.openai_frontend`` on a free port in front of
    ``triton_server``; return (process, base URL ``http://127.0.0.1:PORT``) once ``/health`` answers
    200.  ``extra``: more of its flags.  Fails the test when it exits or is not healthy in 120 s."""
    port = free_ports(1)[0]
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tokenrouter.tools.openai_frontend", "--triton-url", triton_server.grpc_url,
             "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", *extra],
            stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        if proc.poll() is not None:
            pytest.fail(f"front end exited with {proc.returncode}:\n{log.read_text()}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, base
        except OSError:
            pass
        if time.time() > deadline:
            proc.kill()
            pytest.fail(f"front end not healthy after 120 s:\n{log.read_text()}")
        time.sleep(0.3)


def stop_openai_frontend(proc: subprocess.Popen) -> None:
    """SIGINT (its graceful shutdown), SIGKILL after 20 s."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# ------------------------------------------------------------------ the shared routing server
# tests/conftest.py's ``routing_server``: speculative decoding, draft-verify and structured output on
# several routes, each on a router model of its own, over one pair of models.

#: the models of the routing server: a smaller KV pool and fewer running rows than the repository's
#: (memory only: outputs are unchanged)
ROUTING_MODEL_PARAMS = {"kv_pool_tokens": "8192", "max_running_requests": "32"}
#: its ``token_router``: R-Stitch at tau 0.05, many handoffs both ways on the demo pair (the same
#: SmolLM2 in both roles); the SLM's discarded tokens are regenerated by the LLM's catch-up extend
ROUTING_TOKEN_ROUTER = {"algorithm": "rstitch", "algorithm_params": '{"tau": 0.05}'}
#: its other routers (test_speculative.py's and test_structured.py's), copies of token_router:
#: {name: parameters}
ROUTING_ROUTERS = {
    "token_router_llm": {"algorithm": "none", "algorithm_params": '{"model": 1}'},
    "token_router_slm": {"algorithm": "none", "algorithm_params": '{"model": 0}'},
    "token_router_spec": {"algorithm": "speculative", "algorithm_params": '{"k": 4}'},
    # drafts sampled at temperature 1 (verification stays greedy): many are rejected and rolled back
    "token_router_spec_reject": {"algorithm": "speculative",
                                 "algorithm_params": '{"k": 4, "draft_temperature": 1.0}'},
    # hotter drafts, more of them: most are rejected
    "token_router_spec_hot": {"algorithm": "speculative",
                              "algorithm_params": '{"k": 5, "draft_temperature": 1.5}'},
    "token_router_spec_adaptive": {"algorithm": "speculative",
                                   "algorithm_params": '{"k": 2, "adaptive": true, "k_max": 6, '
                                                       '"draft_temperature": 0.8}'},
    # draft-verify at alpha = 1 with the ratio rule on drafts sampled at temperature 1: the LLM
    # replaces many of them, and the output is LLM-only's
    "token_router_dv": {"algorithm": "draft_verify",
                        "algorithm_params": '{"k": 4, "rule": "ratio", "alpha": 1.0, "draft_temperature": 1.0}'},
    # the SLM's own drafts, kept when the LLM's probability of them is >= 0.5; adaptive k
    "token_router_dv_prob": {"algorithm": "draft_verify",
                             "algorithm_params": '{"k": 3, "adaptive": true, "k_max": 6, "rule": "prob", '
                                                 '"alpha": 0.5}'},
    # the trained-router rule (router=auto: the shipped dv router of the LLM's checkpoint) on the
    # drafts of token_router_dv (sampled at temperature 1)
    "token_router_dv_router": {"algorithm": "draft_verify",
                               "algorithm_params": '{"k": 4, "rule": "router", "alpha": 0.5, '
                                                   '"draft_temperature": 1.0}'},
    # every token drawn: about half of them on each model
    "token_router_random": {"algorithm": "random", "algorithm_params": '{"p": 0.5, "seed": 3}'},
    # random with its defaults, p set per request: perf/quality.py --url's router of its random:p=P points
    # (test_quality.py, test_tasks.py; their slm-only points use token_router_slm)
    "token_router_random_default": {"algorithm": "random", "algorithm_params": "{}"},
    # a compile limit no real grammar meets: the refusal path of a slow grammar
    "token_router_fastgrammar": {"grammar_compile_timeout_ms": "1"},
}


def routing_repository(out: Path) -> str:
    """Write the routing server's model repository into ``out`` (replaced): model_repository with
    :data:`ROUTING_MODEL_PARAMS` on both models, :data:`ROUTING_TOKEN_ROUTER` and the routers of
    :data:`ROUTING_ROUTERS`.  Returns its path."""
    from tokenrouter.tools.repository import make_variant

    return make_variant(str(REPO_ROOT / "model_repository"), str(out),
                        model_params={"slm": ROUTING_MODEL_PARAMS, "llm": ROUTING_MODEL_PARAMS,
                                      "token_router": ROUTING_TOKEN_ROUTER}, routers=ROUTING_ROUTERS)
