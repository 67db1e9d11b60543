"""Draft-verify: the SLM drafts k tokens, the LLM keeps the ones it finds acceptable.

Lossy speculation on speculative decoding's subservers and pending state (:mod:`.speculative`:
drafting, the one-extend verification, rollback, adaptive k are the same).  Where speculative
decoding keeps a draft only when it is what the LLM would have written, draft-verify keeps it
when the LLM finds it *acceptable*, a threshold rule on the LLM's probability of it:

* ``prob``:  keep draft x at its position when p(x) >= alpha;
* ``ratio``: keep it when p(x) >= alpha * max_v p(v) (the LLM's largest probability there).

Sources: speculative cascades (Narasimhan et al., "Faster Cascades via Speculative Decoding",
ICLR 2025: deferral rules of the token-level cascade applied to each drafted position;
``ratio`` at alpha = 1 is their exact speculative decoding, ``prob`` is the confidence rule),
and judge decoding (Bachmann et al., "Judge Decoding: Faster Speculative Sampling Requires
Going Beyond Model Alignment", ICLR 2025: the target model accepts drafts it judges correct,
not only those it would have sampled).

A round: model 0 drafts k tokens (its own tokens as it would write them alone: the argmax of a
greedy request, the sampler's draw of a sampled one; ``draft_temperature`` samples them
hotter instead); model 1 runs them in ONE extend (logits float32 ``[k + 1, V]``, one row
before each draft and one after the last), keeps the longest prefix the rule accepts, puts
its own token in place of the first draft it rejects and discards the drafts after it (their
KV freed, on both models).  When every draft is kept the LLM adds NO token of its own (the
bonus token of exact speculation): the round ends on the last draft, so that at alpha = 0
the output is SLM-only's token for token (a :class:`~tokenrouter.protocol.Verdict` with no
own token; the engine recomputes that draft's KV with the next round).

Probabilities p.  Greedy requests (temperature 0): the LLM's softmax of the raw logits at
temperature 1 (``ratio`` compares the raw logits, log p(x) - log max p = l(x) - max l, so that
at alpha = 1 it keeps exactly the argmax: the output is LLM-only's and exact speculation's
token for token, ties between logits aside); the replacing token is the LLM's argmax.
Sampled requests: p after the request's temperature, top-k and top-p
(:func:`~.speculative.target_probs`), and the replacing token is drawn from that p with the
request's generator.  The output is then no longer distributed as either model's.

Parameters: ``rule`` (``prob`` or ``ratio``), ``alpha`` in [0, 1] (the threshold:
``sampling_parameters.routing_threshold`` sets it per request), and speculative decoding's
``k``, ``adaptive``, ``k_max``, ``draft_temperature``, ``draft_top_k`` (the top-k of drafts
sampled at ``draft_temperature``; no draft distribution travels to the LLM).  Not built: the
issue's third rule, ``router``, a trained router scoring each drafted position from the LLM's
verification pass (judge decoding's linear head): the verification returns only logits at
the drafted positions, not the LLM's hidden states, and the shipped routers
(:mod:`.learned`) read model 0's hidden state at its own steps and are trained on SLM-vs-LLM
divergence labels, so such a router needs new engine outputs, training data and a file kind.

Reported like speculative decoding: ``routing_summary.speculative`` (rounds, drafted,
accepted, acceptance_rate, tokens_per_llm_pass), ``routing_trace.drafts``, the
``spec_decode_*`` router metrics; the trace marks kept drafts as the SLM's (0) and the LLM's
replacing tokens as the LLM's (1).
"""

from __future__ import annotations

import math
from typing import Any, Dict, List

import torch

from ..protocol import StepResult, Verdict
from .base import ParamSpec
from .speculative import Speculative, _greedy, target_probs

__all__ = ["DraftVerify", "draft_scores", "RULES"]

#: the acceptance rules built (``router`` is not: see the module docstring)
RULES = ("prob", "ratio")


def _rule(value) -> str:
    if value not in RULES:
        extra = " (the trained-router rule is not built)" if value == "router" else ""
        raise ValueError(f"must be one of {list(RULES)}, got {value!r}{extra}")
    return value


def draft_scores(position_logits: torch.Tensor, drafts: List[int], rule: str,
                 sampling: Dict[str, Any]) -> torch.Tensor:
    """The log of each draft's score, compared with log(alpha) by :meth:`DraftVerify.verify`.

    Args:
        position_logits: float32 ``[n, V]`` (n >= len(drafts)): the LLM's raw next-token logits
            before each draft.
        drafts: the drafted token ids (int), in order.
        rule: ``prob`` (score p(x)) or ``ratio`` (score p(x) / max_v p(v)).
        sampling: the request's sampler dict; greedy: p = softmax of the raw logits
            (temperature 1), else p = :func:`target_probs` (temperature, top-k, top-p).
    Returns:
        float32 ``[len(drafts)]``: log p(x) or log (p(x) / max p), in (-inf, 0].
    """
    n = len(drafts)
    idx = torch.tensor(drafts, dtype=torch.long).view(-1, 1)
    logits = position_logits[:n].float()
    if _greedy(sampling):
        if rule == "ratio":  # exact: the argmax scores 0
            return logits.gather(1, idx).view(-1) - logits.max(dim=-1).values
        return torch.log_softmax(logits, dim=-1).gather(1, idx).view(-1)
    p = torch.stack([target_probs(row, sampling) for row in logits])
    px = p.gather(1, idx).view(-1)
    return torch.log(px / p.max(dim=-1).values if rule == "ratio" else px)


class DraftVerify(Speculative):
    """Draft (model 0) / threshold verification (model 1); see the module docstring."""

    name = "draft_verify"
    params_spec = {
        **Speculative.params_spec,
        "rule": ParamSpec(str, "ratio", doc="acceptance rule: prob (p >= alpha) or ratio (p >= alpha * max p)",
                          parse=_rule),
        "alpha": ParamSpec(float, 0.5, 0.0, 1.0, "acceptance threshold (0: keep every draft)"),
    }
    threshold_param = "alpha"
    uses_q = False

    def _draft_token(self, result: StepResult) -> int:
        """The SLM's own token (the sampler's: argmax when greedy) unless ``draft_temperature`` is set."""
        if self.params["draft_temperature"] is None:
            return int(result.token_id)
        return super()._draft_token(result)

    def verify(self, result: StepResult, position_logits, drafts: List[int], sampler=None) -> Verdict:
        """Model 1: the kept drafts, then its own token in place of the first rejected one (none
        when all are kept).  Records ``verified`` (drafted / accepted) for the adaptive k."""
        hdr = result.state.header
        alpha = self.params["alpha"]
        scores = draft_scores(position_logits, drafts, self.params["rule"], hdr.sampling)
        bar = math.log(alpha) if alpha > 0 else -math.inf
        n = 0
        while n < len(drafts) and float(scores[n]) >= bar:
            n += 1
        self.verified = {"drafted": len(drafts), "accepted": n}
        if n == len(drafts):
            return Verdict(list(drafts), n)
        if _greedy(hdr.sampling):
            own = int(position_logits[n].argmax())
        else:
            gen = sampler.generator(result.rid, hdr.sampling.get("seed")) if sampler is not None else None
            own = int(torch.multinomial(target_probs(position_logits[n], hdr.sampling), 1, generator=gen)[0])
        return Verdict(list(drafts[:n]) + [own], n)
