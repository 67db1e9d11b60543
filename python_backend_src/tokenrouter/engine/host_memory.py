"""Giving freed host memory back to the system: glibc's ``malloc_trim``, on a timer.

A model process allocates and frees activation buffers of a new size at almost every step
(routed steps mix decode rows with resume extends and verifications of a few tokens).  glibc's
allocator keeps what is freed inside its per-thread heaps (arenas) for reuse and gives back
only what sits at the top of a heap, so the process's resident memory creeps up with traffic
although nothing is held: on the 1.5B model's linear shapes (rows 8-120,
``perf/kernel_cache_step.py``) a process's anonymous memory went from 572 to 427 MiB with one
``malloc_trim(0)``; with the row buckets (``cpu_linear_row_buckets``) from 317 to 311 MiB
(docs/reliability.md, "Memory over time").
``malloc_trim(0)`` returns every whole free page of every arena (``madvise(MADV_DONTNEED)``);
the pages come back zeroed on next use.

A fixed mmap threshold (:func:`set_mmap_threshold`, glibc's ``M_MMAP_THRESHOLD``) goes further for
the large buffers: each allocation at least that large is mapped afresh and unmapped at free, so a
step's activation buffers (a 512-token prefill chunk of the 1.5B in float32 allocates tens of MiB)
never stay inside a heap between steps, and the resident size between steps does not depend on
which step ran last.  glibc's own threshold is dynamic: it starts at 128 KiB and rises to the size
of each mmapped block freed (up to 32 MiB), so after warm-up almost every buffer is a heap buffer.

Where the C library is not glibc (musl, macOS) there is nothing to call: :class:`HostMemoryTrimmer`
then does nothing and :func:`set_mmap_threshold` returns False.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys
import time
from typing import Callable, Dict, Optional

__all__ = ["HostMemoryTrimmer", "MAX_MMAP_THRESHOLD_BYTES", "MMAP_THRESHOLD_ENV", "heap_stats",
           "resident_anonymous_bytes", "apply_mmap_threshold", "set_mmap_threshold",
           "undo_inherited_mmap_threshold"]

#: the largest mmap threshold glibc accepts on 64-bit systems (``DEFAULT_MMAP_THRESHOLD_MAX``: 32 MiB)
MAX_MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024
#: ``mallopt``'s parameter numbers for the trim and mmap thresholds (``M_TRIM_THRESHOLD``,
#: ``M_MMAP_THRESHOLD`` in malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: the environment variable through which glibc fixes a process's mmap threshold at start
MMAP_THRESHOLD_ENV = "MALLOC_MMAP_THRESHOLD_"

logger = logging.getLogger(__name__)


def _libc_function(name: str, argtypes: list, restype) -> Optional[Callable]:
    """The C library's function ``name`` with these argument and result types; None where the C
    library has none of that name (not glibc) or cannot be loaded."""
    try:
        fn = getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = argtypes
    fn.restype = restype
    return fn


def _load_malloc_trim() -> Optional[Callable[[int], int]]:
    return _libc_function("malloc_trim", [ctypes.c_size_t], ctypes.c_int)


class _MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (glibc >= 2.33): every field a ``size_t``."""
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                 "fordblks", "keepcost")]


_mallinfo2 = _libc_function("mallinfo2", [], _MallInfo2)


def set_mmap_threshold(nbytes: int) -> bool:
    """Fix this process's mmap threshold at ``nbytes`` (glibc's ``mallopt(M_MMAP_THRESHOLD, nbytes)``):
    from then on, allocations of at least ``nbytes`` bytes are served by their own ``mmap`` and
    returned to the system when freed, and the threshold no longer rises by itself.  Process-wide;
    earlier allocations keep where they are.

    Args:
        nbytes: the threshold in bytes, 0 < nbytes <= :data:`MAX_MMAP_THRESHOLD_BYTES`.

    Returns:
        whether it was set (False where the C library has no ``mallopt``, i.e. is not glibc).

    Raises:
        ValueError: ``nbytes`` out of that range, or refused by ``mallopt``.
    """
    if not 0 < nbytes <= MAX_MMAP_THRESHOLD_BYTES:
        raise ValueError(f"mmap threshold must be > 0 and <= {MAX_MMAP_THRESHOLD_BYTES} bytes, got {nbytes}")
    mallopt = _libc_function("mallopt", [ctypes.c_int, ctypes.c_int], ctypes.c_int)
    if mallopt is None:
        return False
    if mallopt(_M_MMAP_THRESHOLD, int(nbytes)) != 1:
        raise ValueError(f"mallopt(M_MMAP_THRESHOLD, {nbytes}) refused the value")
    return True


def undo_inherited_mmap_threshold() -> bool:
    """Where this process started with a fixed mmap threshold from its environment
    (:data:`MMAP_THRESHOLD_ENV`: ``deploy/serve`` sets one for tritonserver, and the model stubs
    inherit tritonserver's environment), set the mmap threshold to :data:`MAX_MMAP_THRESHOLD_BYTES`
    and the trim threshold to twice that: where glibc's dynamic thresholds stand once a process has
    freed a block of 32 MiB or more, as a model's has after loading its weights.  A model then
    steps as with glibc's own threshold (a small one costs prefill steps page faults:
    docs/reliability.md, "Memory over time").

    Returns:
        whether it did (False: no such variable, or the C library has no ``mallopt``).
    """
    import os

    if not os.environ.get(MMAP_THRESHOLD_ENV):
        return False
    mallopt = _libc_function("mallopt", [ctypes.c_int, ctypes.c_int], ctypes.c_int)
    if mallopt is None:
        return False
    return (mallopt(_M_MMAP_THRESHOLD, MAX_MMAP_THRESHOLD_BYTES) == 1
            and mallopt(_M_TRIM_THRESHOLD, 2 * MAX_MMAP_THRESHOLD_BYTES) == 1)


def apply_mmap_threshold(setting: int) -> int:
    """A model process's mmap threshold at load, from its ``malloc_mmap_threshold_bytes``: ``setting``
    itself when > 0 (:func:`set_mmap_threshold`), else 32 MiB in place of a fixed threshold inherited
    from the environment (:func:`undo_inherited_mmap_threshold`), else nothing done.

    Returns:
        the threshold now fixed, in bytes; 0 where glibc's own dynamic one stays (or no glibc).

    Raises:
        ValueError: ``setting`` above :data:`MAX_MMAP_THRESHOLD_BYTES`.
    """
    if setting:
        return setting if set_mmap_threshold(setting) else 0
    return MAX_MMAP_THRESHOLD_BYTES if undo_inherited_mmap_threshold() else 0


def heap_stats() -> Dict[str, int]:
    """What the process's heap holds, to tell live allocations from freed memory the allocator
    keeps (growth of the first is a leak or a cache; of the second, fragmentation).

    Returns:
        ``python_allocated_blocks`` (``sys.getallocatedblocks()``: CPython's live small-object
        blocks, a count) and, with glibc >= 2.33 (``mallinfo2``; absent elsewhere), in bytes:
        ``malloc_in_use_bytes`` (allocated by malloc and not freed, mmapped chunks included),
        ``malloc_free_bytes`` (freed chunks kept inside the arenas and the free top of each heap,
        resident or not: ``malloc_trim`` gives their whole pages back but they stay counted) and ``malloc_mmapped_bytes`` (large chunks served by ``mmap``,
        returned to the system when freed).  ``mallinfo2`` walks every arena's free lists: about a
        millisecond in a model process.
    """
    out = {"python_allocated_blocks": sys.getallocatedblocks()}
    if _mallinfo2 is not None:
        mi = _mallinfo2()
        out.update(malloc_in_use_bytes=int(mi.uordblks + mi.hblkhd), malloc_free_bytes=int(mi.fordblks),
                   malloc_mmapped_bytes=int(mi.hblkhd))
    return out


def resident_anonymous_bytes() -> Optional[int]:
    """This process's resident anonymous memory (``RssAnon`` of ``/proc/self/status``) in bytes;
    None where there is no such file."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class HostMemoryTrimmer:
    """Calls ``malloc_trim(0)`` at most once every ``interval_s`` seconds, from the thread that
    calls :meth:`maybe_trim` (a model's decode loop, between steps).

    Args:
        interval_s: seconds between two trims; 0 turns trimming off.
        clock: monotonic clock in seconds (tests pass their own).

    Attributes:
        interval_s: the setting (may be changed between calls).
        trims: trims done.
        seconds: seconds spent in them (wall clock).
        released_bytes: resident anonymous memory given back, summed over trims (bytes, each
            trim's drop of ``RssAnon``; 0 when it did not drop).
    """

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic):
        self.interval_s = float(interval_s)
        self._clock = clock
        self._trim = _load_malloc_trim()
        self._last = clock()
        self.trims = 0
        self.seconds = 0.0
        self.released_bytes = 0

    @property
    def available(self) -> bool:
        """Whether trimming is on: ``interval_s`` > 0 and the C library has ``malloc_trim`` (glibc)."""
        return self._trim is not None and self.interval_s > 0

    def maybe_trim(self) -> bool:
        """Trim if ``interval_s`` has passed since the last trim (or since the start); returns
        whether it trimmed."""
        if not self.available or self._clock() - self._last < self.interval_s:
            return False
        before = resident_anonymous_bytes()
        t0 = time.perf_counter()
        self._trim(0)
        self.seconds += time.perf_counter() - t0
        after = resident_anonymous_bytes()
        if before is not None and after is not None and after < before:
            self.released_bytes += before - after
        self.trims += 1
        self._last = self._clock()
        return True
