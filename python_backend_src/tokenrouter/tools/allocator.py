"""tritonserver's memory allocator: jemalloc where the host has it, else glibc's malloc with a 1 MiB
mmap threshold; the model stubs keep glibc's malloc either way.

Why (docs/reliability.md, "Memory over time"): Triton 2.51's front ends take a request of any size, so a
burst of 32 MiB prompts passes through tritonserver's heap before the router refuses them. glibc keeps
the freed memory in its arenas (tritonserver's anonymous memory stepped 16 -> 94 -> 158 MiB over such
bursts, even with the 1 MiB threshold); jemalloc with a background purge thread gives it back within
about a second (15-17 MiB after the same bursts). Triton's own documentation recommends jemalloc or
tcmalloc for tritonserver for this reason.

How: ``LD_PRELOAD`` of ``libjemalloc.so.2`` for tritonserver only. Triton's Python backend starts each
model stub with ``bash -c "exec triton_python_backend_stub ..."``, and every stub would inherit the
preload; ``BASH_ENV`` names ``stub_env.sh`` beside this module, which bash reads first and which puts
back the stub's ``LD_PRELOAD`` and ``MALLOC_CONF`` as they were before. The model processes' heap
settings (``malloc_mmap_threshold_bytes``, periodic ``malloc_trim``) and their glibc heap probes stay
as measured.

``python -m tokenrouter.tools.allocator --malloc auto`` prints the variables, one ``NAME=VALUE`` per
line (what ``deploy/serve`` reads); the choice goes to stderr.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, Mapping, Optional

#: the values of ``--malloc`` / ``TOKENROUTER_MALLOC``
CHOICES = ("auto", "jemalloc", "glibc")

#: tritonserver's glibc mmap threshold (bytes) unless the environment sets one: large buffers are
#: mapped afresh and unmapped when freed
MMAP_THRESHOLD_BYTES = 1 << 20

#: jemalloc's configuration unless ``MALLOC_CONF`` is set: a background thread purges freed pages
#: (dirty after 1 s, no muzzy stage), so memory goes back to the system without new allocations
JEMALLOC_CONF = "background_thread:true,dirty_decay_ms:1000,muzzy_decay_ms:0"

#: what bash reads before it starts a model stub (``BASH_ENV``)
STUB_ENV = Path(__file__).with_name("stub_env.sh")

_SEARCH = ("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2", "/lib/x86_64-linux-gnu/libjemalloc.so.2",
           "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2", "/usr/lib64/libjemalloc.so.2",
           "/usr/local/lib/libjemalloc.so.2")


def find_jemalloc(environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """The path of ``libjemalloc.so.2``: ``$TOKENROUTER_JEMALLOC`` if set, else the dynamic linker's
    cache (``ldconfig -p``), else the usual library folders; None where there is none.

    Raises:
        FileNotFoundError: ``TOKENROUTER_JEMALLOC`` is set and names no readable file.
    """
    named = environ.get("TOKENROUTER_JEMALLOC", "")
    if named:
        if not os.access(named, os.R_OK) or not os.path.isfile(named):
            raise FileNotFoundError(f"TOKENROUTER_JEMALLOC={named!r} is not a readable file")
        return named
    try:
        cache = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        cache = ""
    for line in cache.splitlines():
        name, _, path = line.strip().partition(" => ")
        if name.startswith("libjemalloc.so.2 ") and os.path.isfile(path):
            return path
    return next((p for p in _SEARCH if os.path.isfile(p)), None)


def tritonserver_env(malloc: str = "auto", environ: Mapping[str, str] = os.environ) -> Dict[str, str]:
    """The variables to add to tritonserver's environment for allocator ``malloc``.

    Args:
        malloc: one of :data:`CHOICES`. ``auto``: jemalloc where :func:`find_jemalloc` finds it, else
            glibc. ``jemalloc``: jemalloc or an error.
        environ: the environment tritonserver would otherwise get (its ``LD_PRELOAD``,
            ``MALLOC_CONF``, ``MALLOC_MMAP_THRESHOLD_`` and ``BASH_ENV`` are kept for the stubs).

    Returns:
        dict of str -> str: always ``MALLOC_MMAP_THRESHOLD_`` (the environment's, else
        :data:`MMAP_THRESHOLD_BYTES`; the stubs set their own at load) and ``TOKENROUTER_MALLOC``
        (``jemalloc`` or ``glibc``, the choice made); with jemalloc also ``LD_PRELOAD``,
        ``MALLOC_CONF``, ``BASH_ENV`` and the ``TOKENROUTER_STUB_*`` values ``stub_env.sh`` restores.

    Raises:
        ValueError: ``malloc`` is not one of :data:`CHOICES`, or is ``jemalloc`` and the host has no
            ``libjemalloc.so.2`` (install it: ``apt-get install libjemalloc2``, or name it with
            ``TOKENROUTER_JEMALLOC``).
        FileNotFoundError: from :func:`find_jemalloc`.
    """
    if malloc not in CHOICES:
        raise ValueError(f"malloc must be one of {', '.join(CHOICES)}, got {malloc!r}")
    env = {"MALLOC_MMAP_THRESHOLD_": environ.get("MALLOC_MMAP_THRESHOLD_") or str(MMAP_THRESHOLD_BYTES),
           "TOKENROUTER_MALLOC": "glibc"}
    if malloc == "glibc":
        return env
    lib = find_jemalloc(environ)
    if lib is None:
        if malloc == "jemalloc":
            raise ValueError("malloc jemalloc: no libjemalloc.so.2 on this host (apt-get install libjemalloc2, "
                             "or name the file with TOKENROUTER_JEMALLOC)")
        return env
    preload, conf = environ.get("LD_PRELOAD", ""), environ.get("MALLOC_CONF", "")
    env.update({
        "TOKENROUTER_MALLOC": "jemalloc",
        "LD_PRELOAD": f"{lib}:{preload}" if preload else lib,
        "MALLOC_CONF": conf or JEMALLOC_CONF,
        "BASH_ENV": str(STUB_ENV),
        # what the stubs get back (stub_env.sh): the environment's values, empty for none
        "TOKENROUTER_STUB_LD_PRELOAD": preload,
        "TOKENROUTER_STUB_MALLOC_CONF": conf,
        "TOKENROUTER_STUB_BASH_ENV": environ.get("BASH_ENV", ""),
    })
    return env


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--malloc", default=os.environ.get("TOKENROUTER_MALLOC") or "auto", choices=CHOICES,
                    help="tritonserver's allocator (default $TOKENROUTER_MALLOC, else auto)")
    a = ap.parse_args(argv)
    try:
        env = tritonserver_env(a.malloc)
    except (ValueError, FileNotFoundError) as e:
        print(f"allocator: error: {e}", file=sys.stderr)
        return 2
    how = f"jemalloc ({env['LD_PRELOAD'].split(':')[0]})" if env["TOKENROUTER_MALLOC"] == "jemalloc" else (
        "glibc (no libjemalloc.so.2 found: apt-get install libjemalloc2)" if a.malloc == "auto" else "glibc")
    print(f"tritonserver's allocator: {how}", file=sys.stderr)
    for k, v in env.items():
        print(f"{k}={v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
