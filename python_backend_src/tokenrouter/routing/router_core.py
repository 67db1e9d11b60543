"""The router's inter-model loop, independent of how models are reached.

Paper §Design, "Three decoupled loops": the inter-model loop forwards a
handing-off model's PeerReq, with the token suffix the peer has not seen, to
that peer.  :func:`drive` runs one request through the models until it ends,
over a :class:`~tokenrouter.routing.segments.Transport` — the ZeroMQ channel
(:class:`tokenrouter.routing.peer.PeerClient`), used by ``token_router`` and by
the no-Triton baseline :mod:`tokenrouter.tools.direct`, or Triton BLS requests
(:class:`tokenrouter.triton.transport.TritonTransport`).  It reads the typed
events of :mod:`tokenrouter.protocol` (and the transport's ``TICK`` while
nothing comes); the :class:`RoutedRequest` books the tokens, who wrote them,
the handoffs and the times.

A transport raises :class:`~tokenrouter.routing.peer.PeerDownError` (it has a
``model`` attribute) when a model's process is gone.  :func:`drive` then either
fails the request (``fallback=False``, the ``on_peer_failure: fail`` mode) or
goes on on a live model (``fallback=True``): from its pending state there when
that model has not seen the latest tokens, else re-admitted with the whole
sequence; handoffs to the dead model are then turned off for the request
(``PeerReq.down_models``) and ``RoutedRequest.degraded`` names the model.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from .segments import PeerDownError, Tick, Transport
from ..protocol import Cancelled, Event, Finished, FinishReason, Handoff, PeerReq, SegmentEvent, SpecRound, TokenLogprobs

__all__ = ["RoutedRequest", "drive", "Transport"]


@dataclass
class RoutedRequest:
    """One request as the router drives it through the models, and the outcome of :func:`drive`.

    Attributes:
        tokens: prompt + output token ids.
        n_prompt: prompt length in tokens.
        rid: the request id.
        models: the deployment's model names (indices of ``trace`` and ``handoff_log``).
        finish: finish reason (``stop``, ``length``, ``cancelled``; "" while it runs).
        tokens_by_model: output tokens written by each model.
        handoffs: number of handoffs; ``pairs`` counts them by "from->to".
        trace: per output token, the index of the model that wrote it.
        scores: per output token, the router score the writing model's rule
            compared with its threshold (None where it has none).
        handoff_log: one dict per handoff (pos, from, to, committed, score).
        handoff_gaps_s: seconds from each handoff event to the peer's first response.
        logprobs: per output token, its logprob from the model that wrote it
            (when the request asked for them; None where a model sent none).
        top_logprobs: per output token, its :class:`~tokenrouter.protocol.TokenLogprobs` (rank and
            top N) from that model, likewise.
        first_step_t: ``time.monotonic()`` when the first model started the
            request's first step (None if it did not say).
        first_token_t, last_token_t: ``time.monotonic()`` when the first and the
            last output tokens reached the router (None before any).
        degraded: models that were down while this request ran and that it
            therefore went on without (fallback mode), sorted by name.
        drafted, accepted: speculative decoding: tokens drafted and sent for verification,
            and of those the ones the verifier accepted (output tokens of the drafter).
        spec_rounds: speculative decoding: one ``{"pos", "drafted", "accepted"}`` per
            verification, ``pos`` = output tokens committed before it.
        spec_tokens: speculative decoding: output tokens the verifications committed (accepted
            drafts and the verifier's own tokens).
        seen: per model, how many of ``tokens`` it holds (its next visit sends the rest).
        touched, released: indices of the models visited, and of those whose state is freed.
    """

    tokens: List[int]
    n_prompt: int
    rid: str = ""
    models: List[str] = field(default_factory=list)
    finish: str = ""
    tokens_by_model: Dict[str, int] = field(default_factory=dict)
    handoffs: int = 0
    pairs: Dict[str, int] = field(default_factory=dict)
    trace: List[int] = field(default_factory=list)
    scores: List[Optional[float]] = field(default_factory=list)
    handoff_log: List[Dict[str, Any]] = field(default_factory=list)
    handoff_gaps_s: List[float] = field(default_factory=list)
    logprobs: List[Optional[float]] = field(default_factory=list)
    top_logprobs: List[Optional[TokenLogprobs]] = field(default_factory=list)
    first_step_t: Optional[float] = None
    first_token_t: Optional[float] = None
    last_token_t: Optional[float] = None
    degraded: List[str] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0
    spec_rounds: List[Dict[str, int]] = field(default_factory=list)
    spec_tokens: int = 0
    seen: List[int] = field(default_factory=list)
    touched: Set[int] = field(default_factory=set)
    released: Set[int] = field(default_factory=set)
    _handoff_at: Optional[float] = None  # time.perf_counter() of the last handoff event

    def __post_init__(self) -> None:
        self.seen = self.seen or [0] * len(self.models)

    @property
    def output_ids(self) -> List[int]:
        """The tokens written after the prompt (list of int token ids)."""
        return self.tokens[self.n_prompt:]

    def end(self, reason: str) -> None:
        """Set the finish reason (a :class:`FinishReason` value) unless it is set already."""
        self.finish = self.finish or reason

    def visit(self, m: int) -> Tuple[List[int], bool]:
        """Start a visit to model ``m``: the token ids it has not seen, and whether it holds the request."""
        self.touched.add(m)
        suffix, resume = self.tokens[self.seen[m]:], self.seen[m] > 0
        self.seen[m] = len(self.tokens)
        return suffix, resume

    def release(self, transport: Transport, m: int) -> None:
        """Free the request's state on model ``m`` (ends its running segment there)."""
        transport.release(self.models[m], self.rid)
        self.released.add(m)

    def record(self, m: int, ids: List[int], ev: Event) -> None:
        """Book one response of model ``m``: the handoff gap it closes, the first step's time,
        the tokens it commits (with writer, score and logprob each) and a handoff it announces."""
        if self._handoff_at is not None and not isinstance(ev, Tick):  # a tick carries nothing
            self.handoff_gaps_s.append(time.perf_counter() - self._handoff_at)
            self._handoff_at = None
        if not isinstance(ev, SegmentEvent):
            return
        if self.first_step_t is None and ev.first_step_t is not None:
            self.first_step_t = ev.first_step_t
        if ids:
            now = time.monotonic()
            self.first_token_t = self.first_token_t or now
            self.last_token_t = now
            self.logprobs.extend(_fit(ev.logprobs, len(ids)))
            self.top_logprobs.extend(_fit(ev.top_logprobs, len(ids)))
            self.scores.extend(_fit(ev.scores, len(ids)))
            writers = self._writers(ev.spec, m, len(ids))
            self.tokens.extend(ids)
            self.seen[m] = len(self.tokens)
            for w in writers:
                self.tokens_by_model[self.models[w]] = self.tokens_by_model.get(self.models[w], 0) + 1
            self.trace.extend(writers)
        if isinstance(ev, Handoff):
            self._handoff_at = time.perf_counter()
            self.handoff_log.append({"pos": len(self.output_ids), "from": m, "to": ev.to_index,
                                     "committed": ev.committed, "score": ev.scores[-1] if ev.scores else None})

    def count_handoff(self, m: int, peer: int) -> None:
        """A handoff from model ``m`` to ``peer`` that the request follows."""
        pair = f"{self.models[m]}->{self.models[peer]}"
        self.pairs[pair] = self.pairs.get(pair, 0) + 1
        self.handoffs += 1

    def _writers(self, spec: Optional[SpecRound], m: int, n: int) -> List[int]:
        """The model index that wrote each of ``n`` tokens model ``m`` committed, booking a
        speculative verification: its first ``accepted`` tokens are the drafter's accepted drafts."""
        if spec is None:
            return [m] * n
        accepted = min(spec.accepted, n)
        self.drafted += spec.drafted
        self.accepted += accepted
        self.spec_tokens += n
        self.spec_rounds.append({"pos": len(self.output_ids), "drafted": spec.drafted, "accepted": accepted})
        drafter = spec.drafter if 0 <= spec.drafter < len(self.models) else m
        return [drafter] * accepted + [m] * (n - accepted)


def _fit(values: Optional[List[Any]], n: int) -> List[Any]:
    """``values`` cut or padded with None to ``n`` items."""
    return (list(values or []) + [None] * n)[:n]


def drive(transport: Transport, header: PeerReq, prompt_ids: List[int], first_model: int, detok,
          on_delta: Optional[Callable[[str, RoutedRequest], None]] = None,
          cancelled: Callable[[], bool] = lambda: False, fallback: bool = False) -> RoutedRequest:
    """Run one request through the models until it finishes; release every model's state.

    Args:
        transport: how the models are reached (``segment`` and ``release``).
        header: the initial PeerReq (``models`` names the deployment; ``tokens`` are set here).
        prompt_ids: prompt token ids.
        first_model: index of the model that writes first.
        detok: an :class:`~tokenrouter.engine.detok.IncrementalDetokenizer` (handles stop strings).
        on_delta: called with each releasable text delta and the request so far (streaming;
            the request's books hold every token up to the delta's, and their logprobs).
        cancelled: polled between responses; True ends the request as ``cancelled``.
        fallback: when a model is down, go on on a live model instead of failing
            (models already listed in ``header.down_models`` are never visited).

    Raises:
        PeerDownError: a model the request needs is down (``fallback`` off, or no live model left).
        RuntimeError: a model reported an error (state is released on every model first).
    """
    r = RoutedRequest(tokens=list(prompt_ids), n_prompt=len(prompt_ids), rid=header.rid, models=list(header.models),
                      degraded=sorted(set(header.down_models)))
    if cancelled():  # e.g. cancelled while it waited for a worker: no model is visited
        r.end(FinishReason.CANCELLED.value)
    current = first_model
    try:
        while not r.finish:
            name, handoff = r.models[current], None
            header.tokens, header.resume = r.visit(current)
            try:
                for ids, ev in transport.segment(name, header):
                    r.record(current, ids, ev)
                    if ids:
                        delta = detok.add(ids)
                        if on_delta is not None and delta and not r.finish:
                            on_delta(delta, r)
                        if detok.stopped and not r.finish:
                            r.end(FinishReason.STOP.value)
                            r.release(transport, current)  # ends the running segment
                    match ev:
                        case Handoff():
                            handoff = ev
                        case Finished(finish_reason=reason):
                            r.end(reason)
                            r.released.add(current)
                        case Cancelled():
                            r.end(FinishReason.CANCELLED.value)
                            r.released.add(current)
                    if not r.finish and cancelled():
                        r.end(FinishReason.CANCELLED.value)
                        r.release(transport, current)  # the segment's remaining responses are dropped
                        break
            except PeerDownError as e:
                if r.finish:
                    break  # the request had already ended (e.g. a stop string)
                current = _fall_back(e, r, header, current, transport) if fallback else None
                if current is None:
                    raise
                continue
            if not r.finish:
                if handoff is None:
                    raise RuntimeError(f"model {name} ended a segment without a handoff or finish")
                r.count_handoff(current, handoff.to_index)
                header, current = handoff.header(), handoff.to_index
                if cancelled():
                    r.end(FinishReason.CANCELLED.value)
    finally:
        for m in r.touched - r.released:
            transport.release(r.models[m], r.rid)
    return r


def _fall_back(err: PeerDownError, r: RoutedRequest, header: PeerReq, current: int,
               transport: Transport) -> Optional[int]:
    """Continue a request whose model went down on the first live model (fallback mode).

    Updates ``r`` (``degraded``, ``seen``, ``released``) and ``header`` (``down_models``,
    ``num_generated``); returns the model index to go on with, or None when every model is down.
    """
    models = r.models
    dead = getattr(err, "model", None) or models[current]
    r.released.add(models.index(dead) if dead in models else current)  # its state went with its process
    r.degraded = sorted(set(r.degraded) | {dead})
    alive = [i for i, m in enumerate(models) if m not in r.degraded]
    if not alive:
        return None
    nxt = alive[0]
    header.down_models = list(r.degraded)
    header.num_generated = len(r.output_ids)
    if nxt in r.touched and r.seen[nxt] >= len(r.tokens):
        # it holds every token already (the handoff step's token was not committed): nothing to
        # resume with, so free its state and admit the request anew with the whole sequence
        if nxt not in r.released:
            transport.release(models[nxt], r.rid)
        r.released.discard(nxt)
        r.seen[nxt] = 0
    return nxt


class PromptTooLong(ValueError):
    """A prompt with more tokens than allowed; ``counted`` is a lower bound of its length (tokens)."""

    def __init__(self, counted: int, limit: int):
        super().__init__(f"prompt has at least {counted} tokens (counted until past the limit)")
        self.counted, self.limit = counted, limit


#: characters tokenised at a time when a long prompt is counted against its limit
COUNT_CHUNK_CHARS = 16384


def count_tokens_past(tokenizer, text: str, limit: int, chunk_chars: int = COUNT_CHUNK_CHARS) -> Optional[int]:
    """Count the tokens of ``text`` piece by piece until they pass ``limit``.

    ``text`` is cut into pieces of at most ``chunk_chars`` characters, each cut before a
    whitespace character where the piece has one (where byte-level BPE pre-tokenizers cut
    too), and each piece is tokenised on its own. A cut may change the count by a token or
    two, so a piece is allowed 2 tokens of slack.

    Returns:
        ``None`` when the count stays within ``limit`` + the slack (the prompt may fit:
        encode it whole), else the count reached (int, tokens) at the first piece past it.
        The memory used is that of one piece's tokens, whatever the length of ``text``.
    """
    if len(text.encode("utf-8", "surrogatepass")) <= limit:  # a token holds at least one byte
        return None
    count = pieces = pos = 0
    while pos < len(text):
        end = min(pos + chunk_chars, len(text))
        if end < len(text):
            cut = max(text.rfind(" ", pos + 1, end), text.rfind("\n", pos + 1, end))
            end = cut if cut > pos else end
        count += len(tokenizer.encode(text[pos:end], add_special_tokens=False))
        pieces += 1
        pos = end
        if count > limit + 2 * pieces:
            return count
    return None


def encode_prompt(tokenizer, prompt: str, chat: bool, max_prompt_tokens: Optional[int] = None) -> List[int]:
    """Token ids of ``prompt`` (list of int); with ``chat`` wrapped as a user turn by the chat template.

    With ``max_prompt_tokens``, a prompt that clearly has more tokens is refused before it is
    tokenised whole (:func:`count_tokens_past`), so that a refused prompt claims memory for
    at most that many tokens, not for its length.

    Raises:
        PromptTooLong: the prompt alone has more than ``max_prompt_tokens`` tokens (callers
            still compare the returned length, which counts the chat template, to their limit).
    """
    if max_prompt_tokens is not None:
        counted = count_tokens_past(tokenizer, prompt, max_prompt_tokens)
        if counted is not None:
            raise PromptTooLong(counted, max_prompt_tokens)
    if chat:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                            add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
    else:
        ids = tokenizer.encode(prompt)
    return [int(i) for i in ids]


def make_header(rid: str, sp, algorithm: str, params: Dict[str, Any], models: List[str],
                stop_ids: List[int]) -> PeerReq:
    """The first PeerReq of a request from validated :class:`~tokenrouter.engine.sampling.SamplingParams`."""
    stops = ([] if sp.ignore_eos else list(stop_ids)) + [t for t in getattr(sp, "stop_token_ids", [])
                                                           if t not in stop_ids]
    return PeerReq(rid=rid, max_tokens=sp.max_tokens, stop_token_ids=stops,
                   sampling=sp.sampler_dict(), algorithm=algorithm, params=params, models=list(models))
