"""The second half of a subserver step: sample, route, commit, stream (SGLang's output processor).

Mirrors SGLang's ``SchedulerOutputProcessorMixin`` (``process_batch_result``): the decode
loop (:class:`~tokenrouter.engine.subserver.Subserver`) runs the forward, then hands the
logits here.  The step's rows are sampled at once (:meth:`OutputProcessorMixin._sample`);
then each row has one outcome (:meth:`OutputProcessorMixin._process_row`): its routing
algorithm decides (``route``; paper §Design, request-centric ``route``/``send``/``receive``),
its tokens are committed, and it *finishes*, is *handed off* to a peer (it becomes *pending*,
its KV kept), *streams* its committed tokens, is *kept* for the next step, or fails alone
(*error*).  Last the step is accounted (:meth:`OutputProcessorMixin._account_step`): counters
and routing events (scheduler_model's event format: ``step`` and ``handoff``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..protocol import FinishReason, StepResult, TokenLogprobs, Verdict
from .request import LocalRequest
from .sampling import logprobs_count, normalized_entropy, token_logprobs
from .sequence import ForwardOutput

logger = logging.getLogger(__name__)

__all__ = ["OutputProcessorMixin", "SampledRows", "StepTally", "ROW_OUTCOMES", "draft_logprobs_wire",
           "draft_logprobs_of"]

#: what :meth:`OutputProcessorMixin._process_row` returns
ROW_OUTCOMES = ("error", "finished", "handoff", "streamed", "kept")

#: one committed token's logprob and :class:`TokenLogprobs` (None: the request asked for none)
LogprobEntry = Optional[Tuple[float, TokenLogprobs]]


def draft_logprobs_wire(entries: List[Tuple[float, TokenLogprobs]]) -> List[list]:
    """Drafts' logprobs as they travel in ``PeerReq.extras["draft_logprobs"]`` (JSON): per draft
    ``[logprob, rank, ids, logprobs]``."""
    return [[lp, t.rank, list(t.ids), list(t.logprobs)] for lp, t in entries]


def draft_logprobs_of(extras: Dict[str, Any], n_drafts: int) -> List[Tuple[float, TokenLogprobs]]:
    """The drafting model's logprobs of the ``n_drafts`` drafts a verifier received (inverse of
    :func:`draft_logprobs_wire`).

    Raises:
        ValueError: ``extras["draft_logprobs"]`` missing, not one entry per draft, or malformed.
    """
    raw = extras.get("draft_logprobs")
    if not isinstance(raw, list) or len(raw) != n_drafts:
        raise ValueError("a request that asks for logprobs needs its drafts' logprobs from the drafting model "
                         "(extras.draft_logprobs, one entry per draft)")
    out = []
    for e in raw:
        ok = isinstance(e, list) and len(e) == 4 and isinstance(e[0], (int, float)) and not isinstance(e[0], bool) \
            and isinstance(e[1], int) and isinstance(e[2], list) and isinstance(e[3], list) \
            and len(e[2]) == len(e[3]) and all(isinstance(x, int) for x in e[2]) \
            and all(isinstance(x, (int, float)) for x in e[3])
        if not ok:
            raise ValueError("extras.draft_logprobs: each entry must be [logprob, rank, ids, logprobs]")
        out.append((float(e[0]), TokenLogprobs(rank=e[1], ids=list(e[2]), logprobs=[float(x) for x in e[3]])))
    return out


@dataclass
class SampledRows:
    """The tokens sampled for one step's rows (row i: request i of the batch).

    Attributes:
        tokens: int token id per row.
        probs: its probability per row (float), under the distribution it was sampled from.
        entropies: the row's normalised entropy (in [0, 1]), of that distribution.
        errors: row index -> message, for rows whose sampling failed.
        logits: float32 ``[B, V]``, the logits sampled from: the engine's own tensor, a guided
            request's row with the tokens its grammar does not allow set to -inf in place
            (:mod:`tokenrouter.engine.constrained`), the other rows raw.
        top_n: row index -> N, for the rows whose request asks for logprobs (N top alternatives).
        raw_logp: row index -> float32 ``[V]``, the raw log-softmax of that row's logits (those rows
            only: a request that asks for no logprobs costs nothing here).
    """

    tokens: List[int]
    probs: List[float]
    entropies: List[float]
    errors: Dict[int, str]
    logits: Optional[torch.Tensor] = None
    top_n: Dict[int, int] = field(default_factory=dict)
    raw_logp: Dict[int, torch.Tensor] = field(default_factory=dict)

    def entry(self, i: int, token: int) -> LogprobEntry:
        """Row ``i``'s logprob and :class:`TokenLogprobs` of ``token`` (the sampled token, or a draft),
        from the row's raw distribution; None when its request asks for no logprobs."""
        n = self.top_n.get(i)
        return None if n is None else token_logprobs(self.raw_logp[i], token, n)


@dataclass
class StepTally:
    """What a step's rows add up to, for its accounting.

    Attributes:
        committed: tokens committed in the step.
        handoffs: ``(rid, step, peer model, tokens committed (0/1), score)`` per handoff.
        send_s: seconds spent handing answers to sinks.
    """

    committed: int = 0
    handoffs: List[Tuple[str, int, str, int, Any]] = field(default_factory=list)
    send_s: float = 0.0


class OutputProcessorMixin:
    """Step results of a :class:`~tokenrouter.engine.subserver.Subserver` (uses its engine, sampler,
    ``constrained`` (guided decoding), counters, config, name, event sink, ``ready`` queue,
    ``_end_segment`` and ``_release``)."""

    @staticmethod
    def _sampling_context(lr: LocalRequest):
        """``(tokens, n_output, stop_ids)`` for the sampler's penalties and min_tokens, or None."""
        sp = lr.header.sampling
        if not any(k in sp for k in ("repetition_penalty", "presence_penalty", "frequency_penalty",
                                     "min_tokens")):
            return None
        return lr.seq.tokens, lr.header.num_generated, lr.header.stop_token_ids

    @staticmethod
    def _token_info(lr: LocalRequest) -> Dict[str, Any]:
        """Extras of a sink call: ``logprobs`` of the tokens it carries (when asked for) and,
        once, ``first_step_t`` (monotonic clock, shared by the processes of one host)."""
        info: Dict[str, Any] = {}
        if logprobs_count(lr.header.sampling) is not None:
            info["logprobs"], lr.unflushed_logprobs = lr.unflushed_logprobs, []
            info["top_logprobs"], lr.unflushed_top = lr.unflushed_top, []
        if lr.first_step_t is not None:
            info["first_step_t"], lr.first_step_t = lr.first_step_t, None
        if lr.spec_round is not None:
            info["spec"], lr.spec_round = lr.spec_round, None
        return info

    def _verify_row(self, lr: LocalRequest, res: StepResult, position_logits) -> tuple:
        """Speculative verification of one row: the tokens to commit and their logprobs.

        The step ran ``lr.verify`` (the drafts) in one extend; the algorithm's ``verify`` picks
        the accepted prefix and this model's own next token from the logits at every drafted
        position (Leviathan et al. 2023, Algorithm 1; greedy: the longest prefix equal to the
        argmax choices).  The rejected drafts leave the sequence and their KV is freed
        (:meth:`SGLangEngine.truncate`); the accepted ones stay with their KV.

        A verification may also end on its last draft with no token of its own (a
        :class:`~tokenrouter.protocol.Verdict` that accepts every draft: draft-verify).
        That draft's KV is freed too and the draft is committed like an own token (in the
        sequence, KV computed by the next extend): the next verification then has the k + 1
        new tokens whose logits it needs, and a request that stays here has a token to run.

        Logprobs (a request that asks for them): an accepted draft's are the drafting model's,
        computed when it drafted and received in ``extras["draft_logprobs"]``: its writer in the
        router's trace, and the distribution the token was drawn from.  The verifier's own token
        (a replacement or the bonus token) gets this model's, from its raw logits at that position.

        Returns:
            ``(tokens, entries, in_seq)``: the tokens to commit (accepted drafts first), each one's
            logprob entry (:meth:`SampledRows.entry`'s form; None when the request asks for none),
            and how many leading ones stay in the sequence with their KV (the accepted drafts; one
            fewer without an own token).

        Raises:
            ValueError: the algorithm returned something that is not an accepted prefix plus at
                most one token (none only when every draft is accepted); a request that asks for
                logprobs whose drafts came without theirs.
        """
        drafts, lr.verify = lr.verify, []
        if position_logits is None or position_logits.shape[0] != len(drafts) + 1:
            raise ValueError("the engine returned no logits at the drafted positions")
        n_top = logprobs_count(lr.header.sampling)
        drafted = None if n_top is None else draft_logprobs_of(lr.header.extras, len(drafts))
        # the own token's logprobs are the raw logits' (guided: a copy from before the mask)
        raw = position_logits.clone() if n_top is not None and lr.rid in self.constrained.grammars \
            else position_logits
        # guided decoding: each drafted position masked (in place) by the grammar state before it
        self.constrained.mask_positions(lr, drafts, position_logits)
        v = lr.algo.verify(res, position_logits, drafts, self.sampler)
        if isinstance(v, Verdict):
            toks, n_acc = [int(t) for t in v.tokens], int(v.accepted)
        else:
            toks = [int(t) for t in v]
            n_acc = len(toks) - 1
        own = len(toks) - n_acc
        if not 0 <= n_acc <= len(drafts) or toks[:n_acc] != drafts[:n_acc] or own not in (0, 1) \
                or (own == 0 and (n_acc != len(drafts) or n_acc == 0)):
            raise ValueError(f"verify returned {toks} ({n_acc} accepted) for drafts {drafts}: not an accepted "
                             "prefix plus one token, nor every draft")
        in_seq = n_acc if own else n_acc - 1
        self.counters["verify_kv_freed"] += self.engine.truncate(lr.seq, len(lr.seq.tokens) - len(drafts) + in_seq)
        self.counters["verifications"] += 1
        self.counters["drafts_verified"] += len(drafts)
        self.counters["drafts_accepted"] += n_acc
        if drafted is None:
            entries: List[LogprobEntry] = [None] * len(toks)
        else:
            entries = list(drafted[:n_acc])
            if own:
                entries.append(token_logprobs(torch.log_softmax(raw[n_acc].float(), dim=-1), toks[n_acc], n_top))
        lr.spec_round = {"drafted": len(drafts), "accepted": n_acc, "drafter": lr.algo.peer_model(1)}
        return toks, entries, in_seq

    def process_batch_result(self, batch: List[LocalRequest], out: ForwardOutput, t0: float, t_fwd: float,
                             has_prefill: bool) -> None:
        """Sample, route, commit and stream the results of one forward step (loop thread).

        Args:
            batch: the step's requests, in the rows' order of ``out``.
            out: the engine's output: ``logits`` float32 ``[len(batch), vocab]``, ``hidden`` (or None),
                ``extend_tokens``, ``num_extend``, ``latency_s``, ``position_logits``.
            t0, t_fwd: ``time.perf_counter()`` at the start of the step and after the forward (s).
            has_prefill: the step ran a request's first prompt.

        A row whose sampling or verification fails ends that request alone.
        """
        sampled = self._sample(batch, out)
        tally = StepTally()
        for i, lr in enumerate(batch):
            self._process_row(lr, i, out, sampled, tally)
        self._account_step(len(batch), out, t0, t_fwd, has_prefill, tally)
        self._requeue(batch)

    def _sample(self, batch: List[LocalRequest], out: ForwardOutput) -> SampledRows:
        """One token per row, with its probability and the row's entropy; and, for the rows whose
        request asks for logprobs (not rows that verify drafts: :meth:`_verify_row`), the raw
        log-softmax their entries are read from."""
        errors: Dict[int, str] = {}
        logits = out.logits
        top_n = {i: n for i, lr in enumerate(batch)
                 if not lr.verify and (n := logprobs_count(lr.header.sampling)) is not None}
        # reported logprobs are the raw logits' (tokenrouter.engine.constrained): a guided row that
        # asks for them keeps its raw log-softmax from before the mask (those rows only)
        keep = [i for i in sorted(top_n) if self.constrained.masks(batch[i])]
        kept = torch.log_softmax(logits[keep], dim=-1) if keep else None
        # guided decoding: disallowed tokens at -inf for sampling, routing and drafting (in place,
        # guided rows only)
        self.constrained.mask(batch, logits, errors)
        logp = torch.log_softmax(logits, dim=-1)
        toks = self.sampler.sample(logits, [lr.rid for lr in batch], [lr.header.sampling for lr in batch],
                                   errors=errors, contexts=[self._sampling_context(lr) for lr in batch])
        tok_logp = logp.gather(1, toks.view(-1, 1)).view(-1)
        probs = tok_logp.exp().tolist()
        raw_logp = {i: logp[i] for i in top_n}
        for j, i in enumerate(keep):
            raw_logp[i] = kept[j]
        return SampledRows(tokens=toks.tolist(), probs=probs, entropies=normalized_entropy(logp).tolist(),
                           errors=errors, logits=logits, top_n=top_n, raw_logp=raw_logp)

    def _process_row(self, lr: LocalRequest, i: int, out: ForwardOutput, sampled: SampledRows,
                     tally: StepTally) -> str:
        """Row ``i``'s outcome: route the request, commit its tokens, then finish it, hand it off,
        stream or keep it.  Returns one of :data:`ROW_OUTCOMES`."""
        if i in sampled.errors:  # this request alone fails
            return self._fail_row(lr, sampled.errors[i])
        hdr = lr.header
        res = StepResult(rid=lr.rid, model_index=lr.algo.model_index, token_id=sampled.tokens[i],
                         norm_entropy=sampled.entropies[i], prob=sampled.probs[i], step=hdr.num_generated,
                         hidden=None if out.hidden is None else out.hidden[i], logits=sampled.logits[i], state=lr)
        drafted, verified = None, None
        try:
            if lr.verify:  # speculative decoding: this step ran a peer's drafts
                verified = self._verify_row(lr, res, out.position_logits[i] if out.position_logits else None)
            else:
                drafted = lr.algo.draft(res)
        except (ValueError, RuntimeError) as e:  # this request alone fails
            logger.exception("speculative step of %s failed on %s", lr.rid, self.name)
            return self._fail_row(lr, str(e))
        k = self._route(lr, res)
        if drafted is not None:  # a draft: in the sequence (KV next step), not output
            lr.seq.tokens.append(int(drafted))
            lr.drafts += 1
            self.counters["draft_tokens"] += 1
            entry = sampled.entry(i, int(drafted))
            if entry is not None:  # travels to the verifier with the drafts
                lr.draft_logprobs.append(entry)
            toks, lps, in_seq = [], [], 0
        elif verified is not None:  # kept drafts + own token; the first in_seq already in the sequence
            toks, lps, in_seq = verified
        elif k == 0 or lr.algo.commit_on_handoff(res):
            toks, lps, in_seq = [sampled.tokens[i]], [sampled.entry(i, sampled.tokens[i])], 0
        else:
            toks, lps, in_seq = [], [], 0
        n, finished = self._commit(lr, toks, lps, in_seq)
        tally.committed += n
        try:  # guided decoding: the matcher follows the sequence; a complete match ends the request
            self.constrained.sync(lr)
        except ValueError as e:
            return self._fail_row(lr, f"guided decoding: {e}")
        if finished is None and toks and self.constrained.complete(lr):
            finished = FinishReason.STOP
        if finished is not None:
            self.counters["finished"] += 1
            self._end_segment(lr, "finished", {"finish_reason": finished.value, "num_generated": hdr.num_generated})
            self._release(lr.rid, "finished", "")
            return "finished"
        if k != 0:
            self._hand_off(lr, k, bool(toks), tally)
            return "handoff"
        if len(lr.unflushed) >= self.config.stream_interval or hdr.num_generated == 1:
            self._stream(lr, tally)
            return "streamed"
        return "kept"

    def _fail_row(self, lr: LocalRequest, message: str) -> str:
        self.counters["errors"] += 1
        self._release(lr.rid, "error", f"model {self.name}: {message}")
        return "error"

    def _route(self, lr: LocalRequest, res: StepResult) -> int:
        """The algorithm's ``route`` (0 keeps the request here, k hands it to peer k), 0 where peer k
        is down (the router's fallback mode: this model keeps writing); the step is counted."""
        hdr = lr.header
        k = lr.algo.route(res)
        if k != 0 and hdr.down_models and hdr.models[lr.algo.peer_model(k)] in hdr.down_models:
            k = 0
        lr.algo.step_scores.append(lr.algo.last_score)
        hdr.step += 1
        return k

    @staticmethod
    def _commit(lr: LocalRequest, toks: List[int], lps: List[LogprobEntry],
                in_seq: int) -> Tuple[int, Optional[FinishReason]]:
        """Commit ``toks`` (their logprob entries ``lps``, each ``(logprob, TokenLogprobs)`` when the
        request asks for logprobs; the first ``in_seq`` are in the sequence already) up to the
        first that ends the request: a stop token or the ``max_tokens`` budget.

        Returns:
            ``(tokens committed, why the request finished or None)``.
        """
        hdr = lr.header
        want = logprobs_count(hdr.sampling) is not None
        for j, tok in enumerate(toks):
            if j >= in_seq:
                lr.seq.tokens.append(tok)
            lr.unflushed.append(tok)
            if want:
                lp, top = lps[j]
                lr.unflushed_logprobs.append(lp)
                lr.unflushed_top.append(top)
            hdr.num_generated += 1
            reason = FinishReason.STOP if tok in hdr.stop_token_ids else \
                FinishReason.LENGTH if hdr.num_generated >= hdr.max_tokens else None
            if reason is not None:
                if lr.spec_round is not None:  # drafts after the end are not output
                    lr.spec_round["accepted"] = min(lr.spec_round["accepted"], j + 1)
                return j + 1, reason
        return len(toks), None

    def _hand_off(self, lr: LocalRequest, k: int, committed: bool, tally: StepTally) -> None:
        """End the segment with a ``handoff`` to peer ``k`` carrying the algorithm's PeerReq (``send``);
        the request becomes pending here, its KV kept."""
        hdr = lr.header
        peer = lr.algo.peer_model(k)
        pr = lr.algo.send(lr)
        if "draft_logprobs" in pr.extras or lr.draft_logprobs:  # the drafts' logprobs go with the drafts only
            pr.extras = {k_: v for k_, v in pr.extras.items() if k_ != "draft_logprobs"}
            if lr.draft_logprobs:
                pr.extras["draft_logprobs"] = draft_logprobs_wire(lr.draft_logprobs)
                lr.draft_logprobs = []
        lr.loc = len(lr.seq.tokens)
        self.counters["handoffs_out"] += 1
        tally.handoffs.append((lr.rid, hdr.step, hdr.models[peer], 1 if committed else 0, lr.algo.last_score))
        ts = time.perf_counter()
        self._end_segment(lr, "handoff", {"to": hdr.models[peer], "to_index": peer,
                                          "peer_req": pr.header_json(), "committed": committed})
        tally.send_s += time.perf_counter() - ts

    def _stream(self, lr: LocalRequest, tally: StepTally) -> None:
        """Send the request's unflushed committed tokens to its segment's sink."""
        toks_out, lr.unflushed = lr.unflushed, []
        ts = time.perf_counter()
        try:
            lr.sink("tokens", toks_out, {"scores": lr.algo.take_scores(), **self._token_info(lr)})
        except Exception:  # noqa: BLE001
            logger.exception("sink of %s failed", lr.rid)
        tally.send_s += time.perf_counter() - ts

    # ------------------------------------------------------------ step accounting
    def _account_step(self, rows: int, out: ForwardOutput, t0: float, t_fwd: float, has_prefill: bool,
                      tally: StepTally) -> None:
        """Counters and routing events of a step of ``rows`` sampled rows (times ``time.perf_counter()``, s)."""
        t_end = time.perf_counter()
        self._account_forward(out, t0, t_fwd, t_end, out.num_extend)
        self.counters["decode_tokens"] += rows - out.num_extend
        if not out.num_extend:  # pure decode steps
            self.counters["decode_steps"] += 1
            self.counters["decode_step_forward_us"] += int((t_fwd - t0) * 1e6)
        elif not has_prefill:  # steps that resume requests (no new prompt)
            self.counters["resume_steps"] += 1
            self.counters["resume_step_forward_us"] += int((t_fwd - t0) * 1e6)
        self.counters["send_us"] += int(tally.send_s * 1e6)
        self.counters["route_us"] += int((t_end - t_fwd - tally.send_s) * 1e6)
        now = self._step_event(rows, out, tally.committed)
        if self.event_sink is not None:
            for rid, step, peer, c, score in tally.handoffs:
                self.event_sink({"event": "handoff", "request_id": rid, "step": step, "from": self.name,
                                 "to": peer, "tokens_committed": c, "score": score, "t": now})

    def _account_partial_step(self, out: ForwardOutput, t0: float, t_fwd: float, rows: int) -> None:
        """Counters and step event of a step that ran only partial prefills (``rows`` of them; no token sampled)."""
        self._account_forward(out, t0, t_fwd, time.perf_counter(), rows)
        self._step_event(rows, out, 0)

    def _account_forward(self, out: ForwardOutput, t0: float, t_fwd: float, t_end: float, extend_runs: int) -> None:
        self.counters["steps"] += 1
        self.counters["extend_tokens"] += out.extend_tokens
        self.counters["extend_runs"] += extend_runs
        self.counters["step_time_us"] += int((t_end - t0) * 1e6)
        self.counters["forward_us"] += int((t_fwd - t0) * 1e6)

    def _step_event(self, rows: int, out: ForwardOutput, committed: int) -> float:
        """Send the ``step`` event (when there is an event sink); returns its time (``time.time()``)."""
        now = time.time()
        if self.event_sink is not None:
            self.event_sink({"event": "step", "model": self.name, "batch_size": rows,
                             "latency_s": round(out.latency_s, 6), "tokens_committed": committed,
                             "extend_tokens": out.extend_tokens, "t": now})
        return now

    def _requeue(self, batch: List[LocalRequest]) -> None:
        """The step's requests are prefilled; those that stay go to the back of the ready queue, their
        delayed-batching wait restarting now."""
        now = time.perf_counter()
        for lr in batch:
            lr.prefilled = True
            if lr.rid in self.ready:
                lr.ready_since = now
                self.ready.move_to_end(lr.rid)
