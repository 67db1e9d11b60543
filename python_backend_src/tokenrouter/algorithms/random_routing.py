"""Random routing: every output token goes to the LLM with probability p.

The control any router must beat (issue "quality on a real pair"): at the same
LLM-token share, a router that picks its tokens should answer better than one
that picks them at random.  Before every output token ``t`` a uniform draw
``u = U(seed, request key, t)`` is made (:func:`~.base.request_uniform`; the
request key is the client's sampling ``seed`` when given, else the request id),
and the LLM (model 1) writes token ``t`` when ``u < p``, the SLM (model 0)
otherwise.  The draw is a hash, so every model's instance and the router (first
token) agree on it, and a seeded request routes the same way every time.
Handoffs keep the writing model's token (no token is discarded); expected LLM
share ``p`` and handoffs per token ``2 p (1 − p)``.

Parameters: ``p`` (float in [0, 1], default 0.1; per-request override via
``routing_threshold``), ``seed`` (int, default 0).
Trace score: the uniform draw for the next token.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from ..protocol import StepResult
from .base import ParamSpec, RoutingAlgorithm, request_key, request_uniform

__all__ = ["RandomRouting"]


class RandomRouting(RoutingAlgorithm):
    """Random token-level routing between model 0 (SLM) and model 1 (LLM) (module docstring)."""

    name = "random"
    params_spec = {"p": ParamSpec(float, 0.1, 0.0, 1.0, "probability that a token goes to the LLM"),
                   "seed": ParamSpec(int, 0, 0, None, "seed of the draws")}
    threshold_param = "p"

    @staticmethod
    def draw(params: Dict[str, Any], key: str, index: int) -> tuple:
        """``(model index, uniform)`` for output token ``index`` (0 = first output token)."""
        u = request_uniform(f"random:{params['seed']}", key, index)
        return (1 if u < params["p"] else 0), u

    @staticmethod
    def first_model(params, rid: Optional[str] = None, sampling=None) -> int:
        return RandomRouting.draw(params, request_key(rid, sampling), 0)[0]

    def route(self, result: StepResult) -> int:
        """0 when this model also writes the next token, else 1 (the other model; token kept)."""
        sampling = result.state.header.sampling if result.state is not None else None
        j, u = self.draw(self.params, request_key(result.rid, sampling), result.step + 1)
        self.last_score = u
        return 0 if j == self.model_index else 1
