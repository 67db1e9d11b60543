"""HostMemoryTrimmer: freed heap memory goes back to the system, on its timer only."""

from __future__ import annotations

import ctypes
import ctypes.util

import pytest

from tokenrouter.engine.host_memory import HostMemoryTrimmer, resident_anonymous_bytes


def _libc():
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    return libc


def test_trimmer_gives_freed_heap_back_on_its_timer():
    now = [0.0]
    trimmer = HostMemoryTrimmer(30.0, clock=lambda: now[0])
    if not trimmer.available:
        pytest.skip("the C library has no malloc_trim (not glibc)")
    libc = _libc()
    # 64 MiB in blocks of 64 kB (under glibc's mmap threshold: from the heap), each touched, then all
    # freed but the last, which pins the heap's top so that free() alone cannot shrink it
    blocks = [libc.malloc(64 * 1024) for _ in range(1024)]
    for b in blocks:
        ctypes.memset(b, 1, 64 * 1024)
    for b in blocks[:-1]:
        libc.free(b)
    assert not trimmer.maybe_trim()  # not yet due
    now[0] = 29.9
    assert not trimmer.maybe_trim() and trimmer.trims == 0
    before = resident_anonymous_bytes()
    now[0] = 30.0
    assert trimmer.maybe_trim()
    after = resident_anonymous_bytes()
    libc.free(blocks[-1])
    assert trimmer.trims == 1 and trimmer.seconds > 0
    assert before - after > 32 * 2**20, (before, after)  # most of the 64 MiB went back
    assert trimmer.released_bytes > 32 * 2**20
    now[0] = 59.0
    assert not trimmer.maybe_trim()  # the next one is due 30 s after this one
    now[0] = 60.0
    assert trimmer.maybe_trim() and trimmer.trims == 2


def test_interval_zero_never_trims():
    trimmer = HostMemoryTrimmer(0.0, clock=lambda: 1e9)
    assert not trimmer.available and not trimmer.maybe_trim() and trimmer.trims == 0


def test_heap_stats_tell_live_allocations_from_freed_memory_kept():
    from tokenrouter.engine.host_memory import heap_stats

    libc = _libc()
    base = heap_stats()
    if "malloc_in_use_bytes" not in base:
        pytest.skip("the C library has no mallinfo2 (not glibc >= 2.33)")
    blocks = [libc.malloc(64 * 1024) for _ in range(512)]  # 32 MiB from the heap, live
    live = heap_stats()
    assert live["malloc_in_use_bytes"] - base["malloc_in_use_bytes"] >= 32 * 2**20
    for b in blocks[:-1]:  # freed; the last one pins the heap's top, so the allocator keeps the rest
        libc.free(b)
    kept = heap_stats()
    assert live["malloc_in_use_bytes"] - kept["malloc_in_use_bytes"] >= 31 * 2**20
    # (the free figure includes each heap's free top, which the allocations may have taken from)
    assert kept["malloc_free_bytes"] - live["malloc_free_bytes"] >= 31 * 2**20
    libc.free(blocks[-1])
    objects = [object() for _ in range(100_000)]  # CPython's small-object blocks, counted apart
    assert heap_stats()["python_allocated_blocks"] - base["python_allocated_blocks"] >= 100_000
    del objects


_MMAP_PROBE = r"""
import ctypes, ctypes.util, json, sys
from tokenrouter.engine.host_memory import heap_stats, set_mmap_threshold
libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
if sys.argv[1] != "0":
    assert set_mmap_threshold(int(sys.argv[1]))
size = 4 * 2**20
libc.free(libc.malloc(size))  # glibc's dynamic threshold rises to 4 MiB at this free
b = libc.malloc(size)
print(json.dumps(heap_stats()["malloc_mmapped_bytes"] >= size))
libc.free(b)
"""


def _second_buffer_mmapped(threshold: int) -> bool:
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _MMAP_PROBE, str(threshold)], check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out)


def test_a_fixed_mmap_threshold_keeps_large_buffers_out_of_the_heap():
    from tokenrouter.engine.host_memory import heap_stats

    if "malloc_mmapped_bytes" not in heap_stats():
        pytest.skip("the C library has no mallinfo2 (not glibc >= 2.33)")
    # glibc's own threshold: the second 4 MiB buffer comes from the heap (and stays there when freed)
    assert not _second_buffer_mmapped(0)
    # fixed at 1 MiB: every 4 MiB buffer is mapped afresh, and unmapped at free
    assert _second_buffer_mmapped(2**20)


def test_mmap_threshold_out_of_range_is_refused():
    from tokenrouter.engine.config import SubserverConfig
    from tokenrouter.engine.host_memory import MAX_MMAP_THRESHOLD_BYTES, set_mmap_threshold

    for bad in (0, -1, MAX_MMAP_THRESHOLD_BYTES + 1):
        with pytest.raises(ValueError, match="mmap threshold"):
            set_mmap_threshold(bad)
    with pytest.raises(ValueError, match=r"malloc_mmap_threshold_bytes must be >= 0 and <= 33554432"):
        SubserverConfig(malloc_mmap_threshold_bytes=MAX_MMAP_THRESHOLD_BYTES + 1)


_UNDO_PROBE = r"""
import ctypes, ctypes.util, json
from tokenrouter.engine.host_memory import heap_stats, undo_inherited_mmap_threshold
libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
undone = undo_inherited_mmap_threshold()
b = libc.malloc(4 * 2**20)
print(json.dumps([undone, heap_stats()["malloc_mmapped_bytes"] >= 4 * 2**20]))
libc.free(b)
"""


def test_a_threshold_inherited_from_tritonserver_is_replaced_at_load():
    """deploy/serve fixes tritonserver's mmap threshold at 1 MiB (MALLOC_MMAP_THRESHOLD_) and the
    stubs inherit it; a model process puts its own at 32 MiB, so a 4 MiB buffer is a heap buffer
    again. Without the variable nothing is changed."""
    import json
    import os
    import subprocess
    import sys

    from tokenrouter.engine.host_memory import heap_stats

    if "malloc_mmapped_bytes" not in heap_stats():
        pytest.skip("the C library has no mallinfo2 (not glibc >= 2.33)")
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}

    def probe(extra):
        out = subprocess.run([sys.executable, "-c", _UNDO_PROBE], check=True, capture_output=True, text=True,
                             env={**env, **extra}).stdout
        return json.loads(out)

    assert probe({"MALLOC_MMAP_THRESHOLD_": "1048576"}) == [True, False]
    assert probe({})[0] is False
