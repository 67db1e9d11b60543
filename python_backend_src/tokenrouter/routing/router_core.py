"""The router's inter-model loop, independent of how models are reached.

Paper §Design, "Three decoupled loops": the inter-model loop forwards a
handing-off model's PeerReq, with the token suffix the peer has not seen, to
that peer.  :func:`drive` runs one request through the models until it ends;
the *transport* reaches the models — the ZeroMQ channel
(:class:`tokenrouter.routing.peer.PeerClient`), used by ``token_router`` and by
the no-Triton baseline :mod:`tokenrouter.tools.direct`.

A transport has two methods:

* ``segment(model, rid, tokens, header_json)`` → iterator of
  ``(committed_token_ids, event_dict)`` for one visit of the request to
  ``model``, ending with a final event (``handoff``, ``finished``,
  ``cancelled``); raises ``RuntimeError`` when the model reports an error;
  while waiting it may yield ``([], {"kind": "tick"})`` so that cancellation
  is noticed even when the model sends nothing;
* ``release(model, rid)`` → frees the request's state on ``model``.

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
from typing import Any, Callable, Dict, List, Optional

from .segments import PeerDownError
from ..protocol import FinishReason, PeerReq

__all__ = ["RoutedRequest", "drive"]


@dataclass
class RoutedRequest:
    """Outcome of :func:`drive`.

    Attributes:
        tokens: prompt + output token ids.
        n_prompt: prompt length in tokens.
        finish: finish reason (``stop``, ``length``, ``cancelled``).
        tokens_by_model: output tokens written by each model.
        handoffs: number of handoffs; ``pairs`` counts them by "from->to".
        trace: per output token, the index of the model that wrote it.
        scores: per output token, the router score the writing model's rule
            compared with its threshold (None where it has none).
        handoff_log: one dict per handoff (pos, from, to, committed, score).
        handoff_gaps_s: seconds from each handoff event to the peer's first response.
        logprobs: per output token, its logprob from the model that wrote it
            (when the request asked for them; None where a model sent none).
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
    """

    tokens: List[int]
    n_prompt: int
    finish: str = ""
    tokens_by_model: Dict[str, int] = field(default_factory=dict)
    handoffs: int = 0
    pairs: Dict[str, int] = field(default_factory=dict)
    trace: List[int] = field(default_factory=list)
    scores: List[Optional[float]] = field(default_factory=list)
    handoff_log: List[Dict[str, Any]] = field(default_factory=list)
    handoff_gaps_s: List[float] = field(default_factory=list)
    logprobs: List[Optional[float]] = field(default_factory=list)
    first_step_t: Optional[float] = None
    first_token_t: Optional[float] = None
    last_token_t: Optional[float] = None
    degraded: List[str] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0
    spec_rounds: List[Dict[str, int]] = field(default_factory=list)
    spec_tokens: int = 0

    @property
    def output_ids(self) -> List[int]:
        """The tokens written after the prompt (list of int token ids)."""
        return self.tokens[self.n_prompt:]


def drive(transport, header: PeerReq, prompt_ids: List[int], first_model: int, detok,
          on_delta: Optional[Callable[[str], None]] = None,
          cancelled: Callable[[], bool] = lambda: False, fallback: bool = False) -> RoutedRequest:
    """Run one request through the models until it finishes; release every model's state.

    Args:
        transport: see the module docstring.
        header: the initial PeerReq (tokens empty; ``models`` names the deployment).
        prompt_ids: prompt token ids.
        first_model: index of the model that writes first.
        detok: an :class:`~tokenrouter.engine.detok.IncrementalDetokenizer` (handles stop strings).
        on_delta: called with each releasable text delta (streaming).
        cancelled: polled between responses; True ends the request as ``cancelled``.
        fallback: when a model is down, go on on a live model instead of failing
            (models already listed in ``header.down_models`` are never visited).

    Raises:
        PeerDownError: a model the request needs is down (``fallback`` off, or no live model left).
        RuntimeError: a model reported an error (state is released on every model first).
    """
    models = header.models
    r = RoutedRequest(tokens=list(prompt_ids), n_prompt=len(prompt_ids))
    seen = [0] * len(models)
    touched, released = set(), set()
    current, finish = first_model, None
    if cancelled():  # e.g. cancelled while it waited for a worker: no model is visited
        finish = FinishReason.CANCELLED.value
    handoff_at = None
    rid = header.rid
    r.degraded = sorted(set(header.down_models))
    try:
        while finish is None:
            name = models[current]
            touched.add(current)
            suffix = r.tokens[seen[current]:]
            header.resume = seen[current] > 0
            seen[current] = len(r.tokens)
            header.tokens = []
            handoff = None
            try:
                events = transport.segment(name, rid, suffix, header.header_json())
                for ids, ev in events:
                    kind = ev.get("kind")
                    # a "tick" carries nothing: it only reaches the cancellation check below
                    if handoff_at is not None and kind != "tick":
                        r.handoff_gaps_s.append(time.perf_counter() - handoff_at)
                        handoff_at = None
                    scores = ev.get("scores") or []
                    if r.first_step_t is None and ev.get("first_step_t") is not None:
                        r.first_step_t = float(ev["first_step_t"])
                    if ids:
                        now = time.monotonic()
                        r.first_token_t = r.first_token_t or now
                        r.last_token_t = now
                        r.logprobs.extend((list(ev.get("logprobs") or []) + [None] * len(ids))[:len(ids)])
                        r.scores.extend((list(scores) + [None] * len(ids))[:len(ids)])
                        writers = _writers(ev.get("spec"), current, len(ids), len(models), r)
                        r.tokens.extend(ids)
                        seen[current] = len(r.tokens)
                        for w in writers:
                            r.tokens_by_model[models[w]] = r.tokens_by_model.get(models[w], 0) + 1
                        r.trace.extend(writers)
                        delta = detok.add(ids)
                        if on_delta is not None and delta and finish is None:
                            on_delta(delta)
                        if detok.stopped and finish is None:
                            finish = FinishReason.STOP.value
                            transport.release(name, rid)  # ends the running segment
                            released.add(current)
                    if kind == "handoff":
                        handoff = ev
                        handoff_at = time.perf_counter()
                        r.handoff_log.append({"pos": len(r.tokens) - r.n_prompt, "from": current,
                                              "to": int(ev["to_index"]), "committed": bool(ev.get("committed")),
                                              "score": scores[-1] if scores else None})
                    elif kind == "finished":
                        finish = finish or ev.get("finish_reason", FinishReason.STOP.value)
                        released.add(current)
                    elif kind == "cancelled" and finish is None:
                        finish = FinishReason.CANCELLED.value
                        released.add(current)
                    if finish is None and cancelled():
                        finish = FinishReason.CANCELLED.value
                        transport.release(name, rid)  # the segment's remaining responses are dropped
                        released.add(current)
                        break
            except PeerDownError as e:
                if finish is not None:
                    break  # the request had already ended (e.g. a stop string)
                if not fallback:
                    raise
                nxt = _fall_back(e, models, current, r, header, seen, touched, released, transport, rid)
                if nxt is None:
                    raise
                current = nxt
                continue
            if finish is None and handoff is None:
                raise RuntimeError(f"model {name} ended a segment without a handoff or finish")
            if handoff is not None and finish is None:
                peer = int(handoff["to_index"])
                header = PeerReq.from_wire(handoff["peer_req"], [])
                pair = f"{name}->{models[peer]}"
                r.pairs[pair] = r.pairs.get(pair, 0) + 1
                r.handoffs += 1
                current = peer
                if cancelled():
                    finish = FinishReason.CANCELLED.value
    finally:
        for m in touched:
            if m not in released:
                transport.release(models[m], rid)
    r.finish = finish
    return r


def _writers(spec: Optional[Dict[str, Any]], current: int, n: int, n_models: int, r: RoutedRequest) -> List[int]:
    """The model index that wrote each of ``n`` tokens a model committed, recording a
    speculative verification (``spec`` = ``{"drafted", "accepted", "drafter"}`` of the event
    that carries them): the first ``accepted`` tokens are the drafter's accepted drafts."""
    if not isinstance(spec, dict):
        return [current] * n
    try:
        drafted, accepted = int(spec.get("drafted", 0)), min(int(spec.get("accepted", 0)), n)
        drafter = int(spec.get("drafter", current))
    except (TypeError, ValueError):
        return [current] * n
    r.drafted += drafted
    r.accepted += accepted
    r.spec_tokens += n
    r.spec_rounds.append({"pos": len(r.tokens) - r.n_prompt, "drafted": drafted, "accepted": accepted})
    if not 0 <= drafter < n_models:
        drafter = current
    return [drafter] * accepted + [current] * (n - accepted)


def _fall_back(err, models, current, r, header, seen, touched, released, transport, rid) -> Optional[int]:
    """Continue a request whose model went down on the first live model (fallback mode).

    Updates ``r.degraded``, ``header`` (``down_models``, ``num_generated``) and the
    bookkeeping of :func:`drive`; returns the model index to go on with, or None
    when every model is down.
    """
    dead = getattr(err, "model", None) or models[current]
    released.add(models.index(dead) if dead in models else current)  # its state went with its process
    r.degraded = sorted(set(r.degraded) | {dead})
    alive = [i for i, m in enumerate(models) if m not in r.degraded]
    if not alive:
        return None
    nxt = alive[0]
    header.down_models = list(r.degraded)
    header.num_generated = len(r.tokens) - r.n_prompt
    if nxt in touched and seen[nxt] >= len(r.tokens):
        # it holds every token already (the handoff step's token was not committed): nothing to
        # resume with, so free its state and admit the request anew with the whole sequence
        if nxt not in released:
            transport.release(models[nxt], rid)
        released.discard(nxt)
        seen[nxt] = 0
    return nxt


def stop_token_ids(tokenizer) -> List[int]:
    """EOS and chat end-of-turn token ids of ``tokenizer`` (they end a request)."""
    ids = {tokenizer.eos_token_id}
    for tok in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<|end|>"):
        tid = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id:
            ids.add(tid)
    return sorted(i for i in ids if i is not None)


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
