"""What the engine takes and gives back per step: a :class:`Sequence` in, a :class:`ForwardOutput` out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

__all__ = ["Sequence", "ForwardOutput", "KVCapacityError"]


class KVCapacityError(RuntimeError):
    """Raised when a sequence does not fit into the model's KV pool (tokens)."""


@dataclass
class Sequence:
    """A request's token sequence as seen by one model.

    Attributes:
        rid: request id.
        tokens: every token of the request this model knows (prompt + output),
            int token ids.
        kv_len: number of leading ``tokens`` whose KV is in this model's pool.
        req: the SGLang ``Req`` holding the KV row (``None`` before first forward).
        extend_tokens_total: tokens this model has run through *extend*
            (prefill + resumes); decode steps are not counted.
        cached_tokens: leading tokens whose KV came from the prefix cache at
            :meth:`SGLangEngine.add` (a prefix-cache hit; 0 without one).
        verify_positions: m >= 2 asks the next :meth:`SGLangEngine.forward` for the
            next-token logits at each of the sequence's last m positions (speculative
            verification of m - 1 drafted tokens in one extend, Leviathan et al. 2023 §2.3):
            ``ForwardOutput.position_logits``.  The sequence must have at least m new tokens;
            reset to 0 by the forward.  0 or 1: only the last position's logits.
    """

    rid: str
    tokens: List[int]
    kv_len: int = 0
    req: object = None
    extend_tokens_total: int = 0
    cached_tokens: int = 0
    verify_positions: int = 0
    _in_running: bool = False
    _cache_node: object = None  # locked prefix-cache node (None: none)
    _prefix_slots: object = None  # KV slots of the cached prefix until the first forward

    @property
    def pending_tokens(self) -> int:
        """Tokens appended since the last forward (need KV)."""
        return len(self.tokens) - self.kv_len


@dataclass
class ForwardOutput:
    """Result of one :meth:`SGLangEngine.forward` call.

    Attributes:
        seqs: the sequences, in the order of the rows below.
        logits: float32 tensor ``[B, V]``: next-token logits of each sequence.
        hidden: float32 tensor ``[B, H]`` of last hidden states, or ``None``.
        num_extend: how many of ``seqs`` ran as extend (the rest decoded).
        extend_tokens: tokens run through extend in this step.
        latency_s: wall time of the step (seconds).
        position_logits: per row, float32 ``[m, V]`` next-token logits at the sequence's
            last m positions when it asked for them (``Sequence.verify_positions`` = m >= 2),
            else None; the last of the m rows equals the row's ``logits``.  None when no row asked.
    """

    seqs: List[Sequence]
    logits: torch.Tensor
    hidden: Optional[torch.Tensor]
    num_extend: int
    extend_tokens: int
    latency_s: float
    position_logits: Optional[List[Optional[torch.Tensor]]] = None
