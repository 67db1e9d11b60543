"""What one step of the decode loop runs: its :class:`StepPlan`, with chunked prefill.

The step takes the ready requests (up to ``max_batch``, oldest first) and shares a budget of
``prefill_chunk_tokens`` new tokens among its extends (SGLang's ``chunked_prefill_size``), so
that a long prompt, or a long re-prefill, does not stop every other request for the whole of its
prefill.  Decode rows (one new token) always run and are not counted.  Extends take the budget
shortest first, so a resume's few tokens never wait behind a long prompt; a request whose new
tokens do not fit runs the part that does (a *chunk*) and the rest in later steps, one that gets
none waits a step.  Only a request's last chunk yields a token.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Dict, List, Sequence as Seq, Tuple

import torch

from .request import LocalRequest
from .sequence import ForwardOutput

__all__ = ["StepPlan", "plan_step"]


@dataclass
class StepPlan:
    """One step's rows and what was held back of them.

    Attributes:
        batch: the requests the step runs, in row order.
        held: rid -> ``(sequence, held-back token ids, verify positions)`` of each request that runs
            a chunk of its new tokens only (the rest are cut off its sequence for the step).
        has_prefill: the step runs a request's first prompt.
        t0: ``time.perf_counter()`` when the step began (s).
        t_fwd: ``time.perf_counter()`` after its forward (s); 0.0 before.
    """

    batch: List[LocalRequest]
    held: Dict[str, Tuple[object, List[int], int]] = field(default_factory=dict)
    has_prefill: bool = False
    t0: float = 0.0
    t_fwd: float = 0.0

    def restore_held(self) -> None:
        """Put the held-back tokens back on their sequences (after the forward, or when it failed)."""
        for seq, toks, m in self.held.values():
            seq.tokens.extend(toks)
            seq.verify_positions = m

    def sampled_rows(self, out: ForwardOutput) -> Tuple[List[LocalRequest], ForwardOutput]:
        """The step's requests and engine output without the rows of partial prefills.

        A partial prefill's logits follow a chunk of its prompt, not its last token, so they
        are dropped; the request stays ready and runs its next chunk in the next step.
        """
        if not self.held:
            return self.batch, out
        keep = [i for i, lr in enumerate(self.batch) if lr.rid not in self.held]
        idx = torch.tensor(keep, dtype=torch.long)
        pos = out.position_logits
        out = dataclasses.replace(
            out, seqs=[out.seqs[i] for i in keep], logits=out.logits.index_select(0, idx),
            hidden=None if out.hidden is None else out.hidden.index_select(0, idx),
            num_extend=out.num_extend - len(self.held),
            position_logits=None if pos is None else [pos[i] for i in keep])
        return [self.batch[i] for i in keep], out


def plan_step(ready: Seq[LocalRequest], chunk_tokens: int) -> StepPlan:
    """Plan a step of the requests ``ready`` (in order) within ``chunk_tokens`` new extend tokens.

    The tokens of a request beyond its share are cut off its sequence for this step (put back by
    :meth:`StepPlan.restore_held`); a request with no share left sits this step out (it stays
    ready).  The first extend always gets a share, so every step runs.  A verification's drafted
    positions stay together in its last chunk.

    Args:
        ready: the candidate requests, at most ``max_batch``.
        chunk_tokens: the budget (``prefill_chunk_tokens``); 0: no chunking.
    Returns:
        the plan; ``t0`` is now, ``has_prefill`` set from the rows that run.
    """
    t0 = time.perf_counter()
    batch, held = list(ready), {}
    extends = sorted((lr for lr in batch if lr.seq.pending_tokens > 1), key=lambda lr: lr.seq.pending_tokens)
    budget = chunk_tokens
    if budget > 0 and sum(lr.seq.pending_tokens for lr in extends) > budget:
        sitting_out = set()
        for lr in extends:
            n = lr.seq.pending_tokens
            if budget <= 0:
                sitting_out.add(lr.rid)
                continue
            run = min(n, budget)
            m = lr.seq.verify_positions
            if run < n and m > 1 and n - run < m:  # the drafted positions must be in the last chunk
                run = n - m if n - m > 0 else n
            if run < n:
                held[lr.rid] = (lr.seq, lr.seq.tokens[run - n:], m)
                del lr.seq.tokens[run - n:]
                lr.seq.verify_positions = 0
            budget -= min(run, budget)
        batch = [lr for lr in batch if lr.rid not in sitting_out]
    return StepPlan(batch=batch, held=held, has_prefill=any(not lr.prefilled for lr in batch), t0=t0)
