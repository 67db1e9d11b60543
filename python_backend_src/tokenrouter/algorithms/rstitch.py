"""R-Stitch: entropy-threshold stitching of an SLM and an LLM.

Rule (R-Stitch, "R-Stitch: Dynamic Trajectory Stitching for Efficient
Reasoning", 2025; as served in the TokenRouter paper): the SLM writes by
default; when the normalised entropy H/log V of its next-token distribution
exceeds τ, its uncertain token is discarded and the LLM regenerates it from the
full prefix.  The LLM keeps writing while its own normalised entropy stays
above τ and hands back once it is ≤ τ (the confident token is kept).
Paper setting: τ = 0.03.

Trace score: the normalised entropy of the step (``last_score``).
"""

from __future__ import annotations

from ..protocol import StepResult
from .base import ParamSpec, RoutingAlgorithm


class RStitch(RoutingAlgorithm):
    """Normalised-entropy threshold routing between model 0 (SLM) and model 1 (LLM)."""

    name = "rstitch"
    params_spec = {
        "tau": ParamSpec(float, 0.03, 0.0, 1.0, "normalised-entropy threshold τ"),
        # Not part of the published rule (0 = off).  Used by the size-realistic
        # benchmark pair, whose LLM has random weights and so is never confident:
        # the cap stands in for a real LLM's low-entropy tokens.
        "max_llm_run": ParamSpec(int, 0, 0, None, "hand back after this many LLM tokens in a row (0: no cap)"),
    }
    threshold_param = "tau"

    def route(self, result: StepResult) -> int:
        """SLM: hand over (1) when H/log V > τ.  LLM: hand back (1) when H/log V ≤ τ
        (or after ``max_llm_run`` consecutive LLM tokens when that cap is set)."""
        tau = self.params["tau"]
        self.last_score = float(result.norm_entropy)
        if self.model_index == 0:
            return 1 if result.norm_entropy > tau else 0
        cap = self.params.get("max_llm_run", 0)
        if cap and result.state is not None and len(result.state.seq.tokens) - result.state.loc + 1 >= cap:
            return 1
        return 1 if result.norm_entropy <= tau else 0

    def commit_on_handoff(self, result: StepResult) -> bool:
        """The SLM's uncertain token is discarded; the LLM's confident token is kept."""
        return self.model_index != 0


class NoRouting(RoutingAlgorithm):
    """Baseline: the request stays on its first model (``model`` parameter)."""

    name = "none"
    params_spec = {"model": ParamSpec(int, 0, 0, None, "index of the model that writes every token")}
    max_models = None

    @staticmethod
    def first_model(params, rid=None, sampling=None) -> int:
        return int(params.get("model", 0))

    def route(self, result: StepResult) -> int:
        return 0
