"""The long-output tasks of perf/quality.py (perf/tasks.py): GSM-Symbolic and MATH-500 from their
PyPI packages, the dev/test splits, the boxed-answer extraction, math-verify's equivalences, cut
answers counted wrong, and the runner's records and summary for a math task (one small run through
a real server on the demo pair)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

import quality  # perf/ (pytest.ini)
import tasks

GSM = tasks.get_task("gsm-symbolic")
MATH = tasks.get_task("math500")
HE = tasks.get_task("humaneval")


# --------------------------------------------------------------------------- data and splits
@pytest.mark.parametrize("task,dev,test", [(GSM, 60, 300), (MATH, 60, 251), (HE, 40, 124)])
def test_splits_are_fixed_disjoint_and_cover_the_task(task, dev, test):
    d, t, every = task.problems("dev"), task.problems("test"), task.problems("all")
    assert (len(d), len(t)) == (dev, test) and [p["task_id"] for p in d + t] == [p["task_id"] for p in every]
    assert len({p["task_id"] for p in every}) == len(every)
    with pytest.raises(ValueError, match="--split"):
        task.problems("train")


def test_gsm_symbolic_is_the_packages_generation_with_a_fixed_seed():
    """Item i is reasoning-gym's GSMSymbolicDataset[i]: template Random(seed).choices(tasks_ok)[i] drawn
    with Random(seed + i); the package's __init__ (and its unneeded dependencies) is never imported."""
    import ast
    import importlib.util
    import os
    from random import Random

    items = GSM.load()
    assert "reasoning_gym" not in sys.modules and "reasoning_gym.utils" not in sys.modules
    src = os.path.join(list(importlib.util.find_spec("reasoning_gym").submodule_search_locations)[0],
                       "arithmetic", "gsm_symbolic", "gsm_symbolic.py")
    tree = ast.parse(open(src, encoding="utf-8").read())
    tasks_ok = next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                    and getattr(n.targets[0], "id", "") == "tasks_ok")
    assert 32 not in tasks_ok and {p["template"] for p in items} <= set(tasks_ok)
    assert [p["template"] for p in items] == Random(tasks.GSM_SEED).choices(tasks_ok, k=tasks.GSM_SIZE)
    _, gens = tasks.gsm_generators()
    ex = gens[items[7]["template"]](Random(tasks.GSM_SEED + 7), 1.0)
    assert items[7]["question"] == ex["question"] + tasks.GSM_SUFFIX and items[7]["answer"] == str(ex["answer"])
    assert all(p["question"].endswith("Do not include units.") and p["answer"] for p in items)
    # the same problems on every host and run
    digest = hashlib.sha256(json.dumps([(p["question"], p["answer"]) for p in items]).encode()).hexdigest()
    assert digest == hashlib.sha256(json.dumps(
        [(p["question"], p["answer"]) for p in tasks.GSMSymbolicTask().load()]).encode()).hexdigest()


def test_math500_is_the_311_items_of_mmath():
    items = MATH.load()
    assert len(items) == 311 and items[0]["task_id"] == "math500/0"
    assert all(p["question"] and p["answer"] for p in items)
    assert len({p["source_id"] for p in items}) == 311


def test_math_prompt_is_the_chat_template_with_qwens_instruction():
    class Tok:  # the chat template's contract: messages in, text out
        chat_template = "x"
        bos_token = None

        def apply_chat_template(self, conv, add_generation_prompt, tokenize):
            return "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in conv) + "<assistant>"

    p = GSM.problems("test")[0]
    text = GSM.build_prompt(Tok(), p)
    assert text == f"<system>{tasks.MATH_INSTRUCTION}</system><user>{p['question']}</user><assistant>"
    assert "\\boxed{}" in tasks.MATH_INSTRUCTION


# --------------------------------------------------------------------------- grading
@pytest.mark.parametrize("text,boxed", [
    ("so the answer is \\boxed{42}.", "42"),
    ("first \\boxed{1}, then \\boxed{\\frac{3}{4}}", "\\frac{3}{4}"),
    ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "\\left( 3, \\frac{\\pi}{2} \\right)"),
    ("\\fbox{7}", "7"),
    ("$\\boxed 5$.", "5"),
    ("\\boxed5", "5"),
    ("no box here: 42", None),
    ("cut inside \\boxed{\\frac{1}{", None),
])
def test_last_boxed(text, boxed):
    assert tasks.last_boxed(text) == boxed


@pytest.mark.parametrize("answer,reference,same", [
    ("\\frac{1}{2}", "0.5", True),
    ("\\dfrac{14}{3}", "\\frac{14}{3}", True),
    ("2", "\\frac{4}{2}", True),
    ("1,000", "1000", True),
    ("\\$18.90", "18.90", True),
    ("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}", True),
    ("(1, 2)", "(1,2)", True),
    ("x^2+2x+1", "(x+1)^2", True),
    ("\\{1, 3\\}", "\\{3, 1\\}", True),
    ("[-2, 7]", "[-2,7]", True),
    ("3", "4", False),
    ("0.33", "\\frac{1}{3}", False),
    ("[-2, 7)", "[-2, 7]", False),
    ("x", "\\text{(C)}", False),
])
def test_math_verify_equivalences(answer, reference, same):
    assert tasks.grade_math(answer, reference) is same


def test_grade_counts_cut_and_unboxed_answers_wrong():
    p = {"task_id": "gsm-symbolic/0", "question": "q", "answer": "65"}
    assert GSM.grade(p, "15 * 5 - 10 = 65, so \\boxed{65}", "stop") == {
        "passed": True, "result": "passed", "completion": "65"}
    assert GSM.grade(p, "... \\boxed{65}", "length")["passed"] is False
    assert GSM.grade(p, "... \\boxed{65}", "length")["result"] == tasks.CUT
    assert GSM.grade(p, "the answer is 65", "stop") == {"passed": False, "result": "no boxed answer", "completion": ""}
    long = GSM.grade(p, "\\boxed{" + "(" * 50_000 + "}", "stop")
    assert long["passed"] is False and long["result"].startswith("boxed answer longer than")
    wrong = GSM.grade(p, "\\boxed{64}", "stop")
    assert wrong["passed"] is False and wrong["result"].startswith("wrong: 64")


def test_reference_answers_grade_as_right():
    """Each task's own reference answer, boxed, passes its grader (the graders can say yes)."""
    for task in (GSM, MATH):
        for p in task.problems("dev")[:25]:
            assert task.grade(p, f"so \\boxed{{{p['answer']}}}", "stop")["passed"], p


# --------------------------------------------------------------------------- runner
def test_runner_records_and_summary_of_a_math_task(tmp_path):
    """score_answers grades with the task (cut answers wrong) and point_summary reports the cut rate and
    answers/s; the cache of a math task lives in OUT/PAIR/TASK/ with the task's settings."""
    probs = {p["task_id"]: p for p in GSM.problems("dev")[:3]}
    ids = list(probs)
    answers = {
        ids[0]: {"text": f"\\boxed{{{probs[ids[0]]['answer']}}}", "finish_reason": "stop", "output_tokens": 100,
                 "llm_tokens": 10, "handoffs": 2, "e2e_s": 1.0, "ttft_s": 0.1, "input_tokens": 90},
        ids[1]: {"text": f"\\boxed{{{probs[ids[1]]['answer']}}}", "finish_reason": "length", "output_tokens": 768,
                 "llm_tokens": 0, "handoffs": 0, "e2e_s": 9.0, "ttft_s": 0.1, "input_tokens": 95},
        ids[2]: {"text": "\\boxed{-1}", "finish_reason": "stop", "output_tokens": 132,
                 "llm_tokens": 132, "handoffs": 1, "e2e_s": 2.0, "ttft_s": 0.1, "input_tokens": 80},
    }
    args = SimpleNamespace(exec_timeout=10.0, exec_memory_mb=1024, exec_workers=2, task_obj=GSM, max_tokens=768)
    recs = quality.score_answers(answers, probs, args)
    assert [recs[t]["passed"] for t in ids] == [True, False, False]
    assert recs[ids[1]]["result"] == tasks.CUT and "text" not in recs[ids[0]]
    data = {"point": "slm-only", "problems": recs,
            "runs": [{"problems": 3, "errors": [], "wall_s": 10.0, "output_tokens": 1000}]}
    row = quality.point_summary(data, ids)
    assert row["passed"] == 1 and row["cut_rate"] == pytest.approx(1 / 3)
    assert row["answers_per_s"] == pytest.approx(0.3) and row["llm_share"] == pytest.approx(142 / 1000)
    settings = quality._settings("qwen-coder", args, GSM, dtype="float32")
    assert settings == {"pair": "qwen-coder", "task": "gsm-symbolic", "prompt_format": "qwen-math-cot-v1",
                        "seed": tasks.GSM_SEED, "size": tasks.GSM_SIZE, "max_tokens": 768, "dtype": "float32"}
    pt = quality.Point("slm-only", "none", {"model": 0})
    path = quality._cache_path(str(tmp_path), "qwen-coder", pt, GSM)
    assert path == str(tmp_path / "qwen-coder" / "gsm-symbolic" / "slm-only.json")
    quality.save_cache(path, {**quality.load_cache(path, pt, settings, False), "problems": recs})
    with pytest.raises(ValueError, match="seed: cached 2026, now 7"):
        quality.load_cache(path, pt, {**settings, "seed": 7}, force=False)
    assert "| 33.3 % |" in quality.table([row])  # the cut column
    # a point's speed comes from the runs of the problems reported (not a dev split's under a test table)
    data["runs"] = [{"problems": 3, "task_ids": ids, "errors": [], "wall_s": 10.0, "output_tokens": 1000},
                    {"problems": 3, "task_ids": ["gsm-symbolic/99"], "errors": [], "wall_s": 90.0, "output_tokens": 9}]
    assert quality.point_summary(data, ids)["answers_per_s"] == pytest.approx(0.3)
    assert quality.runs_on(data, ["gsm-symbolic/99"]) == data["runs"][1:]


def test_math_task_end_to_end_on_the_demo_pair(routing_server, repo_root, tmp_path):
    """2 GSM-Symbolic dev problems through a real server (demo pair, slm-only: the shared routing
    server's token_router_slm, --url): the math prompt, a record per problem graded as the task grades
    it (a cut answer wrong), the cut rate in the summary."""
    out = tmp_path / "q"
    cmd = [sys.executable, str(repo_root / "perf" / "quality.py"), "--pair", "demo", "--task", "gsm-symbolic",
           "--split", "dev", "--problems", "2", "--baselines", "slm-only", "--random", "", "--max-tokens", "12",
           "--concurrency", "2", "--out", str(out), "--url", routing_server.grpc_url]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=repo_root)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "GSM-Symbolic pass@1" in run.stdout and "dev split" in run.stdout
    data = json.loads((out / "demo" / "gsm-symbolic" / "slm-only.json").read_text())
    assert sorted(data["problems"]) == ["gsm-symbolic/0", "gsm-symbolic/1"]
    assert data["settings"]["task"] == "gsm-symbolic" and data["settings"]["max_tokens"] == 12
    probs = {p["task_id"]: p for p in GSM.problems("dev")}
    for tid, rec in data["problems"].items():
        assert 1 <= rec["output_tokens"] <= 12 and rec["input_tokens"] > 40
        if rec["finish_reason"] == "length":
            assert rec["passed"] is False and rec["result"] == tasks.CUT
        assert rec["passed"] == GSM.grade(probs[tid], f"\\boxed{{{rec['completion']}}}",
                                          rec["finish_reason"])["passed"] or not rec["completion"]
    summary = json.loads((out / "demo" / "gsm-symbolic" / "summary.json").read_text())
    assert summary["split"] == "dev" and summary["rows"][0]["cut_rate"] >= 0.0


def test_time_breakdown_splits_each_models_loop_time_per_answer():
    """Counters of two runs (4 answers in 20 s of wall time): decode, catch-up (resume steps), prefill (the
    rest of the forward time), step overhead and idle add up to the wall time per answer for each model."""
    def counters(steps, dec, res, fwd, step):
        return {"steps": steps, "decode_steps": steps - 2, "decode_tokens": 4 * steps, "extend_tokens": 0,
                "resume_steps": 2, "forward_s": fwd, "decode_step_forward_s": dec, "resume_step_forward_s": res,
                "step_time_s": step}
    run = {"problems": 2, "errors": [], "wall_s": 10.0, "output_tokens": 100,
           "model_time": {"slm": counters(100, 4.0, 0.5, 5.0, 6.0), "llm": counters(20, 2.0, 1.0, 4.0, 4.4)}}
    b = quality.time_breakdown({"runs": [run, run]})
    assert b["llm"] == pytest.approx({"decode": 1.0, "catch_up": 0.5, "prefill": 0.5, "overhead": 0.2,
                                      "idle": 2.8, "steps": 10.0, "decode_tokens": 40.0})
    for m in ("slm", "llm"):
        assert sum(b[m][k] for k in ("decode", "catch_up", "prefill", "overhead", "idle")) == pytest.approx(5.0)
    assert quality.time_breakdown({"runs": [{**run, "model_time": None}]}) is None
    assert "| p | llm | 1.00 | 0.50 | 0.50 | 0.20 | 2.80 | 10 |" in quality.breakdown_table({"p": {"runs": [run, run]}}, ["p"])
    before = {"llm": {k: 1.0 for k in quality.COUNTERS}}
    assert quality.counter_deltas(before, {"llm": {k: 3.0 for k in quality.COUNTERS}})["llm"]["steps"] == 2.0


def test_runner_sends_a_busy_request_again_and_gives_up_after_its_retries():
    """A *busy* answer (the server's "retry later") is sent again after a doubling wait; any other
    error is returned at once; after the last resend the busy error stands."""
    waits = []

    def server(answers):
        it = iter(answers)
        return lambda: dict(next(it))

    ok = {"text": "x", "output_tokens": 1}
    busy = {"error": "busy: model llm had no KV free for the request within its queue timeout"}
    ans = quality.generate_retrying_busy(server([busy, busy, ok]), retries=3, backoff_s=1.0, sleep=waits.append)
    assert ans["text"] == "x" and ans["busy_retries"] == 2 and waits == [1.0, 2.0] and ans["wait_s"] >= 0
    waits.clear()
    ans = quality.generate_retrying_busy(server([{"error": "deadline exceeded"}, ok]), retries=3, sleep=waits.append)
    assert ans["error"] == "deadline exceeded" and ans["busy_retries"] == 0 and waits == []
    ans = quality.generate_retrying_busy(server([busy] * 3), retries=2, backoff_s=20.0, sleep=waits.append)
    assert ans["error"].startswith("busy") and ans["busy_retries"] == 2 and waits == [20.0, 30.0]  # capped at 30 s
