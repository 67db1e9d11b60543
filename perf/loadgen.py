"""Closed-loop load generator for ``token_router`` (gRPC streaming, tritonclient).

N client threads each send requests back to back; every request is timed on
the client: TTFT (first text chunk), ITL (gaps between chunks), end-to-end.
Decode throughput is output tokens / wall time of the whole run (tokens/s).
"""

from __future__ import annotations

import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Sequence

from tokenrouter.cli import stream_generate

__all__ = ["RequestRecord", "run_load", "summarize", "percentile", "triton_client"]


@dataclass
class RequestRecord:
    """Client-side measurements of one request (seconds, tokens)."""

    ttft_s: float
    itl_s: List[float]
    e2e_s: float
    output_tokens: int
    tokens_by_model: Dict[str, int]
    handoffs: int
    error: str = ""


def percentile(xs: Sequence[float], q: float) -> float:
    """q-th percentile (0..100) with linear interpolation; NaN for no data."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * q / 100.0
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def triton_client(url: str, model: str = "token_router") -> Callable:
    """A generate function streaming from a Triton router model over gRPC."""
    def gen(prompt: str, sampling: Dict, on_text: Callable[[str], None]) -> Dict:
        return stream_generate(url, prompt, sampling, chat=True, model=model, on_text=on_text)
    return gen


def _one(gen: Callable, prompt: str, max_tokens: int) -> RequestRecord:
    stamps: List[float] = []
    t0 = time.perf_counter()
    try:
        out = gen(prompt, {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
                  lambda s: stamps.append(time.perf_counter()))
    except Exception as e:  # noqa: BLE001
        return RequestRecord(float("nan"), [], time.perf_counter() - t0, 0, {}, 0, error=str(e))
    t1 = time.perf_counter()
    s = out.get("routing_summary", {})
    return RequestRecord(
        ttft_s=(stamps[0] - t0) if stamps else t1 - t0,
        itl_s=[b - a for a, b in zip(stamps, stamps[1:])],
        e2e_s=t1 - t0,
        output_tokens=int(out.get("num_output_tokens", 0)),
        tokens_by_model=dict(s.get("tokens_by_model", {})),
        handoffs=int(s.get("handoffs", 0)),
    )


def run_load(target, prompts: Sequence[str], concurrency: int, max_tokens: int,
             requests_per_client: int = 1, model: str = "token_router") -> Dict:
    """Run ``concurrency`` clients, ``requests_per_client`` requests each.

    Args:
        target: a Triton gRPC URL (then ``model`` is the router model to call) or a
            generate function ``gen(prompt, sampling, on_text) -> dict`` (e.g.
            ``DirectRouter.generate`` for the no-Triton baseline).

    Returns:
        dict with ``records`` (list of RequestRecord dicts) and ``wall_s``.
    """
    gen = triton_client(target, model) if isinstance(target, str) else target
    counter = iter(range(10**9))
    lock = threading.Lock()

    def client(_):
        recs = []
        for _r in range(requests_per_client):
            with lock:
                i = next(counter)
            recs.append(_one(gen, prompts[i % len(prompts)], max_tokens))
        return recs

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as ex:
        results = list(ex.map(client, range(concurrency)))
    wall = time.perf_counter() - t0
    return {"records": [asdict(r) for rs in results for r in rs], "wall_s": wall}


def summarize(run: Dict, llm: str = "llm") -> Dict[str, float]:
    """Aggregate a :func:`run_load` result.

    Returns keys: throughput_tok_s, ttft_p50_s, itl_p50_s, itl_p99_s,
    e2e_p50_s, llm_share, handoffs_per_request, requests, errors, output_tokens.
    """
    recs = [r for r in run["records"] if not r["error"]]
    toks = sum(r["output_tokens"] for r in recs)
    by_llm = sum(r["tokens_by_model"].get(llm, 0) for r in recs)
    itl = [x for r in recs for x in r["itl_s"]]
    return {
        "throughput_tok_s": toks / run["wall_s"] if run["wall_s"] > 0 else float("nan"),
        "ttft_p50_s": percentile([r["ttft_s"] for r in recs], 50),
        "itl_p50_s": percentile(itl, 50),
        "itl_p99_s": percentile(itl, 99),
        "e2e_p50_s": percentile([r["e2e_s"] for r in recs], 50),
        "llm_share": by_llm / toks if toks else float("nan"),
        "handoffs_per_request": statistics.fmean([r["handoffs"] for r in recs]) if recs else float("nan"),
        "requests": len(recs),
        "errors": len(run["records"]) - len(recs),
        "output_tokens": toks,
    }
