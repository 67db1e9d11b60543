"""The quality benchmark (perf/quality.py): HumanEval scoring in the sandbox on real problems, the
code-block parsing, the statistics (checked against scipy's implementations), the points and the
report, and one small run through a real server on the demo pair (the shared routing server, the
command's --url; its own server start is the same router plan, checked without a server)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import quality  # perf/ (pytest.ini)

PROBLEMS = {p["task_id"]: p for p in quality.load_problems()}


def test_humaneval_data():
    assert len(PROBLEMS) == 164 and list(PROBLEMS)[0] == "HumanEval/0"
    assert [p["task_id"] for p in quality.select_problems(list(PROBLEMS.values()), "3")] == [
        "HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert [p["task_id"] for p in quality.select_problems(list(PROBLEMS.values()), "160:")] == [
        f"HumanEval/{i}" for i in range(160, 164)]
    assert len(quality.select_problems(list(PROBLEMS.values()), "all")) == 164
    for bad in ("x", "200:", "1:1"):
        with pytest.raises(ValueError):
            quality.select_problems(list(PROBLEMS.values()), bad)


@pytest.mark.parametrize("task", ["HumanEval/0", "HumanEval/2", "HumanEval/53", "HumanEval/162"])
def test_canonical_solution_passes(task):
    """HumanEval's own solutions pass (162 imports hashlib: the sandbox's guard leaves imports alone)."""
    p = PROBLEMS[task]
    assert quality.score(p, p["canonical_solution"]) == {"passed": True, "result": "passed"}


def test_wrong_solutions_fail():
    p = PROBLEMS["HumanEval/2"]  # truncate_number
    r = quality.score(p, "    return number\n")
    assert not r["passed"] and r["result"].startswith("failed: AssertionError")
    r = quality.score(p, "    return number -\n")
    assert not r["passed"] and "SyntaxError" in r["result"]
    r = quality.score(p, "    return undefined_name\n")
    assert not r["passed"] and "NameError" in r["result"]


def test_infinite_loop_is_stopped():
    r = quality.score(PROBLEMS["HumanEval/2"], "    while True:\n        pass\n", timeout_s=2)
    assert r["passed"] is False and r["result"].startswith("timed out"), r


def test_memory_hog_is_stopped():
    """The address-space limit turns a 4 GiB allocation, and a list that grows without end, into a
    MemoryError in the program (it fails; this process is untouched)."""
    p = PROBLEMS["HumanEval/2"]
    r = quality.score(p, "    x = bytearray(4 << 30)\n    return number % 1.0\n", memory_mb=512)
    assert not r["passed"] and "MemoryError" in r["result"], r
    r = quality.score(p, "    x = []\n    while True:\n        x.append(' ' * (1 << 20))\n", timeout_s=30,
                      memory_mb=512)
    assert not r["passed"] and "MemoryError" in r["result"], r


def test_an_early_exit_is_not_a_pass():
    """A program that leaves before ``check`` ran to the end fails, whatever its exit status."""
    p = PROBLEMS["HumanEval/2"]
    assert quality.score(p, "    return number % 1.0\nimport os\nos._exit(0)\n")["passed"] is False
    r = quality.score(p, "    return number % 1.0\nimport sys\nsys.exit(0)\n")
    assert r["passed"] is False and "SystemExit" in r["result"]
    # the same body without the exit passes (the exits were what failed)
    assert quality.score(p, "    return number % 1.0\n")["passed"] is True


def test_sandbox_guards(tmp_path):
    """Destructive os calls are disabled and the program runs in a temporary folder."""
    p = PROBLEMS["HumanEval/2"]
    victim = tmp_path / "keep.txt"
    victim.write_text("x")
    r = quality.score(p, f"    import os\n    os.remove({str(victim)!r})\n    return number % 1.0\n")
    assert not r["passed"] and victim.exists()
    r = quality.score(p, "    open('made_here.txt', 'w').write('x')\n    return number % 1.0\n")
    assert r["passed"] and not (Path.cwd() / "made_here.txt").exists()


def test_completion_parsing_and_program():
    assert quality.extract_completion("    return 1\n```\nMore text\n```") == "    return 1\n"
    assert quality.extract_completion("    return 1\n") == "    return 1\n"  # cut by max_tokens
    assert quality.extract_completion("```") == ""
    p = PROBLEMS["HumanEval/2"]
    prog = quality.check_program(p, "    return number % 1.0\n")
    assert prog == p["prompt"] + "    return number % 1.0\n" + "\n" + p["test"] + "\n" + "check(truncate_number)"


def test_prompt_is_the_chat_template_with_the_prefilled_answer():
    """User turn: the instruction with the problem in a python block (the model's chat template);
    assistant turn: pre-filled with the opening fence and the problem's prompt verbatim."""
    from tokenrouter.tools.openai_frontend import load_tokenizer
    from tokenrouter.triton.common import resolve_model_path

    tok = load_tokenizer(resolve_model_path("smollm2-135m-instruct"))
    p = PROBLEMS["HumanEval/2"]
    text = quality.build_prompt(tok, p)
    user = quality.INSTRUCTION.format(prompt=p["prompt"].strip())
    assert f"```python\n{p['prompt'].strip()}\n```" in user
    head = tok.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True, tokenize=False)
    assert text == head + "```python\n" + p["prompt"]
    assert text.count("<|im_start|>assistant") == 1 and text.index(user) < text.index("<|im_start|>assistant")


def test_load_generators_send_the_task_as_a_quality_run_does():
    """The prompts and stopping that bench_matrix/speculative --prompts humaneval use: every problem in
    order, rendered by build_prompt; a load's sampling keeps its max_tokens and temperature, and stops
    at the code block's end or EOS instead of ignoring EOS."""
    from tokenrouter.tools.openai_frontend import load_tokenizer
    from tokenrouter.triton.common import resolve_model_path

    tok = load_tokenizer(resolve_model_path("smollm2-135m-instruct"))
    probs = list(PROBLEMS.values())[:3]
    assert quality.humaneval_prompts(tok, probs) == [quality.build_prompt(tok, p) for p in probs]
    assert len(quality.humaneval_prompts(tok)) == 164
    seen = []

    def gen(prompt, sampling, on_text, abort=None):
        seen.append((prompt, sampling, abort))
        return {"text": "x"}

    stop = object()
    out = quality.task_sampling(gen)("p", {"max_tokens": 7, "temperature": 0, "ignore_eos": True}, None, abort=stop)
    assert out == {"text": "x"}
    assert seen == [("p", {"max_tokens": 7, "temperature": 0, "ignore_eos": False, "stop": [quality.STOP]}, stop)]


@pytest.mark.parametrize("k,n", [(0, 10), (3, 10), (10, 10), (93, 164), (1, 1)])
def test_wilson_interval(k, n):
    from scipy.stats import binomtest

    ref = binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
    lo, hi = quality.wilson_interval(k, n)
    assert lo == pytest.approx(ref.low, abs=1e-9) and hi == pytest.approx(ref.high, abs=1e-9)
    assert all(math.isnan(x) for x in quality.wilson_interval(0, 0))


def test_mcnemar_exact():
    """b, c counted on the problems both have; p = scipy's exact two-sided binomial test of b among b + c."""
    from scipy.stats import binomtest

    a = {f"t{i}": v for i, v in enumerate([1, 1, 1, 1, 1, 1, 1, 0, 0, 1, 0, 0])}
    b = {f"t{i}": v for i, v in enumerate([0, 0, 0, 0, 0, 1, 1, 1, 0, 1, 0, 0, 1])}  # t12: not in a
    r = quality.mcnemar_exact({k: bool(v) for k, v in a.items()}, {k: bool(v) for k, v in b.items()})
    assert (r["n"], r["b"], r["c"]) == (12, 5, 1)
    assert r["p_value"] == pytest.approx(binomtest(5, 6, 0.5).pvalue)
    r = quality.mcnemar_exact({"x": True, "y": False}, {"x": True, "y": False})
    assert r["b"] == r["c"] == 0 and r["p_value"] == 1.0
    # 0 against 5 discordant: 2 · 2⁻⁵
    r = quality.mcnemar_exact({str(i): False for i in range(5)}, {str(i): True for i in range(5)})
    assert r["p_value"] == pytest.approx(2 / 32)


def test_points_and_routers():
    pts = quality.parse_points(["slm-only", "llm-only"], [0.1, 0.5],
                               ["rstitch:tau=0.1,0.2", "rstitch:max_llm_run=1,2:tau=0.3"])
    by = {p.name: p for p in pts}
    assert list(by) == ["slm-only", "llm-only", "random:p=0.1", "random:p=0.5", "rstitch:tau=0.1",
                        "rstitch:tau=0.2", "rstitch:max_llm_run=1,tau=0.3", "rstitch:max_llm_run=2,tau=0.3"]
    routers = quality.plan_routers(pts)
    # a threshold sweep shares a router (the threshold goes with each request); other parameters do not
    assert by["random:p=0.1"].router == by["random:p=0.5"].router and by["random:p=0.5"].threshold == 0.5
    assert by["rstitch:tau=0.1"].router == by["rstitch:tau=0.2"].router
    assert by["rstitch:max_llm_run=1,tau=0.3"].router != by["rstitch:max_llm_run=2,tau=0.3"].router
    assert by["rstitch:max_llm_run=2,tau=0.3"].threshold is None
    assert json.loads(routers[by["rstitch:max_llm_run=2,tau=0.3"].router]["algorithm_params"]) == {
        "tau": 0.3, "max_llm_run": 2}
    assert routers[by["llm-only"].router] == {"algorithm": "none", "algorithm_params": '{"model": 1}'}
    assert len(routers) == 6 and by["rstitch:tau=0.1"].slug == "rstitch_tau=0.1"
    for bad in (["nope:x=1"], ["rstitch:tau=2"], ["rstitch"], ["rstitch:tau="]):
        with pytest.raises(ValueError):
            quality.parse_points([], [], bad)
    with pytest.raises(ValueError, match="outside"):
        quality.parse_points([], [1.5], [])


def _cache(name, passed, llm, out, handoffs, wall=10.0):
    probs = {f"HumanEval/{i}": {"passed": bool(p), "output_tokens": o, "llm_tokens": l, "handoffs": h,
                                "e2e_s": 1.0 + i, "completion": ""}
             for i, (p, l, o, h) in enumerate(zip(passed, llm, out, handoffs))}
    return {"point": name, "problems": probs,
            "runs": [{"wall_s": wall, "output_tokens": sum(out)}]}


def test_summary_and_comparisons():
    """Token-weighted LLM share, mean handoffs, throughput over the runs, the random point with the
    nearest share as the comparison, and McNemar against llm-only."""
    ids = [f"HumanEval/{i}" for i in range(4)]
    caches = [_cache("llm-only", [1, 1, 1, 0], [10, 20, 30, 40], [10, 20, 30, 40], [0, 0, 0, 0]),
              _cache("random:p=0.2", [1, 0, 0, 0], [2, 4, 6, 8], [10, 20, 30, 40], [3, 5, 7, 9]),
              _cache("random:p=0.5", [1, 1, 0, 0], [5, 10, 15, 20], [10, 20, 30, 40], [1, 1, 1, 1]),
              _cache("rstitch:tau=0.1", [1, 1, 1, 1], [1, 9, 3, 11], [10, 20, 30, 40], [2, 2, 4, 4], wall=20),
              _cache("slm-only", [0, 0, 1, 0], [0, 0, 0, 0], [10, 20, 30, 40], [0, 0, 0, 0])]
    rows = [quality.point_summary(c, ids) for c in caches]
    quality.compare(rows)
    r = rows[3]
    # slm-only 1/4, llm-only 3/4: 4/4 is (1 - 0.25) / (0.75 - 0.25) of the gap
    assert r["gap_recovered"] == pytest.approx(1.5) and rows[4]["gap_recovered"] == 0.0
    assert "vs_random" not in rows[4]  # the baselines are not compared with random routing
    assert r["llm_share"] == pytest.approx(24 / 100) and r["handoffs_per_request"] == pytest.approx(3.0)
    assert r["throughput_tok_s"] == pytest.approx(100 / 20) and r["pass_at_1"] == 1.0
    assert r["e2e_s"]["p50"] == pytest.approx(2.5)
    assert r["vs_random"]["point"] == "random:p=0.2" and (r["vs_random"]["b"], r["vs_random"]["c"]) == (3, 0)
    assert (r["vs_llm_only"]["b"], r["vs_llm_only"]["c"]) == (1, 0) and r["vs_llm_only"]["p_value"] == 1.0
    assert "vs_random" not in rows[1] and "vs_llm_only" not in rows[0] and "vs_llm_only" in rows[4]
    # a subset of the problems: only those enter
    assert quality.point_summary(caches[3], ids[:2])["llm_share"] == pytest.approx(10 / 30)
    table = quality.table(rows)
    assert table.count("\n") == len(rows) + 1
    assert "| rstitch:tau=0.1 | 4 | 100.0 % | 51.0–100.0 | 150 % | 0.240 |" in table


def test_random_routing_interpolated_to_a_share():
    """slm-only is random routing at share 0 and llm-only at share 1; between points, linear in the share."""
    rows = [{"point": "slm-only", "llm_share": 0.0, "outcomes": {"a": False, "b": False}},
            {"point": "random:p=0.5", "llm_share": 0.4, "outcomes": {"a": True, "b": False}},
            {"point": "llm-only", "llm_share": 1.0, "outcomes": {"a": True, "b": True}},
            {"point": "citer:tau=0.9", "llm_share": 0.2, "outcomes": {"a": True, "b": True}}]
    curve = quality.random_curve(rows)
    assert [c[0] for c in curve] == [0.0, 0.4, 1.0]
    assert quality.random_at_share(curve, 0.1, "a") == pytest.approx(0.25)
    assert quality.random_at_share(curve, 0.4, "a") == 1.0 and quality.random_at_share(curve, 0.4, "b") == 0.0
    assert quality.random_at_share(curve, 0.7, "b") == pytest.approx(0.5)
    assert quality.random_at_share(curve[1:2], 0.9, "a") == 1.0  # outside the range: the nearest point


def test_curve_test_against_exact_enumeration():
    """The sign-flip p-value matches the exact one over all 2^n sign vectors; the t interval matches
    scipy's; a curve equal to random routing gives mean 0 and p = 1."""
    import itertools

    import numpy as np
    from scipy.stats import t as student_t

    ids = [f"t{i}" for i in range(9)]
    slm = {"point": "slm-only", "llm_share": 0.0, "outcomes": dict.fromkeys(ids, False)}
    rnd = {"point": "random:p=0.3", "llm_share": 0.3,
           "outcomes": {t: i in (0, 5) for i, t in enumerate(ids)}}
    llm = {"point": "llm-only", "llm_share": 1.0, "outcomes": dict.fromkeys(ids, True)}
    pts = [{"point": "x:a=1", "llm_share": 0.15, "outcomes": {t: i in (0, 1, 2, 3, 6) for i, t in enumerate(ids)}},
           {"point": "x:a=2", "llm_share": 0.3, "outcomes": {t: i in (0, 1, 2, 3, 4, 7) for i, t in enumerate(ids)}}]
    curve = quality.random_curve([slm, rnd, llm])
    r = quality.curve_test(pts, curve)  # 2^9 sign vectors: enumerated
    d = np.array([np.mean([float(p["outcomes"][t]) - quality.random_at_share(curve, p["llm_share"], t)
                           for p in pts]) for t in ids])
    exact = np.mean([abs(np.dot(s, d)) >= abs(d.sum()) - 1e-12 for s in itertools.product((-1, 1), repeat=len(d))])
    assert r["n"] == 9 and r["points"] == 2 and r["mean_diff"] == pytest.approx(d.mean())
    assert r["p_value"] == pytest.approx(exact) and r["draws"] == 0 and 0 < exact < 0.1
    sampled = quality.curve_test(pts, curve, draws=400)  # fewer draws than sign vectors: sampled
    assert sampled["draws"] == 400 and 0 < sampled["mc_error"] < 0.02
    assert sampled["p_value"] == pytest.approx(exact, abs=4 * sampled["mc_error"] + 1 / 401)
    half = student_t.ppf(0.975, 8) * d.std(ddof=1) / 3
    assert r["ci95"][0] == pytest.approx(d.mean() - half) and r["ci95"][1] == pytest.approx(d.mean() + half)
    same = quality.curve_test([{**rnd, "point": "y:a=1"}], curve, draws=1000)
    assert same["mean_diff"] == 0 and same["p_value"] == 1.0
    tests = quality.curve_tests([slm, rnd, llm, *pts], draws=1000)
    assert list(tests) == ["x"] and tests["x"]["shares"] == [0.15, 0.3]
    assert tests["x"]["p_holm"] == tests["x"]["p_value"]  # one curve: nothing to adjust
    assert quality.curve_tests([slm, llm, *pts]) == {}  # no random point: no test
    assert quality.curve_tests([rnd, *pts]) == {}  # no baselines: the curve's ends unknown
    assert quality.curve_table(tests).count("\n") == 2
    one = quality.curve_test([{**pts[0], "outcomes": {"t0": True}}], curve)
    assert one["n"] == 1 and one["p_value"] is None and "| — |" in quality.curve_table({"x": {**one, "shares": [0.15]}})
    with pytest.raises(ValueError):
        quality.curve_test([], curve)


def test_holm_adjustment():
    """Holm 1979: the k-th smallest of m p-values times m − k + 1, non-decreasing, at most 1."""
    adj = quality.holm({"a": 0.01, "b": 0.04, "c": 0.03, "d": 0.5})
    assert adj == pytest.approx({"a": 0.04, "c": 0.09, "b": 0.09, "d": 0.5})
    assert quality.holm({"a": 0.6, "b": 0.7}) == pytest.approx({"a": 1.0, "b": 1.0})


def test_cache_with_other_settings_is_refused(tmp_path):
    pt = quality.Point("slm-only", "none", {"model": 0})
    path = str(tmp_path / "slm-only.json")
    settings = {"pair": "demo", "prompt_format": quality.PROMPT_FORMAT, "max_tokens": 512,
                "exec_timeout_s": 10.0, "exec_memory_mb": 1024}
    data = quality.load_cache(path, pt, settings, force=False)
    data["problems"]["HumanEval/0"] = {"passed": True}
    quality.save_cache(path, data)
    assert quality.load_cache(path, pt, settings, force=False)["problems"] == data["problems"]
    with pytest.raises(ValueError, match="max_tokens: cached 512, now 64"):
        quality.load_cache(path, pt, {**settings, "max_tokens": 64}, force=False)
    assert quality.load_cache(path, pt, {**settings, "max_tokens": 64}, force=True)["problems"] == {}


def test_the_served_dtype_is_a_cache_setting(tmp_path):
    """Greedy answers change with the models' dtype: the cache records it, a point measured in
    another dtype is refused, and --dtype names it (auto: the pair's setting, resolved as the
    engine resolves it on this CPU)."""
    from tokenrouter.engine.device import resolve_dtype

    assert quality.pair_dtype("demo") == "float32"  # the demo pair's repository says float32
    assert quality.pair_dtype("qwen-coder") == resolve_dtype("auto", "cpu")  # the pair says auto
    assert quality.pair_dtype("qwen-coder", "bfloat16") == "bfloat16"
    with pytest.raises(ValueError, match="--dtype must be one of"):
        quality.pair_dtype("demo", "int4")
    args = type("A", (), {"max_tokens": 768})()
    bf16 = quality._settings("qwen-coder", args, quality.get_task("gsm-symbolic"), dtype="bfloat16")
    assert bf16["dtype"] == "bfloat16"
    pt = quality.Point("llm-only", "none", {"model": 1})
    path = str(tmp_path / "llm-only.json")
    quality.save_cache(path, quality.load_cache(path, pt, bf16, force=False))
    with pytest.raises(ValueError, match="dtype: cached 'bfloat16', now 'float32'.*--dtype to read"):
        quality.load_cache(path, pt, {**bf16, "dtype": "float32"}, force=False)
    with tempfile.TemporaryDirectory() as work:
        repo = quality._variant("demo", work, {}, "bfloat16")
        assert quality.served_dtype(repo, "llm") == quality.served_dtype(repo, "slm") == "bfloat16"


def test_planned_routers_are_the_routers_url_finds(repo_root, tmp_path):
    """The router models the command writes for its own server (plan_routers, make_variant) serve
    their points by the rule --url finds a running server's routers with (router_serves), and no
    other point's."""
    from tokenrouter.tools.repository import read_config

    pts = quality.parse_points(["slm-only", "llm-only"], [0.1, 0.5], ["rstitch:tau=0.1", "rstitch:max_llm_run=2:tau=0.3"])
    routers = quality.plan_routers(pts)
    repo = quality._variant("demo", str(tmp_path), routers)
    models = quality._router_models(repo)
    assert models == "slm,llm"
    for name in routers:
        params = {k: v.string_value for k, v in read_config(f"{repo}/{name}/config.pbtxt").parameters.items()}
        assert {p.name for p in pts if quality.router_serves(params, p, models)} == \
            {p.name for p in pts if p.router == name}, name
        assert not any(quality.router_serves(params, p, "llm,slm") for p in pts)
    token_router = {k: v.string_value for k, v in read_config(f"{repo}/token_router/config.pbtxt").parameters.items()}
    assert not any(quality.router_serves(token_router, p, models) for p in pts)  # rstitch at its own tau


def test_quality_end_to_end_on_the_demo_pair(routing_server, repo_root, tmp_path):
    """2 problems through a real server (demo pair: the shared routing server, --url; its routers
    token_router_slm and token_router_random_default serve the points) at 2 points, slm-only and
    random p = 0.5: a record per problem and point, its completion rescored to the same verdict, the
    routing as the seeded draws decide (random: LLM token t iff U(seed = problem number, t) < p), then
    the cache serves a second command without a server (table and plot)."""
    from tokenrouter.algorithms.base import request_uniform

    out = tmp_path / "q"
    cmd = [sys.executable, str(repo_root / "perf" / "quality.py"), "--pair", "demo", "--problems", "2",
           "--baselines", "slm-only", "--random", "0.5", "--max-tokens", "24", "--concurrency", "2",
           "--out", str(out), "--url", routing_server.grpc_url]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=repo_root)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert f"2 points to run (4 requests), on the tritonserver at {routing_server.grpc_url}" in run.stdout
    for name in ("slm-only", "random_p=0.5"):
        data = json.loads((out / "demo" / f"{name}.json").read_text())
        assert sorted(data["problems"]) == ["HumanEval/0", "HumanEval/1"] and data["runs"][0]["errors"] == []
        for tid, rec in data["problems"].items():
            assert 1 <= rec["output_tokens"] <= 24 and rec["finish_reason"] in ("stop", "length")
            assert rec["passed"] == quality.score(PROBLEMS[tid], rec["completion"])["passed"]
            assert "```" not in rec["completion"] and rec["input_tokens"] > 100
            if name == "slm-only":
                assert rec["llm_tokens"] == 0 and rec["handoffs"] == 0
            else:
                seed = int(tid.split("/")[1])
                draws = [request_uniform("random:0", f"seed:{seed}", t) < 0.5 for t in range(rec["output_tokens"])]
                assert rec["llm_tokens"] == sum(draws)
                assert rec["handoffs"] == sum(a != b for a, b in zip(draws, draws[1:]))
    before = (out / "demo" / "slm-only.json").read_text()
    again = subprocess.run(cmd + ["--plot", str(tmp_path / "q.png")], capture_output=True, text=True,
                           timeout=300, cwd=repo_root)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "points to run" not in again.stdout and "| random:p=0.5 | 2 |" in again.stdout
    assert (out / "demo" / "slm-only.json").read_text() == before
    assert (tmp_path / "q.png").stat().st_size > 0
    summary = json.loads((out / "demo" / "summary.json").read_text())
    assert {r["point"] for r in summary["rows"]} == {"slm-only", "random:p=0.5"}


def test_unscored_answers_are_scored_later(tmp_path):
    """Answers saved as they arrived by a command stopped before its tests become records (with their
    measurements) in the next one."""
    from types import SimpleNamespace

    p = PROBLEMS["HumanEval/2"]
    path = str(tmp_path / "pt.json")
    data = {"point": "slm-only", "problems": {}, "runs": [], "unscored": {
        "HumanEval/2": {"text": p["canonical_solution"] + "```\n", "output_tokens": 9, "llm_tokens": 0,
                        "handoffs": 0, "e2e_s": 1.5, "ttft_s": 0.1, "finish_reason": "stop", "input_tokens": 200}}}
    args = SimpleNamespace(exec_timeout=10.0, exec_memory_mb=1024, exec_workers=1)
    quality._finish_point(data, path, PROBLEMS, args)
    saved = json.loads(Path(path).read_text())
    assert saved["unscored"] == {} and saved["problems"]["HumanEval/2"]["passed"] is True
    rec = saved["problems"]["HumanEval/2"]
    assert rec["completion"] == p["canonical_solution"] and rec["output_tokens"] == 9 and "text" not in rec
