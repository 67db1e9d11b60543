"""The KV pool's slot bookkeeping of one engine: sequences in and out, accounting, the prefix cache.

:class:`KVSlots` is the engine's half that owns KV slots and request rows; its subclass
:class:`~tokenrouter.engine.sglang_engine.SGLangEngine` runs the steps.  A sequence is
registered by :meth:`KVSlots.add` (nothing allocated until its first forward; with the prefix
cache on it starts from its longest cached prefix), its slots are freed by
:meth:`KVSlots.release` (or handed to the prefix cache) and, for rejected speculative drafts,
by :meth:`KVSlots.truncate`.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence as Seq

import torch

from .sequence import KVCapacityError, Sequence

__all__ = ["KVSlots"]


class _NoPrefixCache:
    """Minimal tree-cache object for ``ScheduleBatch``: SGLang's own prefix sharing is off.

    TokenRouter keeps a request's KV row for its whole life (pending state), so
    SGLang's per-step prefix matching is work the paper removes.  Prefix reuse
    across requests is the engine's own (:mod:`tokenrouter.engine.prefix_cache`):
    a new request's cached prefix slots are handed to SGLang's allocation through
    :meth:`prefix_device_indices`.
    """

    def __init__(self, page_size, device, allocator):
        self.page_size = page_size
        self.device = device
        self.token_to_kv_pool_allocator = allocator
        self.prefixes: Dict[str, torch.Tensor] = {}  # rid -> cached prefix slots (one extend)

    def prefix_device_indices(self, req) -> torch.Tensor:
        """KV slot ids of ``req``'s cached prefix (``req.prefix_len`` of them), for its first extend."""
        return self.prefixes[req.rid][: req.prefix_len]

    def supports_swa(self) -> bool:
        return False

    def supports_mamba(self) -> bool:
        return False

    def supports_prefix_sharing(self) -> bool:
        return False

    def evict(self, params) -> None:
        return None

    def maybe_hand_to_session(self, req) -> None:
        return None



class KVSlots:
    """KV slots and request rows of one model's pool, and its prefix cache.

    Needs, from the subclass: ``runner`` (SGLang's ``ModelRunner``: ``req_to_token_pool``,
    ``token_to_kv_pool_allocator``), a call of :meth:`_init_kv_slots` once it is loaded, and
    :meth:`_leave_running`.  Not thread-safe: the decode-loop thread owns it.

    Attributes:
        kv_capacity: token slots of the pool (int).
        prefix_cache: the :class:`~tokenrouter.engine.prefix_cache.RadixPrefixCache`, or None (off).
        prefix_counters: ``{"queries", "hits", "evicted"}`` in tokens (see :meth:`prefix_cache_stats`).
    """

    def _init_kv_slots(self, page_size: int, prefix_cache: bool) -> None:
        """Start the bookkeeping of the loaded ``runner``'s pool (``page_size`` tokens a page)."""
        self._seqs: Dict[str, Sequence] = {}
        self.kv_capacity = int(self.runner.token_to_kv_pool_allocator.available_size())
        self._tree_cache = _NoPrefixCache(page_size, self.runner.device, self.runner.token_to_kv_pool_allocator)
        self._free_slots_unsorted = False  # see _sort_free_slots
        self.prefix_cache = None  # RadixPrefixCache when on
        self.prefix_counters = {"queries": 0, "hits": 0, "evicted": 0}  # tokens (see prefix_cache_stats)
        self.set_prefix_cache(prefix_cache)

    def _leave_running(self, seq: Sequence) -> None:
        """Take ``seq`` out of the running batch before its slots change (the subclass's)."""
        raise NotImplementedError

    # ------------------------------------------------------------- accounting
    def kv_tokens_in_use(self) -> int:
        """KV token slots held for running and pending sequences (including cached prefixes
        they read); prefixes only the prefix cache holds are not counted (see
        :meth:`prefix_cache_stats`), so this is 0 on an idle model."""
        return self.kv_capacity - self.kv_tokens_free()

    def kv_tokens_free(self) -> int:
        """KV token slots a sequence can get: free slots plus those the prefix cache would evict."""
        free = int(self.runner.token_to_kv_pool_allocator.available_size())
        return free + (self.prefix_cache.evictable_tokens if self.prefix_cache is not None else 0)

    def prefix_cache_stats(self) -> Dict[str, int]:
        """The prefix cache's sizes and counters (all in tokens; zeros when it is off).

        Keys: ``prefix_cache_enabled`` (0/1), ``prefix_cache_tokens`` (KV the tree holds),
        ``prefix_cache_evictable_tokens`` (of those, read by no request),
        ``prefix_cache_queries`` (prompt tokens looked up by new sequences),
        ``prefix_cache_hits`` (of those, found cached), ``prefix_cache_evicted_tokens``
        (freed by eviction or flush), ``kv_tokens_allocated`` (every allocated slot:
        ``kv_tokens_in_use`` + ``prefix_cache_evictable_tokens``).
        """
        pc = self.prefix_cache
        return {"prefix_cache_enabled": int(pc is not None),
                "prefix_cache_tokens": pc.total_tokens if pc is not None else 0,
                "prefix_cache_evictable_tokens": pc.evictable_tokens if pc is not None else 0,
                "prefix_cache_queries": self.prefix_counters["queries"],
                "prefix_cache_hits": self.prefix_counters["hits"],
                "prefix_cache_evicted_tokens": self.prefix_counters["evicted"]
                + (pc.evicted_tokens if pc is not None else 0),
                "kv_tokens_allocated": self.kv_capacity
                - int(self.runner.token_to_kv_pool_allocator.available_size())}

    def set_prefix_cache(self, enabled: bool) -> None:
        """Turn the prefix cache on or off at run time (off empties it).

        Raises:
            RuntimeError: turning it off while sequences still read cached prefixes.
        """
        pc = self.prefix_cache
        if enabled and pc is None:
            from .prefix_cache import RadixPrefixCache
            self.prefix_cache = RadixPrefixCache(int(self._tree_cache.page_size or 1), self._free_kv_slots)
        elif not enabled and pc is not None:
            if pc.locked_tokens:
                raise RuntimeError(f"{pc.locked_tokens} cached tokens are read by requests in flight: "
                                   "turn the prefix cache off when the model is idle")
            pc.flush()
            self.prefix_counters["evicted"] += pc.evicted_tokens
            self.prefix_cache = None

    def flush_prefix_cache(self) -> int:
        """Evict every prefix no sequence reads; returns the tokens freed (0 when the cache is off)."""
        return self.prefix_cache.flush() if self.prefix_cache is not None else 0

    def _free_kv_slots(self, slots: torch.Tensor) -> None:
        if len(slots) > 0:
            self.runner.token_to_kv_pool_allocator.free(slots)
            self._free_slots_unsorted = True

    def _evict_for(self, num_tokens: int) -> None:
        """Evict cached prefixes until ``num_tokens`` slots are free (as far as eviction can)."""
        if self.prefix_cache is None:
            return
        short = num_tokens - int(self.runner.token_to_kv_pool_allocator.available_size())
        if short > 0:
            self.prefix_cache.evict(short)

    def rows_in_use(self) -> int:
        """Request rows held (sequences with a KV row)."""
        return sum(1 for s in self._seqs.values() if s.req is not None and s.req.kv.holds_kv)


    # ------------------------------------------------------------- lifecycle
    def add(self, rid: str, tokens: Seq[int], use_prefix_cache: bool = True) -> Sequence:
        """Register a new sequence (nothing is allocated until its first forward).

        With the prefix cache on (and ``use_prefix_cache``), the sequence starts from the
        longest cached prefix of ``tokens`` (whole pages, at most ``len(tokens) - 1`` tokens,
        so one is left to extend): ``kv_len`` and ``cached_tokens`` are set to its length and
        the prefix is locked (not evicted) until :meth:`release`.

        Raises:
            ValueError: ``rid`` is already registered or ``tokens`` is empty.
        """
        if rid in self._seqs:
            raise ValueError(f"request id {rid!r} is already active on this model")
        if len(tokens) == 0:
            raise ValueError("a sequence needs at least one token")
        seq = Sequence(rid=rid, tokens=list(tokens))
        pc = self.prefix_cache
        if pc is not None and use_prefix_cache:
            self.prefix_counters["queries"] += len(seq.tokens)
            slots, node, n = pc.match(seq.tokens, limit=len(seq.tokens) - 1)
            if n > 0:
                pc.lock(node)
                seq._cache_node, seq._prefix_slots = node, slots
                seq.kv_len = seq.cached_tokens = n
                self.prefix_counters["hits"] += n
        self._seqs[rid] = seq
        return seq

    def get(self, rid: str) -> Optional[Sequence]:
        """The registered sequence with id ``rid``, or ``None``."""
        return self._seqs.get(rid)

    def release(self, seq: Sequence, cache: bool = True) -> None:
        """Free ``seq``'s KV row and token slots and forget it.  Idempotent.

        With the prefix cache on and ``cache``, the KV of ``seq.tokens[:kv_len]`` (whole pages)
        goes to the prefix cache instead of being freed (where the cache already holds those
        tokens, ``seq``'s duplicate slots are freed); ``seq``'s lock on its cached prefix ends.
        """
        self._leave_running(seq)
        req = seq.req
        pc = self.prefix_cache
        if req is not None and req.kv.holds_kv:
            n = int(req.kv.kv_allocated_len)
            pool = self.runner.req_to_token_pool
            if n > 0:
                slots = pool.req_to_token[req.kv.req_pool_idx, :n].to(torch.int64).clone()
                own = seq.cached_tokens if seq._cache_node is not None else 0  # slots the cache owns
                if pc is not None and cache:
                    keep = pc.page_floor(min(seq.kv_len, n, len(seq.tokens)))
                    if keep > own:
                        had = pc.insert(seq.tokens[:keep], slots[:keep])
                        self._free_kv_slots(slots[own:max(own, had)])  # duplicates of cached tokens
                        own = keep
                self._free_kv_slots(slots[own:])
            pool.free(req)
            req.kv.mark_kv_released()
        if seq._cache_node is not None:
            pc.unlock(seq._cache_node)
            seq._cache_node = seq._prefix_slots = None
            self._tree_cache.prefixes.pop(seq.rid, None)
        seq.req = None
        seq.kv_len = 0
        self._seqs.pop(seq.rid, None)


    def truncate(self, seq: Sequence, length: int) -> int:
        """Cut ``seq`` back to its first ``length`` tokens and free the KV slots beyond them.

        Speculative decoding's rollback (Leviathan et al. 2023; Chen et al. 2023): a drafted
        token the verifier rejected leaves the sequence together with its KV (and every token
        after it).  The sequence leaves the running batch (its next forward is an extend from
        ``length``).  Cached-prefix slots (prefix cache) are never cut.

        Args:
            seq: a registered sequence.
            length: tokens to keep, ``cached_tokens <= length <= len(seq.tokens)``.
        Returns:
            KV token slots freed (int).
        Raises:
            ValueError: ``length`` out of that range.
        """
        if not seq.cached_tokens <= length <= len(seq.tokens):
            raise ValueError(f"cannot truncate sequence {seq.rid!r} of {len(seq.tokens)} tokens to {length} "
                             f"(cached prefix {seq.cached_tokens})")
        if length == len(seq.tokens):
            return 0
        self._leave_running(seq)
        freed = 0
        req = seq.req
        if req is not None and req.kv.holds_kv:
            n = int(req.kv.kv_allocated_len)
            if n > length:
                slots = self.runner.req_to_token_pool.req_to_token[req.kv.req_pool_idx, length:n]
                self._free_kv_slots(slots.to(torch.int64).clone())
                freed = n - length
                req.kv.kv_allocated_len = length
                req.kv.kv_committed_len = min(int(req.kv.kv_committed_len), length)
        del seq.tokens[length:]
        seq.kv_len = min(seq.kv_len, length)
        return freed


    def check_fits(self, seq: Sequence, extra_tokens: int = 0) -> None:
        """Raise :class:`KVCapacityError` if ``seq`` plus ``extra_tokens`` cannot fit."""
        need = len(seq.tokens) + extra_tokens
        if need > self.context_length:
            raise KVCapacityError(
                f"sequence of {need} tokens exceeds the context length {self.context_length}")
        held = seq.req.kv.kv_allocated_len if (seq.req is not None and seq.req.kv.holds_kv) else seq.kv_len
        if need - held > self.kv_tokens_free():
            raise KVCapacityError(
                f"KV pool full: {need - held} more tokens needed, {self.kv_tokens_free()} free")

    @torch.no_grad()

    def _make_room(self, seqs: Seq[Sequence]) -> None:
        """Before a step of ``seqs``: evict cached prefixes until their new tokens fit, and sort the
        free slots (:meth:`_sort_free_slots`)."""
        if self.prefix_cache is not None:  # room for this step's new tokens: evict cached prefixes
            page = self.prefix_cache.page_size
            self._evict_for(sum(s.pending_tokens for s in seqs) + (len(seqs) * page if page > 1 else 0))
        if self._free_slots_unsorted:
            self._sort_free_slots()

    def _sort_free_slots(self) -> None:
        """Put the KV pool's free slots back in ascending order (before the next allocation).

        SGLang's token allocator hands out slots from the head of its free list and
        appends freed ones at the tail, so as requests of different lengths end, the
        list becomes a permutation of the pool and a request's new tokens land in
        slots scattered over it. Attention then gathers K/V rows from all over the
        pool instead of a few strided runs. Measured with SmolLM2-135M in bf16 on
        one CPU thread, 24 requests of ~150 tokens: a decode step took 351 ms with a
        shuffled free list and 230 ms with a sorted one (median of 4 alternations),
        and a long-running server slowed down step by step the same way. Sorting
        32k int64 slot ids costs well under a millisecond, at most once per step.
        """
        a = self.runner.token_to_kv_pool_allocator
        if getattr(a, "release_pages", None) is not None and len(a.release_pages) > 0:
            a.merge_and_sort_free()  # SGLang's own deferred frees (need_sort allocators)
        elif isinstance(getattr(a, "free_pages", None), torch.Tensor):
            a.free_pages, _ = torch.sort(a.free_pages)
        self._free_slots_unsorted = False
