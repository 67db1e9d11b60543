"""Draft-verify: the SLM drafts k tokens, the LLM keeps the ones it finds acceptable.

Lossy speculation on speculative decoding's subservers and pending state (:mod:`.speculative`:
drafting, the one-extend verification, rollback, adaptive k are the same).  Where speculative
decoding keeps a draft only when it is what the LLM would have written, draft-verify keeps it
when the LLM finds it *acceptable*, by one of three rules with one threshold alpha in [0, 1]:

* ``prob``:  keep draft x at its position when p(x) >= alpha (the LLM's probability of it);
* ``ratio``: keep it when p(x) >= alpha * max_v p(v) (the LLM's largest probability there);
* ``router``: keep it when it is the LLM's argmax or when a trained router, reading the LLM's
  distribution at that position, gives 1 - P(critical) >= alpha (below).

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

Rule ``router``: a trained router (:mod:`.learned`, kind ``dv``) scores each drafted position
from the LLM's verification pass, as judge decoding's linear head and R2R's router do: its
input is :func:`~.learned.dv_features` of the LLM's raw logits at that position and the draft
(log p(x), log max p, their gap, normalised entropy, the draft's rank, the top-2 margin), its
output z a logit of P(critical) = sigmoid(z), the probability that keeping the draft changes
where the LLM's text goes (R2R's *critical* label, ``tools/train_routers.py``: the SLM's token
differs from the LLM's and the LLM's continuation after it does not re-join).  A draft is kept
when it is the LLM's argmax (the token the LLM would write: rejecting it would only put it back
and end the round), or when its acceptability 1 - P(critical) >= alpha, computed as
-z >= logit(alpha) (:func:`router_keeps`), so that alpha has the other rules' direction:

* alpha = 0: every draft kept, the output is SLM-only's (as with ``prob`` and ``ratio``);
* alpha = 1: only the argmax kept (no finite z passes logit(1) = inf): the output is exact
  speculation's (greedy: LLM-only's), as ``ratio`` at alpha = 1;
* in between, a draft the LLM would not have written is kept when the router finds it likely
  harmless (alpha = 0.5: P(critical) <= 0.5).

A draft the LLM gives probability 0 (a grammar forbids it) is kept only at alpha = 0.  The
router is evaluated in the LLM's subserver (model 1) on logits it already has: no hidden
state and no [V]-sized tensor travels.  It does not read the LLM's hidden states, which the
verification extend could also return: the router decides only where a draft differs from the
LLM's argmax (a few hundred positions in a router training set), too few to fit an input of
the hidden size.

Parameters: ``rule`` (``prob``, ``ratio`` or ``router``), ``alpha`` in [0, 1] (the threshold:
``sampling_parameters.routing_threshold`` sets it per request), ``router`` (rule ``router``:
the router file; default ``auto``, the shipped ``dv_*.pt`` trained for model 1's checkpoint),
and speculative decoding's ``k``, ``adaptive``, ``k_max``, ``draft_temperature``,
``draft_top_k`` (the top-k of drafts sampled at ``draft_temperature``; no draft distribution
travels to the LLM).  For sampled requests the router's features are still those of the raw
logits (temperature 1, as it was trained); the replacing token is drawn from p as above.

Reported like speculative decoding: ``routing_summary.speculative`` (rounds, drafted,
accepted, acceptance_rate, tokens_per_llm_pass), ``routing_trace.drafts``, the
``spec_decode_*`` router metrics; the trace marks kept drafts as the SLM's (0) and the LLM's
replacing tokens as the LLM's (1).
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

import torch

from ..protocol import StepResult, Verdict
from .base import ParamSpec
from .deferral import router_spec
from .learned import AUTO, DV_FEATURES, RouterFile, dv_features, find_router, load_router
from .speculative import Speculative, _greedy, target_probs

__all__ = ["DraftVerify", "draft_scores", "router_keeps", "RULES", "ROUTER_KIND"]

#: the acceptance rules (module docstring)
RULES = ("prob", "ratio", "router")
#: the router file kind of rule ``router``
ROUTER_KIND = "dv"


def _rule(value) -> str:
    if value not in RULES:
        raise ValueError(f"must be one of {list(RULES)}, got {value!r}")
    return value


def router_keeps(position_logits: torch.Tensor, drafts: List[int], critical_logits: torch.Tensor,
                 alpha: float) -> torch.Tensor:
    """Rule ``router``'s decision at each drafted position (module docstring).

    Args:
        position_logits: float32 ``[n, V]`` (n >= len(drafts)): the LLM's logits before each draft
            (masked by a grammar, if any).
        drafts: the drafted token ids, in order.
        critical_logits: float32 ``[len(drafts)]``: the router's z, P(critical) = sigmoid(z).
        alpha: the threshold in [0, 1].
    Returns:
        bool ``[len(drafts)]``: True where the draft may be kept: alpha = 0; or it is the LLM's argmax
        (its logit equals the largest, ties included); or it has probability > 0 and
        -z >= logit(alpha) (1 - P(critical) >= alpha; never at alpha = 1).
    """
    n = len(drafts)
    if alpha <= 0.0:
        return torch.ones(n, dtype=torch.bool)
    logits = position_logits[:n].float()
    lx = logits.gather(1, torch.tensor(drafts, dtype=torch.long).view(-1, 1)).view(-1)
    is_max = lx >= logits.max(dim=-1).values
    if alpha >= 1.0:
        return is_max
    bar = math.log(alpha) - math.log1p(-alpha)
    return is_max | (torch.isfinite(lx) & (-critical_logits.float().view(-1) >= bar))


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
        "rule": ParamSpec(str, "ratio", doc="acceptance rule: prob (p >= alpha), ratio (p >= alpha * max p) "
                          "or router (the LLM's argmax, or 1 - P(critical) >= alpha)", parse=_rule),
        "alpha": ParamSpec(float, 0.5, 0.0, 1.0, "acceptance threshold (0: keep every draft)"),
        "router": router_spec(),
    }
    threshold_param = "alpha"
    uses_q = False

    def __init__(self, model_index: int, num_models: int, params: Dict[str, Any]):
        super().__init__(model_index, num_models, params)
        self.router: Optional[RouterFile] = None

    @classmethod
    def validate_params(cls, params, num_models):
        """Defaults and bounds; with rule ``router`` and a router file named, load it once to check it.

        Raises:
            ValueError: also for a missing router file, one of another kind or one whose input is not
                :data:`~.learned.DV_FEATURES`, and for a ``router`` file given to another rule.
        """
        out = super().validate_params(params, num_models)
        if out["router"] != AUTO:
            if out["rule"] != "router":
                raise ValueError(f"routing parameter 'router' is used by rule 'router' only (rule is {out['rule']!r})")
            _check_router(load_router(out["router"], ROUTER_KIND))
        return out

    def attach(self, engine) -> None:
        """Model 1 with rule ``router``: load the router (``auto``: the shipped one trained for model 1's
        checkpoint, :func:`~.learned.find_router` on ``meta.llm``).

        Raises:
            ValueError: no such router (the message says how to train one).
        """
        super().attach(engine)
        if self.model_index != 1 or self.params["rule"] != "router":
            return
        path = self.params["router"]
        if path == AUTO:
            path = find_router(ROUTER_KIND, engine.config.model_path, key="llm")
        self.router = _check_router(load_router(path, ROUTER_KIND))

    def router_logits(self, position_logits: torch.Tensor, drafts: List[int]) -> torch.Tensor:
        """The router's z (P(critical) = sigmoid(z)) at each drafted position: float32 ``[len(drafts)]``."""
        with torch.no_grad():
            return self.router.module(dv_features(position_logits[:len(drafts)], drafts)).float().view(-1)

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
        if self.params["rule"] == "router":
            if self.router is None:
                raise ValueError("rule 'router': no router loaded (attach was not called)")
            keep = router_keeps(position_logits, drafts, self.router_logits(position_logits, drafts), alpha).tolist()
        else:
            scores = draft_scores(position_logits, drafts, self.params["rule"], hdr.sampling)
            bar = math.log(alpha) if alpha > 0 else -math.inf
            keep = [float(s) >= bar for s in scores]
        n = 0
        while n < len(drafts) and keep[n]:
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


def _check_router(router: RouterFile) -> RouterFile:
    """``router`` itself, when its input is :data:`~.learned.DV_FEATURES`.

    Raises:
        ValueError: another input size or feature list (a file from another version).
    """
    names = router.meta.get("features")
    if int(router.arch.get("in_dim", -1)) != len(DV_FEATURES) or (names is not None and tuple(names) != DV_FEATURES):
        raise ValueError(f"router {router.path!r} reads {names or router.arch.get('in_dim')}, "
                         f"rule 'router' gives {list(DV_FEATURES)}")
    return router
