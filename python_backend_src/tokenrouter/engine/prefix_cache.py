"""A page-aligned radix tree of KV slots: prefix caching across requests on one model.

The design follows SGLang's ``RadixCache`` (RadixAttention, Zheng et al., "SGLang: Efficient
Execution of Structured Language Model Programs", 2024, §3) on the engine's own KV pool: a
tree whose edges are token sequences and whose nodes hold the KV slot ids of those tokens.

* :meth:`RadixPrefixCache.match` finds the longest cached prefix of a prompt (whole pages),
  splitting a node where the match ends inside it.
* :meth:`RadixPrefixCache.lock` / :meth:`unlock` count the requests that read a node's slots
  (and every ancestor's); a locked node is never evicted.  A pending request keeps its lock
  while it is away at a peer.
* :meth:`RadixPrefixCache.insert` takes over the slots of a finished request's tokens; where the
  tree already holds those tokens it keeps its own slots and reports the overlap, so the caller
  frees the duplicates.
* :meth:`RadixPrefixCache.evict` frees unlocked leaves, least recently used first, until enough
  slots are free (LRU, as SGLang's default eviction policy).

The tree owns the slots it holds: it frees them through the allocator passed in (SGLang's
``TokenToKVPoolAllocator.free``).  Not thread-safe: the decode-loop thread owns it.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

__all__ = ["RadixPrefixCache"]


class _Node:
    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access")

    def __init__(self, parent: Optional["_Node"], key: List[int], value: Optional[torch.Tensor]):
        self.children: Dict[tuple, "_Node"] = {}
        self.parent = parent
        self.key = key          # token ids of this edge (a whole number of pages)
        self.value = value      # int64 KV slot ids, one per token of key
        self.lock_ref = 0
        self.last_access = 0


class RadixPrefixCache:
    """Radix tree from token prefixes to KV slot ids, with LRU eviction of unlocked leaves.

    Args:
        page_size: tokens per KV page (SGLang's ``page_size``; 1 on the CPU).  Keys are matched
            and stored in whole pages.
        free_slots: callable freeing an int64 tensor of KV slot ids (the pool allocator's
            ``free``); called on eviction.

    Sizes (:attr:`total_tokens`, :attr:`evictable_tokens`, :attr:`locked_tokens`) are in tokens.
    Counters: :attr:`evicted_tokens` (tokens freed by :meth:`evict` and :meth:`flush`).
    """

    def __init__(self, page_size: int, free_slots: Callable[[torch.Tensor], None]):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = int(page_size)
        self._free_slots = free_slots
        self._clock = itertools.count(1)
        self.root = _Node(None, [], None)
        self.root.lock_ref = 1  # never evicted
        self.evictable_tokens = 0
        self.locked_tokens = 0
        self.evicted_tokens = 0

    # ------------------------------------------------------------------ sizes
    @property
    def total_tokens(self) -> int:
        """Tokens whose KV the tree holds (locked + evictable)."""
        return self.evictable_tokens + self.locked_tokens

    def page_floor(self, n: int) -> int:
        """``n`` rounded down to whole pages."""
        return n - n % self.page_size

    # ----------------------------------------------------------------- lookup
    def _child_key(self, tokens: Sequence[int], pos: int) -> tuple:
        return tuple(tokens[pos:pos + self.page_size])

    def _common_pages(self, key: List[int], tokens: Sequence[int], pos: int) -> int:
        """Tokens (whole pages) shared by ``key`` and ``tokens[pos:]``."""
        n = min(len(key), self.page_floor(len(tokens) - pos))
        i = 0
        while i < n and key[i] == tokens[pos + i]:
            i += 1
        return self.page_floor(i)

    def _split(self, node: _Node, at: int) -> _Node:
        """Split ``node``'s edge after ``at`` tokens; returns the new upper node."""
        upper = _Node(node.parent, node.key[:at], node.value[:at])
        upper.lock_ref = node.lock_ref
        upper.last_access = node.last_access
        upper.children[self._child_key(node.key, at)] = node
        node.parent.children[self._child_key(upper.key, 0)] = upper
        node.parent = upper
        node.key = node.key[at:]
        node.value = node.value[at:]
        return upper

    def match(self, tokens: Sequence[int], limit: Optional[int] = None) -> Tuple[torch.Tensor, object, int]:
        """The longest cached prefix of ``tokens`` (whole pages, at most ``limit`` tokens).

        Marks the matched nodes as used now (LRU).  Does not lock: call :meth:`lock` on the
        returned node before the slots may be evicted (before the next :meth:`evict`).

        Args:
            tokens: token ids.
            limit: longest match wanted (a request keeps at least one token to extend).

        Returns:
            ``(slots, node, length)``: int64 tensor of ``length`` KV slot ids, the tree node the
            match ends at (the root when nothing matched), ``length`` in tokens.
        """
        toks = tokens if limit is None else tokens[:max(0, int(limit))]
        node, pos, parts = self.root, 0, []
        now = next(self._clock)
        while pos < len(toks):
            child = node.children.get(self._child_key(toks, pos))
            if child is None:
                break
            n = self._common_pages(child.key, toks, pos)
            if n == 0:
                break
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            parts.append(child.value)
            pos += n
            node = child
        if not parts:
            return torch.empty(0, dtype=torch.int64), self.root, 0
        return (parts[0] if len(parts) == 1 else torch.cat(parts)), node, pos

    # ---------------------------------------------------------------- locking
    def lock(self, node) -> None:
        """Protect ``node`` and its ancestors from eviction (one more reader)."""
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_tokens -= len(node.key)
                self.locked_tokens += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node) -> None:
        """Undo one :meth:`lock` of ``node``."""
        while node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError("prefix cache: unlock of a node that is not locked")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_tokens += len(node.key)
                self.locked_tokens -= len(node.key)
            node = node.parent

    # ----------------------------------------------------------------- insert
    def insert(self, tokens: Sequence[int], slots: torch.Tensor) -> int:
        """Cache the KV slots ``slots`` of ``tokens`` (whole pages; a partial last page is ignored).

        The tree takes ownership of the slots it stores.  Where it already holds a prefix of
        ``tokens`` it keeps its own slots: the caller still owns (and must free) its slots of
        that prefix, except those it got from the tree in the first place.

        Args:
            tokens: token ids, ``len(tokens) == len(slots)``.
            slots: int64 tensor of KV slot ids.

        Returns:
            Length (tokens) of the prefix of ``tokens`` the tree held before this call; the slots
            from there up to the page-floored length are now the tree's.
        """
        if len(tokens) != len(slots):
            raise ValueError(f"insert: {len(tokens)} tokens but {len(slots)} slots")
        end = self.page_floor(len(tokens))
        node, pos = self.root, 0
        now = next(self._clock)
        while pos < end:
            child = node.children.get(self._child_key(tokens, pos))
            if child is None:
                break
            n = self._common_pages(child.key, tokens[:end], pos)
            if n == 0:
                break
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            pos += n
            node = child
        if pos < end:
            leaf = _Node(node, list(tokens[pos:end]), slots[pos:end].to(torch.int64).clone())
            leaf.last_access = now
            node.children[self._child_key(leaf.key, 0)] = leaf
            self.evictable_tokens += len(leaf.key)
        return pos

    # --------------------------------------------------------------- eviction
    def _unlocked_leaves(self) -> List[_Node]:
        out, stack = [], [self.root]
        while stack:
            n = stack.pop()
            if not n.children and n is not self.root and n.lock_ref == 0:
                out.append(n)
            stack.extend(n.children.values())
        return out

    def _remove_leaf(self, leaf: _Node) -> int:
        self._free_slots(leaf.value)
        del leaf.parent.children[self._child_key(leaf.key, 0)]
        n = len(leaf.key)
        self.evictable_tokens -= n
        self.evicted_tokens += n
        return n

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` slots held by unlocked nodes, least recently used first.

        Stops early when nothing unlocked is left.  Returns the tokens freed.
        """
        if num_tokens <= 0:
            return 0
        heap = [(n.last_access, id(n), n) for n in self._unlocked_leaves()]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            freed += self._remove_leaf(leaf)
            parent = leaf.parent
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def flush(self) -> int:
        """Evict every unlocked node (what running and pending requests read stays).

        Returns the tokens freed."""
        return self.evict(self.evictable_tokens)
