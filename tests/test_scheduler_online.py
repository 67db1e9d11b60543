"""Online adaptation: sliding-window re-estimation and B* with hysteresis."""


import numpy as np
import pytest

from scheduler_model import dtmc, search
from scheduler_model.errors import ProfileError
from scheduler_model.online import OnlineAdapter
from scheduler_model.profile import profile_from_events
from scheduler_model.simulate import simulate
from scheduler_model.system import System

LAT = [{1: 0.006}, {1: 0.027, 2: 0.028, 8: 0.034}]


def system(P, N=6, C=((1, 0), (1, 1))):
    return System(models=("slm", "llm"), concurrency=N, latency=LAT, P=P, C=C, quantum_s=1e-3)


def events_of(s, B, n_events, t0, seed):
    ev = []
    simulate(s, B, events=n_events, warmup_events=0, seed=seed, emit_event=ev.append, t0_s=t0)
    return ev


def loss(s, B):
    best = search.find_B_star(s, method="exact").throughput_tokens_per_s
    return 1 - dtmc.throughput(s, B, on_periodic="ignore").throughput_tokens_per_s / best


def test_simulated_events_recover_profile():
    s = system([[0.7, 0.3], [0.8, 0.2]], C=((1, 0.5), (1, 2)))
    prof = profile_from_events(events_of(s, (1, 2), 30_000, 0.0, 0), ["slm", "llm"], 6)
    np.testing.assert_allclose(prof["transition"], s.P, atol=0.01)
    np.testing.assert_allclose(prof["committed_tokens"], s.C, atol=1e-9)   # C is deterministic here
    assert prof["step_latency_s"]["slm"]["1"] == pytest.approx(0.006)
    # run lengths at slm are geometric with p_stay = 0.7
    rl = prof["run_lengths"]["slm"]
    assert rl["2"] / rl["1"] == pytest.approx(0.7, abs=0.05)


def test_adapter_tracks_regime_change():
    fixed = {"slm": 1}
    s1 = system([[0.95, 0.05], [0.9, 0.1]])
    s2 = system([[0.5, 0.5], [0.3, 0.7]])
    ad = OnlineAdapter(["slm", "llm"], default_concurrency=6, window_s=60.0, quantum_s=1e-3,
                       fixed_thresholds=fixed, min_gain=0.0, search_kwargs={"method": "exact"})
    ev1 = events_of(s1.with_(fixed_thresholds=fixed), (1, 1), 20_000, 0.0, 1)
    ad.observe_many(ev1)
    r1 = ad.recommend()
    assert r1.changed and r1.reason == "initial" and r1.B_star["slm"] == 1
    assert loss(s1.with_(fixed_thresholds=fixed), r1.B_star) < 0.01
    t_end = ev1[-1]["t"]
    ev2 = events_of(s2.with_(fixed_thresholds=fixed), (1, 1), 40_000, t_end + 1.0, 2)
    ad.observe_many(ev2)
    assert ad.events[0]["t"] >= ev2[-1]["t"] - 60.0   # window evicted regime 1
    r2 = ad.recommend()
    assert r2.B_star != r1.B_star and r2.changed   # the optimum moves with the regime
    np.testing.assert_allclose(r2.profile["transition"], s2.P, atol=0.02)
    assert loss(s2.with_(fixed_thresholds=fixed), r2.B_star) < 0.01


def test_hysteresis_and_rate_limit():
    s = system([[0.8, 0.2], [0.6, 0.4]])
    ev = events_of(s, (1, 2), 20_000, 0.0, 3)
    ad = OnlineAdapter(["slm", "llm"], default_concurrency=6, window_s=1e9, quantum_s=1e-3,
                       min_gain=10.0, min_interval_s=5.0, search_kwargs={"method": "exact"})
    half = len(ev) // 2
    ad.observe_many(ev[:half])
    first = ad.recommend()
    soon = [e for e in ev[half:] if e["t"] < ev[half - 1]["t"] + 4.0]
    ad.observe_many(soon)
    limited = ad.recommend()
    assert limited.reason == "rate-limited" and not limited.changed
    ad.observe_many(ev[half + len(soon):])
    again = ad.recommend(force=True)
    assert again.B_star == first.B_star and not again.changed   # 1000 % gain needed to switch
    assert "below" in again.reason


def test_bursty_concurrency_keeps_thresholds_feasible():
    s = system([[0.8, 0.2], [0.6, 0.4]], N=8)
    ev = events_of(s, (1, 2), 10_000, 0.0, 4)
    ad = OnlineAdapter(["slm", "llm"], default_concurrency=8, window_s=1e9, quantum_s=1e-3,
                       concurrency_quantile=0.25, search_kwargs={"method": "exact"})
    ad.observe_many(ev)
    t = ev[-1]["t"]
    # bursts: mostly 2 live requests, occasionally 16
    for k in range(40):
        ad.set_concurrency(16 if k % 5 == 0 else 2, t + 0.01 * k)
    rec = ad.recommend(force=True)
    assert rec.concurrency == 2
    assert sum(b - 1 for b in rec.B_star.values()) < 2


def test_quiet_model_falls_back_to_prior():
    prior = {"models": ["slm", "llm"], "concurrency": 4, "step_latency_s": {"slm": 0.006, "llm": 0.027},
             "transition": [[0.9, 0.1], [0.5, 0.5]], "committed_tokens": [[1, 0], [1, 1]]}
    only_slm = [{"event": "step", "model": "slm", "batch_size": 4, "latency_s": 0.006, "tokens_committed": 4,
                 "t": 0.01 * k} for k in range(100)]
    ad = OnlineAdapter(["slm", "llm"], default_concurrency=4, prior_profile=prior, min_request_steps=50,
                       search_kwargs={"method": "exact"})
    ad.observe_many(only_slm)
    prof = ad.window_profile()
    assert prof["transition"][0] == [1.0, 0.0]           # slm re-estimated: no handoffs seen
    assert prof["transition"][1] == [0.5, 0.5]           # llm from the prior
    ad2 = OnlineAdapter(["slm", "llm"], default_concurrency=4)
    ad2.observe_many(only_slm)
    with pytest.raises(ProfileError):
        ad2.recommend()
