"""Co-LLM: a base model that learns when to defer single tokens to an assistant.

Rule (Co-LLM, Shen et al. 2024, "Learning to Decode Collaboratively with
Multiple Language Models"; as served in the TokenRouter paper): the base model
(model 0) writes by default; its deferral score is ``p = sigmoid(w·h + b)``, a
learned linear head on its last hidden state ``h`` (float32 ``[H]``).  When
``p > η`` the base's token is discarded and the assistant (model 1, the LLM)
writes that one token, then hands back.  Paper setting: η = 0.15.

Compose mode (``compose: true``): the next token is drawn from
``(1 − p)·P_base + p·P_assistant``.  It is realised exactly as a mixture: with
probability ``p`` (a per-request, per-position hashed uniform draw, reproducible
with a sampling seed) the position is deferred and the assistant samples from
its own distribution, else the base's sample is kept.  (Under greedy decoding
this samples the mixture's components rather than taking the mixture's argmax.)

Parameters: ``eta`` (float in [0, 1], default 0.15; per-request override via
``routing_threshold``), ``compose`` (bool, default false), ``seed`` (int,
compose draws), ``router`` (default ``auto``: the shipped router trained for model 0's checkpoint).
Trace score: ``p`` on base steps, none on assistant steps.
"""

from __future__ import annotations

from ..protocol import StepResult
from .base import ParamSpec, request_key, request_uniform
from .deferral import OneTokenDeferral, router_spec

__all__ = ["CoLLM"]


class CoLLM(OneTokenDeferral):
    """Co-LLM (see module docstring)."""

    name = "colm"
    router_kind = "colm"
    params_spec = {"eta": ParamSpec(float, 0.15, 0.0, 1.0, "deferral threshold η: defer when p > η"),
                   "compose": ParamSpec(bool, False, doc="mix (1-p)·base + p·assistant instead of thresholding"),
                   "seed": ParamSpec(int, 0, 0, None, "seed of the compose-mode draws"),
                   "router": router_spec()}
    threshold_param = "eta"

    def score(self, result: StepResult) -> float:
        return float(self.router.prob(self._hidden(result))[0])

    def defer(self, score: float, result: StepResult) -> bool:
        if not self.params["compose"]:
            return score > self.params["eta"]
        sampling = result.state.header.sampling if result.state is not None else None
        u = request_uniform(f"colm:{self.params['seed']}", request_key(result.rid, sampling), result.step)
        return u < score
