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
