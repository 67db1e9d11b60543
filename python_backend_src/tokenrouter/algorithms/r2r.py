"""R2R: small-large token routing by a learned "critical token" classifier.

Rule (R2R, Fu et al. 2025, "R2R: Efficiently Navigating Divergent Reasoning
Paths with Small-Large Model Token Routing"; as served in the TokenRouter
paper): the SLM writes by default; after each SLM step a router MLP sees

    x = [h (SLM last hidden state, [H]), e (embedding of the sampled token, [H]),
         the top-100 next-token logits sorted descending ([100])]   float32 [2H + 100]

and outputs the critical probability ``p = sigmoid(MLP(x))``.  When
``p ≥ threshold`` the SLM's token is discarded and the LLM's token replaces it
(the LLM runs from the same prefix); the LLM hands back after one token.

R2R's published router is a 6-layer, 1024-wide MLP trained with BCE, its
threshold picked for 0.95 recall on held-out data.  The router file stores
that threshold; ``threshold`` overrides it (per request: ``routing_threshold``).

Parameters: ``threshold`` (float in [0, 1]; default: the file's recall-0.95
threshold), ``router`` (default ``auto``: the shipped router trained for model 0's checkpoint).
With a named router file and no ``threshold``, validation fills in the file's threshold, so the
routing summary's ``params`` show the one in force (with ``auto`` the file is chosen by model 0's
process, and ``threshold`` stays null there).
Trace score: ``p`` on SLM steps, none on LLM steps.
"""

from __future__ import annotations

from ..protocol import StepResult
from .base import ParamSpec
from .deferral import OneTokenDeferral, router_spec
from .learned import AUTO, embedding_matrix, load_router, r2r_features

__all__ = ["R2R"]


class R2R(OneTokenDeferral):
    """R2R (see module docstring)."""

    name = "r2r"
    router_kind = "r2r"
    params_spec = {"threshold": ParamSpec(float, None, 0.0, 1.0,
                                          "critical-probability threshold: defer when p >= threshold "
                                          "(default: the router file's recall-0.95 threshold)"),
                   "router": router_spec()}
    threshold_param = "threshold"

    @classmethod
    def validate_params(cls, params, num_models):
        """The base checks, then, for a named router file and no ``threshold``, the file's threshold.

        Raises:
            ValueError: as :meth:`OneTokenDeferral.validate_params`, or a named file that stores
                no threshold while none is given.
        """
        out = super().validate_params(params, num_models)
        if out["threshold"] is None and out["router"] != AUTO:
            thr = load_router(out["router"], cls.router_kind).threshold
            if thr is None:
                raise ValueError(f"router {out['router']!r} stores no threshold; set 'threshold'")
            out["threshold"] = thr
        return out

    def attach(self, engine) -> None:
        super().attach(engine)
        if self.model_index == 0:
            self._emb = embedding_matrix(engine)
            self._topk = int(self.router.arch["topk"])
            self._thr = self.params["threshold"]
            if self._thr is None:
                if self.router.threshold is None:
                    raise ValueError(f"router {self.router.path!r} stores no threshold; set 'threshold'")
                self._thr = self.router.threshold

    def score(self, result: StepResult) -> float:
        x = r2r_features(result.hidden, self._emb[int(result.token_id)], result.logits, self._topk)
        return float(self.router.prob(x)[0])

    def defer(self, score: float, result: StepResult) -> bool:
        return score >= self._thr
