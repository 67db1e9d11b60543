"""Speculative decoding (algorithm ``speculative``): the SLM drafts, the LLM verifies.

* the rejection-sampling rule on synthetic distributions (no model): the verified token is
  distributed as the LLM's p whatever the draft distribution q (Leviathan et al. 2023, Thm 3.5);
* the engine: logits at every drafted position of one extend equal those of decoding the same
  tokens one by one; truncating a sequence frees the KV of the cut tokens;
* the real server (tests/conftest.py's ``routing_server``, shared with test_structured.py; its
  routers are tr_server.ROUTING_ROUTERS): with temperature 0 the output equals LLM-only's token
  for token for every prompt, alone, 4 and 8 at a time, with drafts that are all accepted (the
  demo pair: the same SmolLM2 in both roles) and with drafts that are often rejected (drafts
  sampled at ``draft_temperature`` 1.5, verification greedy: the rollback runs); the routing
  summary / trace / metrics count drafts and accepted drafts; a cancelled request and a request
  whose LLM dies leave no KV on any model, drafts included.

Draft-verify (algorithm ``draft_verify``: the LLM keeps the drafts it finds acceptable, and adds
no token of its own when it keeps them all), on the same server: its rules on hand-made logits
and the engine's handling of a verification without an own token (no model); at alpha = 1
(``ratio``) the greedy output is LLM-only's (= speculative decoding's), at alpha = 0 SLM-only's
(greedy, and sampled with a seed); the summary / trace / metrics bookkeeping; the KV of every
rejected draft freed; cancellations leaving no KV; bad alpha / k / rule refused.  Its trained-router
rule: the features and the keep decision on hand-made logits, its alpha ends (0: every draft, 1: the
argmax only, exact speculation's tokens), the shipped router found for the LLM's checkpoint, and on
the server the alpha ends and the KV freed.
"""

from __future__ import annotations

import concurrent.futures as cf
import math
import os
import queue
import signal
import time
from types import SimpleNamespace

import pytest
import torch

from tr_client import (generate, generate_many, grpc_stream, metric_values, router_inputs, stream_then_cancel,
                       wait_kv_released)

PROMPTS = [
    "Explain why the sky is blue in two sentences.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Three tips for staying healthy are",
    "The capital of France is",
    "Write a haiku about the sea.",
]
N = 32  # output tokens per request
TIMEOUT = 900  # s per request: the CPU may be shared with other jobs

# ------------------------------------------------------------------ the rule, no model
def _verifier(sampling):
    from tokenrouter.algorithms.speculative import Speculative

    algo = Speculative(1, 2, Speculative.validate_params({}, 2))
    state = SimpleNamespace(header=SimpleNamespace(sampling=sampling), rid="r")
    return algo, SimpleNamespace(rid="r", state=state)


def test_rejection_sampling_preserves_the_target_distribution():
    from tokenrouter.algorithms.speculative import target_probs
    from tokenrouter.engine.sampling import BatchSampler

    g = torch.Generator().manual_seed(0)
    V = 6
    p_logits = torch.randn(V, generator=g) * 2
    sampling = {"temperature": 0.9, "top_p": 1.0, "top_k": 0, "seed": 7}
    p = target_probs(p_logits, sampling)
    q = torch.softmax(torch.randn(V, generator=g) * 2, -1)  # a different draft distribution
    algo, res = _verifier(sampling)
    algo._q = [[list(range(V)), q.tolist()]]
    sampler = BatchSampler()
    counts = torch.zeros(V)
    n, accepted = 20000, 0
    logits2 = torch.stack([p_logits, p_logits])  # position 0 (the draft's) and the bonus position
    for _ in range(n):
        d = int(torch.multinomial(q, 1, generator=g)[0])
        out = algo.verify(res, logits2, [d], sampler)
        counts[out[0]] += 1
        accepted += len(out) == 2
    emp = counts / n
    assert (emp - p).abs().max() < 0.015, (emp, p)  # ~4 standard errors at n = 20000
    # the acceptance rate is sum_x min(p, q) (Leviathan et al. 2023, Corollary 3.6)
    assert abs(accepted / n - float(torch.minimum(p, q).sum())) < 0.015


def test_greedy_verification_accepts_the_argmax_prefix():
    algo, res = _verifier({"temperature": 0})
    logits = torch.full((4, 10), -5.0)
    for pos, tok in enumerate([3, 4, 9, 1]):
        logits[pos, tok] = 5.0
    assert algo.verify(res, logits, [3, 4, 9]) == [3, 4, 9, 1]  # all accepted + the bonus token
    assert algo.verify(res, logits, [3, 7, 9]) == [3, 4]  # rejected at 1: the LLM's token instead
    assert algo.verify(res, logits, [0, 4, 9]) == [3]


def test_parameters_are_checked():
    from tokenrouter.algorithms import configure

    _, params = configure("speculative", '{"k": 3}', 2)
    assert params["k"] == 3 and params["adaptive"] is False
    for bad in ('{"k": 0}', '{"k": 2.5}', '{"draft_temperature": -1}', '{"tau": 0.1}'):
        with pytest.raises(ValueError):
            configure("speculative", bad, 2)
    with pytest.raises(ValueError, match="between 2 and 2"):
        configure("speculative", "{}", 3)


# ------------------------------------------------------------------ draft-verify, no model
def _dv(sampling, **params):
    from tokenrouter.algorithms.draft_verify import DraftVerify

    algo = DraftVerify(1, 2, DraftVerify.validate_params(params, 2))
    state = SimpleNamespace(header=SimpleNamespace(sampling=sampling), rid="r")
    return algo, SimpleNamespace(rid="r", state=state)


def _rows(*probs):
    """Logits ``[len(probs), V]`` whose softmax (temperature 1) is each of ``probs``."""
    return torch.log(torch.tensor(probs, dtype=torch.float32))


def test_draft_verify_rules_on_hand_made_logits():
    from tokenrouter.protocol import Verdict

    row = [0.5, 0.3, 0.15, 0.05]
    logits = _rows(row, row, row, row)  # 3 drafts + the position after the last one
    greedy = {"temperature": 0}
    algo, res = _dv(greedy, rule="prob", alpha=0.25)
    assert algo.verify(res, logits, [1, 0, 2]) == Verdict([1, 0, 0], 2)  # p = 0.15 < 0.25: the argmax instead
    assert algo.verified == {"drafted": 3, "accepted": 2}
    assert algo.verify(res, logits, [1, 0, 1]) == Verdict([1, 0, 1], 3)  # all kept: no token of the LLM's own
    assert algo.verify(res, logits, [3, 0, 1]) == Verdict([0], 0)
    algo, res = _dv(greedy, rule="ratio", alpha=0.55)  # keep when p >= 0.55 * 0.5
    assert algo.verify(res, logits, [0, 1, 2]) == Verdict([0, 1, 0], 2)
    # prob at alpha 0.6: even the argmax (p = 0.5) is rejected, and replaced by itself
    algo, res = _dv(greedy, rule="prob", alpha=0.6)
    assert algo.verify(res, logits, [0, 1, 2]) == Verdict([0], 0)
    for rule in ("prob", "ratio"):  # alpha 0: every draft kept, even one the LLM gives probability 0
        algo, res = _dv(greedy, rule=rule, alpha=0.0)
        z = logits.clone()
        z[1, 3] = -math.inf
        assert algo.verify(res, z, [3, 3, 2]) == Verdict([3, 3, 2], 3)


def test_draft_verify_ratio_at_alpha_one_is_exact_speculation():
    """ratio, alpha = 1, greedy: the tokens of speculative decoding's greedy verification, less its
    bonus token when every draft is accepted (random logits; drafts often equal to the argmax)."""
    algo, res = _dv({"temperature": 0}, rule="ratio", alpha=1.0)
    _check_exact_speculation(algo, res, seed=1, p_argmax=0.8)


def _check_exact_speculation(algo, res, seed: int, p_argmax: float, also=None) -> None:
    """300 rounds of random logits ``[k + 1, 12]`` and drafts (each the argmax with probability
    ``p_argmax``): ``algo`` verifies as speculative decoding's greedy verification, less its bonus
    token when every draft is accepted; ``also(logits, drafts)`` runs extra checks per round."""
    g = torch.Generator().manual_seed(seed)
    spec, sres = _verifier({"temperature": 0})
    full = 0
    for _ in range(300):
        k = int(torch.randint(1, 6, (1,), generator=g))
        logits = torch.randn(k + 1, 12, generator=g) * 3
        best = logits.argmax(-1)
        drafts = [int(best[j]) if torch.rand(1, generator=g) < p_argmax
                  else int(torch.randint(0, 12, (1,), generator=g)) for j in range(k)]
        if also is not None:
            also(logits, drafts)
        v, want = algo.verify(res, logits, drafts), spec.verify(sres, logits, drafts)
        if v.accepted == k:
            full += 1
            assert v.tokens == want[:-1] == drafts
        else:
            assert v.tokens == want and v.accepted == len(want) - 1
    assert 0 < full < 300


def test_draft_verify_sampled_requests():
    """Sampled: p after the request's temperature / top-k; a draft outside top-k has p = 0 and is
    rejected, and the LLM's token is drawn from p (the request's generator)."""
    from tokenrouter.algorithms.draft_verify import draft_scores
    from tokenrouter.engine.sampling import BatchSampler

    row = [0.5, 0.3, 0.15, 0.05]
    logits = _rows(row, row)
    sampling = {"temperature": 1.0, "top_k": 2, "top_p": 1.0, "seed": 5}
    s = draft_scores(logits, [1], "prob", sampling)
    assert torch.allclose(s.exp(), torch.tensor([0.3 / 0.8]))  # renormalised over the top 2
    assert torch.allclose(draft_scores(logits, [1], "ratio", sampling).exp(), torch.tensor([0.6]))
    algo, res = _dv(sampling, rule="prob", alpha=0.3)
    sampler = BatchSampler()
    own = []
    for _ in range(400):
        v = algo.verify(res, logits, [2], sampler)
        assert v.accepted == 0 and len(v.tokens) == 1
        own.append(v.tokens[0])
    assert set(own) == {0, 1} and abs(own.count(0) / 400 - 0.625) < 0.1
    assert algo.verify(res, logits, [1], sampler) == ([1], 1)


def test_verification_without_an_own_token_in_the_engine():
    """The subserver's handling of a Verdict (engine/output_processor.py): every draft kept and no
    own token -> the last draft's KV is freed and it is committed like an own token; malformed
    results are refused."""
    import collections

    from tokenrouter.engine.constrained import ConstrainedDecoding
    from tokenrouter.engine.output_processor import OutputProcessorMixin
    from tokenrouter.protocol import Verdict

    class Engine:
        def truncate(self, seq, n):
            freed = len(seq.tokens) - n
            del seq.tokens[n:]
            return freed

    def run(verdict, drafts=(3, 4, 9)):
        algo = SimpleNamespace(verify=lambda *a: verdict, peer_model=lambda k: 0)
        lr = SimpleNamespace(rid="r", verify=list(drafts), seq=SimpleNamespace(tokens=[7, 7] + list(drafts)),
                             algo=algo, spec_round=None, header=SimpleNamespace(sampling={}, extras={}))
        proc = SimpleNamespace(engine=Engine(), counters=collections.Counter(), sampler=None,
                               constrained=ConstrainedDecoding("unguided", 10))  # no grammar: logits as they are
        toks, lps, in_seq = OutputProcessorMixin._verify_row(proc, lr, None, torch.zeros(len(drafts) + 1, 10))
        return toks, in_seq, lr, proc.counters

    toks, in_seq, lr, c = run(Verdict([3, 4, 9], 3))
    assert toks == [3, 4, 9] and in_seq == 2 and lr.seq.tokens == [7, 7, 3, 4]  # 9 is appended again
    assert lr.spec_round == {"drafted": 3, "accepted": 3, "drafter": 0} and c["verify_kv_freed"] == 1
    toks, in_seq, lr, c = run(Verdict([3, 4], 1))  # the LLM's own token equals the rejected draft
    assert in_seq == 1 and lr.seq.tokens == [7, 7, 3] and c["drafts_accepted"] == 1 and c["verify_kv_freed"] == 2
    toks, in_seq, lr, c = run([3, 4, 9, 5])  # a list: the accepted prefix plus one own token
    assert in_seq == 3 and c["drafts_accepted"] == 3 and c["verify_kv_freed"] == 0
    for bad in (Verdict([3, 4], 2), Verdict([3, 5], 2), Verdict([3, 4, 9, 1, 2], 3), Verdict([], 0), [3, 5, 1]):
        with pytest.raises(ValueError, match="verify returned"):
            run(bad)


def test_verification_logprobs_come_from_each_token_s_writer():
    """A request that asks for logprobs (engine/output_processor.py): a kept draft reports the
    drafting model's logprob, rank and top N (computed when it drafted, shipped with the drafts in
    extras.draft_logprobs), the verifier's own token (a replacement or the bonus token) this model's,
    from its raw logits at that position; drafts that come without theirs are refused."""
    import collections

    from tokenrouter.engine.constrained import ConstrainedDecoding
    from tokenrouter.engine.output_processor import (OutputProcessorMixin, draft_logprobs_of,
                                                     draft_logprobs_wire)
    from tokenrouter.engine.sampling import token_logprobs
    from tokenrouter.protocol import TokenLogprobs, Verdict

    class Engine:
        def truncate(self, seq, n):
            freed = len(seq.tokens) - n
            del seq.tokens[n:]
            return freed

    drafts = [3, 4, 9]
    g = torch.Generator().manual_seed(0)
    drafter_logits = torch.randn(len(drafts), 10, generator=g)  # the drafting model's, at each draft
    drafted = [token_logprobs(torch.log_softmax(row, -1), d, 2) for row, d in zip(drafter_logits, drafts)]
    wire = draft_logprobs_wire(drafted)
    assert draft_logprobs_of({"draft_logprobs": wire}, 3) == drafted  # the JSON form round-trips
    position_logits = torch.randn(len(drafts) + 1, 10, generator=g)  # the verifier's

    def run(verdict, extras):
        algo = SimpleNamespace(verify=lambda *a: verdict, peer_model=lambda k: 0)
        lr = SimpleNamespace(rid="r", verify=list(drafts), seq=SimpleNamespace(tokens=[7, 7] + drafts),
                             algo=algo, spec_round=None,
                             header=SimpleNamespace(sampling={"temperature": 0, "logprobs": 2}, extras=extras))
        proc = SimpleNamespace(engine=Engine(), counters=collections.Counter(), sampler=None,
                               constrained=ConstrainedDecoding("unguided", 10))
        return OutputProcessorMixin._verify_row(proc, lr, None, position_logits.clone())

    toks, entries, _ = run(Verdict([3, 4, 5], 2), {"draft_logprobs": wire})
    assert toks == [3, 4, 5] and entries[:2] == drafted[:2]  # the kept drafts: the drafter's
    lp, top = entries[2]  # the replacement: the verifier's distribution at position 2
    ref = torch.log_softmax(position_logits[2], -1)
    assert abs(lp - float(ref[5])) < 1e-6 and top.ids == torch.argsort(ref, descending=True)[:2].tolist()
    assert top.rank == int((ref >= ref[5]).sum()) and isinstance(top, TokenLogprobs)
    assert abs(drafted[2][0] - float(torch.log_softmax(position_logits[2], -1)[9])) > 1e-3  # they differ
    toks, entries, _ = run(Verdict([3, 4, 9], 3), {"draft_logprobs": wire})  # all kept, no own token
    assert entries == drafted
    toks, entries, _ = run([3, 4, 9, 1], {"draft_logprobs": wire})  # all kept, then the bonus token
    assert entries[:3] == drafted
    assert abs(entries[3][0] - float(torch.log_softmax(position_logits[3], -1)[1])) < 1e-6
    for extras in ({}, {"draft_logprobs": wire[:2]}, {"draft_logprobs": [[0.0, "one", [], []]] * 3}):
        with pytest.raises(ValueError, match="draft_logprobs"):
            run(Verdict([3, 4, 5], 2), extras)


def test_draft_verify_parameters_are_checked():
    from tokenrouter.algorithms import configure, get_algorithm

    cls, params = configure("draft_verify", '{"rule": "prob", "alpha": 0.2, "k": 3}', 2)
    assert cls.threshold_param == "alpha" and (params["rule"], params["alpha"], params["k"]) == ("prob", 0.2, 3)
    assert get_algorithm("draft_verify").validate_params({}, 2)["rule"] == "ratio"
    for bad, msg in (('{"alpha": 1.5}', r"'alpha'=1.5 outside \[0.0, 1.0\]"), ('{"alpha": -0.1}', "'alpha'"),
                     ('{"k": 0}', r"'k'=0 outside"), ('{"k": "adaptive"}', "'k' must be an integer, got \"adaptive\""),
                     ('{"rule": "judge"}', r"'rule': must be one of \['prob', 'ratio', 'router'\]"),
                     ('{"rule": "router", "router": "dv_none.pt"}', "router file 'dv_none.pt' not found"),
                     ('{"rule": "router", "router": "r2r_smollm2-135m.pt"}',
                      "holds a 'r2r' router, algorithm needs 'dv'"),
                     ('{"rule": "ratio", "router": "dv_smollm2-135m.pt"}', "'router' is used by rule 'router' only")):
        with pytest.raises(ValueError, match=msg):
            configure("draft_verify", bad, 2)
    _, params = configure("draft_verify", '{"rule": "router", "router": "dv_smollm2-135m.pt"}', 2)
    assert params["rule"] == "router"  # the shipped demo-pair router loads


# ------------------------------------------------------------------ draft-verify's router rule, no model
def test_dv_features_on_hand_made_logits():
    from tokenrouter.algorithms.learned import DV_FEATURES, dv_features

    row = [0.5, 0.3, 0.15, 0.05]
    logits = _rows(row, row) + torch.tensor([[0.0], [7.0]])  # a shift per row changes nothing
    f = dv_features(logits, [2, 0])
    assert f.shape == (2, len(DV_FEATURES)) and f.dtype == torch.float32
    ent = -sum(p * math.log(p) for p in row) / math.log(4)
    want = [[math.log(0.15), math.log(0.5), math.log(0.15 / 0.5), ent, math.log(3), math.log(0.5 / 0.3)],
            [math.log(0.5), math.log(0.5), 0.0, ent, 0.0, math.log(0.5 / 0.3)]]
    assert torch.allclose(f, torch.tensor(want), atol=1e-5), f
    z = logits.clone()
    z[0, 2] = -math.inf  # masked by a grammar: floored, finite
    assert torch.isfinite(dv_features(z, [2, 0])).all() and float(dv_features(z, [2, 0])[0, 0]) == -100.0


def test_router_keeps_the_argmax_and_what_the_router_accepts():
    from tokenrouter.algorithms.draft_verify import router_keeps

    row = [0.5, 0.3, 0.15, 0.05]
    logits = _rows(row, row, row, row)
    drafts = [0, 1, 2]
    z = torch.tensor([5.0, 0.0, -2.0])  # P(critical) = 0.993, 0.5, 0.119
    assert router_keeps(logits, drafts, z, 0.0).tolist() == [True, True, True]
    assert router_keeps(logits, drafts, z, 0.5).tolist() == [True, True, True]  # 1 - P >= 0.5 at 1 and 2
    assert router_keeps(logits, drafts, z, 0.6).tolist() == [True, False, True]  # the argmax whatever z
    assert router_keeps(logits, drafts, z, 0.9).tolist() == [True, False, False]
    assert router_keeps(logits, drafts, torch.full((3,), -1e4), 1.0).tolist() == [True, False, False]
    masked = logits.clone()
    masked[1, 1] = -math.inf  # probability 0: rejected unless alpha = 0
    assert router_keeps(masked, drafts, torch.full((3,), -1e4), 0.01).tolist() == [True, False, True]
    assert router_keeps(masked, drafts, z, 0.0).tolist() == [True, True, True]


class _Gap(torch.nn.Module):
    """A stand-in dv router: z = -4 - 2 * logp_gap (drafts far below the argmax are critical)."""

    def forward(self, x):
        return -4.0 - 2.0 * x[:, 2]


def _dv_router(sampling, alpha, router=None):
    from tokenrouter.algorithms.learned import RouterFile

    algo, res = _dv(sampling, rule="router", alpha=alpha)
    algo.router = router or RouterFile("stand-in", "dv", {"in_dim": 6}, _Gap(), None, {})
    return algo, res


def test_draft_verify_router_rule_and_its_alpha_ends():
    """Rule router: the argmax and the drafts the router accepts are kept; alpha = 0 keeps every draft
    (SLM-only's output), alpha = 1 only the argmax: speculative decoding's greedy verification, less its
    bonus token when every draft is kept (random logits)."""
    from tokenrouter.protocol import Verdict

    row = [0.5, 0.3, 0.15, 0.05]
    logits = _rows(row, row, row, row)
    greedy = {"temperature": 0}
    # gap(1) = log 0.6: z = -2.98, P = 0.048; gap(3) = log 0.1: z = 0.61, P = 0.65
    algo, res = _dv_router(greedy, 0.5)
    assert algo.verify(res, logits, [1, 0, 1]) == Verdict([1, 0, 1], 3)
    assert algo.verify(res, logits, [1, 3, 1]) == Verdict([1, 0], 1)  # 3 rejected: the LLM's argmax instead
    assert algo.verified == {"drafted": 3, "accepted": 1}
    algo, res = _dv_router(greedy, 0.96)
    assert algo.verify(res, logits, [0, 1, 0]) == Verdict([0, 0], 1)
    zero, zres = _dv_router(greedy, 0.0)

    def alpha_zero_keeps_every_draft(lg, drafts):
        assert zero.verify(zres, lg, drafts) == Verdict(drafts, len(drafts))

    one, ores = _dv_router(greedy, 1.0)
    _check_exact_speculation(one, ores, seed=2, p_argmax=0.7, also=alpha_zero_keeps_every_draft)


def test_draft_verify_router_rule_with_the_shipped_router():
    """The demo pair's shipped dv router, loaded by router=auto for model 1's checkpoint: its z from
    the features; a draft far below the argmax is judged more critical than one close to it."""
    from tokenrouter.algorithms.learned import find_router, load_router

    path = find_router("dv", os.path.join("weights", "smollm2-135m-instruct"), key="llm")
    router = load_router(path, "dv")
    assert router.meta["llm"] == "smollm2-135m-instruct" and router.meta["target"] == "critical"
    algo, res = _dv_router({"temperature": 0}, 0.5, router)
    engine = SimpleNamespace(config=SimpleNamespace(model_path="/x/smollm2-135m-instruct"), vocab_size=4)
    algo.attach(engine)
    assert algo.router.path == path
    row = [0.6, 0.3, 0.0999, 0.0001]
    z = algo.router_logits(_rows(row, row), [1, 3])
    assert z.shape == (2,) and float(z[1]) > float(z[0])
    with pytest.raises(ValueError, match="no shipped dv router was trained for model 1 'other-llm'"):
        algo.attach(SimpleNamespace(config=SimpleNamespace(model_path="other-llm"), vocab_size=4))


# ------------------------------------------------------------------ the engine
@pytest.fixture()
def engine(smollm2_engine):
    return smollm2_engine  # tests/conftest.py: one engine per test process


def test_engine_position_logits_and_truncate(engine):
    prompt = engine.tokenizer.encode("The quick brown fox jumps over")
    s = engine.add("ref", prompt)
    ref = []
    for _ in range(8):
        out = engine.forward([s])
        assert out.position_logits is None
        ref.append(out.logits[0].clone())
        s.tokens.append(int(out.logits[0].argmax()))
    full = list(s.tokens)
    engine.release(s)
    # one extend of the prompt + 4 tokens, beside another request: logits at the last 5 positions
    s = engine.add("v", full[:len(prompt) + 4])
    s.verify_positions = 5
    other = engine.add("o", engine.tokenizer.encode("Hello there my friend"))
    out = engine.forward([other, s])
    assert out.position_logits[0] is None and out.position_logits[1].shape == (5, engine.vocab_size)
    for j in range(5):
        assert torch.allclose(out.position_logits[1][j], ref[j], atol=1e-3), j
    assert torch.allclose(out.position_logits[1][-1], out.logits[1], atol=1e-4)
    assert s.verify_positions == 0  # one forward only
    # roll back 2 tokens: their KV slots are freed, the rest is reused
    held = engine.kv_tokens_in_use()
    assert engine.truncate(s, len(prompt) + 2) == 2
    assert engine.kv_tokens_in_use() == held - 2 and s.kv_len == len(prompt) + 2
    s.tokens += full[len(prompt) + 2:len(prompt) + 5]
    s.verify_positions = 3
    other.tokens.append(int(out.logits[0].argmax()))
    out = engine.forward([s, other])
    assert out.extend_tokens == 3 + 1  # only the new tokens run
    for j in range(3):
        assert torch.allclose(out.position_logits[0][j], ref[3 + j], atol=1e-3), j
    with pytest.raises(ValueError):
        engine.truncate(s, len(s.tokens) + 1)
    s.verify_positions = 2  # more positions than new tokens
    other.tokens.append(1)
    s.tokens.append(1)
    with pytest.raises(ValueError, match="positions"):
        engine.forward([s, other])
    engine.release(s)
    engine.release(other)
    assert engine.kv_tokens_in_use() == 0


# ------------------------------------------------------------------ the server
@pytest.fixture(scope="module")
def server(routing_server):
    return routing_server  # tests/conftest.py: shared with test_structured.py


def greedy(n=N, **kw):
    return {"max_tokens": n, "temperature": 0, **kw}


def _ids(out):
    assert out["_status"] == 200, out
    return out["routing_trace"]["token_ids"]


@pytest.fixture(scope="module")
def reference(server):
    """LLM-only greedy output of every prompt (token ids)."""
    outs = generate_many(server, [(p, greedy()) for p in PROMPTS], model="token_router_llm", timeout=TIMEOUT)
    return {p: _ids(out) for p, out in zip(PROMPTS, outs)}


def _check_summary(out):
    summ, tr = out["routing_summary"], out["routing_trace"]
    spec = summ["speculative"]
    assert spec["rounds"] == len(tr["drafts"]) > 0
    assert spec["drafted"] == sum(d["drafted"] for d in tr["drafts"])
    assert spec["accepted"] == sum(d["accepted"] for d in tr["drafts"]) <= spec["drafted"]
    assert spec["acceptance_rate"] == round(spec["accepted"] / spec["drafted"], 4)
    # the accepted drafts are the SLM's tokens, the rest the LLM's (one per round at most)
    n = len(tr["token_ids"])
    assert spec["tokens_per_llm_pass"] == round(n / spec["rounds"], 4)
    assert summ["tokens_by_model"]["slm"] == spec["accepted"] == tr["trace"].count(0)
    assert summ["tokens_by_model"]["llm"] == n - spec["accepted"] <= spec["rounds"]
    pos = 0
    for d in tr["drafts"]:  # each round: its accepted drafts (slm), then one llm token
        assert d["pos"] == pos, (d, tr["drafts"])
        assert tr["trace"][pos:pos + d["accepted"]] == [0] * min(d["accepted"], n - pos)
        pos += d["accepted"] + 1
    return spec


@pytest.mark.parametrize("router", ["token_router_spec", "token_router_spec_reject", "token_router_spec_hot",
                                    "token_router_spec_adaptive"])
def test_greedy_output_equals_llm_only(server, reference, router):
    drafted = accepted = 0
    outs = [generate(server, PROMPTS[0], greedy(), model=router, timeout=TIMEOUT)]  # alone
    outs += generate_many(server, [(p, greedy()) for p in PROMPTS[1:]], model=router, timeout=TIMEOUT)  # 4 at once
    for p, out in zip(PROMPTS, outs):
        assert _ids(out) == reference[p], (router, p)
        spec = _check_summary(out)
        drafted, accepted = drafted + spec["drafted"], accepted + spec["accepted"]
    if router == "token_router_spec":  # same model drafts and verifies: (almost) every draft accepted
        assert accepted >= 0.9 * drafted, (accepted, drafted)
    else:  # sampled drafts: some are rejected and rolled back
        assert accepted < drafted, (accepted, drafted)
    st = wait_kv_released(server)
    for m, s in st.items():
        assert s["kv_tokens_in_use"] == 0 and s["active"] == 0, (m, s)
    if router == "token_router_spec_reject":
        assert st["slm"]["draft_tokens_rolled_back"] > 0
        assert st["llm"]["drafts_verified"] > st["llm"]["drafts_accepted"] > 0


def test_greedy_equals_llm_only_under_concurrency(server, reference):
    jobs = [(router, p) for router in ("token_router_spec", "token_router_spec_reject") for p in PROMPTS]
    with cf.ThreadPoolExecutor(8) as ex:
        outs = list(ex.map(lambda j: generate(server, j[1], greedy(), model=j[0], timeout=TIMEOUT), jobs))
    for (router, p), out in zip(jobs, outs):
        assert _ids(out) == reference[p], (router, p)
        _check_summary(out)
    st = wait_kv_released(server)
    for m, s in st.items():
        assert s["kv_tokens_in_use"] == 0 and s["active"] == 0, (m, s)


@pytest.mark.parametrize("router", ["token_router_spec_reject", "token_router_dv_prob"])
def test_logprobs_of_verified_tokens_come_from_their_writer(server, router):
    """Logprobs N through verification rounds: the same greedy output, each token's logprob and top
    N those of its writer in the trace (an accepted draft: the drafter; a replacement or bonus
    token: the verifier), each model's own run for the same prefix.  Both models of this pair are
    SmolLM2, so this checks that every token gets its own position's values through drafting,
    shipping, verification and rollback; which model a kept draft's values come from is checked
    without a model (test_verification_logprobs_come_from_each_token_s_writer)."""
    from tokenrouter.engine.detok import load_tokenizer
    from tokenrouter.routing.router_core import encode_prompt
    from tokenrouter.triton.common import resolve_model_path
    from tr_client import assert_from_writers

    tok = load_tokenizer(resolve_model_path("smollm2-135m-instruct"))
    prompt = PROMPTS[2]
    # seed: the drafts' draws keyed by it, not by the request id (the same rounds every run)
    plain = generate(server, prompt, greedy(16, seed=5), model=router, timeout=TIMEOUT)
    out = generate(server, prompt, greedy(16, seed=5, logprobs=4), model=router, timeout=TIMEOUT)
    assert _ids(out) == _ids(plain)
    spec = out["routing_summary"]["speculative"]
    assert 0 < spec["accepted"] < spec["drafted"], spec  # kept drafts and replaced ones
    assert 0 < out["routing_summary"]["tokens_by_model"]["slm"] < len(_ids(out))
    assert_from_writers(server, encode_prompt(tok, prompt, False), out, 4, 2e-3)


def test_stop_and_budget_end_a_round(server):
    # a budget below k: the drafts stop at the budget, the output has exactly max_tokens tokens;
    # EOS ends the request inside a round, as with LLM-only (the last pair)
    jobs = [(PROMPTS[0], greedy(n, ignore_eos=True)) for n in (1, 2, 3)] + [("Say OK.", greedy(64))]
    outs = generate_many(server, [(*j, r) for j in jobs for r in ("token_router_spec", "token_router_llm")],
                         timeout=TIMEOUT)
    for n, out, ref in zip((1, 2, 3), outs[0::2], outs[1::2]):
        assert _ids(out) == _ids(ref) and len(_ids(out)) == n and out["finish_reason"] == "length"
    out, ref = outs[-2:]
    assert _ids(out) == _ids(ref) and out["finish_reason"] == ref["finish_reason"]


def test_sampled_requests_are_served_and_counted_in_the_metrics(server):
    before = metric_values(server, "tokenrouter:spec_decode_num_draft_tokens_total")
    sp = {"max_tokens": 24, "temperature": 0.8, "top_p": 0.95, "seed": 3}
    a = generate(server, PROMPTS[2], sp, model="token_router_spec_reject", timeout=TIMEOUT)
    b = generate(server, PROMPTS[2], sp, model="token_router_spec_reject", timeout=TIMEOUT)
    assert a["_status"] == 200 and len(_ids(a)) == 24
    assert _ids(a) == _ids(b)  # a seeded request is reproducible
    spec = _check_summary(a)
    deadline = time.time() + 10
    while time.time() < deadline:
        after = metric_values(server, "tokenrouter:spec_decode_num_draft_tokens_total")
        if after.get("token_router_spec_reject", 0) >= before.get("token_router_spec_reject", 0) + 2 * spec["drafted"]:
            break
        time.sleep(0.5)
    assert after["token_router_spec_reject"] - before.get("token_router_spec_reject", 0) >= 2 * spec["drafted"]
    acc = metric_values(server, "tokenrouter:spec_decode_num_accepted_tokens_total")["token_router_spec_reject"]
    assert 0 < acc <= after["token_router_spec_reject"]
    # penalties are not supported: a clear error for that request alone
    bad = generate(server, PROMPTS[2], {"max_tokens": 4, "repetition_penalty": 1.2}, model="token_router_spec",
                   timeout=TIMEOUT)
    assert bad["_status"] != 200 and "does not support" in bad.get("error", ""), bad
    wait_kv_released(server)


def _cancel_beside_one(server, jobs, other_router):
    """Streamed clients that give up (``jobs``: (router, responses read before cancelling)) beside
    one that does not (``other_router``, whose text must be LLM-only's): no KV, drafts included, is
    left on either model."""
    sp_long = {"max_tokens": 400, "temperature": 0, "ignore_eos": True}
    with cf.ThreadPoolExecutor(len(jobs) + 1) as ex:
        futs = [ex.submit(stream_then_cancel, server, r, f"Tell a very long story number {i}.", sp_long, chunks=c,
                          timeout=TIMEOUT) for i, (r, c) in enumerate(jobs)]
        other = ex.submit(grpc_stream, server, PROMPTS[3], greedy(16), model=other_router, timeout=TIMEOUT)
        assert [f.result() for f in futs] == [c for _, c in jobs]
        o = other.result()
    ref = generate(server, PROMPTS[3], greedy(16), model="token_router_llm", timeout=TIMEOUT)
    assert o["error"] is None and o["text"] == ref["text_output"]
    st = wait_kv_released(server, timeout=60)
    for m, s in st.items():
        assert s["kv_tokens_in_use"] == 0 and s["kv_rows_in_use"] == 0 and s["active"] == 0, (m, s)


def test_cancelled_requests_free_all_kv(server):
    _cancel_beside_one(server, [("token_router_spec", 3), ("token_router_spec_reject", 3),
                                ("token_router_spec_reject", 3)], "token_router_spec_reject")


# ------------------------------------------------------------------ draft-verify on the server
@pytest.fixture(scope="module")
def reference_slm(server):
    """SLM-only greedy output of every prompt (token ids)."""
    outs = generate_many(server, [(p, greedy()) for p in PROMPTS], model="token_router_slm", timeout=TIMEOUT)
    return {p: _ids(out) for p, out in zip(PROMPTS, outs)}


def _check_dv_summary(out):
    """Draft-verify's bookkeeping: each round keeps ``accepted`` drafts (the SLM's tokens) and, when
    it rejects one, adds exactly one LLM token; no LLM token after a round that kept them all."""
    summ, tr = out["routing_summary"], out["routing_trace"]
    spec, drafts, trace = summ["speculative"], tr["drafts"], tr["trace"]
    n = len(tr["token_ids"])
    assert spec["rounds"] == len(drafts) > 0
    assert spec["drafted"] == sum(d["drafted"] for d in drafts)
    assert spec["accepted"] == sum(d["accepted"] for d in drafts) <= spec["drafted"]
    assert spec["acceptance_rate"] == round(spec["accepted"] / spec["drafted"], 4)
    assert spec["tokens_per_llm_pass"] == round(n / spec["rounds"], 4)
    rejected = sum(d["accepted"] < d["drafted"] for d in drafts)
    assert summ["tokens_by_model"] == {"slm": spec["accepted"], "llm": rejected}
    assert trace.count(0) == spec["accepted"] and trace.count(1) == rejected == n - spec["accepted"]
    pos = 0
    for d in drafts:
        assert d["pos"] == pos, (d, drafts)
        own = int(d["accepted"] < d["drafted"])
        assert trace[pos:pos + d["accepted"] + own] == [0] * d["accepted"] + [1] * own
        pos += d["accepted"] + own
    assert pos == n
    return spec


def test_draft_verify_alpha_one_ratio_equals_llm_only(server, reference):
    """ratio at alpha = 1: the greedy output is LLM-only's (and so speculative decoding's) token for
    token, with drafts sampled at temperature 1 that the LLM often replaces.  prob at alpha = 1 (set
    per request) too: it rejects nearly every draft and writes its argmax instead, here the draft
    itself (the demo pair's two models are one), which the SLM's rollback must handle."""
    drafted = accepted = 0
    jobs = [(p, greedy(), "token_router_dv") for p in PROMPTS] + \
           [(p, greedy(routing_threshold=1.0), "token_router_dv_prob") for p in PROMPTS] + \
           [(PROMPTS[1], greedy(), "token_router_spec_reject")]
    outs = generate_many(server, jobs, timeout=TIMEOUT)
    for p, out in zip(PROMPTS, outs[:len(PROMPTS)]):
        assert _ids(out) == reference[p], p
        spec = _check_dv_summary(out)
        drafted, accepted = drafted + spec["drafted"], accepted + spec["accepted"]
    for p, out in zip(PROMPTS, outs[len(PROMPTS):-1]):
        assert _ids(out) == reference[p], p
        _check_dv_summary(out)
    assert 0 < accepted < drafted, (accepted, drafted)
    assert _ids(outs[-1]) == reference[PROMPTS[1]]


def test_draft_verify_alpha_zero_equals_slm_only(server, reference_slm):
    """alpha = 0 keeps every draft and the LLM adds no token: SLM-only's output, greedy and sampled
    with a seed (the drafts are the SLM's sampler's tokens)."""
    sp = {"max_tokens": 24, "temperature": 0.9, "top_p": 0.95, "seed": 11, "ignore_eos": True}
    budgets = (1, 2, 5)
    jobs = [(p, greedy(routing_threshold=0.0), "token_router_dv_prob") for p in PROMPTS] + \
           [(PROMPTS[2], sp, "token_router_slm"), (PROMPTS[2], {**sp, "routing_threshold": 0.0}, "token_router_dv_prob")]
    for n in budgets:
        jobs += [(PROMPTS[1], greedy(n, ignore_eos=True), "token_router_slm"),
                 (PROMPTS[1], greedy(n, ignore_eos=True, routing_threshold=0.0), "token_router_dv_prob")]
    outs = generate_many(server, jobs, timeout=TIMEOUT)
    for p, out in zip(PROMPTS, outs):
        assert _ids(out) == reference_slm[p], p
        spec = _check_dv_summary(out)
        assert spec["accepted"] == spec["drafted"] == len(_ids(out)) and set(out["routing_trace"]["trace"]) == {0}
        assert out["routing_summary"]["tokens_by_model"]["llm"] == 0
    ref, out = outs[len(PROMPTS):len(PROMPTS) + 2]
    assert _ids(out) == _ids(ref) and len(_ids(out)) == 24
    # the budget ends a round that keeps every draft: exactly max_tokens tokens, no LLM token
    rest = outs[len(PROMPTS) + 2:]
    for n, ref, out in zip(budgets, rest[0::2], rest[1::2]):
        assert _ids(out) == _ids(ref) and len(_ids(out)) == n and out["finish_reason"] == "length"
        assert set(out["routing_trace"]["trace"]) == {0}


def test_draft_verify_frees_the_kv_of_every_rejection(server, reference):
    """prob at alpha = 0.5 on the demo pair: the LLM rejects drafts it gives p < 0.5 (and writes the
    same token instead: the two models are one).  Each verification frees on the LLM the KV of its
    rejected drafts, or of the last draft of a round that kept them all (recomputed next round);
    the router's metrics count the rounds, drafts and accepted drafts; nothing is left held."""
    names = ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
             "spec_decode_num_accepted_tokens_total")
    m0 = {k: metric_values(server, f"tokenrouter:{k}").get("token_router_dv_prob", 0.0) for k in names}
    st0 = wait_kv_released(server)
    rounds = drafted = accepted = freed = 0
    for out in generate_many(server, [(p, greedy(ignore_eos=True)) for p in PROMPTS[:3]], model="token_router_dv_prob",
                             timeout=TIMEOUT):
        assert len(_ids(out)) == N
        spec = _check_dv_summary(out)
        rounds, drafted, accepted = rounds + spec["rounds"], drafted + spec["drafted"], accepted + spec["accepted"]
        freed += sum(d["drafted"] - d["accepted"] if d["accepted"] < d["drafted"] else 1
                     for d in out["routing_trace"]["drafts"])
    st = wait_kv_released(server)
    for m, s in st.items():
        assert s["kv_tokens_in_use"] == 0 and s["active"] == 0, (m, s)
    llm = {k: st["llm"][k] - st0["llm"][k] for k in ("verifications", "drafts_verified", "drafts_accepted",
                                                     "verify_kv_freed")}
    assert llm == {"verifications": rounds, "drafts_verified": drafted, "drafts_accepted": accepted,
                   "verify_kv_freed": freed}, (llm, rounds, drafted, accepted, freed)
    assert 0 < accepted < drafted
    assert st["slm"]["draft_tokens_rolled_back"] > st0["slm"]["draft_tokens_rolled_back"]
    want = {names[0]: rounds, names[1]: drafted, names[2]: accepted}
    deadline = time.time() + 10
    while True:
        got = {k: metric_values(server, f"tokenrouter:{k}").get("token_router_dv_prob", 0.0) - m0[k] for k in names}
        if got == want or time.time() > deadline:
            break
        time.sleep(0.5)
    assert got == want, (got, want)


def test_draft_verify_router_rule(server, reference):
    """Rule router with the shipped demo-pair router, on drafts sampled at temperature 1.  alpha = 1 (per
    request): only the LLM's argmax is kept, the greedy output is LLM-only's.  alpha = 0: every draft is
    kept and the LLM writes nothing, the output is the drafts, those of the ratio rule at alpha = 0 with
    the same seed.  alpha = 0.5: served with the bookkeeping exact, the KV of every rejected draft (and
    of each fully kept round's last draft) freed on the LLM, nothing left held on either model."""
    st0 = wait_kv_released(server)
    rounds = drafted = accepted = freed = 0
    for alpha in (1.0, 0.5):
        for p in PROMPTS[:3]:
            out = generate(server, p, greedy(routing_threshold=alpha), model="token_router_dv_router", timeout=TIMEOUT)
            if alpha == 1.0:
                assert _ids(out) == reference[p], p
            spec = _check_dv_summary(out)
            rounds, drafted, accepted = rounds + spec["rounds"], drafted + spec["drafted"], accepted + spec["accepted"]
            freed += sum(d["drafted"] - d["accepted"] if d["accepted"] < d["drafted"] else 1
                         for d in out["routing_trace"]["drafts"])
    assert 0 < accepted < drafted, (accepted, drafted)
    sp = greedy(24, seed=4, ignore_eos=True, routing_threshold=0.0)
    out = generate(server, PROMPTS[2], sp, model="token_router_dv_router", timeout=TIMEOUT)
    ref = generate(server, PROMPTS[2], sp, model="token_router_dv", timeout=TIMEOUT)
    assert _ids(out) == _ids(ref) and len(_ids(out)) == 24
    spec = _check_dv_summary(out)
    assert spec["accepted"] == spec["drafted"] == 24 and out["routing_summary"]["tokens_by_model"]["llm"] == 0
    st = wait_kv_released(server)
    for m, s in st.items():
        assert s["kv_tokens_in_use"] == 0 and s["active"] == 0, (m, s)
    llm = {k: st["llm"][k] - st0["llm"][k] for k in ("verifications", "drafts_verified", "drafts_accepted",
                                                     "verify_kv_freed")}
    ref_spec = ref["routing_summary"]["speculative"]
    want = {"verifications": rounds + spec["rounds"] + ref_spec["rounds"],
            "drafts_verified": drafted + 2 * 24, "drafts_accepted": accepted + 2 * 24,
            "verify_kv_freed": freed + spec["rounds"] + ref_spec["rounds"]}
    assert llm == want, (llm, want)


def test_draft_verify_cancellation_leaves_no_kv(server):
    """Clients that give up mid-stream after 2 to 7 responses (some while the LLM verifies a round)
    and one that does not: no KV, drafts included, is left on either model."""
    _cancel_beside_one(server, [("token_router_dv", 2), ("token_router_dv", 5), ("token_router_dv_prob", 3),
                                ("token_router_dv_prob", 7)], "token_router_dv")


def test_draft_verify_bad_requests_are_refused(server):
    """A bad per-request alpha: HTTP 400 / a gRPC error naming it; penalties: an error for that request."""
    for alpha in (1.5, -0.2):
        out = generate(server, PROMPTS[0], greedy(4, routing_threshold=alpha), model="token_router_dv",
                       timeout=TIMEOUT)
        assert out["_status"] == 400 and f"'alpha'={alpha} outside [0.0, 1.0]" in out.get("error", ""), out
    g = grpc_stream(server, PROMPTS[0], greedy(4, routing_threshold=2.0), model="token_router_dv_prob",
                    timeout=TIMEOUT)
    assert g["error"] and "'alpha'=2.0 outside [0.0, 1.0]" in g["error"], g
    bad = generate(server, PROMPTS[2], {"max_tokens": 4, "presence_penalty": 0.5}, model="token_router_dv",
                   timeout=TIMEOUT)
    assert bad["_status"] != 200 and "algorithm 'draft_verify' does not support" in bad.get("error", ""), bad
    wait_kv_released(server)


@pytest.mark.breaks_server
def test_llm_failure_frees_the_drafters_kv(server):
    """Last test of the module: it kills the LLM's stub (as an OOM kill would); tests/conftest.py runs
    this module after the other users of its server."""
    from tr_server import python_stubs

    s = _stream(server, "token_router_spec_reject", "Tell me a long story about a dragon.",
                {"max_tokens": 400, "temperature": 0, "ignore_eos": True})
    assert s["first"].wait(TIMEOUT)
    pid = python_stubs(server)["llm_0_0"].pid
    os.kill(pid, signal.SIGKILL)
    assert s["done"].wait(TIMEOUT)
    assert s["error"] and "llm" in s["error"], s
    st = wait_kv_released(server, models=("slm",), timeout=60)
    assert st["slm"]["kv_tokens_in_use"] == 0 and st["slm"]["active"] == 0, st


def _stream(server, model, prompt, sampling):
    import threading

    import tritonclient.grpc as grpcclient

    state = {"first": threading.Event(), "done": threading.Event(), "error": None}
    q: "queue.Queue" = queue.Queue()
    c = grpcclient.InferenceServerClient(server.grpc_url)
    c.start_stream(callback=lambda result, error: q.put((result, error)))
    c.async_stream_infer(model, router_inputs(prompt, sampling, True, trace=False), enable_empty_final_response=True)

    def read():
        try:
            while True:
                result, error = q.get(timeout=300)
                if error is not None:
                    state["error"] = str(error)
                    return
                state["first"].set()
                p = result.get_response().parameters.get("triton_final_response")
                if p is not None and p.bool_param:
                    return
        finally:
            state["first"].set()
            state["done"].set()
            c.stop_stream()
            c.close()

    threading.Thread(target=read, daemon=True).start()
    return state
