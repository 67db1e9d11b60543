"""Constrained decoding on one model's subserver: each guided request's matcher, and the masks.

The subserver (:class:`~tokenrouter.engine.subserver.Subserver`) calls these hooks; the grammar
machinery itself is :mod:`tokenrouter.engine.grammar`.  Invariant: on every model a guided
request visits, its :class:`~tokenrouter.engine.grammar.RequestGrammar` has accepted exactly the
output tokens of that model's sequence (committed tokens, whichever model wrote them, and this
model's own unconfirmed speculative drafts; not a peer's drafts waiting for verification).
:meth:`ConstrainedDecoding.sync` restores it after anything changes the sequence: a new visit,
a resume's catch-up extend, a speculative rollback, a step's commit.  So the next token of
whichever model samples it is masked by one grammar state, carried across every handoff.

Masks apply to the logits the step samples from, routes on (entropy: a token the grammar
forces has entropy 0) and drafts from; reported logprobs stay those of the raw logits.  They are
applied in place, to the guided rows only (the rows of other requests are not touched, nor
copied): a step pays one bitmask fill and one pass over the vocabulary per guided row.  A guided
row whose request asks for logprobs keeps its raw log-softmax from before the mask
(:meth:`~tokenrouter.engine.output_processor.OutputProcessorMixin._sample`).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Dict, List, Optional

import torch

from .detok import load_tokenizer, stop_token_ids
from .grammar import GrammarCompiler, RequestGrammar, allocate_bitmask, allows_any, apply_bitmask, grammar_of

__all__ = ["ConstrainedDecoding"]

logger = logging.getLogger(__name__)


class ConstrainedDecoding:
    """Guided requests of one subserver: compile (any thread), then match and mask (loop thread).

    Args:
        model_path: the checkpoint folder whose tokenizer the grammars compile against.
        vocab_size: rows of the model's logits.
        max_rows: most rows of one step (bitmask buffer; grows if needed).
    """

    def __init__(self, model_path: str, vocab_size: int, max_rows: int = 64):
        self.model_path = model_path
        self.vocab_size = int(vocab_size)
        self._compiler: Optional[GrammarCompiler] = None
        self._compiler_lock = threading.Lock()
        self.grammars: Dict[str, RequestGrammar] = {}
        self._bitmask = allocate_bitmask(max_rows, self.vocab_size)  # a step's rows (row i: batch row i)
        self._position_bitmask = allocate_bitmask(8, self.vocab_size)  # a verification's drafted positions

    @property
    def compiler(self) -> GrammarCompiler:
        """The process's :class:`GrammarCompiler` (created, and its vocabulary started, on first use)."""
        with self._compiler_lock:
            if self._compiler is None:
                tok = load_tokenizer(self.model_path)
                self._compiler = GrammarCompiler(tok, self.vocab_size, stop_token_ids(tok)).start()
            return self._compiler

    # ------------------------------------------------------------ any thread
    def prepare(self, sampling: Dict[str, Any]) -> None:
        """Compile the grammar of a PeerReq's sampler dict if it is not cached yet (any thread but
        the decode loop's: a compile takes 1 ms to a few hundred; the router has refused those past
        its limit).  Errors are left for :meth:`attach` to report on the request."""
        try:
            spec = grammar_of(sampling)
        except ValueError:
            return
        if spec is None or (self._compiler is not None and self._compiler.cached(spec) is not None):
            return
        try:
            self.compiler.compile(spec)
        except (ValueError, RuntimeError):
            pass

    # ------------------------------------------------------------ the loop
    def attach(self, lr) -> Optional[str]:
        """A new request on this model (``lr``: a LocalRequest): its matcher over the output it
        arrived with.  Returns an error message for that request, or None (also when unguided)."""
        try:
            spec = grammar_of(lr.header.sampling)
            if spec is None:
                return None
            compiled = self.compiler.compile(spec)
            start = len(lr.seq.tokens) - len(lr.verify) - lr.header.num_generated
            g = RequestGrammar(compiled, start)
            self.grammars[lr.rid] = g
            self.sync(lr)
        except (ValueError, RuntimeError) as e:
            self.grammars.pop(lr.rid, None)
            return f"guided decoding: {e}"
        return None

    def sync(self, lr) -> None:
        """Bring the request's matcher in line with its sequence (see the module docstring).

        Raises:
            ValueError: an output token the grammar does not allow.
        """
        g = self.grammars.get(lr.rid)
        if g is None:
            return
        # the output less a peer's drafts waiting for verification; of it, only this model's own
        # unconfirmed drafts may leave the sequence (a resume rolls back the rejected ones), so the
        # matcher compares only the tokens after its settled ones (O(new tokens + drafts))
        g.sync(lr.seq.tokens, g.start, len(lr.seq.tokens) - len(lr.verify), tentative=lr.drafts)

    def complete(self, lr) -> bool:
        """The request's committed output is a complete match (its grammar accepted a stop token
        that is not a draft of this model): it ends here."""
        g = self.grammars.get(lr.rid)
        return g is not None and not lr.drafts and g.terminated

    def release(self, rid: str) -> None:
        """Forget a request's matcher (it ended or left this model for good)."""
        self.grammars.pop(rid, None)

    def masks(self, lr) -> bool:
        """Whether :meth:`mask` masks this request's row of a step: it is guided and does not
        verify drafts (its drafted positions are masked by :meth:`mask_positions`)."""
        return not lr.verify and lr.rid in self.grammars

    def mask(self, batch: List[Any], logits: torch.Tensor, errors: Dict[int, str]) -> List[int]:
        """Set each guided row's disallowed tokens to -inf, in place (:meth:`masks`' rows only).

        Args:
            batch: the step's LocalRequests in row order.
            logits: float32 ``[B, V]``, the step's raw logits; the guided rows are masked in place,
                the other rows are neither modified nor copied.
            errors: row -> message, filled for a row whose grammar allows no token (that row is
                left as it is: its request fails).

        Returns:
            the rows masked, in order (empty when no row is guided).  Cost: per guided row one
            bitmask fill (the matcher's) and one pass over its V logits; nothing per other row.
        """
        rows = [i for i, lr in enumerate(batch) if self.masks(lr)]
        if not rows:
            return []
        if self._bitmask.shape[0] < len(batch):
            self._bitmask = allocate_bitmask(len(batch), self.vocab_size)
        filled = []
        for i in rows:
            if not self.grammars[batch[i].rid].fill(self._bitmask, i):
                continue  # terminated: the request ends on this step's commit
            if allows_any(self._bitmask, i, logits.shape[1]):
                filled.append(i)
            else:
                errors[i] = "guided decoding: the grammar allows no next token"
        apply_bitmask(logits, self._bitmask, filled)
        return filled

    def mask_positions(self, lr, drafts: List[int], position_logits: torch.Tensor) -> int:
        """Speculative verification: mask, in place, the logits at each drafted position by the
        grammar state after the output and the drafts before that position.

        Args:
            lr: the verifying model's LocalRequest (its matcher holds the committed output).
            drafts: the drafted token ids, in order.
            position_logits: float32 ``[len(drafts) + 1, V]``, masked in place (a draft the
                grammar does not allow gets probability 0, so verification rejects it and every
                draft after it; the positions after it are left as they are).

        Returns:
            the positions masked (0 when the request is not guided).
        """
        g = self.grammars.get(lr.rid)
        if g is None:
            return 0
        n = position_logits.shape[0]
        if self._position_bitmask.shape[0] < n:
            self._position_bitmask = allocate_bitmask(n, self.vocab_size)
        done = g.fill_after(drafts, self._position_bitmask)
        apply_bitmask(position_logits, self._position_bitmask, list(range(done)))
        return done

    def stats(self) -> Dict[str, int]:
        """``guided_requests`` (matchers held) and the compiler's counters (``grammar_*``)."""
        out = {"guided_requests": len(self.grammars)}
        if self._compiler is not None:
            for k in ("hits", "compiled", "invalid", "timeouts"):
                out[f"grammar_{k}"] = int(self._compiler.counters[k])
        return out

