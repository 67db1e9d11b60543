"""Routing algorithms as route/send/receive plugins, selected by name.

``citer`` (CITER), ``r2r`` (R2R), ``rstitch`` (R-Stitch), ``colm`` (Co-LLM),
``me`` (ME, M >= 2 models) and ``none`` (baseline: one model writes all).
See docs/algorithms/ for the rules, parameters and router training.
"""

from __future__ import annotations

from typing import Dict, Type

from .base import ParamSpec, RoutingAlgorithm
from .citer import CITER
from .colm import CoLLM
from .me import ME
from .r2r import R2R
from .rstitch import NoRouting, RStitch

ALGORITHMS: Dict[str, Type[RoutingAlgorithm]] = {
    cls.name: cls for cls in (CITER, R2R, RStitch, CoLLM, ME, NoRouting)}


def get_algorithm(name: str) -> Type[RoutingAlgorithm]:
    """The algorithm class registered as ``name``.

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ValueError(f"unknown routing algorithm {name!r}; known: {sorted(ALGORITHMS)}") from None


__all__ = ["ALGORITHMS", "get_algorithm", "RoutingAlgorithm", "ParamSpec"]
