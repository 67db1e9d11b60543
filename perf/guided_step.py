#!/usr/bin/env python
"""Per-step cost of guided decoding (structured output) in one engine's step, without a server.

Times, in this process on one thread (as a subserver runs its loop), the parts of a step that
guided decoding adds, with the real :class:`~tokenrouter.engine.constrained.ConstrainedDecoding`
over a real tokenizer's vocabulary (default Qwen2.5-Coder's, V = 151,936) and synthetic logits:

* ``sample``: :meth:`OutputProcessorMixin._sample` (mask, log-softmax, sampling, entropy,
  logprobs) of a step of B rows of which 0, 1 or all are guided (greedy; ``--logprobs N``: every
  row also asks for N top logprobs); ``overhead`` is its median against the same B with no
  guided row.  A guided row's matcher sits inside a JSON string (``state=string``: most tokens
  allowed) or right after the object's ``{`` (``state=key``: a handful allowed, the rest -inf).
* ``mask``: :meth:`ConstrainedDecoding.mask` alone (bitmask fill, apply, check) for those steps.
* ``sync``: a step's matcher advance of one guided row (:meth:`ConstrainedDecoding.sync` after
  one committed token) at output length L.
* ``attach``: a guided request's first visit to a model (:meth:`ConstrainedDecoding.attach`: a
  new matcher replays the L output tokens it arrived with), once per model and request.
* ``verify``: :meth:`ConstrainedDecoding.mask_positions` for a verification of k drafts.

Each figure is the median of ``--repeats`` timed calls (after ``--warmup``), in milliseconds;
the logits are refreshed outside the timed call (a step's logits are new every step).  The step
configurations of one B are timed in turn, repeat after repeat, so that a load that drifts (a
shared host) weighs on each alike.

    source deploy/env.sh
    python perf/guided_step.py                                  # Qwen2.5's vocabulary, B = 1, 8, 32
    python perf/guided_step.py --model smollm2-135m-instruct    # the demo pair's (V = 49,152)
    python perf/guided_step.py --batch-sizes 8 --logprobs 5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from types import SimpleNamespace
from typing import Callable, Dict, List, Optional

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
#: output text of a guided row: a JSON object cut inside its first string (the matcher's state there)
STRING_PREFIX = '{"name": "'
#: ... or cut right after its opening brace (only the first key's quote may follow)
KEY_PREFIX = "{"
WORDS = "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor incididunt ut labore "


def _median_ms(fn: Callable[[], None], repeats: int, warmup: int,
               before: Optional[Callable[[], None]] = None) -> float:
    """Median wall time of ``fn()`` in ms over ``repeats`` calls (``before()`` runs untimed first)."""
    for _ in range(warmup):
        if before:
            before()
        fn()
    ts = []
    for _ in range(repeats):
        if before:
            before()
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return 1000.0 * statistics.median(ts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct",
                    help="folder under $TOKENROUTER_WEIGHTS (its tokenizer and config's vocab_size), or an "
                         "absolute path (default qwen2.5-coder-0.5b-instruct)")
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--lengths", default="160,2048", help="output lengths L for sync and attach (tokens)")
    ap.add_argument("--drafts", type=int, default=4, help="k drafts of the verify figure (default 4)")
    ap.add_argument("--logprobs", type=int, default=None, help="every row also asks for N top logprobs")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1, as served)")
    ap.add_argument("--json", help="also write the rows to this file")
    a = ap.parse_args(argv)
    try:
        bs = [int(x) for x in a.batch_sizes.split(",") if x]
        lengths = [int(x) for x in a.lengths.split(",") if x]
    except ValueError:
        ap.error("--batch-sizes and --lengths take comma-separated integers")
    if not bs or min(bs) < 1 or not lengths or min(lengths) < 1 or a.repeats < 1 or a.drafts < 1:
        ap.error("--batch-sizes, --lengths, --repeats and --drafts take positive integers")

    import torch

    from tokenrouter.engine.constrained import ConstrainedDecoding
    from tokenrouter.engine.detok import load_tokenizer
    from tokenrouter.engine.grammar import GuidedSpec
    from tokenrouter.engine.output_processor import OutputProcessorMixin
    from tokenrouter.engine.sampling import BatchSampler
    from tokenrouter.triton.common import resolve_model_path

    torch.set_num_threads(a.threads)
    path = resolve_model_path(a.model)
    with open(os.path.join(path, "config.json")) as f:
        vocab = int(json.load(f)["vocab_size"])
    tok = load_tokenizer(path)
    cd = ConstrainedDecoding(path, vocab, max(bs))
    spec = GuidedSpec("json", json.dumps(SCHEMA, separators=(",", ":")))
    t0 = time.perf_counter()
    cd.compiler.compile(spec)
    print(f"# {a.model}: V = {vocab}, vocabulary + first compile {time.perf_counter() - t0:.1f} s, "
          f"torch threads {a.threads}", file=sys.stderr)

    prompt = tok.encode("Describe a person as JSON.")
    body = tok.encode(WORDS * (1 + (max(lengths) + a.warmup + a.repeats) // 8))
    head = tok.encode(STRING_PREFIX)
    brace = tok.encode(KEY_PREFIX)
    gsampling = {"temperature": 0.0, "guided": spec.wire()}
    psampling = {"temperature": 0.0}
    if a.logprobs is not None:
        gsampling["logprobs"] = psampling["logprobs"] = a.logprobs

    def request(rid: str, guided: bool, out_len: int = 24, state: str = "string"):
        out = (head + body)[:out_len] if state == "string" else list(brace)
        lr = SimpleNamespace(rid=rid, verify=[], drafts=0, seq=SimpleNamespace(tokens=list(prompt) + out),
                             header=SimpleNamespace(sampling=gsampling if guided else psampling,
                                                    num_generated=len(out), stop_token_ids=[]))
        if guided:
            err = cd.attach(lr)
            if err:
                raise SystemExit(f"the benchmark's output prefix does not match its schema: {err}")
        return lr

    class Host(OutputProcessorMixin):
        constrained = cd
        sampler = BatchSampler()

    host = Host()
    gen = torch.Generator().manual_seed(0)
    rows: List[Dict] = []

    def emit(row: Dict) -> None:
        rows.append(row)
        print("  ".join(f"{k}={v}" for k, v in row.items()))

    for b in bs:
        template = torch.randn(b, vocab, generator=gen) * 3.0
        configs = [(0, "-")] + [(g, st) for st in ("string", "key") for g in sorted({1, b})]
        cd.grammars.clear()
        batches = {(g, st): [request(f"b{b}g{g}{st}r{i}", i < g, state=st) for i in range(b)] for g, st in configs}
        outs = {g: SimpleNamespace(logits=template.clone()) for g in configs}
        times: Dict[str, Dict[int, List[float]]] = {"sample": {g: [] for g in configs},
                                                    "mask": {g: [] for g in configs}}
        # the configurations in turn, repeat after repeat: a load that drifts weighs on all alike
        for rep in range(a.warmup + a.repeats):
            for what in ("sample", "mask"):
                for g in configs:
                    batch, out = batches[g], outs[g]
                    out.logits.copy_(template)  # a step's logits are new every step
                    t0 = time.perf_counter()
                    if what == "sample":
                        host._sample(batch, out)
                    else:
                        cd.mask(batch, out.logits, {})
                    if rep >= a.warmup:
                        times[what][g].append(time.perf_counter() - t0)
        for g in configs:
            t_sample = 1000.0 * statistics.median(times["sample"][g])
            t_mask = 1000.0 * statistics.median(times["mask"][g])
            base = 1000.0 * statistics.median(times["sample"][configs[0]])
            emit({"what": "step", "B": b, "guided": g[0], "state": g[1], "sample_ms": round(t_sample, 3),
                  "overhead_ms": round(t_sample - base, 3), "mask_ms": round(t_mask, 3)})

    cd.grammars.clear()
    for n in lengths:
        lr = request("sync", True, n)
        toks = lr.seq.tokens
        more = iter((head + body)[n:])

        def step(lr=lr, toks=toks, more=more):  # a step's commit: one more output token
            toks.append(next(more))
            lr.header.num_generated += 1
            cd.sync(lr)

        t_sync = _median_ms(step, a.repeats, a.warmup)

        def fresh(n=n):
            cd.grammars.clear()
            return request("attach", False, n)

        holder = {}

        def attach(holder=holder):
            holder["lr"].header.sampling = gsampling
            cd.attach(holder["lr"])

        t_attach = _median_ms(attach, max(3, a.repeats // 5), 1, lambda: holder.update(lr=fresh()))
        emit({"what": "matcher", "L": n, "sync_ms": round(t_sync, 4), "attach_ms": round(t_attach, 3)})

    cd.grammars.clear()
    lr = request("verify", True, 24)
    drafts = (head + body)[24:24 + a.drafts]
    pos = torch.randn(a.drafts + 1, vocab, generator=gen)
    work = pos.clone()
    t_verify = _median_ms(lambda: cd.mask_positions(lr, drafts, work), a.repeats, a.warmup,
                          lambda: work.copy_(pos))
    emit({"what": "verify", "k": a.drafts, "mask_positions_ms": round(t_verify, 3)})
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": a.model, "vocab": vocab, "threads": a.threads, "logprobs": a.logprobs,
                       "repeats": a.repeats, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
