"""The second half of a subserver step: sample, route, commit, stream (SGLang's output processor).

Mirrors SGLang's ``SchedulerOutputProcessorMixin`` (``process_batch_result``): the decode
loop (:class:`~tokenrouter.engine.subserver.Subserver`) runs the forward, then hands the
logits here.  Per row: sample a token, let the request's routing algorithm decide
(``route``; paper §Design, request-centric ``route``/``send``/``receive``), commit it,
and either finish the request, hand it off to a peer (it becomes *pending*, its KV kept)
or stream its committed tokens.  Also the step's counters and routing events
(scheduler_model's event format: ``step`` and ``handoff``).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Dict, List

import torch

from ..protocol import FinishReason, StepResult, Verdict
from .sampling import normalized_entropy

#: a :class:`tokenrouter.engine.subserver.LocalRequest` (subserver imports this module, not the reverse)
LocalRequest = Any

logger = logging.getLogger(__name__)

__all__ = ["OutputProcessorMixin"]


class OutputProcessorMixin:
    """Step results of a :class:`~tokenrouter.engine.subserver.Subserver` (uses its sampler,
    counters, config, event sink, ``ready`` queue, ``_end_segment`` and ``_release``)."""

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
        if lr.header.sampling.get("logprobs"):
            info["logprobs"], lr.unflushed_logprobs = lr.unflushed_logprobs, []
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

        Returns:
            ``(tokens, logprobs, in_seq)``: the tokens to commit (accepted drafts first), the
            raw logprob of each under this model, and how many leading ones stay in the
            sequence with their KV (the accepted drafts; one fewer without an own token).

        Raises:
            ValueError: the algorithm returned something that is not an accepted prefix plus at
                most one token (none only when every draft is accepted).
        """
        drafts, lr.verify = lr.verify, []
        if position_logits is None or position_logits.shape[0] != len(drafts) + 1:
            raise ValueError("the engine returned no logits at the drafted positions")
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
        logp = torch.log_softmax(position_logits[: len(toks)], dim=-1)
        lps = logp.gather(1, torch.tensor(toks, dtype=torch.long).view(-1, 1)).view(-1).tolist()
        lr.spec_round = {"drafted": len(drafts), "accepted": n_acc, "drafter": lr.algo.peer_model(1)}
        return toks, lps, in_seq

    def process_batch_result(self, batch: List[LocalRequest], out, t0: float, t_fwd: float,
                             has_prefill: bool) -> None:
        """Sample, route, commit and stream the results of one forward step (loop thread).

        Args:
            batch: the step's requests, in the rows' order of ``out``.
            out: the engine's ``ForwardOutput``: ``logits`` float32 ``[len(batch), vocab]``,
                ``hidden`` (or None), ``extend_tokens``, ``num_extend``, ``latency_s``.
            t0, t_fwd: ``time.perf_counter()`` at the start of the step and after the forward (s).
            has_prefill: the step ran a request's first prompt.

        Each row samples its token, asks its routing algorithm ``route`` (paper §Design,
        request-centric algorithms: 0 keeps the request here, k hands it to peer k), then
        commits, finishes, hands off (``send``; the request becomes pending here) or
        streams.  A row whose sampling fails ends that request alone.
        """
        logits = out.logits
        logp = torch.log_softmax(logits, dim=-1)
        ent = normalized_entropy(logp).tolist()
        row_errors: Dict[int, str] = {}
        toks_t = self.sampler.sample(logits, [lr.rid for lr in batch], [lr.header.sampling for lr in batch],
                                     errors=row_errors, contexts=[self._sampling_context(lr) for lr in batch])
        tok_logp = logp.gather(1, toks_t.view(-1, 1)).view(-1)
        probs = tok_logp.exp().tolist()
        tok_logp = tok_logp.tolist()
        toks = toks_t.tolist()
        self.counters["steps"] += 1
        self.counters["extend_tokens"] += out.extend_tokens
        self.counters["extend_runs"] += out.num_extend
        self.counters["decode_tokens"] += len(batch) - out.num_extend
        committed_total = 0
        handoff_events = []
        send_s = 0.0
        for i, lr in enumerate(batch):
            if i in row_errors:  # this request alone fails
                self.counters["errors"] += 1
                self._release(lr.rid, "error", f"model {self.name}: {row_errors[i]}")
                continue
            hdr = lr.header
            res = StepResult(rid=lr.rid, model_index=lr.algo.model_index, token_id=toks[i],
                             norm_entropy=ent[i], prob=probs[i], step=hdr.num_generated,
                             hidden=None if out.hidden is None else out.hidden[i],
                             logits=logits[i], state=lr)
            drafted, verified = None, None
            try:
                if lr.verify:  # speculative decoding: this step ran a peer's drafts
                    pos = out.position_logits[i] if getattr(out, "position_logits", None) else None
                    verified = self._verify_row(lr, res, pos)
                else:
                    drafted = lr.algo.draft(res)
            except (ValueError, RuntimeError) as e:  # this request alone fails
                logger.exception("speculative step of %s failed on %s", lr.rid, self.name)
                self.counters["errors"] += 1
                self._release(lr.rid, "error", f"model {self.name}: {e}")
                continue
            k = lr.algo.route(res)
            if k != 0 and hdr.down_models and hdr.models[lr.algo.peer_model(k)] in hdr.down_models:
                k = 0  # that peer is down (router's fallback mode): this model keeps writing
            lr.algo.step_scores.append(lr.algo.last_score)
            hdr.step += 1
            if drafted is not None:  # a draft: in the sequence (KV next step), not output
                lr.seq.tokens.append(int(drafted))
                lr.drafts += 1
                self.counters["draft_tokens"] += 1
                commit_toks, commit_lps, in_seq = [], [], 0
            elif verified is not None:  # kept drafts + own token; the first in_seq already in the sequence
                commit_toks, commit_lps, in_seq = verified
            elif k == 0 or lr.algo.commit_on_handoff(res):
                commit_toks, commit_lps, in_seq = [toks[i]], [tok_logp[i]], 0
            else:
                commit_toks, commit_lps, in_seq = [], [], 0
            commit = bool(commit_toks)
            finished_reason = None
            for j, tok in enumerate(commit_toks):
                if j >= in_seq:
                    lr.seq.tokens.append(tok)
                lr.unflushed.append(tok)
                if hdr.sampling.get("logprobs"):
                    lr.unflushed_logprobs.append(commit_lps[j])
                hdr.num_generated += 1
                committed_total += 1
                if tok in hdr.stop_token_ids:
                    finished_reason = FinishReason.STOP
                elif hdr.num_generated >= hdr.max_tokens:
                    finished_reason = FinishReason.LENGTH
                if finished_reason is not None:
                    if lr.spec_round is not None:  # drafts after the end are not output
                        lr.spec_round["accepted"] = min(lr.spec_round["accepted"], j + 1)
                    break
            if finished_reason is not None:
                self.counters["finished"] += 1
                self._end_segment(lr, "finished", {"finish_reason": finished_reason.value,
                                                   "num_generated": hdr.num_generated})
                self._release(lr.rid, "finished", "")
            elif k != 0:
                peer = lr.algo.peer_model(k)
                pr = lr.algo.send(lr)
                lr.loc = len(lr.seq.tokens)
                self.counters["handoffs_out"] += 1
                handoff_events.append((lr.rid, hdr.step, hdr.models[peer], 1 if commit else 0,
                                       lr.algo.last_score))
                ts = time.perf_counter()
                self._end_segment(lr, "handoff", {"to": hdr.models[peer], "to_index": peer,
                                                  "peer_req": pr.header_json(),
                                                  "committed": bool(commit)})
                send_s += time.perf_counter() - ts
            elif len(lr.unflushed) >= self.config.stream_interval or hdr.num_generated == 1:
                toks_out, lr.unflushed = lr.unflushed, []
                ts = time.perf_counter()
                try:
                    lr.sink("tokens", toks_out, {"scores": lr.algo.take_scores(), **self._token_info(lr)})
                except Exception:  # noqa: BLE001
                    logger.exception("sink of %s failed", lr.rid)
                send_s += time.perf_counter() - ts
        t_end = time.perf_counter()
        self.counters["step_time_us"] += int((t_end - t0) * 1e6)
        self.counters["forward_us"] += int((t_fwd - t0) * 1e6)
        if not out.num_extend:  # pure decode steps
            self.counters["decode_steps"] += 1
            self.counters["decode_step_forward_us"] += int((t_fwd - t0) * 1e6)
        elif not has_prefill:  # steps that resume requests (no new prompt)
            self.counters["resume_steps"] += 1
            self.counters["resume_step_forward_us"] += int((t_fwd - t0) * 1e6)
        self.counters["send_us"] += int(send_s * 1e6)
        self.counters["route_us"] += int((t_end - t_fwd - send_s) * 1e6)
        if self.event_sink is not None:
            now = time.time()
            self.event_sink({"event": "step", "model": self.name, "batch_size": len(batch),
                             "latency_s": round(out.latency_s, 6), "tokens_committed": committed_total,
                             "extend_tokens": out.extend_tokens, "t": now})
            for rid, step, peer, c, score in handoff_events:
                self.event_sink({"event": "handoff", "request_id": rid, "step": step, "from": self.name,
                                 "to": peer, "tokens_committed": c, "score": score, "t": now})
        for lr in batch:
            lr.prefilled = True
        # requests that stepped and stay go to the back of the queue; their
        # delayed-batching wait restarts at the end of this step
        now_pc = time.perf_counter()
        for lr in batch:
            if lr.rid in self.ready:
                lr.ready_since = now_pc
                self.ready.move_to_end(lr.rid)
