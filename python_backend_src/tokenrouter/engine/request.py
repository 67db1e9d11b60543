"""A request as one model holds it (:class:`LocalRequest`), and how the model answers it: sinks.

The subserver talks to the outside world through *sinks*: a callable per segment (one visit of
a request to this model) receiving ``sink(kind, tokens, info)`` where ``kind`` is ``"tokens"``
(a non-final chunk of committed tokens) or one of :data:`FINAL_KINDS`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..protocol import PeerReq, TokenLogprobs
from .sequence import Sequence

__all__ = ["LocalRequest", "Sink", "FINAL_KINDS", "BUSY_PREFIX"]

#: ``sink(kind, tokens, info)``: kind ``"tokens"`` or one of :data:`FINAL_KINDS`, committed token ids,
#: and the kind's details (``message``, ``finish_reason``, ``peer_req``, ``logprobs``, ``scores``, …)
Sink = Callable[[str, List[int], Dict[str, Any]], None]
#: the kinds that end a segment
FINAL_KINDS = ("handoff", "finished", "cancelled", "error")

#: start of the message of a request refused or ended because the model is busy (its KV queue
#: is full, or the request waited past its queue timeout); the router answers it with Triton's
#: UNAVAILABLE code and this message, never as a failure
BUSY_PREFIX = "busy: "


@dataclass
class LocalRequest:
    """A request as held by one model.

    Attributes:
        rid: request id.
        seq: the engine sequence (tokens + KV position).
        header: latest PeerReq fields (tokens empty): budget, sampling, params.
        algo: this request's routing-algorithm instance for this model.
        loc: position anchor — tokens from here on were written by this model
            and not yet sent to peers.
        sink: current segment's sink, or None while pending.
        reserved_tokens: KV tokens reserved for the request's whole life.
        ready_since: time it became ready (for the delayed-batching bound).
        unflushed: committed tokens not yet streamed.
        prefilled: its prompt has been run (later extends are resumes).
        unflushed_logprobs: log-probabilities of ``unflushed`` (when the request asks for them).
        unflushed_top: their :class:`~tokenrouter.protocol.TokenLogprobs` (rank, top N), likewise.
        first_step_t: ``time.monotonic()`` at the start of the request's first
            step (its queue time ends there), until reported to the router.
        drafts: speculative decoding, drafting model: how many trailing ``seq.tokens`` are
            drafted tokens this model sent for verification and has not had confirmed (they
            are not output); on the next resume they are rolled back (:meth:`Subserver._rollback_drafts`).
        verify: speculative decoding, verifying model: the drafted token ids (the trailing
            ``len(verify)`` of ``seq.tokens``) the next step checks (one extend, logits at every
            drafted position: ``Sequence.verify_positions``); empty otherwise.
        spec_round: ``{"drafted", "accepted", "drafter"}`` of the latest verification, shipped
            to the router with the tokens it committed (``spec`` in the sink's info).
        draft_logprobs: speculative decoding, drafting model, a request that asks for logprobs:
            ``(logprob, TokenLogprobs)`` of each draft of this visit under this model's raw
            distribution; they travel to the verifier with the handoff (``extras["draft_logprobs"]``),
            which reports them for the drafts it keeps.
    """

    rid: str
    seq: Sequence
    header: PeerReq
    algo: Any  # a tokenrouter.algorithms.RoutingAlgorithm
    loc: int
    sink: Optional[Sink]
    reserved_tokens: int
    ready_since: float = 0.0
    unflushed: List[int] = field(default_factory=list)
    prefilled: bool = False
    unflushed_logprobs: List[float] = field(default_factory=list)
    unflushed_top: List[TokenLogprobs] = field(default_factory=list)
    first_step_t: Optional[float] = None
    drafts: int = 0
    verify: List[int] = field(default_factory=list)
    spec_round: Optional[Dict[str, int]] = None
    draft_logprobs: List[Tuple[float, TokenLogprobs]] = field(default_factory=list)
