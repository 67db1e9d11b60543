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
from typing import TYPE_CHECKING, Any, Dict, List

import torch

from ..protocol import FinishReason, StepResult
from .sampling import normalized_entropy

if TYPE_CHECKING:
    from .subserver import LocalRequest

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
        return info

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
            k = lr.algo.route(res)
            if k != 0 and hdr.down_models and hdr.models[lr.algo.peer_model(k)] in hdr.down_models:
                k = 0  # that peer is down (router's fallback mode): this model keeps writing
            lr.algo.step_scores.append(lr.algo.last_score)
            hdr.step += 1
            commit = k == 0 or lr.algo.commit_on_handoff(res)
            finished_reason = None
            if commit:
                lr.seq.tokens.append(toks[i])
                lr.unflushed.append(toks[i])
                if hdr.sampling.get("logprobs"):
                    lr.unflushed_logprobs.append(tok_logp[i])
                hdr.num_generated += 1
                committed_total += 1
                if toks[i] in hdr.stop_token_ids:
                    finished_reason = FinishReason.STOP
                elif hdr.num_generated >= hdr.max_tokens:
                    finished_reason = FinishReason.LENGTH
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
