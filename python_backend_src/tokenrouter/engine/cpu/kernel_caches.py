"""The CPU's per-shape kernel caches: bounded, and optionally filled at load.

On the CPU, torch runs the linear layers with oneDNN. Each distinct input shape (the number of
tokens in a step: every new prompt length, every new batch of rows) gets a oneDNN primitive that
is kept in two LRU caches: PyTorch's (ideep's, ``LRU_CACHE_CAPACITY``) and oneDNN's own
(``ONEDNN_PRIMITIVE_CACHE_CAPACITY``), 1,024 entries each by default. Entries cost memory (about
0.5 MiB each for SmolLM2-135M, more for larger models), so a server fills them slowly with traffic
and its resident memory creeps up for a long time before it levels off. :func:`bound_kernel_caches`
sets both capacities (before the process's first oneDNN call: both libraries read them once);
:func:`warm_kernel_caches` fills them at load with steps of 1..n tokens, so that the memory a model
has when it turns ready is the memory it keeps.

The prepacked linear layers pad a step's rows to one of about 50 sizes
(:func:`tokenrouter.engine.cpu.linear.row_bucket`), so that the kernels of those sizes serve every
step within the bound; without the buckets, routed steps (decode rows plus resume extends of a
few tokens) meet a new row count most steps and thrash the caches.  See docs/reliability.md,
"Memory over time", and ``perf/kernel_cache_step.py``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

__all__ = ["CACHE_ENV", "bound_kernel_caches", "warm_kernel_caches"]

logger = logging.getLogger(__name__)

#: the environment variables that set the two caches' capacities (entries)
CACHE_ENV = ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")


def bound_kernel_caches(entries: int) -> dict:
    """Bound PyTorch's and oneDNN's primitive caches to ``entries`` entries each.

    Must run before the process's first oneDNN primitive (the libraries read the capacity once);
    a capacity already in the environment (set by the user) is left as it is.

    Args:
        entries: cache capacity (entries, >= 0); 0 leaves the libraries' defaults (1,024).

    Returns:
        ``{variable: value}`` of the two variables as they now are (absent when unset).

    Raises:
        ValueError: ``entries`` < 0.
    """
    if entries < 0:
        raise ValueError(f"cpu_kernel_cache_entries must be >= 0, got {entries}")
    if entries:
        for var in CACHE_ENV:
            os.environ.setdefault(var, str(int(entries)))
    return {v: os.environ[v] for v in CACHE_ENV if v in os.environ}


def warm_kernel_caches(engine: Any, max_tokens: int) -> int:
    """Run one extend step of each length 1..``max_tokens`` tokens (a throw-away sequence each,
    outside the prefix cache), so that the kernel caches hold their steady number of entries.

    Args:
        engine: an :class:`~tokenrouter.engine.sglang_engine.SGLangEngine` with free KV.
        max_tokens: the longest warm-up step (tokens, >= 0; 0 does nothing).

    Returns:
        the number of steps run.
    """
    n = 0
    for m in range(1, int(max_tokens) + 1):
        seq = engine.add(f"__warmup_{m}", [1 + (i % 1000) for i in range(m)], use_prefix_cache=False)
        try:
            engine.forward([seq])
        finally:
            engine.release(seq, cache=False)
        n += 1
    return n
