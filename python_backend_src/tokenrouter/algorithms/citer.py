"""CITER: token-level routing by a learned confidence model on the SLM's hidden state.

Rule (CITER, Zheng et al. 2025, "CITER: Collaborative Inference for Efficient
Large Language Model Decoding with Token-Level Routing"; as served in the
TokenRouter paper): the SLM writes by default; an MLP on its last hidden state
``h`` (float32 ``[H]``) gives the confidence ``c = sigmoid(MLP(h))`` that the SLM's
token is acceptable.  When ``c < τ`` the token is discarded and the LLM
regenerates it from the full prefix; the LLM hands back after one token.
Paper setting: τ = 0.98.

Parameters: ``tau`` (float in [0, 1], default 0.98; per-request override via
``routing_threshold``), ``router`` (router file; default ``auto``: the shipped router trained for model 0's checkpoint).
Trace score: ``c`` on SLM steps, none on LLM steps.
"""

from __future__ import annotations

from ..protocol import StepResult
from .base import ParamSpec
from .deferral import OneTokenDeferral, router_spec

__all__ = ["CITER"]


class CITER(OneTokenDeferral):
    """CITER (see module docstring)."""

    name = "citer"
    router_kind = "citer"
    params_spec = {"tau": ParamSpec(float, 0.98, 0.0, 1.0, "confidence threshold τ: defer when c < τ"),
                   "router": router_spec()}
    threshold_param = "tau"

    def score(self, result: StepResult) -> float:
        return float(self.router.prob(self._hidden(result))[0])

    def defer(self, score: float, result: StepResult) -> bool:
        return score < self.params["tau"]

