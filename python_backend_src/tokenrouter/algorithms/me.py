"""ME: token-level ensemble of M models by fixed weights.

Rule (the TokenRouter paper's ME workload: M models, weights w_0..w_{M-1};
paper: three models, 0.5/0.3/0.2): before every output token the model that
writes it is drawn with probabilities ``w`` (normalised).  The draw for output
token t is a hash of (seed parameter, request key, t) -- the request key is the
client's sampling seed when given, else the request id -- so every model's
instance and the router agree on it and a seeded request is reproducible.
After writing token t, model i keeps the request if draw(t+1) = i, else hands
it (token kept) to the drawn model.  Shares converge to ``w``; handoffs per
token ≈ 1 − Σ w_i².

Parameters: ``weights`` (list of M non-negative numbers or a comma-separated
string; default 0.5/0.3/0.2 for M = 3, uniform otherwise), ``seed`` (int).
No threshold (``routing_threshold`` is rejected).  Trace score: the uniform
draw for the next token.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

from ..protocol import StepResult
from .base import ParamSpec, RoutingAlgorithm, request_key, request_uniform

__all__ = ["ME"]

PAPER_WEIGHTS_3 = (0.5, 0.3, 0.2)


def _parse_weights(value: Any) -> List[float]:
    if isinstance(value, str):
        value = [v for v in value.replace(" ", "").split(",") if v]
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"weights must be a list of numbers or a comma-separated string, got {value!r}")
    try:
        w = [float(v) for v in value]
    except (TypeError, ValueError):
        raise ValueError(f"weights must be numbers, got {value!r}") from None
    if any(not math.isfinite(x) or x < 0 for x in w) or sum(w) <= 0:
        raise ValueError(f"weights must be finite, >= 0 and not all 0, got {w}")
    return w


class ME(RoutingAlgorithm):
    """ME (see module docstring); M >= 2 models."""

    name = "me"
    params_spec = {"weights": ParamSpec(list, None, parse=_parse_weights,
                                        doc="per-model weights (deployment order)"),
                   "seed": ParamSpec(int, 0, 0, None, "seed of the model draws")}
    threshold_param = None
    min_models = 2
    max_models = None

    @classmethod
    def validate_params(cls, params, num_models):
        """Base checks, then: ``weights`` has one entry per model; normalised to sum 1.

        Raises:
            ValueError: wrong number of weights (or the base class's errors).
        """
        out = super().validate_params(params, num_models)
        w = out["weights"]
        if w is None:
            w = list(PAPER_WEIGHTS_3) if num_models == 3 else [1.0] * num_models
        if len(w) != num_models:
            raise ValueError(f"routing parameter 'weights' needs {num_models} entries (one per model), got {len(w)}")
        s = float(sum(w))
        out["weights"] = [x / s for x in w]
        return out

    @staticmethod
    def draw(params: Dict[str, Any], key: str, index: int) -> tuple:
        """(model index, uniform) for output token ``index``."""
        u = request_uniform(f"me:{params['seed']}", key, index)
        acc = 0.0
        w = params["weights"]
        for i, x in enumerate(w):
            acc += x
            if u < acc:
                return i, u
        return max(i for i, x in enumerate(w) if x > 0), u

    @staticmethod
    def first_model(params, rid: Optional[str] = None, sampling=None) -> int:
        return ME.draw(params, request_key(rid, sampling), 0)[0]

    def route(self, result: StepResult) -> int:
        """0 when this model also writes the next token, else the 1-based peer index of the drawn model."""
        sampling = result.state.header.sampling if result.state is not None else None
        j, u = self.draw(self.params, request_key(result.rid, sampling), result.step + 1)
        self.last_score = u
        if j == self.model_index:
            return 0
        return self.peers().index(j) + 1
