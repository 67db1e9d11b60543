"""The models' step counters (``Subserver.stats``, read with ``admin.model_stats``): a snapshot of
chosen counters of each model, and their increase between two snapshots.

    before = model_counters(url, ("steps", "forward_s"))
    ...                                                   # the load to measure
    d = counter_deltas(before, model_counters(url, ("steps", "forward_s")))
    d["llm"]["forward_s"] / d["llm"]["steps"]             # the LLM's mean forward time per step (s)
"""

from __future__ import annotations

from typing import Dict, Iterable, Mapping, Sequence

__all__ = ["MODELS", "model_counters", "counter_deltas"]

#: the pair's models, as the benchmarks' repositories name them
MODELS = ("slm", "llm")


def model_counters(url: str, keys: Iterable[str], models: Sequence[str] = MODELS) -> Dict[str, Dict[str, float]]:
    """Each model's counters ``keys`` now, ``{model: {key: value}}`` (one ``stats`` call per model).

    Units are the counters' own (``*_s``: seconds, the rest counts); a counter the model does not
    report reads 0.

    Raises:
        Whatever ``admin.model_stats`` raises (the server or a model does not answer).
    """
    from tokenrouter.tools import admin

    keys = tuple(keys)
    out = {}
    for m in models:
        stats = admin.model_stats(url, m)
        out[m] = {k: float(stats.get(k, 0)) for k in keys}
    return out


def counter_deltas(before: Mapping[str, Mapping[str, float]], after: Mapping[str, Mapping[str, float]]
                   ) -> Dict[str, Dict[str, float]]:
    """The increase of every counter between two :func:`model_counters` snapshots, same shape.

    Raises:
        KeyError: ``after`` lacks a model or a counter of ``before``.
    """
    return {m: {k: after[m][k] - before[m][k] for k in before[m]} for m in before}
