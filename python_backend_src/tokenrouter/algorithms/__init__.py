"""Routing algorithms as route/send/receive plugins, selected by name."""

from __future__ import annotations

from typing import Dict, Type

from .base import ParamSpec, RoutingAlgorithm
from .rstitch import NoRouting, RStitch

ALGORITHMS: Dict[str, Type[RoutingAlgorithm]] = {cls.name: cls for cls in (RStitch, NoRouting)}


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
