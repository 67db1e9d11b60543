"""CLI, PROFILE.json, event-log conversion and the Triton config writer."""

import json

import numpy as np
import pytest

from scheduler_model import config_writer, dtmc
from scheduler_model.cli import main
from scheduler_model.errors import ConfigWriteError, EventLogError, ProfileError
from scheduler_model.profile import profile_from_events, read_events
from scheduler_model.system import System

PROFILE = {"models": ["slm", "llm"], "concurrency": 4,
           "step_latency_s": {"slm": 0.006, "llm": {"1": 0.027, "2": 0.028}},
           "transition": [[0.65, 0.35], [1.0, 0.0]], "committed_tokens": [[1, 0], [1, 0]],
           "quantum_s": 0.0001, "fixed_thresholds": {"slm": 1}}

SLM_CONFIG = """# SLM config, kept by the writer
name: "slm"
backend: "python"
max_batch_size: 8
input [ { name: "INPUT_IDS" data_type: TYPE_INT64 dims: [ -1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT64 dims: [ -1 ] } ]
instance_group [ { kind: KIND_CPU count: 2 } ]
parameters { key: "other" value { string_value: "x" } }
"""
LLM_CONFIG = """name: "llm"
backend: "python"
max_batch_size: 1
dynamic_batching { preferred_batch_size: [ 4, 8 ] max_queue_delay_microseconds: 100 }
"""


@pytest.fixture
def profile_path(tmp_path):
    p = tmp_path / "profile.json"
    p.write_text(json.dumps(PROFILE))
    return str(p)


@pytest.fixture
def repo(tmp_path):
    r = tmp_path / "repo"
    for name, text in (("slm", SLM_CONFIG), ("llm", LLM_CONFIG)):
        (r / name).mkdir(parents=True)
        (r / name / "config.pbtxt").write_text(text)
    return r


def _parse(text):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    cfg = model_config_pb2.ModelConfig()
    text_format.Parse(text, cfg)
    return cfg


def test_solve_json_matches_dtmc(profile_path, capsys):
    assert main(["solve", "--profile", profile_path, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) >= {"B_star", "throughput_tokens_per_s", "method", "states", "table"}
    assert out["method"] == "exact-dtmc"
    s = System.from_profile(PROFILE)
    best = max(out["table"], key=lambda r: r["throughput_tokens_per_s"])
    assert best["B"] == out["B_star"]
    direct = dtmc.throughput(s, out["B_star"])
    assert out["throughput_tokens_per_s"] == pytest.approx(direct.throughput_tokens_per_s, rel=1e-12)
    assert out["states"] == direct.states
    assert [r["B"]["llm"] for r in out["table"]] == [1, 2, 3, 4]
    assert all(r["B"]["slm"] == 1 for r in out["table"])


def test_solve_min_gain(profile_path, capsys):
    """--min-gain: a B that waits more must be predicted to gain that much; a huge one means eager."""
    assert main(["solve", "--profile", profile_path, "--json", "--min-gain", "0"]) == 0
    argmax = json.loads(capsys.readouterr().out)
    best = max(argmax["table"], key=lambda r: r["throughput_tokens_per_s"])
    assert argmax["B_star"] == best["B"]
    assert main(["solve", "--profile", profile_path, "--json", "--min-gain", "100"]) == 0
    eager = json.loads(capsys.readouterr().out)
    assert eager["B_star"] == {"slm": 1, "llm": 1}
    assert (eager["B_star"] == argmax["B_star"]) != any("less waiting" in n for n in eager["notes"])
    assert main(["solve", "--profile", profile_path, "--min-gain", "-1"]) == 2
    assert "--min-gain" in capsys.readouterr().err


def test_solve_table_output(profile_path, capsys):
    assert main(["solve", "--profile", profile_path]) == 0
    text = capsys.readouterr().out
    assert "B* =" in text and "| slm=1,llm=1 |" in text


def test_write_config_uses_protobuf_and_keeps_fields(profile_path, repo, capsys):
    before = {m: _parse((repo / m / "config.pbtxt").read_text()) for m in ("slm", "llm")}
    assert main(["solve", "--profile", profile_path, "--json", "--write-config", str(repo)]) == 0
    out = json.loads(capsys.readouterr().out)
    B = out["B_star"]
    for m in ("slm", "llm"):
        text = (repo / m / "config.pbtxt").read_text()
        cfg = _parse(text)
        assert list(cfg.dynamic_batching.preferred_batch_size) == [B[m]]
        assert cfg.parameters["delayed_batch_size"].string_value == str(B[m])
        wait = int(cfg.parameters["delayed_batch_max_wait_us"].string_value)
        assert cfg.dynamic_batching.max_queue_delay_microseconds == wait == out["max_queue_delay_us"][m]
        assert cfg.max_batch_size >= B[m]
        # everything else as it was
        expect = before[m]
        expect.max_batch_size = max(expect.max_batch_size, B[m])
        expect.dynamic_batching.CopyFrom(cfg.dynamic_batching)
        expect.parameters["delayed_batch_size"].CopyFrom(cfg.parameters["delayed_batch_size"])
        expect.parameters["delayed_batch_max_wait_us"].CopyFrom(cfg.parameters["delayed_batch_max_wait_us"])
        assert cfg == expect
    assert (repo / "slm" / "config.pbtxt").read_text().startswith("# SLM config, kept by the writer")
    assert _parse((repo / "slm" / "config.pbtxt").read_text()).parameters["other"].string_value == "x"
    if B["llm"] > 1:
        assert any("raised max_batch_size" in c for c in out["config_changes"])
        assert out["max_queue_delay_us"]["llm"] > 0
    assert out["max_queue_delay_us"]["slm"] == 0  # B = 1 starts at once


def test_write_config_for_triton_transport(profile_path, repo, capsys):
    """--transport triton: B* and the wait go to Triton's batcher only; the decode loop's rule is off."""
    assert main(["solve", "--profile", profile_path, "--json", "--write-config", str(repo),
                 "--transport", "triton"]) == 0
    out = json.loads(capsys.readouterr().out)
    for m in ("slm", "llm"):
        cfg = _parse((repo / m / "config.pbtxt").read_text())
        assert list(cfg.dynamic_batching.preferred_batch_size) == [out["B_star"][m]]
        assert cfg.dynamic_batching.max_queue_delay_microseconds == out["max_queue_delay_us"][m]
        assert cfg.parameters["delayed_batch_size"].string_value == "1"
        assert cfg.parameters["delayed_batch_max_wait_us"].string_value == "0"
    with pytest.raises(ConfigWriteError, match="transport"):
        config_writer.update_config_text((repo / "slm" / "config.pbtxt").read_text(), 2, 10, transport="bls")


def test_write_config_missing_model_dir(profile_path, tmp_path, capsys):
    r = tmp_path / "empty_repo"
    (r / "slm").mkdir(parents=True)
    (r / "slm" / "config.pbtxt").write_text(SLM_CONFIG)
    assert main(["solve", "--profile", profile_path, "--write-config", str(r)]) == 2
    assert "llm" in capsys.readouterr().err
    # nothing written when one model is missing
    assert _parse((r / "slm" / "config.pbtxt").read_text()).parameters.get("delayed_batch_size") is None


def test_unparsable_config_rejected(tmp_path):
    r = tmp_path / "repo"
    (r / "m").mkdir(parents=True)
    (r / "m" / "config.pbtxt").write_text("name: \"m\"\nnot_a_field: 3\n")
    with pytest.raises(ConfigWriteError):
        config_writer.write_configs(str(r), {"m": 2}, {"m": 10})


def test_wait_bound_flow_balance():
    # W = (B-1)/lambda + slowest peer step, lambda from rho = T v / (v . ctok)
    s = System.from_profile(PROFILE)
    T = 200.0
    w = config_writer.max_wait_us(s, {"slm": 1, "llm": 3}, T)
    v = np.array([1.0, 0.35])
    v /= v.sum()  # stationary vector of P: v_llm / v_slm = p_01 / p_10
    rho = T * v / (v @ (s.P * s.C).sum(axis=1))
    lam = rho[0] * 0.35
    assert w["slm"] == 0
    assert w["llm"] == int(np.ceil(1e6 * (2 / lam + 0.006)))


def _events():
    ev = [
        {"event": "step", "model": "slm", "batch_size": 3, "latency_s": 0.006, "tokens_committed": 3, "t": 1.0},
        {"event": "handoff", "request_id": "a", "step": 5, "from": "slm", "to": "llm", "tokens_committed": 0, "t": 1.0},
        {"event": "step", "model": "slm", "batch_size": 2, "latency_s": 0.007, "tokens_committed": 2, "t": 1.1},
        {"event": "step", "model": "slm", "batch_size": 3, "latency_s": 0.008, "tokens_committed": 3, "t": 1.2},
        {"event": "handoff", "request_id": "b", "step": 9, "from": "slm", "to": "llm", "tokens_committed": 0, "t": 1.2},
        {"event": "step", "model": "llm", "batch_size": 1, "latency_s": 0.027, "tokens_committed": 1, "t": 1.3},
        {"event": "handoff", "request_id": "a", "step": 6, "from": "llm", "to": "slm", "tokens_committed": 1, "t": 1.3},
        {"event": "step", "model": "llm", "batch_size": 1, "latency_s": 0.029, "tokens_committed": 1, "t": 1.4},
        {"event": "handoff", "request_id": "b", "step": 10, "from": "llm", "to": "slm", "tokens_committed": 1, "t": 1.4},
        {"event": "step", "model": "llm", "batch_size": 2, "latency_s": 0.028, "tokens_committed": 2, "t": 1.5},
        {"event": "handoff", "request_id": "c", "step": 2, "from": "llm", "to": "slm", "tokens_committed": 1, "t": 1.5},
        {"event": "heartbeat", "t": 1.6},
        {"event": "handoff", "request_id": "a", "step": 10, "from": "slm", "to": "llm", "tokens_committed": 0, "t": 1.7},
    ]
    return ev


def test_profile_from_events_estimators():
    prof = profile_from_events(_events(), ["slm", "llm"], 4, quantum_s=1e-3)
    # slm: request-steps 3+2+3 = 8, 3 handoffs to llm (0 tokens), step tokens 8
    # llm: request-steps 1+1+2 = 4, 3 handoffs to slm (1 token each), step tokens 4
    P = np.array(prof["transition"])
    C = np.array(prof["committed_tokens"])
    np.testing.assert_allclose(P, [[1 - 3 / 8, 3 / 8], [3 / 4, 1 - 3 / 4]])
    np.testing.assert_allclose(C, [[(8 - 0) / (8 - 3), 0.0], [1.0, (4 - 3) / (4 - 3)]])
    assert prof["step_latency_observed_s"]["slm"] == {"2": 0.007, "3": 0.007}   # median of 0.006, 0.008
    assert prof["step_latency_observed_s"]["llm"] == {"1": 0.028, "2": 0.028}
    # request a: slm->llm at 5, llm->slm at 6 (1 step at llm), slm->llm at 10 (4 steps at slm)
    assert prof["run_lengths"] == {"slm": {"4": 1}, "llm": {"1": 2}}
    System.from_profile(prof)


def test_profile_cli_roundtrip(tmp_path, capsys):
    ev = tmp_path / "events.jsonl"
    ev.write_text("\n".join(json.dumps(e) for e in _events()) + "\n\n")
    out = tmp_path / "p.json"
    assert main(["profile", "--events", str(ev), "--models", "slm,llm", "--concurrency", "3", "-o", str(out),
                 "--fixed-thresholds", "slm=1"]) == 0
    prof = json.loads(out.read_text())
    assert prof["concurrency"] == 3 and prof["fixed_thresholds"] == {"slm": 1}
    assert main(["solve", "--profile", str(out), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["B_star"]["slm"] == 1


def test_malformed_events(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"event": "step", "model": "slm", "batch_size": 1, "latency_s": 0.006, "tokens_committed": 1}\n'
                   '{"event": "step", "model": "slm"\n')
    with pytest.raises(EventLogError, match=":2:"):
        read_events(str(bad))
    with pytest.raises(EventLogError, match="batch_size"):
        profile_from_events([{"event": "step", "model": "slm", "latency_s": 0.1, "tokens_committed": 1}],
                            ["slm"], 1)
    with pytest.raises(EventLogError, match="unknown model"):
        profile_from_events([{"event": "step", "model": "big", "batch_size": 1, "latency_s": 0.1,
                              "tokens_committed": 1}], ["slm"], 1)
    with pytest.raises(EventLogError, match="'event'"):
        profile_from_events([{"model": "slm", "batch_size": 1}], ["slm"], 1)
    with pytest.raises(ProfileError, match="no step events"):
        profile_from_events(_events()[:5], ["slm", "llm"], 2)


def test_bad_profiles(tmp_path, capsys):
    for change in ({"transition": [[0.5, 0.4], [1.0, 0.0]]}, {"concurrency": 0},
                   {"step_latency_s": {"slm": 0.006}}, {"fixed_thresholds": {"slm": 9}},
                   {"max_batch_size": "big"}, {"committed_tokens": [[1, -1], [1, 0]]}):
        p = tmp_path / "p.json"
        p.write_text(json.dumps({**PROFILE, **change}))
        assert main(["solve", "--profile", str(p)]) == 2
        assert "error:" in capsys.readouterr().err


def test_simulate_cli(profile_path, capsys):
    assert main(["simulate", "--profile", profile_path, "--thresholds", "llm=2", "--events", "20000",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    exact = dtmc.throughput(System.from_profile(PROFILE), {"slm": 1, "llm": 2}).throughput_tokens_per_s
    assert abs(out["throughput_tokens_per_s"] - exact) / exact < 0.03


def test_solve_with_the_servers_wait_bound(tmp_path, repo, capsys):
    """``solve --max-wait-us``: the table is the chain with the bound (B_llm = N no longer waits
    for N requests), bad names fail with status 2, and ``--write-config`` writes the bound
    modelled for a model with B* > 1."""
    prof = dict(PROFILE, concurrency=4, transition=[[0.9, 0.1], [0.7, 0.3]], quantum_s=0.001)
    p = tmp_path / "p.json"
    p.write_text(json.dumps(prof))
    assert main(["solve", "--profile", str(p), "--json", "--method", "exact", "--min-gain", "0"]) == 0
    free = {r["B"]["llm"]: r["throughput_tokens_per_s"] for r in json.loads(capsys.readouterr().out)["table"]}
    assert main(["solve", "--profile", str(p), "--json", "--method", "exact", "--min-gain", "0",
                 "--max-wait-us", "llm=6000"]) == 0
    out = json.loads(capsys.readouterr().out)
    bounded = {r["B"]["llm"]: r["throughput_tokens_per_s"] for r in out["table"]}
    assert bounded[4] > 1.05 * free[4], (bounded, free)
    assert bounded[1] == pytest.approx(free[1], rel=1e-12)  # B = 1: the bound never decides
    assert any("wait bound modelled" in n for n in out["notes"])
    assert main(["solve", "--profile", str(p), "--max-wait-us", "gpu=5"]) == 2
    assert "unknown models" in capsys.readouterr().err
    # the written bound is the one modelled, for the model whose B* > 1 (a profile where waiting
    # pays a little: the LLM's batch of 4 costs little more than 1; --min-gain 0 takes that gain)
    prof2 = dict(PROFILE, step_latency_s={"slm": 0.006, "llm": {"1": 0.030, "4": 0.031}}, quantum_s=0.001,
                 transition=[[0.5, 0.5], [0.9, 0.1]])
    p.write_text(json.dumps(prof2))
    assert main(["solve", "--profile", str(p), "--json", "--method", "exact", "--min-gain", "0",
                 "--max-wait-us", "llm=7000", "--write-config", str(repo)]) == 0
    out = json.loads(capsys.readouterr().out)
    cfg = _parse((repo / "llm" / "config.pbtxt").read_text())
    assert out["B_star"]["llm"] > 1, out["table"]
    assert out["max_queue_delay_us"]["llm"] == 7000
    assert cfg.dynamic_batching.max_queue_delay_microseconds == 7000
    assert out["max_queue_delay_us"]["slm"] == 0  # B*_slm = 1 (fixed)
