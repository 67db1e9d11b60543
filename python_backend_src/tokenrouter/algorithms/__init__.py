"""Routing algorithms as route/send/receive plugins, selected by name.

``citer`` (CITER), ``r2r`` (R2R), ``rstitch`` (R-Stitch), ``colm`` (Co-LLM),
``me`` (ME, M >= 2 models), ``random`` (each token to the LLM with probability p: the
control a router must beat), ``speculative`` (speculative decoding: the SLM drafts,
the LLM verifies), ``draft_verify`` (the SLM drafts, the LLM keeps the drafts it finds
acceptable: lossy speculation) and ``none`` (baseline: one model writes all).
See docs/algorithms/ for the rules, parameters and router training.
"""

from __future__ import annotations

import json
from typing import Any, Dict, Mapping, Tuple, Type, Union

from .base import ParamSpec, RoutingAlgorithm
from .citer import CITER
from .colm import CoLLM
from .draft_verify import DraftVerify
from .me import ME
from .r2r import R2R
from .random_routing import RandomRouting
from .rstitch import NoRouting, RStitch
from .speculative import Speculative

ALGORITHMS: Dict[str, Type[RoutingAlgorithm]] = {
    cls.name: cls for cls in (CITER, R2R, RStitch, CoLLM, ME, RandomRouting, Speculative, DraftVerify,
                              NoRouting)}


def get_algorithm(name: str) -> Type[RoutingAlgorithm]:
    """The algorithm class registered as ``name``.

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ValueError(f"unknown routing algorithm {name!r}; known: {sorted(ALGORITHMS)}") from None


def configure(name: str, params: Union[str, Mapping[str, Any], None],
              n_models: int) -> Tuple[Type[RoutingAlgorithm], Dict[str, Any]]:
    """An algorithm and its checked parameters, from a router's config or a PeerReq.

    Args:
        name: a key of :data:`ALGORITHMS`.
        params: the parameters as a mapping, or as JSON object text (a router's
            ``algorithm_params``; empty or None = no parameters).
        n_models: how many models the request or deployment routes between.

    Returns:
        ``(algorithm class, validated parameters)`` (``RoutingAlgorithm.validate_params``).

    Raises:
        ValueError: unknown name, ``params`` not a JSON object, or parameters / a model
            count the algorithm does not accept.
    """
    cls = get_algorithm(name)
    if params is None or isinstance(params, (str, bytes)):
        try:
            params = json.loads(params or "{}")
        except ValueError as e:
            raise ValueError(f"algorithm_params is not valid JSON: {e}") from None
        if not isinstance(params, dict):
            raise ValueError("algorithm_params must be a JSON object")
    return cls, cls.validate_params(params, n_models)


__all__ = ["ALGORITHMS", "get_algorithm", "configure", "RoutingAlgorithm", "ParamSpec"]
