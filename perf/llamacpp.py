#!/usr/bin/env python3
"""The CPU peer a user would pick instead of TokenRouter: llama.cpp's ``llama-server`` serving the
same Qwen2.5-Coder-1.5B-Instruct GGUF file, alone and with Qwen2.5-Coder-0.5B-Instruct as its draft
model (speculative decoding), on the prompts and grading of ``perf/tasks.py``.

    source deploy/env.sh
    python deploy/prepare_weights.py --pair qwen-coder        # the checkpoints (tokenizer, chat template)
    python perf/llamacpp.py --build-only                      # build llama-server once (11-38 min on 2 shared cores)
    python perf/llamacpp.py --task gsm-symbolic --split test --problems 50 \\
        --concurrency 1,8 --settings llm,llm+draft --draft-max 4,8 --repeats 2
    python perf/llamacpp.py --task humaneval --problems 2 --concurrency 1 --settings llm \\
        --max-tokens 64 --repeats 1                           # a smoke run

**Build** (:func:`ensure_server`, once, cached): the source package of PyPI ``llama-cpp-python``
:data:`VERSION` (fetched with ``pip download --no-binary :all:``, checked against
:data:`SDIST_SHA256`) is unpacked under ``${TOKENROUTER_CACHE:-~/.cache/tokenrouter}/llamacpp-<version>/``
and the llama.cpp it vendors (``vendor/llama.cpp``, commit :data:`LLAMA_CPP_COMMIT` by the package's
CHANGELOG) is built with cmake (the machine's, else PyPI ``cmake`` in a venv there) into one static
``bin/llama-server``: Release, CPU only, ``-march=native`` (``GGML_NATIVE``), no web UI (nothing is
downloaded at build time), no AMX (:data:`NO_AMX`: its kernels die with SIGILL on this host), flags
:func:`cmake_flags`, ``nice -n 15``, ``-j2``.  The sources and the build tree are deleted afterwards;
``build-info.json`` there records the version, sha256, flags, the instruction sets compiled for,
compiler, build time and ``llama-server --version``; a build with other flags is built again.
Nothing is installed in the project's venv.
Why llama.cpp's server and not llama-cpp-python's own (``python -m llama_cpp.server``): in
llama-cpp-python 0.3.36 its ``draft_model`` setting takes only ``prompt-lookup-decoding``
(``llama_cpp/server/model.py`` builds ``LlamaPromptLookupDecoding``), not a second GGUF, so it cannot
run the 1.5B with the 0.5B as draft; its Python bindings are therefore not built.

**Weights** (:func:`ensure_gguf`): the GGUF files ``deploy/prepare_weights.py`` assembles for the
qwen-coder pair (it deletes them once dequantized), assembled again with its own functions from the
same pinned PyPI chunks (pip's cache usually holds them) and checked against the same sha256, kept
under ``$TOKENROUTER_WEIGHTS/gguf/`` (1.6 GB).  Their headers (``gguf`` package, :func:`gguf_info`):

* Qwen2.5-Coder-1.5B-Instruct (general.name "Qwen2.5 Coder 1.5B Instruct GGUF"): file type
  MOSTLY_Q4_K_M; 1.78 G parameters (embeddings untied: ``token_embd`` and ``output`` 0.23 G each);
  169 tensors Q4_K (1.35 G parameters), 29 Q6_K (0.43 G, ``output`` among them), 141 F32 (norms and
  biases, 0.14 M) -- 1.11 GB of weights, 0.63 bytes per weight, against 3.55 GB in the bf16
  checkpoint TokenRouter serves (2 bytes per weight; 3.2×).
* Qwen2.5-Coder-0.5B-Instruct ("Qwen2.5 Coder 0.5B Instruct AWQ"): labelled MOSTLY_Q4_K_M, mostly
  Q5_0: 133 tensors Q5_0 (0.39 G parameters), 13 Q8_0 (0.14 G, the input embedding among them),
  12 Q6_K and 12 Q4_K (0.05 G each), 121 F32; 0.63 G parameters, 0.49 GB, 0.77 bytes per weight,
  against 1.26 GB in bf16 (2.6×).

A decoding step reads every matrix once but only one row of the input embedding (untied), so the
bytes read per step are 0.98 GB for the 1.5B here against 3.09 GB in bf16 (3.15×), and 0.39 GB
against 0.99 GB for the 0.5B (2.5×): on a memory-bound CPU that alone favours llama.cpp, and the
quantisation can change the answers.  The result file records all these figures per model
(``models``, :func:`gguf_info`).

**Measurement** (one ``llama-server`` per setting and concurrency N, on a free port of 127.0.0.1):
``-m LLM.gguf [-md SLM.gguf --spec-type draft-simple --spec-draft-n-max K --spec-draft-n-min M] -np N
-c CTX --threads T`` (:func:`server_command`; this llama.cpp removed ``--draft-max``/``--draft-min``,
and drafts with a plain draft model only when ``--spec-type draft-simple`` says so), CTX = N × (the
longest prompt + max_tokens + K + 16) (:func:`context_size`: llama-server splits its context among the
N slots), ``--cache-ram 0`` and ``cache_prompt`` false on every request, so no answer reuses another's
prompt KV: every setting starts cold.  Settings: ``llm`` (the 1.5B alone) and ``llm+draft`` (one
server per ``--draft-max`` K; ``llm+draft:K`` names one; ``llm+draft:default`` leaves the server's
default, 3 here).  After ``/health`` answers, one warm-up request, then each selected problem once
per repeat, sent as raw text (the task's prompt, chat template applied client-side with the pair's
tokenizer, as ``perf/quality.py`` sends it) to ``/completion``, streamed: greedy (temperature 0,
top_k 1), ``n_predict`` = ``--max-tokens`` (the task's), the task's stop strings; N closed-loop
client threads.  The repeats are the outer loop (settings and N alternate within a repeat, so the
drift of a shared host falls on all of them).  After the servers, every answer is graded with
``task.grade`` (finish reason ``length`` when the server stopped at ``n_predict``).

**Reported** per setting and N (:func:`run_summary` per repeat, :func:`summarize` over repeats:
mean, min, max, sd): output tokens/s (all output tokens / wall time, first send to last answer),
answers/s, TTFT p50/p90 (client: send → first streamed token; the server's ``prompt_ms`` too),
end-to-end p50/p90/p99, draft acceptance (the server's ``draft_n_accepted`` / ``draft_n``),
accuracy (passed / problems) and, per answer, its text, tokens and timings.  Raw JSON to ``--out``
(default ``perf/results/<date>-<host>-llamacpp-<task>.json``), rewritten after every run.

**A quiet host.** llama.cpp's threads spin-wait for each other at every step, so with
``--threads`` equal to the cores of a host other jobs are using it slows down by an order of
magnitude or more, far beyond its share (``--threads 1`` holds up better there); every run records
how many cores other processes kept busy just before it (``others_busy_cores_before``, from
``/proc/stat`` over 1 s) and the load average at its end, and a busy host is warned about.

Run time: a run is the problems' output tokens over the throughput; GSM-Symbolic's answers are a
few hundred tokens, so 50 problems × (1 + 2 draft settings) × N = 1, 8 × 2 repeats is hours on 2
cores: size ``--problems`` and ``--repeats`` to the time you have.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import http.client
import itertools
import json
import os
import platform
import queue
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from loadgen import percentile, spread  # noqa: E402  (perf/)

__all__ = ["VERSION", "SDIST_SHA256", "LLAMA_CPP_COMMIT", "CMAKE_FLAGS", "NO_AMX", "cmake_flags", "ensure_server",
           "ensure_gguf",
           "gguf_info", "parse_settings", "context_size", "server_command", "completion_body",
           "sse_events", "record_from_stream", "finish_reason", "run_summary", "summarize", "main"]

#: llama-cpp-python, the newest on PyPI when this was written; its sdist's sha256 (pip download)
VERSION = "0.3.36"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
#: the llama.cpp commit it vendors (its CHANGELOG: "update llama.cpp to ggml-org/llama.cpp@0c1e57098")
LLAMA_CPP_COMMIT = "0c1e57098"
#: cmake configure flags of llama-server (Release, CPU only, native, static, no web UI, no downloads)
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",                 # -march=native: the host's AVX-512 / AMX / VNNI kernels
    "-DGGML_CUDA=OFF", "-DGGML_VULKAN=OFF", "-DGGML_BLAS=OFF",
    "-DBUILD_SHARED_LIBS=OFF",          # one self-contained binary
    "-DLLAMA_BUILD_COMMON=ON", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",   # no npm, no Hugging Face download
    "-DLLAMA_OPENSSL=OFF",
    f"-DLLAMA_BUILD_COMMIT={LLAMA_CPP_COMMIT}",              # the sdist has no .git: --version shows it
)
#: x86 only: no AMX, whatever -march=native finds.  On this host (a Xeon with AMX, in a Firecracker VM)
#: the AMX kernels of this ggml die at their first matrix product (SIGILL: ``tilezero`` in
#: ``ggml_backend_amx_mul_mat``), although a lone ldtilecfg + tilezero runs; AVX-512 VNNI / BF16 stay.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def cmake_flags(machine: Optional[str] = None) -> List[str]:
    """:data:`CMAKE_FLAGS`, and on x86-64 (``platform.machine()``) the C/C++ flags :data:`NO_AMX`."""
    machine = (machine or platform.machine()).lower()
    extra = [f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"] if machine in ("x86_64", "amd64") else []
    return [*CMAKE_FLAGS, *extra]
CMAKE_PYPI = "cmake==3.31.10"  # only where the machine has no cmake >= 3.14
BUILD_JOBS = 2
SETTINGS = ("llm", "llm+draft")
LLM_FOLDER, SLM_FOLDER = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
CTX_MARGIN = 16  # tokens per slot beyond prompt + max_tokens + draft


class LlamaCppError(RuntimeError):
    pass


# --------------------------------------------------------------------------- paths and build
def cache_dir() -> Path:
    return Path(os.environ.get("TOKENROUTER_CACHE") or Path.home() / ".cache" / "tokenrouter")


def home(version: str = VERSION) -> Path:
    """``$TOKENROUTER_CACHE/llamacpp-<version>/``: sdist, ``bin/llama-server``, ``build-info.json``."""
    return cache_dir() / f"llamacpp-{version}"


@contextlib.contextmanager
def _flock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            h.update(block)
    return h.hexdigest()


def _say(msg: str) -> None:
    print(f"llamacpp: {msg}", file=sys.stderr, flush=True)


def _run(cmd: Sequence[str], log: Path, cwd: Optional[Path] = None) -> None:
    with open(log, "a") as fh:
        fh.write(f"\n$ {' '.join(map(str, cmd))}\n")
        fh.flush()
        rc = subprocess.run(list(map(str, cmd)), cwd=cwd, stdout=fh, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        tail = log.read_text(errors="replace").splitlines()[-30:]
        raise LlamaCppError(f"{cmd[0]} {cmd[1] if len(cmd) > 1 else ''} failed ({rc}); log {log}:\n" + "\n".join(tail))


def fetch_sdist(dest: Path) -> Path:
    """The verified sdist in ``dest`` (``pip download`` when absent or different).

    Raises:
        LlamaCppError: pip failed, or the file's sha256 is not :data:`SDIST_SHA256`.
    """
    path = dest / f"llama_cpp_python-{VERSION}.tar.gz"
    if not (path.is_file() and sha256_file(path) == SDIST_SHA256):
        dest.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "--disable-pip-version-check", f"llama-cpp-python=={VERSION}", "-d", str(dest)]
        if subprocess.run(cmd).returncode != 0 or not path.is_file():
            raise LlamaCppError(f"pip could not download llama-cpp-python=={VERSION}'s source package")
    got = sha256_file(path)
    if got != SDIST_SHA256:
        raise LlamaCppError(f"{path.name}: sha256 {got}, expected {SDIST_SHA256}")
    return path


def _cmake_version(cmake: str) -> Tuple[int, ...]:
    out = subprocess.run([cmake, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"(\d+)\.(\d+)\.(\d+)", out)
    return tuple(int(x) for x in m.groups()) if m else (0,)


def find_cmake(where: Path, log: Path) -> str:
    """The machine's cmake when >= 3.14, else PyPI's :data:`CMAKE_PYPI` in a venv under ``where``."""
    cmake = shutil.which("cmake")
    if cmake and _cmake_version(cmake) >= (3, 14):
        return cmake
    venv = where / "cmake-venv"
    if not (venv / "bin" / "cmake").exists():
        _say(f"no cmake >= 3.14 on PATH: installing {CMAKE_PYPI} into {venv}")
        _run([sys.executable, "-m", "venv", str(venv)], log)
        _run([str(venv / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check", CMAKE_PYPI], log)
    return str(venv / "bin" / "cmake")


def _first_line(cmd: Sequence[str]) -> str:
    try:
        p = subprocess.run(list(cmd), capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return ((p.stdout or "") + (p.stderr or "")).strip().splitlines()[0] if (p.stdout or p.stderr) else ""


def server_version(binary: Path) -> str:
    p = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    return " ".join(((p.stdout or "") + (p.stderr or "")).split())


def ensure_server(force: bool = False) -> Dict[str, Any]:
    """Build ``llama-server`` once (module docstring); its ``build-info.json`` (with ``binary``).

    Serialised with a lock file; a build is complete when ``build-info.json`` is written (last).

    Raises:
        LlamaCppError: download, checksum, configure or build failed.
    """
    where = home()
    info_path = where / "build-info.json"
    binary = where / "bin" / "llama-server"
    with _flock(cache_dir() / f"llamacpp-{VERSION}.lock"):
        if info_path.is_file() and binary.is_file() and not force:
            info = json.loads(info_path.read_text())
            if info.get("cmake_flags") == cmake_flags():
                return info
            _say("llama-server was built with other flags: building it again")
        where.mkdir(parents=True, exist_ok=True)
        log = where / "build.log"
        log.write_text("")
        t0 = time.monotonic()
        _say(f"building llama-server from llama-cpp-python {VERSION}'s vendored llama.cpp (once; log {log})")
        sdist = fetch_sdist(where / "sdist")
        src = where / "src"
        shutil.rmtree(src, ignore_errors=True)
        src.mkdir()
        with tarfile.open(sdist) as tf:
            kw = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            tf.extractall(src, **kw)
        top = src / f"llama_cpp_python-{VERSION}"
        llama = top / "vendor" / "llama.cpp"
        changelog = (top / "CHANGELOG.md").read_text(errors="replace")
        m = re.search(r"## \[" + re.escape(VERSION) + r"\].*?llama\.cpp@([0-9a-f]+)", changelog, re.S)
        if not m or m.group(1) != LLAMA_CPP_COMMIT:
            raise LlamaCppError(f"the sdist's CHANGELOG names llama.cpp {m.group(1) if m else '?'}, "
                                f"expected {LLAMA_CPP_COMMIT}")
        cmake = find_cmake(where, log)
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        build = where / "build"
        shutil.rmtree(build, ignore_errors=True)
        nice = ["nice", "-n", "15"] if shutil.which("nice") else []
        t_conf = time.monotonic()
        _run([*nice, cmake, "-S", str(llama), "-B", str(build), *generator, *cmake_flags()], log)
        t_build = time.monotonic()
        _run([*nice, cmake, "--build", str(build), "--target", "llama-server", "-j", str(BUILD_JOBS)], log)
        t_done = time.monotonic()
        binary.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(build / "bin" / "llama-server", binary)
        cache_txt = (build / "CMakeCache.txt").read_text(errors="replace")
        compiler = re.search(r"^CMAKE_CXX_COMPILER:\w+=(.*)$", cache_txt, re.M)
        info = {
            "llama_cpp_python": VERSION, "sdist_sha256": SDIST_SHA256, "llama_cpp_commit": LLAMA_CPP_COMMIT,
            "cmake_flags": cmake_flags(), "generator": generator[1] if generator else "Unix Makefiles",
            "jobs": BUILD_JOBS, "nice": 15 if nice else 0,
            "cmake": _first_line([cmake, "--version"]),
            "compiler": _first_line([compiler.group(1) if compiler else "c++", "--version"]),
            "isa_macros": _isa_macros(build),
            "seconds": {"configure": round(t_build - t_conf, 1), "build": round(t_done - t_build, 1),
                        "total": round(t_done - t0, 1)},
            "binary": str(binary), "binary_bytes": binary.stat().st_size,
            "version": server_version(binary), "host": host_cpu(),
            "built": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        shutil.rmtree(build, ignore_errors=True)
        shutil.rmtree(src, ignore_errors=True)
        info["disk_bytes"] = sum(p.stat().st_size for p in where.rglob("*") if p.is_file())
        tmp = info_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(info, indent=1) + "\n")
        os.replace(tmp, info_path)
        _say(f"llama-server built in {info['seconds']['total']:.0f} s: {binary}")
        return info


def _isa_macros(build: Path) -> List[str]:
    """The instruction sets the compiler targets with ggml-cpu's flags (its ``__AVX…__`` / ``__AMX…__``
    macros, from ``compile_commands.json`` and ``-dM -E``); empty where that fails."""
    try:
        cmds = json.loads((build / "compile_commands.json").read_text())
        cmd = next(c for c in cmds if c.get("file", "").endswith("ggml-cpu/ggml-cpu.c"))
        argv = shlex.split(cmd["command"])
        keep = [a for a in argv[1:] if a.startswith(("-m", "-D"))]
        p = subprocess.run([argv[0], *keep, "-dM", "-E", "-x", "c", "/dev/null"], capture_output=True, text=True,
                           timeout=60)
    except (OSError, ValueError, StopIteration, KeyError, subprocess.TimeoutExpired):
        return []
    return sorted(set(re.findall(r"#define __((?:AVX|AMX|FMA|F16C|BMI2|SSE4_2)\w*?)__ 1", p.stdout)))


def host_cpu() -> str:
    """This machine's CPU model name (``/proc/cpuinfo``), else ``platform.processor()``."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def busy_cores(interval_s: float = 1.0) -> float:
    """How many cores were busy (not idle or iowait) over ``interval_s``, from ``/proc/stat``; NaN
    where it cannot be read."""
    def sample() -> Tuple[int, int]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        idle = v[3] + (v[4] if len(v) > 4 else 0)
        return sum(v[:8]) - idle, sum(v[:8])

    try:
        b0, t0 = sample()
        time.sleep(interval_s)
        b1, t1 = sample()
    except (OSError, ValueError, IndexError):
        return float("nan")
    return (b1 - b0) / (t1 - t0) * (os.cpu_count() or 1) if t1 > t0 else float("nan")


def host_label(cpu: str) -> str:
    """The short host name of result files (``xeon``, ``epyc``, else the node name)."""
    low = cpu.lower()
    for word in ("xeon", "epyc", "graviton", "neoverse"):
        if word in low:
            return word
    return re.sub(r"[^a-z0-9]+", "-", platform.node().lower()).strip("-") or "host"


# --------------------------------------------------------------------------- weights
def weights_dir() -> Path:
    return Path(os.environ.get("TOKENROUTER_WEIGHTS") or cache_dir() / "weights")


def ensure_gguf() -> Dict[str, Path]:
    """The pair's GGUF files (``{"llm": …, "draft": …}``) under ``$TOKENROUTER_WEIGHTS/gguf/``,
    assembled once with ``deploy/prepare_weights.py``'s ``fetch_chunks`` / ``assemble_gguf`` (its
    pinned chunks, its sha256).

    Raises:
        prepare_weights.PrepareError: a chunk could not be fetched, or a file's sha256 differs.
    """
    sys.path.insert(0, os.path.join(ROOT, "deploy"))
    import prepare_weights as pw

    out = weights_dir() / "gguf"
    specs = {spec.folder: spec for spec in pw.QWEN_CODER}
    paths = {role: out / f"{folder}.gguf" for role, folder in (("llm", LLM_FOLDER), ("draft", SLM_FOLDER))}

    def ok(role: str) -> bool:
        spec, p = specs[paths[role].stem], paths[role]
        mark = p.with_suffix(".gguf.sha256")
        return (p.is_file() and p.stat().st_size == spec.size and mark.is_file()
                and mark.read_text().strip() == spec.sha256)

    if all(ok(r) for r in paths):
        return paths
    with _flock(out / ".assemble.lock"):
        todo = [r for r in paths if not ok(r)]
        if todo:
            work = Path(tempfile.mkdtemp(prefix=".chunks-", dir=out))
            try:
                pw.fetch_chunks(pw.QWEN_REQUIREMENTS, work / "wheels")
                for role in todo:
                    spec, p = specs[paths[role].stem], paths[role]
                    tmp = work / p.name
                    pw.assemble_gguf(spec, work / "wheels", tmp)  # checks size and sha256
                    os.replace(tmp, p)
                    p.with_suffix(".gguf.sha256").write_text(spec.sha256 + "\n")
            finally:
                shutil.rmtree(work, ignore_errors=True)
    return paths


def gguf_info(path: Path) -> Dict[str, Any]:
    """A GGUF file's quantisation from its header: file type, parameters per tensor type, bytes of
    weights and bytes per weight, against the same parameters in bf16 (what TokenRouter serves)."""
    import gguf

    reader = gguf.GGUFReader(str(path))

    def field(name: str):
        f = reader.fields.get(name)
        if f is None:
            return None
        if hasattr(f, "contents"):
            return f.contents()
        return f.parts[f.data[0]].tolist()[0]

    by_type: Dict[str, Dict[str, int]] = {}
    params = nbytes = 0
    for t in reader.tensors:
        name = t.tensor_type.name
        row = by_type.setdefault(name, {"tensors": 0, "parameters": 0, "bytes": 0})
        row["tensors"] += 1
        row["parameters"] += int(t.n_elements)
        row["bytes"] += int(t.n_bytes)
        params += int(t.n_elements)
        nbytes += int(t.n_bytes)
    # a decoding step reads every matrix once, but only one row of the input embedding when the
    # output projection is a separate tensor (untied, as in both GGUF files here)
    names = {t.name: t for t in reader.tensors}
    embd = names.get("token_embd.weight") if "output.weight" in names else None
    embd_params, embd_bytes = (int(embd.n_elements), int(embd.n_bytes)) if embd is not None else (0, 0)
    ftype = field("general.file_type")
    try:
        ftype_name = gguf.LlamaFileType(int(ftype)).name if ftype is not None else None
    except ValueError:
        ftype_name = str(ftype)
    return {"file": str(path), "file_bytes": path.stat().st_size, "name": field("general.name"),
            "file_type": ftype_name, "tensor_types": by_type, "parameters": params, "weight_bytes": nbytes,
            "bytes_per_weight": nbytes / params if params else float("nan"),
            "bf16_bytes": 2 * params, "bf16_over_gguf": 2 * params / nbytes if nbytes else float("nan"),
            "tied_embeddings": "output.weight" not in names,
            "read_per_token_bytes": nbytes - embd_bytes, "read_per_token_bf16_bytes": 2 * (params - embd_params)}


# --------------------------------------------------------------------------- settings and command line
def parse_settings(spec: str, draft_max: Sequence[Optional[int]]) -> List[Dict[str, Any]]:
    """``--settings`` → the server settings to run, in order.

    ``llm``: the LLM alone; ``llm+draft``: one setting per ``draft_max`` value (None: the server's
    default); ``llm+draft:K``: K drafted tokens; ``llm+draft:default``: the server's default.

    Raises:
        ValueError: an unknown setting.
    """
    out: List[Dict[str, Any]] = []
    for name in (s.strip() for s in spec.split(",") if s.strip()):
        base, _, k = name.partition(":")
        if base == "llm" and not k:
            out.append({"name": "llm", "draft": False, "draft_max": None})
        elif base == "llm+draft":
            ks: Sequence[Optional[int]] = draft_max if not k else [None if k == "default" else int(k)]
            for kk in ks:
                out.append({"name": f"llm+draft:{'default' if kk is None else kk}", "draft": True, "draft_max": kk})
        else:
            raise ValueError(f"--settings: unknown setting {name!r} (llm, llm+draft, llm+draft:K, llm+draft:default)")
    names = [s["name"] for s in out]
    if len(set(names)) != len(names):
        raise ValueError(f"--settings: a setting is named twice ({', '.join(names)})")
    return out


def context_size(n_parallel: int, prompt_tokens: int, max_tokens: int, draft_max: Optional[int] = None) -> int:
    """``-c`` for N slots: llama-server gives each slot ``ctx / N``, and a slot must hold the longest
    prompt, ``max_tokens`` and a draft (K, or 16 for the server's default) plus :data:`CTX_MARGIN`,
    rounded up to a multiple of 64."""
    per_slot = prompt_tokens + max_tokens + (draft_max if draft_max is not None else 16) + CTX_MARGIN
    per_slot = -(-per_slot // 64) * 64
    return n_parallel * per_slot


def server_command(binary: str, llm_gguf: str, n_parallel: int, ctx: int, port: int, threads: int,
                   draft_gguf: Optional[str] = None, draft_max: Optional[int] = None,
                   draft_min: Optional[int] = None) -> List[str]:
    """The ``llama-server`` command line of one setting (module docstring).

    The LLM alone: ``-m``; with a draft: ``-md``, ``--spec-type draft-simple`` (without it this
    llama.cpp loads the draft model and never drafts: it infers a type only for MTP / EAGLE3 / DFlash
    drafts) and, when given, ``--spec-draft-n-max`` / ``--spec-draft-n-min`` (this llama.cpp's
    names; ``--draft-max`` was removed), its threads as the LLM's.  Always 127.0.0.1, ``-np N``,
    ``-c CTX``, ``--threads`` / ``--threads-batch``, no prompt cache in RAM (``--cache-ram 0``), no
    web UI, ``--metrics``.
    """
    cmd = [binary, "-m", llm_gguf, "--host", "127.0.0.1", "--port", str(port), "-np", str(n_parallel),
           "-c", str(ctx), "--threads", str(threads), "--threads-batch", str(threads),
           "--cache-ram", "0", "--no-webui", "--metrics"]
    if draft_gguf:
        cmd += ["-md", draft_gguf, "--spec-type", "draft-simple",
                "--spec-draft-threads", str(threads), "--spec-draft-threads-batch", str(threads)]
        if draft_max is not None:
            cmd += ["--spec-draft-n-max", str(draft_max)]
        if draft_min is not None:
            cmd += ["--spec-draft-n-min", str(draft_min)]
    elif draft_max is not None or draft_min is not None:
        raise ValueError("draft_max / draft_min without a draft model")
    return cmd


def completion_body(prompt: str, max_tokens: int, stop: Sequence[str], stream: bool = True) -> Dict[str, Any]:
    """The ``/completion`` request of one answer: raw prompt text, greedy, no prompt cache."""
    return {"prompt": prompt, "n_predict": int(max_tokens), "temperature": 0.0, "top_k": 1, "top_p": 1.0,
            "min_p": 0.0, "stop": list(stop), "cache_prompt": False, "stream": stream, "seed": 0}


# --------------------------------------------------------------------------- responses
def sse_events(lines: Iterable[bytes]) -> Iterator[Dict[str, Any]]:
    """The JSON objects of a server-sent-event stream (``data: {...}`` lines; others skipped).

    Raises:
        LlamaCppError: an ``error`` event.
    """
    for raw in lines:
        line = raw.decode("utf-8", "replace").strip() if isinstance(raw, bytes) else raw.strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if not data or data == "[DONE]":
            continue
        ev = json.loads(data)
        if "error" in ev:
            raise LlamaCppError(f"server error: {ev['error']}")
        yield ev


def finish_reason(stop_type: Optional[str]) -> Optional[str]:
    """llama-server's ``stop_type`` as ``task.grade``'s finish reason: ``limit`` → ``length``,
    ``eos`` / ``word`` → ``stop``; anything else (``none``: not finished) → None."""
    return {"limit": "length", "eos": "stop", "word": "stop"}.get(stop_type or "")


def record_from_stream(chunks: Sequence[Tuple[float, Mapping[str, Any]]], t0: float, t_end: float) -> Dict[str, Any]:
    """One answer's record from its streamed ``/completion`` events (arrival time, event).

    Text: the ``content`` of every event in order.  TTFT: send (``t0``) → the first event that
    carries a token (``tokens`` or ``content``).  The final event (``stop`` true) gives the output
    tokens (``tokens_predicted``), prompt tokens, ``stop_type`` and the server's ``timings``
    (``prompt_ms``, ``predicted_ms``, ``draft_n``, ``draft_n_accepted`` when drafting).
    """
    text, first, final = [], None, None
    for t, ev in chunks:
        piece = ev.get("content") or ""
        text.append(piece)
        if first is None and (piece or ev.get("tokens")):
            first = t
        if ev.get("stop"):
            final = ev
    rec: Dict[str, Any] = {"text": "".join(text), "ttft_s": (first - t0) if first is not None else float("nan"),
                           "e2e_s": t_end - t0, "error": ""}
    if final is None:
        rec.update(error="the stream ended without a final event", output_tokens=0, finish_reason=None)
        return rec
    tm = final.get("timings") or {}
    rec.update({
        "output_tokens": int(final.get("tokens_predicted", tm.get("predicted_n", 0)) or 0),
        "prompt_tokens": final.get("tokens_evaluated", tm.get("prompt_n")),
        "stop_type": final.get("stop_type"), "stopping_word": final.get("stopping_word") or "",
        "finish_reason": finish_reason(final.get("stop_type")), "truncated": bool(final.get("truncated", False)),
        "server_prompt_ms": tm.get("prompt_ms"), "server_predicted_ms": tm.get("predicted_ms"),
        "server_predicted_per_s": tm.get("predicted_per_second"), "cache_n": tm.get("cache_n"),
        "draft_n": tm.get("draft_n"), "draft_n_accepted": tm.get("draft_n_accepted"),
    })
    return rec


def post_completion(port: int, body: Mapping[str, Any], timeout_s: float) -> Dict[str, Any]:
    """Send one streamed ``/completion`` request; its :func:`record_from_stream` record
    (``t_start_s`` on the perf_counter clock)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    chunks: List[Tuple[float, Dict[str, Any]]] = []
    t0 = time.perf_counter()
    try:
        conn.request("POST", "/completion", body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise LlamaCppError(f"HTTP {resp.status}: {resp.read(2000).decode('utf-8', 'replace')}")
        for ev in sse_events(resp):
            chunks.append((time.perf_counter(), ev))
            if ev.get("stop"):
                break
        t1 = time.perf_counter()
        rec = record_from_stream(chunks, t0, t1)
    except (OSError, http.client.HTTPException, LlamaCppError, ValueError) as e:
        t1 = time.perf_counter()
        rec = {**record_from_stream(chunks, t0, t1), "error": f"{type(e).__name__}: {e}"}
    finally:
        conn.close()
    rec["t_start_s"] = t0
    return rec


# --------------------------------------------------------------------------- statistics
def run_summary(records: Sequence[Mapping[str, Any]], wall_s: float) -> Dict[str, Any]:
    """One run's figures: output tokens/s and answers/s (over the wall time), TTFT p50/p90 (client
    and server), end-to-end p50/p90/p99, draft acceptance and accuracy (when graded)."""
    ok = [r for r in records if not r.get("error")]
    toks = sum(int(r.get("output_tokens") or 0) for r in ok)
    ttft = [r["ttft_s"] for r in ok if r.get("ttft_s") == r.get("ttft_s")]
    e2e = [r["e2e_s"] for r in ok]
    sttft = [r["server_prompt_ms"] / 1000.0 for r in ok if r.get("server_prompt_ms") is not None]
    drafted = sum(int(r.get("draft_n") or 0) for r in ok)
    accepted = sum(int(r.get("draft_n_accepted") or 0) for r in ok)
    graded = [r for r in ok if "passed" in r]
    out: Dict[str, Any] = {
        "answers": len(ok), "errors": len(records) - len(ok), "output_tokens": toks, "wall_s": wall_s,
        "output_tok_s": toks / wall_s if wall_s > 0 else float("nan"),
        "answers_per_s": len(ok) / wall_s if wall_s > 0 else float("nan"),
        "ttft_p50_s": percentile(ttft, 50), "ttft_p90_s": percentile(ttft, 90),
        "server_ttft_p50_s": percentile(sttft, 50), "server_ttft_p90_s": percentile(sttft, 90),
        "e2e_p50_s": percentile(e2e, 50), "e2e_p90_s": percentile(e2e, 90), "e2e_p99_s": percentile(e2e, 99),
        "output_tokens_mean": toks / len(ok) if ok else float("nan"),
        "cut_at_max_tokens": sum(1 for r in ok if r.get("finish_reason") == "length"),
        "draft_n": drafted, "draft_n_accepted": accepted,
        "acceptance": accepted / drafted if drafted else None,
    }
    if graded:
        out["passed"] = sum(1 for r in graded if r["passed"])
        out["accuracy"] = out["passed"] / len(records) if records else float("nan")
    return out


SUMMARY_KEYS = ("output_tok_s", "answers_per_s", "ttft_p50_s", "ttft_p90_s", "server_ttft_p50_s", "e2e_p50_s",
                "e2e_p90_s", "e2e_p99_s", "acceptance", "accuracy", "output_tokens_mean")


def summarize(runs: Sequence[Mapping[str, Any]]) -> Dict[str, Dict[str, Dict[str, Any]]]:
    """``{setting: {str(N): {metric: spread over repeats}}}`` of the runs' :func:`run_summary`
    (``spread``: mean, min, max, sd, ci95, n; a metric no run has is left out)."""
    groups: Dict[Tuple[str, int], List[Mapping[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["setting"], int(r["n"])), []).append(r["summary"])
    out: Dict[str, Dict[str, Dict[str, Any]]] = {}
    for (setting, n), sums in groups.items():
        row = {}
        for k in SUMMARY_KEYS:
            xs = [s[k] for s in sums if s.get(k) is not None]
            if xs:
                row[k] = spread(xs)
        row["repeats"] = len(sums)
        out.setdefault(setting, {})[str(n)] = row
    return out


# --------------------------------------------------------------------------- server and load
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get_json(port: int, path: str, timeout_s: float = 10.0) -> Tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        raw = resp.read()
        try:
            return resp.status, json.loads(raw)
        except ValueError:
            return resp.status, raw.decode("utf-8", "replace")
    finally:
        conn.close()


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM when this script dies, however it dies."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class LlamaServer:
    """One ``llama-server`` process (context manager): started, ``/health`` waited for, stopped."""

    def __init__(self, cmd: Sequence[str], port: int, log: Path, ready_timeout_s: float = 600.0) -> None:
        self.cmd, self.port, self.log, self.ready_timeout_s = list(cmd), port, log, ready_timeout_s
        self.proc: Optional[subprocess.Popen] = None

    def __enter__(self) -> "LlamaServer":
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.log, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self._fh, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        try:
            return self._wait_ready()
        except BaseException:
            self._close()
            raise

    def _wait_ready(self) -> "LlamaServer":
        assert self.proc is not None
        t_end = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < t_end:
            if self.proc.poll() is not None:
                tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-20:])
                rc = self.proc.returncode
                how = f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit status {rc}"
                raise LlamaCppError(f"llama-server exited ({how}); log {self.log}:\n{tail}")
            with contextlib.suppress(OSError, http.client.HTTPException):
                status, _ = _get_json(self.port, "/health", 5.0)
                if status == 200:
                    return self
            time.sleep(0.5)
        raise LlamaCppError(f"llama-server not ready in {self.ready_timeout_s:.0f} s; log {self.log}")

    def metrics(self) -> Dict[str, float]:
        """The Prometheus counters of ``/metrics`` (``llamacpp:...`` name → value)."""
        try:
            _, text = _get_json(self.port, "/metrics")
        except (OSError, http.client.HTTPException):
            return {}
        out = {}
        for line in (text if isinstance(text, str) else "").splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                with contextlib.suppress(ValueError):
                    out[name] = float(value)
        return out

    def props(self) -> Any:
        with contextlib.suppress(OSError, http.client.HTTPException):
            return _get_json(self.port, "/props")[1]
        return None

    def _close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:  # SIGTERM: llama-server exits at once
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._fh.close()

    def __exit__(self, *exc) -> None:
        self._close()


def closed_loop(port: int, items: Sequence[Tuple[str, str]], n: int, max_tokens: int, stop: Sequence[str],
                timeout_s: float) -> Tuple[List[Dict[str, Any]], float]:
    """Every (task_id, prompt) once, by ``n`` client threads each sending its next item as soon as
    its last answer is in; the records in item order and the wall time (first send → last answer)."""
    todo: "queue.Queue[int]" = queue.Queue()
    for i in range(len(items)):
        todo.put(i)
    out: List[Optional[Dict[str, Any]]] = [None] * len(items)

    def worker() -> None:
        while True:
            try:
                i = todo.get_nowait()
            except queue.Empty:
                return
            tid, prompt = items[i]
            rec = post_completion(port, completion_body(prompt, max_tokens, stop), timeout_s)
            out[i] = {"task_id": tid, **rec}

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(max(1, n))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    recs = [r for r in out if r is not None]
    for r in recs:
        r["t_start_s"] -= t0
    return recs, wall


# --------------------------------------------------------------------------- main
def _ints(text: str) -> List[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _draft_max(text: str) -> List[Optional[int]]:
    return [None if x.strip() == "default" else int(x) for x in text.split(",") if x.strip()]


def _save(path: str, data: Mapping[str, Any]) -> None:
    """Write the results as JSON, this machine's cache folder written as ``$TOKENROUTER_CACHE``
    (results are shared; where a file lay on one host is not a result)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    text = json.dumps(data, indent=1, default=str).replace(str(cache_dir()), "$TOKENROUTER_CACHE")
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text + "\n")
    os.replace(tmp, path)


def _print_table(summary: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> None:
    def m(row, k, fmt):
        s = row.get(k)
        if not s:
            return "-"
        return fmt.format(s["mean"]) + (f" [{fmt.format(s['min'])}-{fmt.format(s['max'])}]" if s["n"] > 1 else "")

    print(f"{'setting':<20} {'N':>3} {'tok/s':>18} {'answers/s':>18} {'TTFT p50 s':>18} {'e2e p50 s':>18} "
          f"{'e2e p99 s':>18} {'accept':>7} {'accuracy':>9}")
    for setting, by_n in summary.items():
        for n, row in by_n.items():
            print(f"{setting:<20} {n:>3} {m(row, 'output_tok_s', '{:.2f}'):>18} "
                  f"{m(row, 'answers_per_s', '{:.3f}'):>18} "
                  f"{m(row, 'ttft_p50_s', '{:.2f}'):>18} {m(row, 'e2e_p50_s', '{:.1f}'):>18} "
                  f"{m(row, 'e2e_p99_s', '{:.1f}'):>18} {m(row, 'acceptance', '{:.2f}'):>7} "
                  f"{m(row, 'accuracy', '{:.2f}'):>9}")


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", default="gsm-symbolic", help="a task of perf/tasks.py (default %(default)s)")
    ap.add_argument("--split", default="test", help="dev, test or all (default %(default)s)")
    ap.add_argument("--problems", type=int, default=50, help="the first K problems of the split (default %(default)s)")
    ap.add_argument("--concurrency", default="1,8", help="closed-loop clients N, comma-separated (default %(default)s)")
    ap.add_argument("--settings", default=",".join(SETTINGS), help="llm, llm+draft, llm+draft:K, llm+draft:default "
                    "(default %(default)s)")
    ap.add_argument("--draft-max", default="4,8", help="K of the llm+draft setting, one server each; 'default' = "
                    "the server's (default %(default)s)")
    ap.add_argument("--draft-min", type=int, default=None, help="--spec-draft-n-min (default: the server's, 0)")
    ap.add_argument("--max-tokens", type=int, default=None, help="n_predict (default: the task's)")
    ap.add_argument("--repeats", type=int, default=2, help="runs of every (setting, N) (default %(default)s)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2,
                    help="llama-server --threads, the draft's too (default %(default)s)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="per request, seconds (default %(default)s)")
    ap.add_argument("--llm-gguf", default=None, help="the LLM's GGUF (default: the pair's, assembled once)")
    ap.add_argument("--draft-gguf", default=None, help="the draft's GGUF (default: the pair's)")
    ap.add_argument("--tokenizer", default=None, help="checkpoint folder of the tokenizer (default: "
                    f"$TOKENROUTER_WEIGHTS/{LLM_FOLDER})")
    ap.add_argument("--server-args", default="", help="extra llama-server arguments, appended (e.g. '-fa on')")
    ap.add_argument("--out", default=None, help="result JSON (default perf/results/<date>-<host>-llamacpp-<task>.json)")
    ap.add_argument("--build-only", action="store_true",
                    help="build llama-server (and assemble the GGUF files), then exit")
    ap.add_argument("--rebuild", action="store_true", help="build llama-server again")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)  # a SIGTERM stops the servers as Ctrl-C does

    try:
        settings = parse_settings(args.settings, _draft_max(args.draft_max))
        conc = _ints(args.concurrency)
        build = ensure_server(force=args.rebuild)
        ggufs = {"llm": Path(args.llm_gguf), "draft": Path(args.draft_gguf)} if args.llm_gguf and args.draft_gguf \
            else ensure_gguf()
        if args.build_only:
            print(json.dumps({"build": build, "gguf": {k: str(v) for k, v in ggufs.items()}}, indent=1))
            return 0
    except (LlamaCppError, ValueError) as e:
        print(f"llamacpp: error: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # prepare_weights.PrepareError
        if type(e).__name__ != "PrepareError":
            raise
        print(f"llamacpp: error: {e}", file=sys.stderr)
        return 1

    from tasks import get_task
    from tokenrouter.tools.openai_frontend import load_tokenizer

    task = get_task(args.task)
    problems = task.problems(args.split)[: args.problems]
    by_id = {p["task_id"]: p for p in problems}
    tok_dir = args.tokenizer or str(weights_dir() / LLM_FOLDER)
    tokenizer = load_tokenizer(tok_dir)
    prompts = [(p["task_id"], task.build_prompt(tokenizer, p)) for p in problems]
    prompt_tokens = {tid: len(tokenizer(pr, add_special_tokens=False)["input_ids"]) for tid, pr in prompts}
    max_tokens = args.max_tokens or task.max_tokens
    cpu = host_cpu()
    out = args.out or os.path.join(
        HERE, "results", f"{time.strftime('%Y-%m-%d')}-{host_label(cpu)}-llamacpp-{args.task}.json")
    models = {role: gguf_info(p) for role, p in ggufs.items()}
    data: Dict[str, Any] = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "host": cpu, "task": args.task, "split": args.split,
        "prompt_format": getattr(task, "prompt_format", ""), "problems": [p["task_id"] for p in problems],
        "prompt_tokens": prompt_tokens, "tokenizer": tok_dir, "max_tokens": max_tokens, "stop": list(task.stop),
        "concurrency": conc, "settings": settings, "repeats": args.repeats, "threads": args.threads,
        "server_args": args.server_args,
        "draft_min": args.draft_min, "build": build, "models": models, "runs": [], "summary": {},
    }
    longest = max(prompt_tokens.values()) if prompt_tokens else 0
    logs = Path(tempfile.mkdtemp(prefix="llamacpp-logs-"))
    _say(f"{args.task}/{args.split}: {len(problems)} problems (longest prompt {longest} tokens), max_tokens "
         f"{max_tokens}; settings {', '.join(s['name'] for s in settings)}; N {conc}; {args.repeats} repeats; "
         f"server logs {logs}; results {out}")
    binary = build["binary"]
    try:
        for rep, st, n in itertools.product(range(args.repeats), settings, conc):  # repeats outermost
            port = free_port()
            ctx = context_size(n, longest, max_tokens, st["draft_max"] if st["draft"] else 0)
            cmd = server_command(binary, str(ggufs["llm"]), n, ctx, port, args.threads,
                                 draft_gguf=str(ggufs["draft"]) if st["draft"] else None,
                                 draft_max=st["draft_max"] if st["draft"] else None,
                                 draft_min=args.draft_min if st["draft"] else None) + shlex.split(args.server_args)
            log = logs / f"{st['name'].replace(':', '-').replace('+', '-')}-n{n}-r{rep}.log"
            others = busy_cores()  # no server of ours runs now: this is other jobs
            if others > 0.3:
                _say(f"warning: other processes keep {others:.1f} of {os.cpu_count()} cores busy: llama.cpp's "
                     "threads spin-wait for each other, so they slow it far more than their share")
            t_load = time.monotonic()
            try:
                with LlamaServer(cmd, port, log) as srv:
                    load_s = time.monotonic() - t_load
                    props = srv.props()
                    t_w = time.perf_counter()
                    warm = post_completion(port, completion_body(prompts[0][1], min(16, max_tokens), task.stop),
                                           args.timeout)
                    warm_s = time.perf_counter() - t_w
                    if warm.get("error"):
                        raise LlamaCppError(f"warm-up failed: {warm['error']}")
                    m0 = srv.metrics()
                    records, wall = closed_loop(port, prompts, n, max_tokens, task.stop, args.timeout)
                    m1 = srv.metrics()
                    load_after = os.getloadavg()[0]
            except LlamaCppError as e:
                raise LlamaCppError(f"{st['name']} N={n}: {e}") from None
            for r in records:
                r["prompt_tokens_hf"] = prompt_tokens[r["task_id"]]
                if not r.get("error"):
                    g = task.grade(by_id[r["task_id"]], r["text"], r.get("finish_reason"))
                    r.update(passed=bool(g["passed"]), result=str(g.get("result", "")))
            summ = run_summary(records, wall)
            run = {"setting": st["name"], "n": n, "repeat": rep, "server_cmd": cmd, "ctx": ctx,
                   "load_s": load_s, "warmup_s": warm_s, "props": props,
                   "others_busy_cores_before": others, "loadavg_1m_after": load_after,
                   "metrics_delta": {k: m1[k] - m0.get(k, 0.0) for k in m1 if ":" in k},
                   "summary": summ, "records": records}
            data["runs"].append(run)
            data["summary"] = summarize(data["runs"])
            _save(out, data)
            if st["draft"] and summ["draft_n"] == 0:
                _say(f"warning: {st['name']} N={n}: the server drafted no token (no speculative decoding)")
            acc = f", accuracy {summ['accuracy']:.2f}" if "accuracy" in summ else ""
            accept = f", acceptance {summ['acceptance']:.2f}" if summ.get("acceptance") is not None else ""
            _say(f"repeat {rep} {st['name']} N={n}: {summ['output_tok_s']:.2f} tok/s, "
                 f"{summ['answers_per_s']:.3f} answers/s, TTFT p50 {summ['ttft_p50_s']:.2f} s, "
                 f"e2e p50 {summ['e2e_p50_s']:.1f} s{accept}{acc}, {summ['errors']} errors")
    except KeyboardInterrupt:
        _say(f"interrupted; the runs finished so far are in {out}")
        return 130
    except LlamaCppError as e:
        print(f"llamacpp: error: {e}", file=sys.stderr)
        return 1
    _print_table(data["summary"])
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
