"""Speculative decoding on the routing subservers: the SLM drafts, the LLM verifies.

Rule (Leviathan, Kalman, Matias 2023, "Fast Inference from Transformers via Speculative
Decoding", Algorithm 1; Chen et al. 2023, "Accelerating Large Language Model Decoding with
Speculative Sampling", Algorithm 2):

* model 0 (the drafter, the SLM) writes k tokens as *drafts*: each is appended to its
  sequence (the next step computes its KV) but not output; after the k-th draft, a drafted
  stop token or when the drafts fill the request's remaining ``max_tokens``, it hands the
  request to model 1 with the drafts in ``PeerReq.extras["drafts"]``;
* model 1 (the verifier, the LLM) runs its unseen tokens plus the k drafts as ONE extend and
  reads its next-token logits at every drafted position (k + 1 positions); it commits the
  longest prefix of drafts it accepts and one token of its own (the correction after a
  rejection, or the bonus token after k acceptances), frees the KV of the rejected drafts
  and hands the request back;
* back on model 0 the drafts its committed tokens do not confirm are rolled back (sequence
  cut, KV slots freed) before it extends with the rest and drafts the next round.

Acceptance.  Greedy requests (temperature 0): a draft is accepted when it equals the LLM's
argmax at its position, so the output equals LLM-only greedy decoding token for token,
whatever the drafts.  Sampled requests: draft x drawn from q is accepted with probability
min(1, p(x)/q(x)); at the first rejection the LLM's token is drawn from norm(max(0, p - q));
after k acceptances from p (Leviathan et al. 2023, Theorem 3.5: the output is distributed as
the LLM's sampling distribution p, after the request's temperature / top-k / top-p).
q is the SLM's distribution at ``draft_temperature`` (default: the request's temperature)
restricted to its ``draft_top_k`` most likely tokens and renormalised, so that it travels in
the PeerReq as (ids, probabilities); any q keeps the rule exact, a narrower one only lowers
acceptance.

Parameters: ``k`` (drafts per round), ``adaptive`` (per request: k + 1 after a round whose
drafts were all accepted, accepted + 1 otherwise, within [1, ``k_max``]),
``draft_temperature`` (the drafts' temperature; with a greedy request and a temperature > 0
the drafts are sampled while verification stays greedy: the output is still LLM-only's, used
to exercise rejections), ``draft_top_k``.  No threshold (``routing_threshold`` is rejected).
Penalties and ``min_tokens`` are not supported (a clear error for that request).

The router's ``routing_summary`` and ``routing_trace`` report drafts, accepted drafts and the
acceptance rate; tokens the SLM drafted and the LLM accepted are attributed to the SLM in
``tokens_by_model`` and the trace.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional

import torch

from ..engine.sampling import SAMPLING_EPS, filtered_probs
from ..protocol import PeerReq, Status, StepResult
from .base import ParamSpec, RoutingAlgorithm, request_key, request_uniform

__all__ = ["Speculative", "target_probs"]

#: sampling keys the rule does not support (their meaning depends on the tokens before each position)
UNSUPPORTED_SAMPLING = ("repetition_penalty", "presence_penalty", "frequency_penalty", "min_tokens")


def target_probs(logits: torch.Tensor, sampling: Dict[str, Any], temperature: Optional[float] = None) -> torch.Tensor:
    """The sampling distribution of one position, as :class:`~tokenrouter.engine.sampling.BatchSampler`
    samples it: temperature, then top-k, then top-p (vLLM order).

    Args:
        logits: float32 ``[V]`` raw next-token logits.
        sampling: the request's sampler dict (``temperature``, ``top_k``, ``top_p``).
        temperature: overrides the request's temperature (> 0).
    Returns:
        float32 ``[V]`` probabilities (sum 1).
    """
    t = float(sampling.get("temperature", 1.0) if temperature is None else temperature)
    tp = float(sampling.get("top_p", 1.0))
    probs = filtered_probs(logits.float() / max(t, SAMPLING_EPS), int(sampling.get("top_k") or 0), tp)
    return probs / probs.sum() if tp < 1.0 else probs


def _greedy(sampling: Dict[str, Any]) -> bool:
    return float(sampling.get("temperature", 1.0)) < SAMPLING_EPS


def _draw(probs: torch.Tensor, u: float) -> int:
    """Inverse-CDF draw of an index of ``probs`` (1-D, sum > 0) with the uniform number ``u``."""
    cdf = torch.cumsum(probs.double(), 0)
    i = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=torch.float64))[0])
    return min(i, probs.shape[0] - 1)


class Speculative(RoutingAlgorithm):
    """Draft (model 0) / verify (model 1) speculative decoding; see the module docstring."""

    name = "speculative"
    params_spec = {
        "k": ParamSpec(int, 4, 1, 32, "drafted tokens per round (the first round's k when adaptive)"),
        "adaptive": ParamSpec(bool, False, doc="adapt k per request from the previous round's acceptance"),
        "k_max": ParamSpec(int, 8, 1, 32, "largest k when adaptive"),
        "draft_temperature": ParamSpec(float, None, 0.0, 100.0,
                                       "temperature of the drafts (default: the request's)"),
        "draft_top_k": ParamSpec(int, 32, 1, 4096, "tokens of the draft distribution q sent to the verifier"),
    }
    threshold_param = None
    #: the verifier's rule needs the draft distribution q of a sampled request (``extras.draft_q``)
    uses_q = True

    def __init__(self, model_index: int, num_models: int, params: Dict[str, Any]):
        super().__init__(model_index, num_models, params)
        self.vocab_size: Optional[int] = None
        self.drafts: List[int] = []  # drafter: this visit's drafts
        self.draft_q: List[List[List[float]]] = []  # drafter: per draft [ids, probs] (sampled requests)
        self._to_verify: List[int] = []  # verifier: drafts received
        self._q: List[List[List[float]]] = []
        self.verified: Optional[Dict[str, int]] = None  # verifier: {"drafted", "accepted"} of this visit

    def attach(self, engine) -> None:
        self.vocab_size = int(getattr(engine, "vocab_size", 0)) or None

    # ------------------------------------------------------------ drafter
    def _k(self, hdr: PeerReq) -> int:
        k = int(hdr.extras.get("spec_k", self.params["k"])) if self.params["adaptive"] else self.params["k"]
        return max(1, min(k, hdr.max_tokens - hdr.num_generated))

    def _verifier_down(self, hdr: PeerReq) -> bool:
        return bool(hdr.down_models) and hdr.models[self.peer_model(1)] in hdr.down_models

    def draft(self, result: StepResult) -> Optional[int]:
        """Model 0: the step's token becomes a draft (None when the verifier is down: the SLM then
        writes on its own, the router's fallback mode); :meth:`_draft_token` picks it."""
        if self.model_index != 0 or self._verifier_down(result.state.header):
            return None
        tok = self._draft_token(result)
        self.drafts.append(tok)
        return tok

    def _draft_token(self, result: StepResult) -> int:
        """The draft of one step.  A greedy request with no ``draft_temperature`` drafts the
        argmax; otherwise the draft is drawn from q (module docstring) with a per-(request, step)
        uniform number (:func:`request_uniform`), and q is kept for the verifier (``draft_q``)
        when the request is sampled and :attr:`uses_q`."""
        lr = result.state
        hdr = lr.header
        t = self.params["draft_temperature"]
        keep_q = self.uses_q and not _greedy(hdr.sampling)
        if (t is None and _greedy(hdr.sampling)) or (t is not None and t < SAMPLING_EPS):
            tok = int(torch.argmax(result.logits))
            if keep_q:  # q is a point mass on the argmax
                self.draft_q.append([[tok], [1.0]])
            return tok
        probs = target_probs(result.logits, hdr.sampling, temperature=t)
        top = torch.topk(probs, min(self.params["draft_top_k"], probs.shape[0]))
        q = top.values / top.values.sum()
        u = request_uniform(f"{self.name}-draft", request_key(lr.rid, hdr.sampling), hdr.step)
        tok = int(top.indices[_draw(q, u)])
        if keep_q:
            self.draft_q.append([top.indices.tolist(), q.tolist()])
        return tok

    # ------------------------------------------------------------ verifier
    def receive(self, peer_req: PeerReq) -> List[int]:
        """Both models: reject unsupported sampling keys.  Model 1: append the drafts to verify.

        Raises:
            ValueError: penalties / ``min_tokens`` asked for, or drafts that are not token ids
                (or a q that does not match them).
        """
        bad = [k for k in UNSUPPORTED_SAMPLING if k in peer_req.sampling]
        if bad:
            raise ValueError(f"algorithm {self.name!r} does not support the sampling parameters {bad}")
        tokens = list(peer_req.tokens)
        if self.model_index != 1:
            return tokens
        drafts = peer_req.extras.get("drafts") or []
        if not isinstance(drafts, list) or len(drafts) > 64 or any(
                not isinstance(t, int) or isinstance(t, bool) or t < 0 or
                (self.vocab_size is not None and t >= self.vocab_size) for t in drafts):
            raise ValueError("extras.drafts must be a list of at most 64 token ids of this model")
        q = peer_req.extras.get("draft_q") or []
        if drafts and self.uses_q and not _greedy(peer_req.sampling):
            if not isinstance(q, list) or len(q) != len(drafts):
                raise ValueError("a sampled request's drafts need their draft distributions (extras.draft_q)")
            for (ids, ps), d in zip(q, drafts):
                if len(ids) != len(ps) or d not in ids:
                    raise ValueError("extras.draft_q does not match extras.drafts")
        self._to_verify, self._q = list(drafts), list(q)
        return tokens + list(drafts)

    def drafts_to_verify(self) -> List[int]:
        return list(self._to_verify) if self.model_index == 1 else []

    def verify(self, result: StepResult, position_logits, drafts: List[int], sampler=None) -> List[int]:
        """Model 1: the accepted drafts and one token of its own (module docstring).

        Greedy: the longest prefix of ``drafts`` equal to the argmax at each position, then the
        argmax after it.  Sampled: Leviathan et al. 2023 Algorithm 1 with the request's random
        generator (``sampler.generator``).
        """
        hdr = result.state.header
        if _greedy(hdr.sampling):
            choice = position_logits.argmax(dim=-1).tolist()
            n = 0
            while n < len(drafts) and drafts[n] == choice[n]:
                n += 1
            out = list(drafts[:n]) + [int(choice[n])]
        else:
            gen = sampler.generator(result.rid, hdr.sampling.get("seed")) if sampler is not None else None
            out = []
            for j, d in enumerate(drafts):
                p = target_probs(position_logits[j], hdr.sampling)
                ids, qs = self._q[j]
                q = torch.zeros_like(p)
                q[torch.tensor(ids, dtype=torch.long)] = torch.tensor(qs, dtype=p.dtype)
                u = float(torch.rand(1, generator=gen)[0])
                if q[d] > 0 and u < min(1.0, float(p[d] / q[d])):
                    out.append(int(d))
                    continue
                resid = torch.clamp(p - q, min=0.0)
                if float(resid.sum()) <= 0.0:  # p == q: the rejection had probability 0
                    resid = p
                out.append(int(torch.multinomial(resid / resid.sum(), 1, generator=gen)[0]))
                break
            else:
                p = target_probs(position_logits[len(drafts)], hdr.sampling)
                out.append(int(torch.multinomial(p, 1, generator=gen)[0]))
        self.verified = {"drafted": len(drafts), "accepted": len(out) - 1}
        return out

    # ------------------------------------------------------------ both
    def route(self, result: StepResult) -> int:
        """Model 0: hand the drafts over (1) after k of them, a drafted stop token, or when they
        fill the remaining budget; else keep drafting (0).  Model 1: hand back (1) after every
        step (a verification)."""
        self.last_score = None
        if self.model_index == 1:
            return 1
        if not self.drafts:
            return 0  # the verifier is down: the SLM writes on its own
        hdr = result.state.header
        if len(self.drafts) >= self._k(hdr) or self.drafts[-1] in hdr.stop_token_ids:
            return 1
        return 0

    def commit_on_handoff(self, result: StepResult) -> bool:
        """Model 0's handoff step drafted its token (nothing to commit); model 1's token is committed."""
        return self.model_index == 1

    def send(self, req) -> PeerReq:
        """Model 0: the drafts (and q for a sampled request) in ``extras``.  Model 1: no drafts;
        with ``adaptive`` the next round's k in ``extras["spec_k"]``."""
        extras = {k: v for k, v in req.header.extras.items() if k not in ("drafts", "draft_q")}
        if self.model_index == 0:
            extras["drafts"] = list(self.drafts)
            if self.draft_q:
                extras["draft_q"] = self.draft_q
        elif self.params["adaptive"] and self.verified is not None:
            k = int(extras.get("spec_k", self.params["k"]))
            d, a = self.verified["drafted"], self.verified["accepted"]
            k = k + 1 if a >= d else a + 1
            extras["spec_k"] = max(1, min(self.params["k_max"], k))
        return dataclasses.replace(req.header, tokens=list(req.seq.tokens[req.loc:]),
                                   status=Status.RUNNING, extras=extras)
