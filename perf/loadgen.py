"""Closed-loop load generator for ``token_router`` (gRPC streaming, tritonclient).

Two ways to measure, both with N client threads that time every request on the
client (TTFT, ITL, end-to-end latency):

* **steady state** (:class:`SteadyLoad` + :func:`window_summary`), as genai-perf
  and aiperf define output-token throughput under a concurrency level: each of
  N clients sends requests back to back for the whole run; a warm-up (until
  every client has finished one request that started after the measurement was
  asked for, or 2N such requests have finished, whichever comes first;
  optionally a minimum time) and the drain after the measurement are excluded
  (``stop(cancel=True)`` cancels the requests in flight instead of waiting for
  them); the measurement period is split into ``windows`` consecutive
  windows, and a window's throughput counts the output tokens *streamed inside
  it*, by their client-side arrival times, so one slow request cannot set the
  figure.  Mean and spread over the windows are reported.
* **one shot** (:func:`run_load` + :func:`summarize`): every client sends
  ``requests_per_client`` requests; throughput is all output tokens over the
  wall time of the run (the slowest request ends it).

Token counting.  A streamed chunk of ``token_router`` carries a text delta, not
a token count: the router releases the text of the tokens a model has committed
(``stream_interval`` tokens per model response, more at a handoff), and a token
whose text is not complete yet (part of a UTF-8 character, a skipped special
token) is released with a later chunk.  Each request therefore asks for the
routing trace (``return_routing_trace``: the output token ids and which model
wrote each), and the client replays the router's own detokeniser
(:class:`tokenrouter.engine.detok.IncrementalDetokenizer`) over those ids: token *i*
arrived with the first chunk whose cumulative text covers the text up to and
including token *i* (a token without text of its own: with the next chunk that
brings new text); tokens whose text never arrived in a chunk arrived with the
final response.  See :func:`token_arrival_times`.  A request cancelled at the end
of a measurement, or one still running when the load is read, has no trace: with a
tokenizer its streamed text is encoded again and those tokens replayed over its chunks
(the count of the text's canonical tokenisation, not of the model's ids, which may differ
by a token here and there; a token without text of its own is missed); without one, its
tokens are counted as ``tokens_per_chunk`` per streamed chunk with text, at the chunk's
arrival.  A chunk carries the tokens a model committed since the last one: one per decode
step, several per speculative or draft-verify round, so ``tokens_per_chunk`` undercounts
those settings.
"""

from __future__ import annotations

import math
import os
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

__all__ = ["RequestRecord", "SteadyLoad", "run_load", "summarize", "window_summary", "latency_stats",
           "spread", "percentile", "token_arrival_times", "load_tokenizer", "triton_client"]


@dataclass
class RequestRecord:
    """Client-side measurements of one request.

    Times are ``time.perf_counter()`` seconds (absolute ones: ``t_start_s``,
    ``token_t_s``; durations: ``ttft_s``, ``e2e_s``).

    Attributes:
        ttft_s: send → first text chunk (s); NaN when the request failed.
        itl_s: gaps between consecutive text chunks (s).
        e2e_s: send → final response (s).
        output_tokens: tokens the server reports for the request (``num_output_tokens``).
        tokens_by_model: tokens written by each model (routing summary).
        handoffs: model switches of the request.
        error: the server's error message, "" on success.
        t_start_s: when the request was sent.
        token_t_s: arrival time of each output token (len == output tokens on success), see
            :func:`token_arrival_times`.
        token_model: index (in ``models``) of the model that wrote each output token; empty when
            the server sent no trace.
        models: the deployment's model names (from the trace).
        cancelled: the client cancelled the request before it finished (the end of a
            measurement); ``token_t_s`` then holds the tokens streamed until then.
        in_flight: a request still running when :meth:`SteadyLoad.snapshot` was taken;
            ``token_t_s`` holds the tokens streamed until then.  Counted like a cancelled one.
    """

    ttft_s: float
    itl_s: List[float]
    e2e_s: float
    output_tokens: int
    tokens_by_model: Dict[str, int]
    handoffs: int
    error: str = ""
    t_start_s: float = float("nan")
    token_t_s: List[float] = field(default_factory=list)
    token_model: List[int] = field(default_factory=list)
    models: List[str] = field(default_factory=list)
    cancelled: bool = False
    in_flight: bool = False


def percentile(xs: Sequence[float], q: float) -> float:
    """q-th percentile (0..100) with linear interpolation; NaN for no data."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * q / 100.0
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def spread(xs: Sequence[float]) -> Dict[str, float]:
    """Mean, min, max, sample standard deviation and 95 % confidence half-width of ``xs``.

    The half-width is Student's t: ``t_{0.975, n-1} * sd / sqrt(n)`` (NaN for n < 2).

    Returns:
        dict with keys ``mean``, ``min``, ``max``, ``sd``, ``ci95``, ``n`` (NaN values for no data).
    """
    xs = [float(x) for x in xs if not math.isnan(float(x))]
    n = len(xs)
    if not n:
        return {"mean": float("nan"), "min": float("nan"), "max": float("nan"), "sd": float("nan"),
                "ci95": float("nan"), "n": 0}
    sd = statistics.stdev(xs) if n > 1 else float("nan")
    if n > 1:
        from scipy.stats import t as student_t

        ci = float(student_t.ppf(0.975, n - 1)) * sd / math.sqrt(n)
    else:
        ci = float("nan")
    return {"mean": statistics.fmean(xs), "min": min(xs), "max": max(xs), "sd": sd, "ci95": ci, "n": n}


def load_tokenizer(path: str):
    """The tokenizer of a checkpoint folder (``tokenizer.json``), as the router's detokeniser takes it.

    Raises:
        FileNotFoundError: no ``tokenizer.json`` in ``path``.
    """
    from tokenizers import Tokenizer

    f = os.path.join(path, "tokenizer.json")
    if not os.path.exists(f):
        raise FileNotFoundError(f"no tokenizer.json in {path}")
    return SimpleNamespace(_tokenizer=Tokenizer.from_file(f))


def token_arrival_times(chunks: Sequence[Tuple[float, str]], token_ids: Sequence[int], t_final: float,
                        tokenizer) -> List[float]:
    """Arrival time of each output token of one streamed request.

    Args:
        chunks: ``(client time s, text delta)`` of each streamed chunk with text, in order.
        token_ids: the request's output token ids (routing trace).
        t_final: when the final response arrived (s).
        tokenizer: as :func:`load_tokenizer` returns (``None``: no replay).

    Returns:
        one time per token (len == len(token_ids)).  With the replay (see the module
        docstring); if the replayed text differs from the streamed text (or there is no
        tokenizer), tokens are spread over the chunks in proportion to their characters.
    """
    n = len(token_ids)
    if n == 0:
        return []
    cum, total = [], 0
    for _t, s in chunks:
        total += len(s)
        cum.append(total)
    streamed = "".join(s for _t, s in chunks)
    lens: Optional[List[int]] = None
    if tokenizer is not None:
        from tokenrouter.engine.detok import IncrementalDetokenizer

        d = IncrementalDetokenizer(tokenizer)
        lens = []
        for t in token_ids:
            d.add([t])
            lens.append(len(d.text))
        if not d.text.startswith(streamed):
            lens = None
    if lens is None:  # proportional fallback
        lens = [math.ceil(total * (i + 1) / n) for i in range(n)]
    out, k, prev = [], 0, 0
    for L in lens:
        need_new = L == prev  # no text of its own: it travels with the next chunk that brings text
        while k < len(cum) and (cum[k] < L or (need_new and cum[k] <= prev)):
            k += 1
        out.append(chunks[k][0] if k < len(cum) else t_final)
        prev = L
    return out


def triton_client(url: str, model: str = "token_router", chat: bool = True) -> Callable:
    """A generate function streaming from a Triton router model over gRPC (with the routing trace).

    ``chat``: the server applies the model's chat template to the prompt (false: the prompt is
    sent as it is, e.g. prompts rendered client-side by ``perf/quality.py``).  It takes ``abort``
    (a ``threading.Event``): once set, the request is cancelled on the server and
    ``RequestAborted`` raised.
    """
    from tokenrouter.tools.cli import stream_generate

    def gen(prompt: str, sampling: Dict, on_text: Callable[[str], None],
            abort: Optional[threading.Event] = None) -> Dict:
        return stream_generate(url, prompt, sampling, chat=chat, trace=True, model=model, on_text=on_text,
                               abort=abort)
    return gen


def _takes_abort(gen: Callable) -> bool:
    """Whether a generate function accepts the ``abort`` keyword (cancellation at a measurement's end)."""
    import inspect

    try:
        return "abort" in inspect.signature(gen).parameters
    except (TypeError, ValueError):
        return False


def _partial_record(chunks: List[Tuple[float, str]], t0: float, t1: float, tokens_per_chunk: int,
                    tokenizer=None, **flag: bool) -> RequestRecord:
    """The record of a request cut short (``cancelled``) or still running (``in_flight``); sent at
    ``t0``, read at ``t1`` (perf_counter s).

    Its tokens: with ``tokenizer`` (:func:`load_tokenizer`), the streamed text encoded again and
    replayed over the chunks (:func:`token_arrival_times`); without, ``tokens_per_chunk`` tokens per
    chunk at the chunk's arrival (module docstring: "Token counting")."""
    chunks = list(chunks)
    if tokenizer is not None and chunks:
        ids = tokenizer._tokenizer.encode("".join(s for _t, s in chunks), add_special_tokens=False).ids
        times = token_arrival_times(chunks, ids, t1, tokenizer)
    else:
        times = [t for t, _s in chunks for _ in range(tokens_per_chunk)]
    return RequestRecord(chunks[0][0] - t0 if chunks else float("nan"), [], t1 - t0, len(times), {}, 0,
                         t_start_s=t0, token_t_s=times, **flag)


def _one(gen: Callable, prompt: str, max_tokens: int, tokenizer=None, abort: Optional[threading.Event] = None,
         tokens_per_chunk: int = 1, chunks: Optional[List[Tuple[float, str]]] = None) -> RequestRecord:
    chunks = [] if chunks is None else chunks  # (arrival time, text); the caller may read it meanwhile
    t0 = time.perf_counter()
    kw = {} if abort is None else {"abort": abort}
    try:
        out = gen(prompt, {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
                  lambda s: chunks.append((time.perf_counter(), s)) if s else None, **kw)
    except Exception as e:  # noqa: BLE001
        t1 = time.perf_counter()
        if abort is not None and abort.is_set():  # cancelled at the end of a measurement: keep its tokens
            return _partial_record(chunks, t0, t1, tokens_per_chunk, tokenizer, cancelled=True)
        return RequestRecord(float("nan"), [], t1 - t0, 0, {}, 0, error=str(e) or repr(e), t_start_s=t0)
    t1 = time.perf_counter()
    s = out.get("routing_summary", {})
    tr = out.get("routing_trace") or {}
    n = int(out.get("num_output_tokens", 0))
    ids = list(tr.get("token_ids", []))
    if len(ids) != n:
        ids = []
    stamps = [c[0] for c in chunks]
    times = token_arrival_times(chunks, ids, t1, tokenizer) if ids else (
        token_arrival_times(chunks, [0] * n, t1, None))
    return RequestRecord(
        ttft_s=(stamps[0] - t0) if stamps else t1 - t0,
        itl_s=[b - a for a, b in zip(stamps, stamps[1:])],
        e2e_s=t1 - t0,
        output_tokens=n,
        tokens_by_model=dict(s.get("tokens_by_model", {})),
        handoffs=int(s.get("handoffs", 0)),
        t_start_s=t0,
        token_t_s=times,
        token_model=[int(i) for i in tr.get("trace", [])] if len(tr.get("trace", [])) == n else [],
        models=list(tr.get("models", [])),
        cancelled=out.get("finish_reason") == "cancelled",
    )


def _gen_for(target, model: str) -> Callable:
    return triton_client(target, model) if isinstance(target, str) else target


def run_load(target, prompts: Sequence[str], concurrency: int, max_tokens: int,
             requests_per_client: int = 1, model: str = "token_router", tokenizer=None) -> Dict:
    """One-shot load: ``concurrency`` clients, ``requests_per_client`` requests each.

    Args:
        target: a Triton gRPC URL (then ``model`` is the router model to call) or a
            generate function ``gen(prompt, sampling, on_text) -> dict`` (e.g.
            ``DirectRouter.generate`` for the no-Triton baseline).
        tokenizer: :func:`load_tokenizer` result for per-token arrival times (optional).

    Returns:
        dict with ``records`` (list of RequestRecord dicts) and ``wall_s``.
    """
    gen = _gen_for(target, model)
    counter = iter(range(10**9))
    lock = threading.Lock()

    def client(_):
        recs = []
        for _r in range(requests_per_client):
            with lock:
                i = next(counter)
            recs.append(_one(gen, prompts[i % len(prompts)], max_tokens, tokenizer))
        return recs

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as ex:
        results = list(ex.map(client, range(concurrency)))
    wall = time.perf_counter() - t0
    return {"records": [asdict(r) for rs in results for r in rs], "wall_s": wall}


def latency_stats(recs: Sequence[Dict]) -> Dict[str, float]:
    """TTFT, ITL and end-to-end latency percentiles (p50/p90/p99, seconds) of successful requests.

    ITL is genai-perf's per-request inter-token latency: ``(e2e − TTFT) / (output tokens − 1)``
    (requests with at least 2 tokens).  Keys: ``ttft_p50_s`` … ``e2e_p99_s``.
    """
    ttft = [r["ttft_s"] for r in recs]
    e2e = [r["e2e_s"] for r in recs]
    itl = [(r["e2e_s"] - r["ttft_s"]) / (r["output_tokens"] - 1) for r in recs if r["output_tokens"] > 1]
    out = {}
    for name, xs in (("ttft", ttft), ("itl", itl), ("e2e", e2e)):
        for q in (50, 90, 99):
            out[f"{name}_p{q}_s"] = percentile(xs, q)
    return out


def summarize(run: Dict, llm: str = "llm") -> Dict[str, float]:
    """Aggregate a one-shot :func:`run_load` result.

    Returns keys: throughput_tok_s (all output tokens / wall time), requests_per_s,
    the :func:`latency_stats` keys, llm_share, handoffs_per_request, requests, errors,
    output_tokens.
    """
    recs = [r for r in run["records"] if not r["error"]]
    toks = sum(r["output_tokens"] for r in recs)
    by_llm = sum(r["tokens_by_model"].get(llm, 0) for r in recs)
    wall = run["wall_s"]
    return {
        "throughput_tok_s": toks / wall if wall > 0 else float("nan"),
        "requests_per_s": len(recs) / wall if wall > 0 else float("nan"),
        **latency_stats(recs),
        "llm_share": by_llm / toks if toks else float("nan"),
        "handoffs_per_request": statistics.fmean([r["handoffs"] for r in recs]) if recs else float("nan"),
        "requests": len(recs),
        "errors": len(run["records"]) - len(recs),
        "output_tokens": toks,
    }


def _cut(r: Dict) -> bool:
    """A record that holds only the tokens a request streamed so far (cancelled or in flight)."""
    return bool(r.get("cancelled", False) or r.get("in_flight", False))


def window_summary(records: Sequence[Dict], bounds: Sequence[float], llm: str = "llm",
                   probes: Optional[Sequence[Dict[str, Dict[str, float]]]] = None,
                   latencies: str = "started") -> Dict[str, Any]:
    """Steady-state figures of one measurement, from the records of a :class:`SteadyLoad`.

    Args:
        records: RequestRecord dicts (any time; the ones outside the period are ignored as below).
        bounds: window boundaries ``[t0, t1, …, tW]`` (perf_counter s, increasing, W >= 1).
        llm: name of the large model (LLM token share).
        probes: optional, one per boundary: ``{model: admin.model_stats(...)}``; a model's busy
            share of window w is the increase of its ``step_time_s`` counter over the window
            divided by the window's length.
        latencies: which requests the latency percentiles describe: ``"started"`` (those that
            started in ``[t0, tW)``; needs the drain) or ``"completed"`` (those that finished in
            ``[t0, tW)``, perf_analyzer's convention; right where the requests in flight at ``tW``
            were cancelled).  Requests the client cancelled (``cancelled``) and the snapshot of
            requests still running (``in_flight``) count for their streamed tokens only: never
            for latencies, completions, errors or handoffs.

    Returns:
        ``throughput_tok_s`` (mean over windows of output tokens whose arrival time lies in
        ``[t_w, t_{w+1})``, divided by the window length), ``throughput`` (:func:`spread` of the
        per-window values), ``throughput_tok_s_windows``; the same for requests/s (requests that
        completed inside a window): ``requests_per_s``, ``requests``; :func:`latency_stats` of the
        successful requests that started (or completed, see ``latencies``) in ``[t0, tW)``;
        ``llm_share`` (with ``latencies="started"``: share of the tokens streamed in ``[t0, tW)``
        that ``llm`` wrote, from the traces; otherwise, or when a trace is missing: of the output
        tokens of the latency requests, from their routing summaries.  Not of the streamed tokens
        with ``"completed"``: the requests cut at ``tW`` have no trace, and the requests in flight
        at an instant are the long ones, those that visit the LLM most); ``handoffs_per_request``
        and ``errors`` over the latency requests;
        ``requests_started``; ``output_tokens`` (streamed in the period); ``window_s``;
        ``busy_share`` ``{model: spread dict}`` when probes are given.

    Raises:
        ValueError: fewer than 2 bounds, bounds not increasing, probes of the wrong length, or
            an unknown ``latencies``.
    """
    if len(bounds) < 2 or any(b <= a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"bounds must be >= 2 increasing times, got {list(bounds)}")
    if latencies not in ("started", "completed"):
        raise ValueError(f"latencies must be 'started' or 'completed', got {latencies!r}")
    if probes is not None and len(probes) != len(bounds):
        raise ValueError(f"{len(probes)} probes for {len(bounds)} bounds")
    t0, tW = bounds[0], bounds[-1]
    W = len(bounds) - 1
    tok = [0] * W
    done = [0] * W
    llm_tok = in_tok = 0
    have_trace = True
    for r in records:
        if r["error"]:
            continue
        cancelled = _cut(r)
        for t in r["token_t_s"]:
            for w in range(W):
                if bounds[w] <= t < bounds[w + 1]:
                    tok[w] += 1
                    break
        end = r["t_start_s"] + r["e2e_s"]
        for w in range(W if not cancelled else 0):
            if bounds[w] <= end < bounds[w + 1]:
                done[w] += 1
                break
        inside = [i for i, t in enumerate(r["token_t_s"]) if t0 <= t < tW]
        if inside:
            if len(r.get("token_model", [])) != len(r["token_t_s"]) or llm not in r.get("models", []):
                have_trace = False
            else:
                k = r["models"].index(llm)
                llm_tok += sum(1 for i in inside if r["token_model"][i] == k)
                in_tok += len(inside)
    lens = [b - a for a, b in zip(bounds, bounds[1:])]
    tps = [n / L for n, L in zip(tok, lens)]
    rps = [n / L for n, L in zip(done, lens)]
    started = [r for r in records if t0 <= r["t_start_s"] < tW]
    if latencies == "completed":
        measured = [r for r in records if t0 <= r["t_start_s"] + r["e2e_s"] < tW and not _cut(r)]
    else:
        measured = [r for r in started if not _cut(r)]
    ok = [r for r in measured if not r["error"]]
    if have_trace and latencies == "started":
        llm_share = llm_tok / in_tok if in_tok else float("nan")
    else:
        toks = sum(r["output_tokens"] for r in ok)
        llm_share = sum(r["tokens_by_model"].get(llm, 0) for r in ok) / toks if toks else float("nan")
    th, rq = spread(tps), spread(rps)
    out: Dict[str, Any] = {
        "throughput_tok_s": th["mean"], "throughput": th, "throughput_tok_s_windows": tps,
        "requests_per_s": rq["mean"], "requests": rq, "requests_per_s_windows": rps,
        **latency_stats(ok),
        "llm_share": llm_share,
        "handoffs_per_request": statistics.fmean([r["handoffs"] for r in ok]) if ok else float("nan"),
        "requests_started": len(started), "errors": len(measured) - len(ok), "latencies_of": latencies,
        "output_tokens": sum(tok), "window_s": statistics.fmean(lens), "windows": W,
    }
    if probes is not None:
        out["busy_share"] = {m: spread([(probes[w + 1][m]["step_time_s"] - probes[w][m]["step_time_s"]) / lens[w]
                                        for w in range(W)]) for m in probes[0]}
    return out


class SteadyLoad:
    """N closed-loop clients sending requests back to back until :meth:`stop`.

    Args:
        target: Triton gRPC URL (``model`` is the router model) or a generate function
            ``gen(prompt, sampling, on_text) -> dict`` (it should return ``routing_trace``
            with ``token_ids``/``trace``/``models`` for exact token times).
        prompts: prompts, used round robin.
        concurrency: N (>= 1).
        max_tokens: output tokens per request (``ignore_eos``, greedy).
        tokenizer: :func:`load_tokenizer` result (token arrival replay).
        tokens_per_chunk: output tokens per streamed chunk (the models' ``stream_interval``);
            counts the tokens of a request cancelled by ``stop(cancel=True)``.

    Use: ``start()``, then one or more ``measure(...)`` (settings may change between them:
    each measurement waits for its own warm-up), then ``stop()`` (drains in-flight requests)
    or ``stop(cancel=True)`` (cancels them, where the generate function takes ``abort``).
    """

    def __init__(self, target, prompts: Sequence[str], concurrency: int, max_tokens: int,
                 model: str = "token_router", tokenizer=None, tokens_per_chunk: int = 1):
        if concurrency < 1 or max_tokens < 1 or not prompts or tokens_per_chunk < 1:
            raise ValueError("concurrency, max_tokens and tokens_per_chunk must be >= 1 and prompts non-empty")
        self._gen = _gen_for(target, model)
        self.tokens_per_chunk = tokens_per_chunk
        #: set by stop(cancel=True): the clients' requests in flight are cancelled
        self._abort: Optional[threading.Event] = threading.Event() if _takes_abort(self._gen) else None
        self.prompts, self.N, self.max_tokens, self.tokenizer = list(prompts), concurrency, max_tokens, tokenizer
        self.records: List[RequestRecord] = []
        self._cv = threading.Condition()
        self._stop = threading.Event()
        self._threads: List[threading.Thread] = []
        self._next = 0
        self._last_start_done = [float("-inf")] * concurrency  # start time of each client's last finished request
        self._done_starts: List[float] = []  # start time of every finished request, in finishing order
        self._in_flight: List[Optional[Tuple[float, List]]] = [None] * concurrency  # (sent, chunks) per client
        self.t_started = float("nan")  # perf_counter time of start()

    def start(self) -> "SteadyLoad":
        """Start the N client threads."""
        self.t_started = time.perf_counter()
        for c in range(self.N):
            th = threading.Thread(target=self._client, args=(c,), name=f"steady-client-{c}", daemon=True)
            th.start()
            self._threads.append(th)
        return self

    def _client(self, c: int) -> None:
        while not self._stop.is_set():
            chunks: List[Tuple[float, str]] = []
            with self._cv:
                i = self._next
                self._next += 1
                self._in_flight[c] = (time.perf_counter(), chunks)
            rec = _one(self._gen, self.prompts[i % len(self.prompts)], self.max_tokens, self.tokenizer,
                       abort=self._abort, tokens_per_chunk=self.tokens_per_chunk, chunks=chunks)
            with self._cv:
                self._in_flight[c] = None
                self.records.append(rec)
                self._last_start_done[c] = rec.t_start_s
                self._done_starts.append(rec.t_start_s)
                self._cv.notify_all()
            if rec.error:
                time.sleep(0.1)  # a failing server: do not spin

    def wait_warm(self, since: float, timeout_s: float = 1800.0) -> float:
        """Block until the load is warm; return the time.

        Warm: every client has finished a request sent at or after ``since``, or 2N requests sent
        at or after ``since`` have finished (N = concurrency), whichever comes first.  The second
        rule ends the warm-up of a load whose latencies are heavy-tailed (a few requests many times
        the median) once the clients have turned over, instead of after its slowest first request.

        Raises:
            TimeoutError: not warm after ``timeout_s``.
        """
        def warm() -> bool:
            if min(self._last_start_done) >= since:
                return True
            return sum(1 for t in self._done_starts if t >= since) >= 2 * self.N

        with self._cv:
            if not self._cv.wait_for(warm, timeout=timeout_s):
                raise TimeoutError(f"clients not warm after {timeout_s} s")
        return time.perf_counter()

    def measure(self, duration_s: float, windows: int = 3, probe: Optional[Callable[[], Dict]] = None,
                min_warmup_s: float = 0.0, warm_timeout_s: float = 1800.0,
                since: Optional[float] = None) -> Dict[str, Any]:
        """Warm up, then measure ``windows`` consecutive windows of ``duration_s / windows`` each.

        Args:
            duration_s: length of the measurement period (s, > 0), warm-up excluded.
            windows: number of windows (>= 1).
            probe: called at every window boundary (e.g. model counters); its results are returned.
            min_warmup_s: warm up at least this long (s, counted from ``since``), besides the rule of
                :meth:`wait_warm`.
            since: the warm-up counts requests sent at or after this time (perf_counter s; default:
                now).  Pass :attr:`t_started` for the first measurement of a
                fresh load, whose first requests were sent before ``measure`` was called.

        Returns:
            ``{"bounds": [t0 … tW], "probes": [...] or None, "warmup_s": s}``; feed it with
            :meth:`snapshot` or :meth:`stop` records to :func:`window_summary`.

        Raises:
            ValueError: bad ``duration_s`` / ``windows``.
            TimeoutError: the clients did not warm up within ``warm_timeout_s``.
        """
        if duration_s <= 0 or windows < 1:
            raise ValueError("duration_s must be > 0 and windows >= 1")
        since = time.perf_counter() if since is None else since
        self.wait_warm(since, warm_timeout_s)
        while (now := time.perf_counter()) < since + min_warmup_s:
            time.sleep(min(0.05, since + min_warmup_s - now))
        # a boundary is the time a probe returned: the models answer between steps, so their
        # counters are read at the end of the step under way when the probe was sent
        probes = [probe()] if probe else None
        t0 = time.perf_counter()
        bounds = [t0]
        for w in range(1, windows + 1):
            target = t0 + duration_s * w / windows
            while (now := time.perf_counter()) < target:
                time.sleep(min(0.05, target - now))
            if probe:
                probes.append(probe())
            bounds.append(time.perf_counter())
        return {"bounds": bounds, "probes": probes, "warmup_s": t0 - since}

    def stop(self, timeout_s: float = 1800.0, cancel: bool = False) -> List[Dict]:
        """Send no new requests and return all records as dicts.

        Args:
            timeout_s: wait at most this long for the clients (s).
            cancel: cancel the requests in flight (recorded with ``cancelled``, keeping the tokens
                they streamed) instead of waiting for them (the drain); a generate function
                without ``abort`` is drained all the same.
        """
        self._stop.set()
        if cancel and self._abort is not None:
            self._abort.set()
        end = time.monotonic() + timeout_s
        for th in self._threads:
            th.join(timeout=max(0.0, end - time.monotonic()))
        with self._cv:
            return [asdict(r) for r in self.records]

    def snapshot(self) -> List[Dict]:
        """Records so far, as dicts, while the load keeps running: the finished requests, and for
        each request in flight a record with ``in_flight`` set and the tokens it streamed so far
        (re-encoded with the tokenizer, else ``tokens_per_chunk`` per chunk with text: module
        docstring), so that a window that ended while requests were
        running counts every token streamed inside it."""
        with self._cv:
            out = [asdict(r) for r in self.records]
            running = [x for x in self._in_flight if x is not None]
        now = time.perf_counter()
        out += [asdict(_partial_record(chunks, sent, now, self.tokens_per_chunk, self.tokenizer, in_flight=True))
                for sent, chunks in running]
        return out
