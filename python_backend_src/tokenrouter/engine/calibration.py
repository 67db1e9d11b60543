"""Step-latency calibration: synthetic steps of one engine timed at controlled batch sizes.

The step-latency model of ``scheduler_model`` is fitted to these times
(:meth:`tokenrouter.engine.subserver.Subserver.calibrate` runs it between two steps of a
serving model's decode loop).
"""

from __future__ import annotations

import random
from typing import Dict, List, Sequence as Seq

import torch

from .sequence import Sequence

__all__ = ["calibrate"]


@torch.no_grad()
def calibrate(engine, batch_sizes: Seq[int], context: int = 256, decode_steps: int = 8,
              seed: int = 0, prefill_chunk_tokens: int = 4096) -> List[Dict[str, object]]:
    """Time synthetic steps of ``engine`` at controlled batch sizes (input of the step-latency model).

    For each b in ``batch_sizes``: b sequences of ``context`` random token ids are
    prefilled (in groups of at most ``prefill_chunk_tokens`` tokens, each group one timed
    extend step), one untimed step joins them into one running batch, ``decode_steps``
    decode steps of b rows are timed, then one *resume* step: one sequence gets 2 new
    tokens (a request back from a peer), the others 1, so the step runs as one extend
    forward of b rows and b + 1 tokens, as a step with a returning request does in
    serving. Every sequence is released afterwards, also on error.

    Args:
        engine: an idle :class:`~tokenrouter.engine.sglang_engine.SGLangEngine` (its decode loop's
            thread; also :meth:`SGLangEngine.calibrate`).
        batch_sizes: rows per step, each >= 1.
        context: prompt tokens of each synthetic sequence (>= 1).
        decode_steps: timed decode steps per batch size (>= 1).
        seed: seed of the random token ids.
        prefill_chunk_tokens: largest prefill step in tokens (bounds its memory).
    Returns:
        One dict per batch size, in the order given: ``batch_size``, ``decode_latency_s``
        (list of ``decode_steps`` step times in s), ``decode_median_s``,
        ``resume_latency_s`` (s), ``resume_extend_tokens`` (tokens), ``prefill`` (list of
        {``rows``, ``extend_tokens``, ``latency_s``}).
    Raises:
        ValueError: bad arguments, or the KV pool / request rows / context length cannot
            hold max(batch_sizes) sequences of ``context + decode_steps + 4`` tokens.
    """
    bs = [int(b) for b in batch_sizes]
    if not bs or any(b < 1 for b in bs) or int(context) < 1 or int(decode_steps) < 1:
        raise ValueError("calibrate needs batch sizes >= 1, context >= 1 and decode_steps >= 1")
    length = int(context) + int(decode_steps) + 4  # + sampled, join, resume tokens
    if length > engine.context_length:
        raise ValueError(f"calibration sequences of {length} tokens exceed the context length "
                         f"{engine.context_length}")
    b_max = max(bs)
    rows_free = engine.config.max_running_requests - engine.rows_in_use()
    if b_max > rows_free:
        raise ValueError(f"batch size {b_max} needs {b_max} request rows, {rows_free} are free "
                         f"(max_running_requests {engine.config.max_running_requests})")
    if b_max * length > engine.kv_tokens_free():
        raise ValueError(f"KV pool too small: batch size {b_max} at context {context} needs "
                         f"{b_max * length} tokens, {engine.kv_tokens_free()} are free")
    rng = random.Random(seed)
    vocab = engine.vocab_size
    out_rows: List[Dict[str, object]] = []
    for b in bs:
        seqs: List[Sequence] = []
        try:
            for j in range(b):
                seqs.append(engine.add(f"__calibrate-{b}-{j}", [rng.randrange(vocab) for _ in range(int(context))],
                                     use_prefix_cache=False))
            prefill = []
            per = max(1, int(prefill_chunk_tokens) // int(context))
            for lo in range(0, b, per):
                grp = seqs[lo:lo + per]
                out = engine.forward(grp)
                prefill.append({"rows": len(grp), "extend_tokens": out.extend_tokens,
                                "latency_s": out.latency_s})
                for s in grp:
                    s.tokens.append(rng.randrange(vocab))
            if len(prefill) > 1:  # earlier groups left the running batch: join them (untimed)
                engine.forward(seqs)
                for s in seqs:
                    s.tokens.append(rng.randrange(vocab))
            decode = []
            for _ in range(int(decode_steps)):
                out = engine.forward(seqs)
                decode.append(out.latency_s)
                for s in seqs:
                    s.tokens.append(rng.randrange(vocab))
            seqs[0].tokens.append(rng.randrange(vocab))  # back from a peer: 2 new tokens
            out = engine.forward(seqs)
            decode_sorted = sorted(decode)
            out_rows.append({"batch_size": b, "decode_latency_s": decode,
                             "decode_median_s": decode_sorted[len(decode) // 2],
                             "resume_latency_s": out.latency_s, "resume_extend_tokens": out.extend_tokens,
                             "prefill": prefill})
        finally:
            for s in seqs:
                engine.release(s, cache=False)  # synthetic tokens: nothing to keep in the prefix cache
    return out_rows
