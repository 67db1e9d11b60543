"""tritonserver's allocator (tokenrouter.tools.allocator): jemalloc for tritonserver where the host has
it, glibc's malloc for the model stubs, which Triton's Python backend starts through ``bash -c``."""

import json
import os
import subprocess
import sys

import pytest

from tokenrouter.tools.allocator import JEMALLOC_CONF, STUB_ENV, find_jemalloc, tritonserver_env

# what a stub sees: Triton's Python backend runs `bash -c "exec <stub> ..."`
_STUB = ("exec {py} -c 'import json, os; print(json.dumps({{k: v for k, v in os.environ.items() if k in "
         "(\"LD_PRELOAD\", \"MALLOC_CONF\", \"BASH_ENV\", \"MALLOC_MMAP_THRESHOLD_\", \"SOURCED\") "
         "or k.startswith(\"TOKENROUTER_STUB_\")}}))'")


def _libc() -> str:
    """The C library this process runs on: a preload that changes nothing."""
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.split()[-1]
            if "/libc.so" in path or "/libc-" in path:
                return path
    pytest.skip("no libc in /proc/self/maps")


def _as_stub(env: dict) -> dict:
    out = subprocess.run(["bash", "-c", _STUB.format(py=sys.executable)], env=env, capture_output=True,
                         text=True, check=True, timeout=60)
    return json.loads(out.stdout)


def _base() -> dict:
    return {k: v for k, v in os.environ.items()
            if k not in ("LD_PRELOAD", "MALLOC_CONF", "BASH_ENV", "MALLOC_MMAP_THRESHOLD_", "TOKENROUTER_MALLOC")}


def test_the_stubs_get_back_the_environment_tritonserver_had_before(tmp_path):
    """tritonserver gets the preload and jemalloc's configuration; a stub started the way Triton starts
    it gets none of them, nor the bookkeeping; with a preload, configuration and BASH_ENV of the user's
    own, the stub gets exactly those, and that BASH_ENV is still read."""
    lib = _libc()
    base = {**_base(), "TOKENROUTER_JEMALLOC": lib}
    env = tritonserver_env("jemalloc", base)
    assert env["LD_PRELOAD"] == lib and env["MALLOC_CONF"] == JEMALLOC_CONF and env["BASH_ENV"] == str(STUB_ENV)
    assert env["TOKENROUTER_MALLOC"] == "jemalloc"
    assert _as_stub({**base, **env}) == {"MALLOC_MMAP_THRESHOLD_": "1048576"}

    own = tmp_path / "own_bash_env.sh"
    own.write_text("export SOURCED=yes\n")
    user = {**base, "LD_PRELOAD": lib, "MALLOC_CONF": "narenas:1", "BASH_ENV": str(own),
            "MALLOC_MMAP_THRESHOLD_": "65536"}
    env = tritonserver_env("jemalloc", user)
    assert env["LD_PRELOAD"] == f"{lib}:{lib}" and env["MALLOC_CONF"] == "narenas:1"  # the user's kept
    assert _as_stub({**user, **env}) == {"LD_PRELOAD": lib, "MALLOC_CONF": "narenas:1", "BASH_ENV": str(own),
                                         "MALLOC_MMAP_THRESHOLD_": "65536", "SOURCED": "yes"}


def test_the_choice_of_allocator():
    """glibc adds only the 1 MiB threshold (or keeps the environment's); auto falls back to glibc where
    there is no jemalloc; jemalloc without the library, a missing TOKENROUTER_JEMALLOC or an unknown
    name are refused with a clear error."""
    base = _base()
    assert tritonserver_env("glibc", base) == {"MALLOC_MMAP_THRESHOLD_": "1048576", "TOKENROUTER_MALLOC": "glibc"}
    assert tritonserver_env("glibc", {**base, "MALLOC_MMAP_THRESHOLD_": "4096"})["MALLOC_MMAP_THRESHOLD_"] == "4096"
    auto = tritonserver_env("auto", base)
    assert auto["TOKENROUTER_MALLOC"] == ("jemalloc" if find_jemalloc(base) else "glibc")
    with pytest.raises(FileNotFoundError, match="TOKENROUTER_JEMALLOC='/nonexistent/libjemalloc.so.2'"):
        tritonserver_env("auto", {**base, "TOKENROUTER_JEMALLOC": "/nonexistent/libjemalloc.so.2"})
    with pytest.raises(ValueError, match="malloc must be one of auto, jemalloc, glibc, got 'tcmalloc'"):
        tritonserver_env("tcmalloc", base)
    if find_jemalloc(base) is None:
        with pytest.raises(ValueError, match="apt-get install libjemalloc2"):
            tritonserver_env("jemalloc", base)


def _maps_jemalloc(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "libjemalloc" in f.read()


@pytest.mark.server
def test_a_served_tritonserver_runs_on_jemalloc_where_found_and_its_stubs_on_glibc(triton_server):
    """The shared test server is started as deploy/serve starts it (allocator ``auto``): tritonserver
    maps libjemalloc exactly where the host has it, and none of its model stubs does."""
    pid = triton_server.process.pid
    assert _maps_jemalloc(pid) == (find_jemalloc() is not None and os.environ.get("TOKENROUTER_MALLOC") != "glibc")
    stubs = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    assert len(stubs) >= 3, stubs  # slm, llm, token_router
    for s in stubs:
        with open(f"/proc/{s}/cmdline") as f:
            assert "triton_python_backend_stub" in f.read(), s
        assert not _maps_jemalloc(int(s)), s
