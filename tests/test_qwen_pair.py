"""The real pair (deploy/serve's default): Qwen2.5-Coder-0.5B-Instruct -> Qwen2.5-Coder-1.5B-Instruct.

Its checkpoints are prepared by tests/run (``deploy/prepare_weights.py --pair qwen-coder``). Checked:
the two tokenizers are one, a pair whose tokenizers differ is refused with the difference named,
one routed request through a real server has both models writing, and its top logprobs are each
token's writer's (two different models here, so the other model's would not do).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tokenrouter.triton.common import weights_dir

SLM, LLM, SMOL = "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct", "smollm2-135m-instruct"


def _prepared(name: str) -> str:
    path = os.path.join(weights_dir(), name)
    if not os.path.isfile(os.path.join(path, ".tokenrouter-complete")):
        pytest.fail(f"{path} is not prepared: run the tests with tests/run", pytrace=False)
    return path


@pytest.mark.slow
def test_the_pair_shares_one_tokenizer_and_another_model_is_named_as_different():
    from tokenrouter.engine.tokenizer_check import tokenizer_difference

    assert tokenizer_difference(_prepared(SLM), _prepared(LLM)) is None
    diff = tokenizer_difference(_prepared(SLM), _prepared(SMOL))
    assert diff is not None and "vocabulary sizes differ" in diff and SMOL in diff, diff


@pytest.mark.slow
def test_a_run_repository_whose_models_have_other_tokenizers_is_refused(repo_root, tmp_path):
    """What deploy/serve runs for a pair: the repository tool checks tokenizers after writing."""
    _prepared(SLM), _prepared(SMOL)
    r = subprocess.run([sys.executable, "-m", "tokenrouter.tools.repository", "--src",
                        str(repo_root / "model_repository"), "--out", str(tmp_path / "v"), "--pair", "qwen-coder",
                        "--set", f"llm.model_path={SMOL}"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "router token_router cannot route to model llm" in r.stderr, r.stderr
    assert "vocabulary sizes differ" in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.fixture(scope="module")
def qwen_server(repo_root, tmp_path_factory):
    """The qwen-coder pair with random routing at p = 0.5 (both models write) and an LLM-only router."""
    from tritonserver import TritonServer

    from tokenrouter.tools.repository import make_variant

    _prepared(SLM), _prepared(LLM)
    work = tmp_path_factory.mktemp("qwen")
    repo = make_variant(str(repo_root / "model_repository"), str(work / "repo"), "qwen-coder",
                        model_params={"token_router": {"algorithm": "random",
                                                       "algorithm_params": '{"p": 0.5, "seed": 1}'}},
                        routers={"token_router_llm_only": {"algorithm": "none", "algorithm_params": '{"model": 1}'}})
    server = TritonServer(repo, ready_timeout=float(os.environ.get("TOKENROUTER_TEST_READY_TIMEOUT", "600")),
                          log_path=work / "tritonserver.log")
    server.start()
    try:
        yield server
    finally:
        server.stop()


PROMPT = "Write a Python function that returns the sum of the squares of a list of integers."


@pytest.mark.server
def test_a_routed_request_has_both_real_models_writing(qwen_server):
    from tr_client import generate

    out = generate(qwen_server, PROMPT, {"max_tokens": 24, "temperature": 0}, chat=True)
    assert out["_status"] == 200, out
    summary = out["routing_summary"]
    by_model = summary["tokens_by_model"]
    assert by_model["slm"] > 0 and by_model["llm"] > 0, summary
    assert by_model["slm"] + by_model["llm"] == out["num_output_tokens"] == 24, summary
    assert summary["handoffs"] >= 2, summary
    assert out["text_output"].strip(), out


@pytest.mark.server
def test_the_llm_of_the_pair_answers_alone_and_its_text_is_code(qwen_server):
    from tr_client import generate

    out = generate(qwen_server, PROMPT, {"max_tokens": 48, "temperature": 0}, chat=True,
                   model="token_router_llm_only")
    assert out["_status"] == 200, out
    assert out["routing_summary"]["tokens_by_model"] == {"slm": 0, "llm": 48}, out["routing_summary"]
    assert "def " in out["text_output"], out["text_output"]


@pytest.mark.server
def test_top_logprobs_of_a_routed_answer_are_each_writer_s(qwen_server):
    """logprobs N = 5 on a routed greedy answer of two different models: each token's logprob and top
    5 are those of the model that wrote it (its own run on the same prefix, sent straight to that
    model), and not those of the other model."""
    from tokenrouter.engine.detok import load_tokenizer
    from tokenrouter.routing.router_core import encode_prompt
    from tr_client import assert_from_writers, generate, own_runs, token_logprobs, top_n

    out = generate(qwen_server, PROMPT, {"max_tokens": 12, "temperature": 0, "seed": 7, "logprobs": 5}, chat=True)
    assert out["_status"] == 200, out
    plain = generate(qwen_server, PROMPT, {"max_tokens": 12, "temperature": 0, "seed": 7}, chat=True)
    assert plain["routing_trace"]["token_ids"] == out["routing_trace"]["token_ids"]
    trace = out["routing_trace"]["trace"]
    assert 0 in trace and 1 in trace, out["routing_summary"]
    prompt_ids = encode_prompt(load_tokenizer(_prepared(SLM)), PROMPT, True)
    # bfloat16 where the CPU computes it: one model's logits for one prefix differ by a step or two of
    # bfloat16 (1/16 at magnitudes 8-16) between a decode step and a prefill; seen: up to 0.13
    tol = 0.25
    assert_from_writers(qwen_server, prompt_ids, out, 5, tol)
    # the other model's own runs on the same prefixes are further off (seen: 0.27-4.2, median 1.3)
    ids = out["routing_trace"]["token_ids"]
    other = own_runs(qwen_server, prompt_ids, ids, [("slm", "llm")[1 - w] for w in trace], 5)
    gaps = [max(abs(a - b) for (_, a), (_, b) in zip(top_n(e, 5), o["top"]))
            for e, o in zip(token_logprobs(out["logprobs"]), other)]
    assert sum(g > 2 * tol for g in gaps) > len(gaps) // 2, gaps
