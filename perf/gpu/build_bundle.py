"""Build the wheel bundle that the GPU benchmark carries to a host without PyPI.

The GPU host this benchmark is written for (one H200; Python 3.12 with torch 2.11,
transformers, Triton, numpy, aiohttp, pillow, ... but no SGLang and no network)
gets the engine's missing packages as wheels beside the working tree, at most
64 MiB in all with the tree.  This script downloads them from PyPI, pinned, for
CPython 3.12 on manylinux x86_64:

* :data:`CARRY`: SGLang 0.5.23 (``--no-deps``: its full dependency list pulls
  CUDA kernel packages the benchmark does without, see ``sglang_gpu_compat.py``)
  and the packages the engine path imports that the GPU host lacks, found by
  importing that path in a clean environment holding only what the host has;
* nothing else: :data:`HOST_HAS` lists what the host's image already provides
  (used only by ``--emulate``, which builds that clean environment here).

Usage::

    python perf/gpu/build_bundle.py                  # -> build/gpu-bundle/*.whl + MANIFEST.json
    python perf/gpu/build_bundle.py --python-version 3.11 --dest build/gpu-bundle-cp311
    python perf/gpu/build_bundle.py --emulate DIR    # + a clean venv standing in for the host,
                                                     #   the bundle installed as on the host, imports checked
                                                     #   (--emulate-dry-run: run.py --dry-run there)

Exit status 1 when a download fails or the bundle is larger than ``--max-mib``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Dict, List, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

#: wheels the GPU host lacks, pinned (the project's own pins in deploy/requirements.txt where it has one)
CARRY: List[str] = [
    "sglang==0.5.23",
    "pyzmq==27.3.0",                 # the inter-model channel (ZeroMQ)
    "apache-tvm-ffi==0.1.11",        # imported by sglang.kernels (JIT loader; no kernel is built)
    "compressed-tensors==0.18.0", "loguru==0.7.3",
    "gguf==0.19.0",
    "fastapi==0.165.0", "starlette==1.10.0", "uvicorn==0.54.0",
    "opentelemetry-api==1.45.2", "importlib_metadata==10.2.0",
    "openai==2.8.0", "jiter==0.19.0", "distro==1.9.0", "sniffio==1.3.1",
    "pydantic==2.14.4", "pydantic_core==2.50.5", "annotated-types==0.8.0", "typing-inspection==0.4.5",
    "partial-json-parser==0.2.1.1.post7", "setproctitle==1.3.8", "orjson==3.13.0", "msgspec==0.22.0",
    "pybase64==1.5.1", "dill==0.4.1",
]

#: what the GPU host's image has that the engine path imports (its package list, 2026-11);
#: ``--emulate`` installs these from PyPI as the host's stand-in, never into the bundle
HOST_HAS: List[str] = [
    "transformers==5.17.0", "tokenizers==0.23.2", "safetensors==0.8.0", "huggingface_hub==1.33.0",
    "numpy", "aiohttp", "psutil", "requests", "pyyaml", "pillow", "einops", "uvloop", "tqdm", "regex",
    "sentencepiece", "anyio", "h11", "httpx", "click", "zipp", "packaging", "jinja2", "typing_extensions",
]
#: host packages installed without dependencies (their PyPI dependencies would pull CUDA torch)
HOST_HAS_NODEPS: List[str] = ["triton==3.9.0", "torchvision==0.28.0"]

PLATFORMS = ["manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_26_x86_64", "manylinux_2_27_x86_64",
             "manylinux_2_28_x86_64", "manylinux_2_31_x86_64", "manylinux_2_34_x86_64", "manylinux_2_35_x86_64",
             "manylinux1_x86_64"]

#: the carry limit of one call is 64 MiB with the working tree (about 4 MiB)
DEFAULT_MAX_MIB = 55.0


def download_command(reqs: Sequence[str], dest: str, python_version: str = "3.12") -> List[str]:
    """The ``pip download`` command for ``reqs`` as wheels for CPython ``python_version``, manylinux x86_64."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir",
           "--disable-pip-version-check", "--python-version", python_version, "--implementation", "cp",
           "--index-url", "https://pypi.org/simple", "-d", dest]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    return cmd + list(reqs)


def wheel_names(dest: str) -> List[str]:
    """The ``.whl`` files in ``dest``, sorted."""
    return sorted(f for f in os.listdir(dest) if f.endswith(".whl")) if os.path.isdir(dest) else []


def check_bundle(dest: str, reqs: Sequence[str] = CARRY, max_mib: float = DEFAULT_MAX_MIB) -> Dict[str, object]:
    """Check the bundle in ``dest``: one wheel per requirement, none other, under ``max_mib``.

    Returns:
        ``{"wheels": [...], "mib": float, "missing": [...], "extra": [...], "ok": bool}``.
    """
    def norm(name: str) -> str:
        return name.lower().replace("-", "_").replace(".", "_")

    wheels = wheel_names(dest)
    have = {norm(w.split("-")[0]): w for w in wheels}
    want = {norm(r.split("==")[0]) for r in reqs}
    mib = sum(os.path.getsize(os.path.join(dest, w)) for w in wheels) / 2**20
    missing = sorted(want - set(have))
    extra = sorted(set(have) - want)
    return {"wheels": wheels, "mib": round(mib, 2), "missing": missing, "extra": extra,
            "ok": not missing and not extra and mib <= max_mib}


def build(dest: str, python_version: str = "3.12", max_mib: float = DEFAULT_MAX_MIB) -> Dict[str, object]:
    """Download :data:`CARRY` into ``dest`` and write ``dest/MANIFEST.json``; the :func:`check_bundle` result."""
    os.makedirs(dest, exist_ok=True)
    for w in wheel_names(dest):  # one version of each: stale wheels would stop the install
        os.remove(os.path.join(dest, w))
    subprocess.run(download_command(CARRY, dest, python_version), check=True)
    res = check_bundle(dest, CARRY, max_mib)
    with open(os.path.join(dest, "MANIFEST.json"), "w") as f:
        json.dump({"python_version": python_version, "requirements": CARRY, **res,
                   "built_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, f, indent=1)
    return res


def emulate(venv: str, bundle: str, torch_wheel: str = "", dry_run: bool = False) -> int:
    """A clean venv standing in for the GPU host, the bundle installed as ``perf/gpu/run.py`` installs it
    there, then the engine path imported (``run.py --check-imports``), or with ``dry_run`` the whole dry
    run (``run.py --dry-run``: results under ``venv/out``). Returns that run's exit status.

    ``torch_wheel``: a local torch wheel (the CPU build), else ``torch`` from the index.
    """
    py = os.path.join(venv, "bin", "python")
    if not os.path.exists(py):
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
        pip = [py, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        subprocess.run(pip + [torch_wheel or "torch"] + HOST_HAS, check=True)
        subprocess.run(pip + ["--no-deps"] + HOST_HAS_NODEPS, check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = os.path.join(venv, "bin") + os.pathsep + env.get("PATH", "")
    site = os.path.join(venv, "bundle-site")
    return subprocess.run([py, os.path.join(HERE, "run.py"), "--bundle", bundle, "--site", site,
                           "--dry-run" if dry_run else "--check-imports", "--out", os.path.join(venv, "out")],
                          cwd=ROOT, env=env).returncode


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dest", default=os.path.join(ROOT, "build", "gpu-bundle"))
    ap.add_argument("--python-version", default="3.12", help="CPython of the GPU host (default 3.12)")
    ap.add_argument("--max-mib", type=float, default=DEFAULT_MAX_MIB)
    ap.add_argument("--check-only", action="store_true", help="check an existing bundle, download nothing")
    ap.add_argument("--emulate", metavar="VENV", default="",
                    help="also build a clean venv standing in for the host (this Python) and check the bundle there")
    ap.add_argument("--torch-wheel", default="", help="local torch wheel for --emulate")
    ap.add_argument("--emulate-dry-run", action="store_true", help="--emulate runs run.py --dry-run (minutes)")
    a = ap.parse_args(argv)
    res = check_bundle(a.dest, CARRY, a.max_mib) if a.check_only else build(a.dest, a.python_version, a.max_mib)
    print(json.dumps({k: res[k] for k in ("mib", "missing", "extra", "ok")}), flush=True)
    if not res["ok"]:
        return 1
    if a.emulate:
        return emulate(a.emulate, a.dest, a.torch_wheel, a.emulate_dry_run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
