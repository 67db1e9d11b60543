"""Shared rule of CITER, R2R and Co-LLM: the SLM defers single tokens to the LLM.

Model 0 (the SLM / Co-LLM's *base*) writes by default.  After each of its
steps a learned router scores the step; when the score crosses the threshold
the SLM's sampled token is **discarded** (``commit_on_handoff`` is False) and
the request is handed to model 1 (the LLM / *assistant*), which regenerates
that position from the full prefix, keeps its one token and hands the request
straight back.  The three algorithms differ in the router and the direction of
the comparison (subclasses: :class:`~.citer.CITER`, :class:`~.r2r.R2R`,
:class:`~.colm.CoLLM`).
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Optional

import torch

from ..protocol import StepResult
from .base import ParamSpec, RoutingAlgorithm
from .learned import AUTO, RouterFile, find_router, load_router, shipped_routers

__all__ = ["OneTokenDeferral", "router_spec"]


def router_spec() -> ParamSpec:
    """The ``router`` parameter: a router weights file (absolute, or under ``tokenrouter/routers/``), or
    ``auto`` (default): the shipped router of the algorithm's kind trained for the served SLM
    (:func:`~.learned.find_router`)."""
    return ParamSpec(str, AUTO, doc="router weights file (absolute, or under tokenrouter/routers/); "
                     "auto: the shipped one trained for model 0's checkpoint")


class OneTokenDeferral(RoutingAlgorithm):
    """Base class: learned router on model 0, one-token visits to model 1.

    Subclasses set :attr:`router_kind`, put their threshold and
    ``router_spec()`` into :attr:`params_spec` and implement :meth:`score` and
    :meth:`defer`.
    """

    router_kind: str = ""
    min_models = 2
    max_models = 2

    def __init__(self, model_index: int, num_models: int, params: Dict[str, Any]):
        super().__init__(model_index, num_models, params)
        self.router: Optional[RouterFile] = None
        self.engine = None

    @classmethod
    def validate_params(cls, params, num_models):
        """Defaults/bounds (base class), then load the router file once to check it.

        Raises:
            ValueError: also for a missing router file or one of another kind.
        """
        out = super().validate_params(params, num_models)
        if out["router"] != AUTO:  # auto is resolved against model 0's checkpoint in attach()
            load_router(out["router"], cls.router_kind)
        return out

    def attach(self, engine) -> None:
        """Model 0: require hidden-state capture and a router that fits the model's hidden size."""
        self.engine = engine
        if self.model_index != 0:
            return
        if not getattr(engine.config, "capture_hidden", False):
            raise ValueError(f"algorithm {self.name!r} needs the last hidden state of model 0: set the "
                             f"config parameter capture_hidden to true on that model")
        self.router = self._router_for(self.params, engine.config.model_path,
                                       getattr(engine.model_config, "hidden_size", None))

    @classmethod
    def _router_for(cls, params: Dict[str, Any], model_path: str, hidden_size: Optional[int]) -> RouterFile:
        """The router file ``params["router"]`` names (``auto``: the shipped one for ``model_path``),
        checked against model 0's hidden size (None: not checked).

        Raises:
            ValueError: no such file, none shipped for the checkpoint, or another hidden size.
        """
        path = params["router"]
        if path == AUTO:
            path = find_router(cls.router_kind, model_path)
        router = load_router(path, cls.router_kind)
        trained = router.arch.get("hidden_size")
        if hidden_size is not None and trained is not None and int(trained) != int(hidden_size):
            fit = [f for f in shipped_routers(cls.router_kind)
                   if load_router(f, cls.router_kind).arch.get("hidden_size") == int(hidden_size)]
            raise ValueError(f"router {router.path!r} was trained for hidden size {trained}, model 0 "
                             f"({os.path.basename(os.path.normpath(model_path))}) has {hidden_size}; "
                             f"shipped {cls.router_kind} routers of that size: {fit or 'none'}")
        return router

    @classmethod
    def check_checkpoints(cls, params, model_paths):
        """Model 0's checkpoint against the router file: one is shipped for it (``auto``) and the
        file's hidden size is the checkpoint's (``config.json``'s ``hidden_size``), so that a
        mismatch fails the deployment instead of every request.  Nothing is checked when model 0's
        checkpoint is not known here.

        Raises:
            ValueError: as :meth:`_router_for`.
        """
        path = model_paths[0] if model_paths else None
        if path is None:
            return
        try:
            with open(os.path.join(path, "config.json")) as f:
                hidden = json.load(f).get("hidden_size")
        except (OSError, ValueError):
            hidden = None
        cls._router_for(params, path, hidden)

    # ---------------------------------------------------------------- rule
    def score(self, result: StepResult) -> float:
        """The router's probability for this SLM step (float in [0, 1])."""
        raise NotImplementedError

    def defer(self, score: float, result: StepResult) -> bool:
        """Whether ``score`` crosses the threshold (hand the position to the LLM)."""
        raise NotImplementedError

    def route(self, result: StepResult) -> int:
        """Model 0: 1 (hand over, token discarded) when the score crosses the threshold, else 0.
        Model 1: always 1 -- back to model 0 after exactly one (kept) token."""
        if self.model_index != 0:
            self.last_score = None
            return 1
        if result.hidden is None:
            raise ValueError(f"algorithm {self.name!r}: model 0 returned no hidden state")
        s = self.score(result)
        self.last_score = s
        return 1 if self.defer(s, result) else 0

    def commit_on_handoff(self, result: StepResult) -> bool:
        """The SLM's token is discarded (the LLM writes that position); the LLM's token is kept."""
        return self.model_index != 0

    @staticmethod
    def _hidden(result: StepResult) -> torch.Tensor:
        return result.hidden.float().reshape(1, -1)
