"""Client sampling parameters (vLLM-backend conventions) and batched sampling.

``sampling_parameters`` is a JSON object string, as in Triton's vllm_backend:
``{"max_tokens": 64, "temperature": 0.7, "top_p": 0.9, "top_k": 40, "seed": 1,
"stop": ["\\n\\n"], "ignore_eos": false, "routing_threshold": 0.05}``.
Unknown keys are rejected, so a typo never silently changes behaviour.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import torch

__all__ = ["SamplingParams", "parse_sampling_parameters", "validate_sampling", "BatchSampler",
           "normalized_entropy", "MAX_SEED", "SAMPLING_EPS"]


@dataclass
class SamplingParams:
    """Validated per-request sampling parameters.

    Attributes:
        max_tokens: output budget in tokens (>= 1).
        temperature: softmax temperature; 0 (or below ``SAMPLING_EPS`` = 1e-5)
            means greedy (argmax).
        top_p: nucleus mass in (0, 1].
        top_k: keep the k most likely tokens; 0 or -1 disables.
        seed: per-request RNG seed (deterministic sampling), or None.
        stop: stop strings; the output is cut before the first one.
        ignore_eos: keep generating after EOS (benchmarks).
        routing_threshold: per-request override of the routing algorithm's
            threshold parameter, or None.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: Optional[int] = None
    stop: List[str] = field(default_factory=list)
    ignore_eos: bool = False
    routing_threshold: Optional[float] = None

    def sampler_dict(self) -> Dict[str, Any]:
        """The subset the model subservers need (travels in the PeerReq)."""
        return {"temperature": self.temperature, "top_p": self.top_p,
                "top_k": self.top_k, "seed": self.seed}


_KEYS = set(SamplingParams.__dataclass_fields__)
#: torch.Generator seeds are 64-bit signed
MAX_SEED = 2**63 - 1
#: temperatures below this are greedy, as in vLLM (logits / t would overflow float32)
SAMPLING_EPS = 1e-5


def parse_sampling_parameters(text: Optional[str], default_max_tokens: int = 16) -> SamplingParams:
    """Parse and validate a ``sampling_parameters`` JSON string.

    Args:
        text: JSON object string, or None/empty for defaults.
        default_max_tokens: ``max_tokens`` when not given.

    Raises:
        ValueError: not JSON, not an object, unknown keys, or a value of the
            wrong type, not finite (NaN, ±Infinity) or out of range (the message
            names the key).
    """
    p = SamplingParams(max_tokens=default_max_tokens)
    if text is None or not text.strip():
        return p
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"sampling_parameters is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise ValueError("sampling_parameters must be a JSON object")
    unknown = set(d) - _KEYS
    if unknown:
        raise ValueError(f"unknown keys in sampling_parameters: {sorted(unknown)}; "
                         f"allowed: {sorted(_KEYS)}")

    def num(key, kind, lo=None, hi=None, lo_open=False):
        v = d[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not float(v).is_integer()):
            raise ValueError(f"sampling_parameters.{key} must be {'an integer' if kind is int else 'a number'}, got {v!r}")
        if not math.isfinite(v):
            raise ValueError(f"sampling_parameters.{key} must be a finite number, got {v!r}")
        v = kind(v)
        if lo is not None and (v <= lo if lo_open else v < lo):
            raise ValueError(f"sampling_parameters.{key} must be {'>' if lo_open else '>='} {lo}, got {v}")
        if hi is not None and v > hi:
            raise ValueError(f"sampling_parameters.{key} must be <= {hi}, got {v}")
        return v

    if "max_tokens" in d:
        p.max_tokens = num("max_tokens", int, 1)
    if "temperature" in d:
        p.temperature = num("temperature", float, 0.0)
    if "top_p" in d:
        p.top_p = num("top_p", float, 0.0, 1.0, lo_open=True)
    if "top_k" in d:
        p.top_k = num("top_k", int, -1)
    if "seed" in d and d["seed"] is not None:
        p.seed = num("seed", int, 0, MAX_SEED)
    if "routing_threshold" in d and d["routing_threshold"] is not None:
        p.routing_threshold = num("routing_threshold", float)
    if "ignore_eos" in d:
        if not isinstance(d["ignore_eos"], bool):
            raise ValueError("sampling_parameters.ignore_eos must be true or false")
        p.ignore_eos = d["ignore_eos"]
    if "stop" in d and d["stop"] is not None:
        s = d["stop"]
        if isinstance(s, str):
            s = [s]
        if not isinstance(s, list) or not all(isinstance(x, str) and x for x in s):
            raise ValueError("sampling_parameters.stop must be a non-empty string or a list of them")
        p.stop = s
    return p


def validate_sampling(sampling: Dict[str, Any]) -> None:
    """Check a PeerReq's sampler dict (temperature, top_p, top_k, seed) as a model receives it.

    Raises:
        ValueError: a value of the wrong type or out of range (the router checks
            client input earlier; this guards the models' own endpoints).
    """
    if not isinstance(sampling, dict):
        raise ValueError("sampling must be a JSON object")
    unknown = set(sampling) - {"temperature", "top_p", "top_k", "seed"}
    if unknown:
        raise ValueError(f"unknown sampling keys {sorted(unknown)}")
    parse_sampling_parameters(json.dumps({k: v for k, v in sampling.items() if v is not None}))


def normalized_entropy(logp: torch.Tensor) -> torch.Tensor:
    """Entropy of a distribution divided by log V, per row.

    Args:
        logp: float log-probabilities ``[B, V]`` (``log_softmax`` of the logits).

    Returns:
        float32 tensor ``[B]`` in [0, 1].  R-Stitch's uncertainty score
        (normalised entropy, H / log V).
    """
    return -(logp.exp() * logp).sum(-1) / math.log(logp.shape[-1])


class BatchSampler:
    """Samples one token per row from a batch of logits, per-request settings.

    Greedy rows (temperature below ``SAMPLING_EPS``) take the argmax; others apply temperature,
    top-k and top-p, then draw with the request's own ``torch.Generator``
    (seeded when the request gave a seed, so output is reproducible whatever
    the batch composition).
    """

    def __init__(self):
        self._gens: Dict[str, torch.Generator] = {}

    def generator(self, rid: str, seed: Optional[int]) -> torch.Generator:
        """The request's generator (created on first use)."""
        g = self._gens.get(rid)
        if g is None:
            g = torch.Generator()
            if seed is not None:
                g.manual_seed(int(seed))
            else:
                g.seed()
            self._gens[rid] = g
        return g

    def forget(self, rid: str) -> None:
        """Drop a finished request's generator."""
        self._gens.pop(rid, None)

    def sample(self, logits: torch.Tensor, rids: Sequence[str],
               params: Sequence[Dict[str, Any]], errors: Optional[Dict[int, str]] = None) -> torch.Tensor:
        """Sample next tokens.

        Args:
            logits: float32 ``[B, V]``.
            rids: request ids, length B.
            params: per-row dicts with temperature, top_p, top_k, seed.
            errors: if given, a row whose sampling fails is recorded here
                (row index → message) instead of failing the whole batch; its
                token is then the argmax and must not be used.

        Returns:
            int64 tensor ``[B]`` of token ids.

        Raises:
            RuntimeError: a row's sampling failed and ``errors`` is None.
        """
        out = torch.argmax(logits, dim=-1)
        for i, p in enumerate(params):
            try:
                tok = self._sample_row(logits[i], rids[i], p)
            except (RuntimeError, ValueError) as e:
                if errors is None:
                    raise
                errors[i] = f"sampling failed: {e}"
                continue
            if tok is not None:
                out[i] = tok
        return out

    def _sample_row(self, logits_row: torch.Tensor, rid: str, p: Dict[str, Any]) -> Optional[int]:
        """One row's sampled token id, or None for greedy (the argmax)."""
        t = float(p.get("temperature", 1.0))
        if t < SAMPLING_EPS:  # greedy (vLLM's convention); 1/t would overflow the softmax
            return None
        row = logits_row.float() / t
        k = int(p.get("top_k") or 0)
        if 0 < k < row.shape[-1]:
            kth = torch.topk(row, k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, -1)
        tp = float(p.get("top_p", 1.0))
        if tp < 1.0:
            sp, si = torch.sort(probs, descending=True)
            cum = torch.cumsum(sp, -1)
            drop = cum - sp > tp
            sp = sp.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, si, sp)
        return int(torch.multinomial(probs, 1, generator=self.generator(rid, p.get("seed")))[0])
