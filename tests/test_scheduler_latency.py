"""Step-latency model: monotone robust fit, no flat extrapolation, profiles old and new, B* at N = 32."""

import json

import numpy as np
import pytest

from scheduler_model.cli import main
from scheduler_model.errors import ProfileError
from scheduler_model.latency import StepLatencyModel, fit_step_latency
from scheduler_model.profile import profile_from_events
from scheduler_model.search import feasible_thresholds, find_B_star
from scheduler_model.system import System


def true_decode(b):
    """A CPU-like decode cost: row-major path for 1-3 rows, packed path (a jump, then a gentler slope) from 4."""
    b = np.asarray(b, dtype=float)
    return np.where(b <= 3, 0.050 + 0.012 * (b - 1), 0.080 + 0.004 * (b - 4))


C_STEP, C_TOK, Q = 0.006, 0.0008, 0.05


def synthetic_steps(n=3000, seed=0, b_max=12, outliers=0.05):
    rng = np.random.default_rng(seed)
    b = rng.integers(1, b_max + 1, n)
    kind = rng.random(n)
    ext = np.zeros(n)
    resume = kind < 1 - (1 - Q) ** b          # a returning request (each row w.p. Q): all rows extend, one has 2
    ext[resume] = b[resume] + 1
    prefill = kind > 0.95                     # a new prompt of ~100 tokens joins the step
    ext[prefill] = b[prefill] - 1 + rng.integers(60, 140, prefill.sum())
    e = ext > 0
    x = np.where(e, ext - b, 0)
    L = true_decode(b) + C_STEP * e + C_TOK * x
    L = L * (1 + 0.03 * rng.standard_normal(n))
    bad = rng.random(n) < outliers            # interference: a few steps take 2-5x as long
    L[bad] *= rng.uniform(2, 5, bad.sum())
    return b, ext, L


def test_fit_recovers_parameters_with_noise_and_outliers():
    b, ext, L = synthetic_steps()
    lm = fit_step_latency(b, ext, L)
    bs = np.arange(1, 13)
    np.testing.assert_allclose(lm.decode_s(bs), true_decode(bs), rtol=0.04)
    assert lm.extend_step_s == pytest.approx(C_STEP, abs=0.002)
    assert lm.extend_token_s == pytest.approx(C_TOK, rel=0.1)
    assert lm.fit["downweighted_points"] > 0                 # the outliers were recognised


def test_fit_is_monotone_in_rows_and_extend_tokens():
    # non-monotone, noisy medians as in a real profile: L(2) > L(4)
    rng = np.random.default_rng(1)
    b = np.repeat([1, 2, 4, 6], 40)
    L = np.select([b == 1, b == 2, b == 4], [0.12, 0.42, 0.14], 0.16) * (1 + 0.05 * rng.standard_normal(b.size))
    lm = fit_step_latency(b, np.zeros_like(b), L)
    grid = np.arange(1, 65)
    assert np.all(np.diff(lm.decode_s(grid)) >= 0)
    assert np.all(np.diff(lm.expected_s(grid)) >= 0)
    b2, ext, L2 = synthetic_steps(seed=2)
    lm2 = fit_step_latency(b2, ext, L2)
    for rows in (1, 4, 9):
        steps = lm2.step_s(rows, [0, rows, rows + 1, rows + 10, rows + 200])
        assert np.all(np.diff(steps) >= 0)


def test_never_flat_beyond_the_data():
    b, ext, L = synthetic_steps(b_max=6)
    lm = fit_step_latency(b, ext, L)
    beyond = lm.decode_s(np.arange(6, 40))
    slope = np.diff(beyond)
    assert np.all(slope > 0)
    assert slope.min() >= lm.slope_beyond_s * (1 - 1e-9)
    # at least the marginal cost the data show on [4, 6] (the packed path): 4 ms per row
    assert lm.slope_beyond_s >= 0.004 * 0.8
    # a step of 27 rows is not "free": it costs more than 20 rows of the fitted marginal cost beyond 6
    assert lm.decode_s(27) > lm.decode_s(6) + 20 * 0.003
    # flat data (every row free in the observed range) still grow beyond it
    flat = fit_step_latency([1, 2, 3] * 10, [0] * 30, [0.1] * 30)
    assert flat.decode_s(30) > flat.decode_s(3)
    # one batch size only: a row's cost is unknown; batching is assumed to gain nothing
    one = fit_step_latency([1] * 10, [0] * 10, [0.1] * 10)
    assert one.decode_s(8) == pytest.approx(0.8)


def test_expected_latency_includes_the_workloads_extend_work():
    b, ext, L = synthetic_steps()
    lm = fit_step_latency(b, ext, L)
    e = ext > 0
    # P(step extends | b) = 1 - (1 - q)^b with q = Q; prefills (5 % of steps) add to it
    assert Q < lm.extend_row_rate < Q + 0.02
    assert lm.extra_extend_tokens_per_row == pytest.approx(np.sum(np.where(e, ext - b, 0)) / b.sum())
    grid = np.arange(1, 33)
    assert np.all(lm.expected_s(grid) > lm.decode_s(grid))


def test_model_json_roundtrip_and_validation():
    lm = fit_step_latency(*synthetic_steps()[:3])
    again = StepLatencyModel.from_json(json.loads(json.dumps(lm.to_json())))
    np.testing.assert_allclose(again.expected_s(np.arange(1, 40)), lm.expected_s(np.arange(1, 40)), rtol=1e-6)
    bad = lm.to_json()
    bad["decode_latency_s"] = bad["decode_latency_s"][::-1]
    with pytest.raises(ProfileError, match="non-decreasing"):
        StepLatencyModel.from_json(bad)
    with pytest.raises(ProfileError, match="slope_beyond_s"):
        StepLatencyModel.from_json({**lm.to_json(), "slope_beyond_s": 0})
    with pytest.raises(ProfileError, match="kind"):
        StepLatencyModel.from_json({**lm.to_json(), "kind": "table"})
    with pytest.raises(ProfileError):
        fit_step_latency([1, 2], [0, 0], [0.1, -0.1])


def _events(n=1500, seed=3):
    """Step and handoff events of an SLM/LLM pair; the LLM's steps follow the synthetic cost model."""
    rng = np.random.default_rng(seed)
    out, t = [], 0.0
    for k in range(n):
        for m, scale in (("slm", 0.3), ("llm", 1.0)):
            b = int(rng.integers(1, 7))
            ext = b + 1 if rng.random() < 0.2 else 0
            L = float(scale * (true_decode(b) + (C_STEP + C_TOK) * (ext > 0)) * (1 + 0.03 * rng.standard_normal()))
            t += L
            out.append({"event": "step", "model": m, "batch_size": b, "latency_s": L, "tokens_committed": b,
                        "extend_tokens": ext, "t": t})
        out.append({"event": "handoff", "request_id": f"r{k % 32}", "step": 2 * k, "from": "slm", "to": "llm",
                    "tokens_committed": 0, "t": t})
        out.append({"event": "handoff", "request_id": f"r{k % 32}", "step": 2 * k + 1, "from": "llm", "to": "slm",
                    "tokens_committed": 1, "t": t})
    return out


def test_profile_writes_the_model_and_old_profiles_load(tmp_path):
    prof = profile_from_events(_events(), ["slm", "llm"], 32, quantum_s=0.002)
    assert set(prof["step_latency_model"]) == {"slm", "llm"}
    assert sorted(map(int, prof["step_latency_s"]["llm"])) == list(range(1, 33))   # every b up to N
    s = System.from_profile(prof)
    lat = [s.latency_s(1, b) for b in range(1, 33)]
    assert np.all(np.diff(lat) > 0)
    # a larger N re-evaluates the model, not the written table
    big = System.from_profile({**prof, "concurrency": 64})
    assert big.latency_s(1, 64) == pytest.approx(big.latency_models[1].expected_s(64))
    # older formats: numbers and tables by batch size, no model
    old = {"models": ["slm", "llm"], "concurrency": 4,
           "step_latency_s": {"slm": 0.006, "llm": {"1": 0.027, "2": 0.028}},
           "transition": [[0.65, 0.35], [1.0, 0.0]], "committed_tokens": [[1, 0], [1, 0]]}
    so = System.from_profile(old)
    assert so.latency_models is None and so.latency_s(0, 3) == 0.006
    assert so.latency_s(1, 4) > so.latency_s(1, 2)                  # tables grow beyond their largest key
    p = tmp_path / "old.json"
    p.write_text(json.dumps(old))
    assert main(["solve", "--profile", str(p), "--json"]) == 0


@pytest.mark.slow
def test_solve_at_n32_searches_every_threshold(tmp_path, capsys):
    """N = 32, no threshold fixed: the search spans the whole feasible set and says which method it used."""
    prof = profile_from_events(_events(), ["slm", "llm"], 32, quantum_s=0.002)
    prof.pop("fixed_thresholds", None)
    p = tmp_path / "p.json"
    p.write_text(json.dumps(prof))
    assert main(["solve", "--profile", str(p), "--json", "--seed", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    system = System.from_profile(prof)
    feasible = {tuple(B) for B in feasible_thresholds(system)}
    searched = {(r["B"]["slm"], r["B"]["llm"]) for r in out["table"]}
    assert searched == feasible                                      # every feasible B, both models free
    assert max(b for b, _ in searched) == 32 and max(b for _, b in searched) == 32
    assert out["method"] in ("exact-dtmc", "crn-racing")
    assert (out["B_star"]["slm"], out["B_star"]["llm"]) in feasible
    assert len(out["step_latency_s"]["llm"]) == 32 and out["concurrency"] == 32


def test_batching_is_only_free_if_the_model_says_so():
    """Rows that cost as much as a step alone give no reason to wait: B* = 1; cheap rows make waiting pay."""
    base = dict(models=("slm", "llm"), concurrency=8, P=[[0.9, 0.1], [0.6, 0.4]], C=[[1, 0], [1, 0]],
                quantum_s=0.002)
    prop = StepLatencyModel(row_knots=[1], decode_latency_s=[0.1], slope_beyond_s=0.1)   # L(b) = 0.1 b
    s = System(latency=[prop.table(8), {b: 0.05 * b for b in range(1, 9)}], latency_models=[prop, None], **base)
    res = find_B_star(s, method="exact")
    assert res.B_star == {"slm": 1, "llm": 1}
    cheap = StepLatencyModel(row_knots=[1, 8], decode_latency_s=[0.1, 0.107], slope_beyond_s=0.001)
    s2 = System(latency=[{b: 0.02 for b in range(1, 9)}, cheap.table(8)], latency_models=[None, cheap], **base)
    res2 = find_B_star(s2, method="exact", min_gain=0)
    assert res2.B_star["llm"] > 1
    # ... but here by 0.6 % only: under the default 2 % tie rule the least waiting wins, with a note
    T = {(r["B"]["slm"], r["B"]["llm"]): r["throughput_tokens_per_s"] for r in res2.table}
    assert 1.0 < res2.throughput_tokens_per_s / T[(1, 1)] < 1.02
    res3 = find_B_star(s2, method="exact")
    assert res3.B_star == {"slm": 1, "llm": 1} and res3.throughput_tokens_per_s == T[(1, 1)]
    assert any("less waiting" in n for n in res3.notes)
    with pytest.raises(ValueError):
        find_B_star(s2, method="exact", min_gain=-0.1)


def test_calibration_scaled_to_the_served_level_extends_the_range():
    """Served steps of b = 1-4 run 1.5x slower than the model alone (the other model steps too);
    a calibration to b = 32 gives the shape beyond 4 at the served level, not a kink down to it."""
    from scheduler_model.latency import contention_scale

    rng = np.random.default_rng(3)
    events, t = [], 0.0
    for _ in range(400):
        b = int(rng.integers(1, 5))
        L = 1.5 * float(true_decode(b)) * (1 + 0.02 * rng.standard_normal())
        t += L
        events.append({"event": "step", "model": "llm", "batch_size": b, "latency_s": L, "tokens_committed": b,
                       "extend_tokens": 0, "t": t})
        events.append({"event": "step", "model": "slm", "batch_size": 4, "latency_s": 0.01, "tokens_committed": 4,
                       "extend_tokens": 0, "t": t})
    events.append({"event": "handoff", "request_id": "r", "step": 1, "from": "slm", "to": "llm",
                   "tokens_committed": 0, "t": t})
    sizes = [1, 2, 4, 8, 16, 32]
    calib = {"models": {"llm": {"table": [{"batch_size": b, "decode_latency_s": [float(true_decode(b))] * 3}
                                          for b in sizes]}}}
    llm_steps = [e for e in events if e.get("model") == "llm"]
    ev_pts = ([e["batch_size"] for e in llm_steps], [0.0] * len(llm_steps), [e["latency_s"] for e in llm_steps])
    kappa = contention_scale(ev_pts, ([1, 2, 4, 8], [0.0] * 4, [float(true_decode(b)) for b in (1, 2, 4, 8)]))
    assert kappa == pytest.approx(1.5, rel=0.02)
    assert contention_scale(ev_pts, ([16], [0.0], [0.2])) == 1.0                  # nothing shared: unscaled
    prof = profile_from_events(events, ["slm", "llm"], 32, quantum_s=0.002, calibration=calib)
    lm = StepLatencyModel.from_json(prof["step_latency_model"]["llm"])
    assert lm.fit["calibration_scale"] == pytest.approx(1.5, rel=0.02)
    assert lm.row_knots[-1] == 32                                                  # the range the calibration saw
    for b in (8, 16, 32):
        assert lm.decode_s(b) == pytest.approx(1.5 * float(true_decode(b)), rel=0.05)
    plain = StepLatencyModel.from_json(profile_from_events(events, ["slm", "llm"], 32,
                                                           quantum_s=0.002)["step_latency_model"]["llm"])
    assert "calibration_scale" not in plain.fit


def test_tie_rule_compares_racing_finalists_and_drives_the_online_switch():
    """crn-racing: only the final round's rows compete (an early-dropped row's rough T does not);
    online: the switch is judged on the best predicted T, and B* is the least waiting near it."""
    import math

    from scheduler_model.online import OnlineAdapter
    from scheduler_model.search import SearchResult, prefer_less_waiting

    system = System(latency=[{b: 0.02 for b in range(1, 9)}, {b: 0.1 for b in range(1, 9)}], models=("slm", "llm"),
                    concurrency=8, P=[[0.9, 0.1], [0.6, 0.4]], C=[[1, 0], [1, 0]], quantum_s=0.002)

    def result(method="crn-racing"):
        table = [{"B": {"slm": 1, "llm": 1}, "throughput_tokens_per_s": 101.0, "events": 1000},  # dropped early
                 {"B": {"slm": 1, "llm": 2}, "throughput_tokens_per_s": 99.0, "events": 9000},
                 {"B": {"slm": 1, "llm": 3}, "throughput_tokens_per_s": 100.0, "events": 9000},
                 {"B": {"slm": 2, "llm": 3}, "throughput_tokens_per_s": 97.0, "events": 9000}]
        return SearchResult(B_star={"slm": 1, "llm": 3}, throughput_tokens_per_s=100.2, method=method, states=0,
                            table=table, seconds=0.0, throughput_stderr_tokens_per_s=0.1)

    res = prefer_less_waiting(result(), system, 0.02)
    assert res.B_star == {"slm": 1, "llm": 2} and res.throughput_tokens_per_s == 99.0
    assert math.isnan(res.throughput_stderr_tokens_per_s) and "less waiting" in res.notes[-1]
    exact = prefer_less_waiting(result("exact-dtmc"), system, 0.02)        # every row exact: (1, 1) wins
    assert exact.B_star == {"slm": 1, "llm": 1}
    for bad in (float("nan"), float("inf"), -0.01):
        with pytest.raises(ValueError):
            prefer_less_waiting(result(), system, bad)
    # online: current (1, 1) at 100; best (1, 5) at 103 (+3 % > 2 %) -> switch to the least
    # waiting B within 2 % of 103, (1, 3) at 101.5, although that alone gains only 1.5 %
    ad = OnlineAdapter(["slm", "llm"], 8, min_gain=0.02)
    rows = [({"slm": 1, "llm": 1}, 100.0), ({"slm": 1, "llm": 3}, 101.5), ({"slm": 1, "llm": 5}, 103.0)]
    table = [{"B": B, "throughput_tokens_per_s": T} for B, T in rows]
    ad.window_profile = lambda: {"concurrency": 8}
    ad._solve = lambda prof: prefer_less_waiting(SearchResult(B_star={"slm": 1, "llm": 5}, throughput_tokens_per_s=103.0,
                                                              method="exact-dtmc", states=0, table=table, seconds=0.0),
                                                 system, ad.min_gain)
    ad.current = {"slm": 1, "llm": 1}
    rec = ad.recommend(force=True)
    assert rec.changed and rec.B_star == {"slm": 1, "llm": 3} and rec.reason.startswith("gain 3.0")
