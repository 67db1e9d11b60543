"""The admin operations of a model's decode loop: statistics, calibration, prefix-cache flush,
scheduling changes at run time.  Each runs on the loop thread, between two steps."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Dict, List

from .config import SubserverConfig
from .host_memory import heap_stats

__all__ = ["AdminOpsMixin"]


class AdminOpsMixin:
    """Admin operations of a :class:`~tokenrouter.engine.subserver.Subserver` (thread-safe: each
    runs through its ``call`` on the loop thread).

    Uses its ``engine``, ``name``, ``config``, ``counters``, ``requests``, ``ready``, ``waiting``,
    ``reserved``, ``call`` and ``_choose_strategy``.
    """

    def calibrate(self, batch_sizes: List[int], context: int = 256, decode_steps: int = 8,
                  timeout: float = 3600.0) -> Dict[str, Any]:
        """Time synthetic steps at controlled batch sizes on the loop thread (step-latency calibration).

        Runs :func:`tokenrouter.engine.calibration.calibrate` between two steps of the decode
        loop, so no real step overlaps it; requests arriving meanwhile wait in the inbox.

        Returns:
            ``{"model", "context", "decode_steps", "table": [...], "seconds",
            "kv_tokens_in_use_after", "kv_rows_in_use_after"}`` (table rows: see
            ``SGLangEngine.calibrate``; times in seconds).
        Raises:
            RuntimeError: the model holds requests (running, pending or waiting for KV).
            ValueError: bad arguments or the KV pool cannot hold the largest batch.
            TimeoutError: the loop did not finish within ``timeout`` seconds.
        """
        def job():
            if self.requests or self.waiting:
                raise RuntimeError(f"model {self.name} holds {len(self.requests) + len(self.waiting)} "
                                   "requests: calibration runs only on an idle model")
            t0 = time.perf_counter()
            table = self.engine.calibrate(batch_sizes, context=context, decode_steps=decode_steps)
            return {"model": self.name, "context": int(context), "decode_steps": int(decode_steps),
                    "table": table, "seconds": time.perf_counter() - t0,
                    "kv_tokens_in_use_after": self.engine.kv_tokens_in_use(),
                    "kv_rows_in_use_after": self.engine.rows_in_use()}
        return self.call(job, timeout=timeout)

    def stats(self) -> Dict[str, Any]:
        """Counters and KV usage, read on the loop thread (consistent snapshot).

        Keys: kv_tokens_in_use, kv_capacity_tokens, kv_rows_in_use, active,
        pending, ready, waiting, steps, decode_tokens, extend_tokens,
        handoffs_out, finished, cancelled, errors and the step-time breakdown
        in seconds: step_time_s = forward_s (model forward incl. batch
        preparation) + route_s (sampling, entropy, route/send decisions) +
        send_s (streaming responses to the router); the delayed-batching settings
        delayed_batch_size (B_i) and delayed_batch_max_wait_us; prefill_chunks (partial
        prefills run: one per request and step whose new tokens did not all fit the step's
        ``prefill_chunk_tokens`` budget) and that setting; ``malloc_trims``, ``malloc_trim_s`` and
        ``malloc_trim_released_bytes`` (freed host memory given back: ``malloc_trim_interval_s``,
        :class:`~tokenrouter.engine.host_memory.HostMemoryTrimmer`), ``malloc_mmap_threshold_bytes`` (the
        fixed mmap threshold in force, the setting of that name; 0: the C library's own) and what the heap holds
        (``python_allocated_blocks``, ``malloc_in_use_bytes``, ``malloc_free_bytes``,
        ``malloc_mmapped_bytes``: :func:`~tokenrouter.engine.host_memory.heap_stats`); the prefix cache's sizes and
        counters in tokens (``prefix_cache_*``, ``kv_tokens_allocated``: see
        ``SGLangEngine.prefix_cache_stats``; ``kv_tokens_in_use`` leaves out what only the
        cache holds); guided decoding's ``guided_requests`` and ``grammar_*`` counters
        (``ConstrainedDecoding.stats``).
        """
        def snap():
            active = len(self.requests)
            ready = len(self.ready)
            return {
                "model": self.name,
                "kv_tokens_in_use": self.engine.kv_tokens_in_use(),
                "kv_capacity_tokens": self.engine.kv_capacity,
                "kv_rows_in_use": self.engine.rows_in_use(),
                "reserved_tokens": self.reserved,
                "active": active,
                "ready": ready,
                "pending": sum(1 for r in self.requests.values() if r.sink is None),
                "waiting": len(self.waiting),
                **{k: self.counters[k] for k in ("steps", "decode_tokens", "extend_tokens", "extend_runs",
                                                  "handoffs_out", "finished", "cancelled", "errors",
                                                  "requests_in", "prefill_chunks",
                                                  "draft_tokens", "verifications", "drafts_verified", "drafts_accepted",
                                                  "draft_tokens_rolled_back", "verify_kv_freed")},
                "step_time_s": self.counters["step_time_us"] / 1e6,
                "forward_s": self.counters["forward_us"] / 1e6,
                "route_s": self.counters["route_us"] / 1e6,
                "send_s": self.counters["send_us"] / 1e6,
                "decode_steps": self.counters["decode_steps"],
                "decode_step_forward_s": self.counters["decode_step_forward_us"] / 1e6,
                "resume_steps": self.counters["resume_steps"],
                "resume_step_forward_s": self.counters["resume_step_forward_us"] / 1e6,
                "delayed_batch_size": self.config.delayed_batch_size,
                "delayed_batch_max_wait_us": int(round(self.config.max_wait_s * 1e6)),
                "prefill_chunk_tokens": self.config.prefill_chunk_tokens,
                "malloc_trims": self.trimmer.trims,
                "malloc_trim_s": self.trimmer.seconds,
                "malloc_trim_released_bytes": self.trimmer.released_bytes,
                "malloc_mmap_threshold_bytes": self.mmap_threshold_bytes,
                **heap_stats(),
                **self.engine.prefix_cache_stats(),
                **self.constrained.stats(),
            }
        return self.call(snap)

    def flush_prefix_cache(self) -> Dict[str, Any]:
        """Empty the model's prefix cache, on the loop thread (between steps).

        Prefixes that running or pending requests read stay until those requests end.

        Returns:
            ``{"model", "flushed_tokens", "prefix_cache_tokens"}`` (tokens freed, tokens still cached).
        """
        def job():
            freed = self.engine.flush_prefix_cache()
            return {"model": self.name, "flushed_tokens": freed,
                    "prefix_cache_tokens": self.engine.prefix_cache_stats()["prefix_cache_tokens"]}
        return self.call(job)

    def reconfigure(self, **changes: Any) -> None:
        """Change scheduling settings at run time, on the loop thread (between steps).

        Keys: the fields of :class:`SubserverConfig` (``delayed_batch_size``, ``max_wait_s``,
        ``stream_interval``, ``readmit_on_resume``, ``lockstep``, ``prefill_chunk_tokens``, ...).
        Used for online adaptation of B* and to switch baselines without restarting the server
        (a change of ``lockstep`` switches the loop's :class:`DecodeStrategy`).

        Raises:
            ValueError: unknown key or a value out of range (checked as SubserverConfig checks it).
        """
        unknown = set(changes) - set(SubserverConfig.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown scheduling settings: {sorted(unknown)}")
        dataclasses.replace(self.config, **changes)  # validates the changed settings
        def job():
            for k, v in changes.items():
                setattr(self.config, k, v)
            self.strategy = self._choose_strategy()
            self.trimmer.interval_s = self.config.malloc_trim_interval_s
        self.call(job)
