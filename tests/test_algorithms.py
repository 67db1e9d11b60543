"""The five routing algorithms through the real Triton server, one server for all.

The server serves a repository written by deploy/algorithm_repository.py: slm
(capture_hidden), llm, mid and one router model per algorithm, plus router
models with invalid configurations (loaded with --exit-on-error=false; their
load errors are read from the repository index).  Every rule is checked on
the ``routing_trace`` the router returns: per-output-token ``scores`` and the
``handoffs`` list (each with the score of its step) -- see
tokenrouter.triton.router_model.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import statistics
import time
from pathlib import Path

import pytest
import requests

from tr_client import generate, generate_many
from tr_server import generate_error_status

from tritonserver import TritonServer

REPO_ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("algorithm_repository", REPO_ROOT / "deploy" / "algorithm_repository.py")
algorithm_repository = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(algorithm_repository)

PROMPTS = [
    "Explain why the sky is blue in two sentences.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Three tips for staying healthy are",
]
N = 24  # output tokens per request in the rule tests

BAD_ROUTERS = {
    # name: (models, algorithm, params, expected text in the load error)
    "token_router_bad_algo": ("slm,llm", "nope", {}, "unknown routing algorithm 'nope'"),
    "token_router_bad_tau": ("slm,llm", "citer", {"tau": 2}, "'tau'=2.0 outside [0.0, 1.0]"),
    "token_router_bad_file": ("slm,llm", "r2r", {"router": "missing.pt"}, "router file 'missing.pt' not found"),
    "token_router_bad_weights": ("slm,llm", "me", {"weights": [0.5, 0.3, 0.2]}, "'weights' needs 2 entries"),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if not os.environ.get("TRITON_BACKEND_DIR"):
        pytest.fail("TRITON_BACKEND_DIR not set: run the tests with tests/run", pytrace=False)
    tmp = tmp_path_factory.mktemp("algorithms")
    routers = {k: v for k, v in algorithm_repository.DEFAULT_ROUTERS.items() if k != "token_router_none"}
    # CITER on a pair whose model 0 does not capture hidden states -> per-request error
    routers["token_router_citer_nohidden"] = ("llm,slm", "citer", {})
    routers["token_router_colm_compose"] = ("slm,llm", "colm", {"compose": True})
    routers["token_router_random"] = ("slm,llm", "random", {"p": 0.3, "seed": 5})
    for name, (models, algo, params, _) in BAD_ROUTERS.items():
        routers[name] = (models, algo, params)
    repo = algorithm_repository.write(str(tmp / "repo"), routers=routers, kv_pool_tokens=4096,
                                      event_log=str(tmp / "events-{model}.jsonl"))
    srv = TritonServer(repo, log_path=tmp / "tritonserver.log",
                       extra_args=["--exit-on-error=false", "--strict-readiness=false"],
                       ready_timeout=float(os.environ.get("TOKENROUTER_TEST_READY_TIMEOUT", "600")))
    srv.start()
    srv.events_dir = tmp
    try:
        yield srv
    finally:
        srv.stop()


def gen(server, model: str, prompt: str, sampling: dict, timeout: float = 120) -> dict:
    """Non-streaming /generate on router ``model`` with the routing trace; parsed JSON plus ``_status``."""
    return generate(server, prompt, sampling, model=model, timeout=timeout)


def gen_many(server, model: str, reqs, timeout: float = 120) -> list:
    """:func:`gen` of each ``(prompt, sampling)`` of ``reqs`` at once (the models batch them); outputs in order."""
    return generate_many(server, reqs, model=model, timeout=timeout)


def greedy(n=N, **kw) -> dict:
    return {"max_tokens": n, "temperature": 0, "ignore_eos": True, **kw}


def check_trace_consistency(out: dict) -> dict:
    """Structural checks shared by all algorithms; returns the trace."""
    assert out["_status"] == 200, out
    tr, summ = out["routing_trace"], out["routing_summary"]
    n = len(tr["token_ids"])
    assert len(tr["trace"]) == n == len(tr["scores"]) == out["num_output_tokens"]
    assert summ["handoffs"] == len(tr["handoffs"])
    for i, m in enumerate(tr["models"]):
        assert summ["tokens_by_model"][m] == tr["trace"].count(i)
    # the handoffs form one chain of holders, and the holder at each position wrote its token
    holder = None
    for h in tr["handoffs"]:
        assert holder is None or h["from"] == holder, h
        if h["committed"]:  # the handing-off model wrote the token just before pos
            assert h["pos"] > 0 and tr["trace"][h["pos"] - 1] == h["from"], h
        holder = h["to"]
    for p, m in enumerate(tr["trace"]):
        before = [h for h in tr["handoffs"] if h["pos"] <= p]
        if before:
            assert before[-1]["to"] == m, (p, m, before[-1])
    return tr


def check_one_token_deferral(out: dict, crosses) -> tuple:
    """CITER / R2R / Co-LLM rule on one trace.

    * every SLM token was kept because its score did not cross the threshold;
    * every SLM -> LLM handoff happened at a step whose score crossed it, and
      that step's token was discarded;
    * every LLM visit writes exactly one (kept) token and hands back.

    Returns (number of SLM tokens, number of handoffs to the LLM).
    """
    tr = check_trace_consistency(out)
    trace, scores, hs = tr["trace"], tr["scores"], tr["handoffs"]
    if crosses is None:  # randomised rule (compose mode): no threshold to check
        crosses_ = lambda s: True  # noqa: E731
        stays = lambda s: True  # noqa: E731
    else:
        crosses_, stays = crosses, (lambda s: not crosses(s))
    for p, (m, s) in enumerate(zip(trace, scores)):
        if m == 0:
            assert s is not None and 0.0 <= s <= 1.0 and stays(s), (p, s)
        else:
            assert s is None, (p, s)
    to_llm = [h for h in hs if h["from"] == 0]
    back = [h for h in hs if h["from"] == 1]
    for h in to_llm:
        assert h["to"] == 1 and not h["committed"] and 0.0 <= h["score"] <= 1.0 and crosses_(h["score"]), h
    for h in back:
        assert h["to"] == 0 and h["committed"] and h["score"] is None, h
    # exactly one LLM token per visit: LLM tokens sit exactly at the handoff positions
    llm_pos = [p for p, m in enumerate(trace) if m == 1]
    assert llm_pos == [h["pos"] for h in to_llm]
    assert [p + 1 for p in llm_pos if p + 1 < len(trace)] == [h["pos"] for h in back]
    return trace.count(0), len(to_llm)


def _two_pass(server, model: str, threshold_never, crosses_fn):
    """Pass 1 with a threshold that never defers (collect the SLM scores), pass 2 at their median.

    The demo pair runs the same weights in both roles, so greedy output must be
    identical in both passes whatever is routed.
    """
    first, scores = {}, []
    for p in PROMPTS:  # one at a time: the passes' token ids are compared exactly
        out = gen(server, model, p, greedy(routing_threshold=threshold_never))
        slm, handoffs = check_one_token_deferral(out, lambda s: crosses_fn(s, threshold_never))
        assert handoffs == 0 and slm == N
        first[p] = out["routing_trace"]["token_ids"]
        scores += out["routing_trace"]["scores"]
    thr = statistics.median(scores)
    total_slm = total_handoffs = 0
    for p in PROMPTS:
        out = gen(server, model, p, greedy(routing_threshold=thr))
        slm, handoffs = check_one_token_deferral(out, lambda s: crosses_fn(s, thr))
        assert out["routing_trace"]["token_ids"] == first[p]
        total_slm += slm
        total_handoffs += handoffs
    # the median threshold must give both outcomes (else the rule check was vacuous)
    assert total_slm > 0 and total_handoffs > 0, (thr, total_slm, total_handoffs)
    return thr


def test_citer_rule(server):
    """CITER: defer (token discarded) exactly when the confidence c < τ; LLM back after one token."""
    _two_pass(server, "token_router_citer", 0.0, lambda s, t: s < t)


def test_r2r_rule(server):
    """R2R: defer exactly when the critical probability p ≥ threshold; LLM back after one token."""
    _two_pass(server, "token_router_r2r", 1.0, lambda s, t: s >= t)


def test_colm_rule(server):
    """Co-LLM: defer exactly when the deferral probability p > η; assistant back after one token."""
    _two_pass(server, "token_router_colm", 1.0, lambda s, t: s > t)


def test_colm_compose_mode(server):
    """Co-LLM compose mode: each base step defers with probability p (the mixture
    (1−p)·base + p·assistant realised by sampling its component); the number of
    deferrals over all base steps is within 4 standard deviations of Σp, and the
    assistant still writes exactly one token per visit.  Seeded: reproducible."""
    deferred, expected, var = 0, 0.0, 0.0
    for p in PROMPTS:  # one at a time: batched with others, a request's scores move in the 7th digit
        out = gen(server, "token_router_colm_compose", p, greedy(seed=11))
        check_one_token_deferral(out, None)
        tr = out["routing_trace"]
        ps = [s for m, s in zip(tr["trace"], tr["scores"]) if m == 0]
        ps += [h["score"] for h in tr["handoffs"] if h["from"] == 0]
        deferred += sum(1 for h in tr["handoffs"] if h["from"] == 0)
        expected += sum(ps)
        var += sum(x * (1 - x) for x in ps)
        again = gen(server, "token_router_colm_compose", p, greedy(seed=11))
        assert again["routing_trace"]["handoffs"] == tr["handoffs"]
    assert abs(deferred - expected) <= 4 * math.sqrt(var) + 1, (deferred, expected, var)


def test_rstitch_rule(server):
    """R-Stitch as a plugin: SLM hands over iff H/log V > τ (token discarded); the LLM keeps writing
    while its entropy is > τ and hands back (token kept) at the first step with entropy ≤ τ."""
    total = {"slm": 0, "llm": 0}
    for out in gen_many(server, "token_router", [(p, greedy()) for p in PROMPTS]):
        tau = out["routing_summary"]["params"]["tau"]
        tr = check_trace_consistency(out)
        trace, scores, hs = tr["trace"], tr["scores"], tr["handoffs"]
        back = {h["pos"] for h in hs if h["from"] == 1}
        for pos, (m, s) in enumerate(zip(trace, scores)):
            assert s is not None and 0.0 <= s <= 1.0
            if m == 0:
                assert s <= tau, (pos, s)
            elif pos + 1 < len(trace) or pos + 1 in back:
                assert (s <= tau) == (pos + 1 in back), (pos, s)
        for h in hs:
            if h["from"] == 0:
                assert not h["committed"] and h["score"] > tau, h
            else:
                assert h["committed"] and h["score"] <= tau, h
        for k, v in out["routing_summary"]["tokens_by_model"].items():
            total[k] += v
    assert total["slm"] > 0 and total["llm"] > 0, total


def test_me_rule_and_shares(server):
    """ME over three models: the model of every next token is the one the recorded uniform draw
    selects under the weights; token shares match the weights within 4 binomial standard deviations."""
    n = 240
    # with the same seed, a shorter request routes the same way (the draws depend on seed and position only)
    out, again = gen_many(server, "token_router_me", [(PROMPTS[2], greedy(n, seed=7)),
                                                       (PROMPTS[2], greedy(32, seed=7))])
    tr = check_trace_consistency(out)
    weights = out["routing_summary"]["params"]["weights"]
    assert tr["models"] == ["slm", "llm", "mid"] and len(weights) == 3
    assert math.isclose(sum(weights), 1.0)
    cum = [sum(weights[: i + 1]) for i in range(3)]

    def drawn(u):
        return next(i for i, c in enumerate(cum) if u < c)

    trace, scores = tr["trace"], tr["scores"]
    for p in range(len(trace) - 1):
        assert drawn(scores[p]) == trace[p + 1], (p, scores[p], trace[p + 1])
    for h in tr["handoffs"]:
        assert h["committed"] and h["from"] != h["to"]
    for i, w in enumerate(weights):
        share = trace.count(i) / n
        assert abs(share - w) <= 4 * math.sqrt(w * (1 - w) / n), (tr["models"][i], share, w)
    assert again["routing_trace"]["trace"] == trace[:32]


def test_random_rule_and_share(server):
    """Random routing through the server: the model of every next token is the LLM exactly when the
    recorded uniform draw is below p (token kept at every handoff); the LLM share is within 4
    binomial standard deviations of p; the same seed routes the same way, and ``routing_threshold``
    sets p per request (0: the SLM writes every token)."""
    n = 200
    out, again, other, none = gen_many(server, "token_router_random", [
        (PROMPTS[2], greedy(n, seed=3)), (PROMPTS[2], greedy(32, seed=3)), (PROMPTS[2], greedy(32, seed=4)),
        (PROMPTS[2], greedy(32, seed=3, routing_threshold=0.0))])
    tr = check_trace_consistency(out)
    p = out["routing_summary"]["params"]["p"]
    assert tr["models"] == ["slm", "llm"] and p == 0.3
    trace, scores = tr["trace"], tr["scores"]
    for pos in range(len(trace) - 1):
        assert 0.0 <= scores[pos] < 1.0 and trace[pos + 1] == int(scores[pos] < p), (pos, scores[pos])
    assert tr["handoffs"] and all(h["committed"] for h in tr["handoffs"])
    share = trace.count(1) / n
    assert abs(share - p) <= 4 * math.sqrt(p * (1 - p) / n), share
    assert again["routing_trace"]["trace"] == trace[:32]
    assert other["routing_trace"]["trace"] != trace[:32]
    assert none["routing_trace"]["trace"] == [0] * 32 and none["routing_summary"]["handoffs"] == 0


def test_random_rule_units():
    """The random rule without a server: per-token draws, shares, handoff rate 2p(1-p),
    reproducibility by sampling seed / request id / seed parameter, and parameter checks."""
    from types import SimpleNamespace

    from tokenrouter.algorithms import get_algorithm
    from tokenrouter.algorithms.base import request_uniform
    from tokenrouter.protocol import StepResult

    cls = get_algorithm("random")
    assert cls.validate_params({}, 2) == {"p": 0.1, "seed": 0}
    with pytest.raises(ValueError, match=r"'p'=1.5 outside"):
        cls.validate_params({"p": 1.5}, 2)
    with pytest.raises(ValueError, match="between 2 and 2"):
        cls.validate_params({}, 3)

    def run(params, n, rid="r1", sampling=None):
        """The models that write tokens 0..n-1 of one request, following route() like the subserver."""
        params = cls.validate_params(params, 2)
        inst = {m: cls(m, 2, params) for m in (0, 1)}
        state = SimpleNamespace(header=SimpleNamespace(sampling=sampling or {}))
        cur, out = cls.first_model(params, rid=rid, sampling=sampling), []
        for t in range(n):
            out.append(cur)
            k = inst[cur].route(StepResult(rid=rid, model_index=cur, token_id=1, norm_entropy=0.5, prob=0.5,
                                           step=t, state=state))
            if k:
                cur = inst[cur].peer_model(k)
        return out

    n, p = 4000, 0.25
    trace = run({"p": p}, n, sampling={"seed": 9})
    # each token's model is its own hashed draw against p (the key is the sampling seed)
    assert trace == [int(request_uniform("random:0", "seed:9", t) < p) for t in range(n)]
    sd = math.sqrt(p * (1 - p) / n)
    assert abs(trace.count(1) / n - p) <= 4 * sd
    switches = sum(a != b for a, b in zip(trace, trace[1:]))
    q = 2 * p * (1 - p)
    assert abs(switches / (n - 1) - q) <= 4 * math.sqrt(q * (1 - q) / (n - 1)) + 1e-9
    assert run({"p": p}, 64, rid="a", sampling={"seed": 9}) == run({"p": p}, 64, rid="b", sampling={"seed": 9})
    assert run({"p": p}, 64, rid="a") != run({"p": p}, 64, rid="b")  # no seed: the request id
    assert run({"p": p, "seed": 1}, 64, rid="a") != run({"p": p}, 64, rid="a")
    assert run({"p": 0.0}, 50) == [0] * 50 and run({"p": 1.0}, 50) == [1] * 50


def test_learned_scores_match_offline_router(server):
    """The scores in the trace are the shipped routers applied to the SLM's last hidden state
    (SGLang hidden capture == transformers' final-norm hidden state), recomputed offline."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tokenrouter.algorithms import get_algorithm
    from tokenrouter.algorithms.learned import find_router, load_router, r2r_features

    prompt = PROMPTS[0]
    algos = ("citer", "r2r", "colm")
    outs = generate_many(server, [(prompt, greedy(16, routing_threshold=0.5), f"token_router_{algo}")
                                  for algo in algos], timeout=120)
    path = os.path.join(os.environ["TOKENROUTER_WEIGHTS"], "smollm2-135m-instruct")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    emb = model.get_input_embeddings().weight
    for algo, out in zip(algos, outs):
        tr = check_trace_consistency(out)
        ids = tok.encode(prompt)
        seq = torch.tensor([ids + tr["token_ids"]])
        with torch.no_grad():
            o = model(seq, output_hidden_states=True)
        hid, logits = o.hidden_states[-1][0], o.logits[0]
        assert get_algorithm(algo).params_spec["router"].default == "auto"
        router = load_router(find_router(algo, path), algo)  # what router=auto served
        # SLM steps: kept tokens (score per token) and discarded ones (handoff score)
        steps = [(p, s) for p, (m, s) in enumerate(zip(tr["trace"], tr["scores"])) if m == 0]
        steps += [(h["pos"], h["score"]) for h in tr["handoffs"] if h["from"] == 0]
        assert steps
        for p, s in steps:
            i = len(ids) + p - 1
            if algo == "r2r":
                x = r2r_features(hid[i], emb[int(logits[i].argmax())], logits[i], router.arch["topk"])
            else:
                x = hid[i]
            assert abs(float(router.prob(x)[0]) - s) < 2e-3, (algo, p, s)


def test_event_log_handoffs(server):
    """Handoff events (request id, step, from, to, tokens committed, score) match the trace and
    scheduler_model's profile conversion reads the log."""
    from scheduler_model.profile import profile_from_events

    logs = {m: server.events_dir / f"events-{m}.jsonl" for m in ("slm", "llm")}
    start = {m: (p.stat().st_size if p.exists() else 0) for m, p in logs.items()}
    out = gen(server, "token_router_citer", PROMPTS[1], greedy(routing_threshold=0.9))
    tr = check_trace_consistency(out)
    deadline = time.time() + 10  # events are written right after the step's responses
    while True:
        events = []
        for m, p in logs.items():
            with open(p) as f:
                f.seek(start[m])
                events += [json.loads(line) for line in f if line.strip()]
        hand = sorted((e for e in events if e["event"] == "handoff"), key=lambda e: e["step"])
        if len(hand) >= len(tr["handoffs"]) or time.time() > deadline:
            break
        time.sleep(0.1)
    assert len(hand) == len(tr["handoffs"]) > 0
    assert len({e["request_id"] for e in hand}) == 1
    for e, h in zip(hand, tr["handoffs"]):
        assert (e["from"], e["to"]) == (tr["models"][h["from"]], tr["models"][h["to"]])
        assert e["tokens_committed"] == (1 if h["committed"] else 0)
        assert e["score"] == h["score"]
    prof = profile_from_events(events, ["slm", "llm"], concurrency=1)
    assert prof


def test_bad_configs_fail_with_clear_errors(server):
    """Unknown algorithm / bad parameter / missing router file in a router config: the model does
    not load and Triton reports the algorithm's error message."""
    r = requests.post(f"http://{server.http_url}/v2/repository/index", json={}, timeout=30)
    index = {m["name"]: m for m in r.json()}
    for name in ("token_router", "token_router_citer", "token_router_r2r", "token_router_colm", "token_router_me"):
        assert index[name]["state"] == "READY", index[name]
    for name, (_, _, _, msg) in BAD_ROUTERS.items():
        assert index[name]["state"] == "UNAVAILABLE", index[name]
        assert msg in index[name].get("reason", ""), (name, index[name])


def test_bad_request_parameters(server):
    """Per-request overrides are validated by the algorithm; the error names the parameter."""
    out = gen(server, "token_router_citer", PROMPTS[0], greedy(4, routing_threshold=1.5))
    assert out["_status"] == 400 and "'tau'=1.5 outside [0.0, 1.0]" in out.get("error", ""), out
    out = gen(server, "token_router_me", PROMPTS[0], greedy(4, routing_threshold=0.5))
    assert out["_status"] == 400 and "algorithm 'me' has no threshold" in out.get("error", ""), out
    out = gen(server, "token_router_citer_nohidden", PROMPTS[0], greedy(4))
    # the deployment's error, not the client's: INTERNAL (HTTP 500 on jemalloc), not INVALID_ARG
    assert out["_status"] == generate_error_status(server, 500) and "capture_hidden" in out.get("error", ""), out


def test_parameter_validation_units():
    """Algorithm-level validation without a server (defaults, bounds, kinds)."""
    from tokenrouter.algorithms import ALGORITHMS, get_algorithm

    assert {"citer", "r2r", "rstitch", "colm", "me", "random", "speculative", "draft_verify"} <= set(ALGORITHMS)
    with pytest.raises(ValueError, match="unknown routing algorithm"):
        get_algorithm("bogus")
    citer = get_algorithm("citer")
    assert citer.validate_params({}, 2)["tau"] == 0.98
    with pytest.raises(ValueError, match="between 2 and 2"):
        citer.validate_params({}, 3)
    with pytest.raises(ValueError, match="must be a non-empty string"):
        citer.validate_params({"router": 3}, 2)
    me = get_algorithm("me")
    assert me.validate_params({}, 3)["weights"] == [0.5, 0.3, 0.2]
    assert me.validate_params({"weights": "1,1"}, 2)["weights"] == [0.5, 0.5]
    with pytest.raises(ValueError, match="weights"):
        me.validate_params({"weights": [1, -1]}, 2)
    colm = get_algorithm("colm")
    assert colm.validate_params({"compose": "true"}, 2)["compose"] is True
    with pytest.raises(ValueError, match="'eta' must be a number, got \"high\""):
        colm.validate_params({"eta": "high"}, 2)
    with pytest.raises(ValueError, match="'eta' must be a number, got true"):  # the request's JSON, not Python's True
        colm.validate_params({"eta": True}, 2)
    with pytest.raises(ValueError, match="'compose' must be true/false, got null"):
        colm.validate_params({"compose": None}, 2)
    with pytest.raises(ValueError, match=r"unknown parameters for algorithm 'colm': \['etaa'\]"):
        colm.validate_params({"etaa": 0.1}, 2)
    r2r = get_algorithm("r2r")
    assert r2r.validate_params({}, 2)["threshold"] is None  # auto: model 0's process picks the file
    # a named file: its recall-0.95 threshold, so that the routing summary shows the one in force
    from tokenrouter.algorithms.learned import load_router
    named = "r2r_qwen2.5-coder-0.5b_code-math.pt"
    stored = load_router(named, "r2r").threshold
    assert stored is not None and r2r.validate_params({"router": named}, 2)["threshold"] == stored
    assert r2r.validate_params({"router": named, "threshold": 0.5}, 2)["threshold"] == 0.5


def test_learned_routers_check_model_0_s_checkpoint():
    """Before serving, a learned router's file is checked against model 0's checkpoint: a file
    trained for another hidden size (or none shipped for it, with ``auto``) is refused, naming the
    shipped files that fit; a remote model 0 (None) is not checked."""
    from tokenrouter.algorithms import get_algorithm
    from tokenrouter.triton.common import resolve_model_path

    smol = resolve_model_path("smollm2-135m-instruct")
    for kind in ("r2r", "citer", "colm"):
        cls = get_algorithm(kind)
        cls.check_checkpoints(cls.validate_params({}, 2), [smol, None])  # auto: the SmolLM2 file
        cls.check_checkpoints(cls.validate_params({"router": f"{kind}_smollm2-135m.pt"}, 2), [smol, None])
        cls.check_checkpoints(cls.validate_params({"router": f"{kind}_qwen2.5-coder-0.5b.pt"}, 2), [None, smol])
        with pytest.raises(ValueError, match=rf"hidden size 896, model 0 \(smollm2-135m-instruct\) has 576; "
                                             rf"shipped {kind} routers of that size: \['{kind}_smollm2-135m.pt'\]"):
            cls.check_checkpoints(cls.validate_params({"router": f"{kind}_qwen2.5-coder-0.5b.pt"}, 2), [smol, None])
    with pytest.raises(ValueError, match="no shipped r2r router was trained for model 0 'elsewhere'"):
        get_algorithm("r2r").check_checkpoints({"router": "auto", "threshold": None}, ["/nonexistent/elsewhere"])
    get_algorithm("rstitch").check_checkpoints({}, [smol, smol])  # nothing to check
