"""The Triton models' settings (tokenrouter.triton.settings), read from config parameters without a server:
the defaults, one override of each kind of value, and bad values refused naming their parameter."""

from __future__ import annotations

import dataclasses
import pickle
import re
from pathlib import Path

import pytest

from tokenrouter.algorithms import configure
from tokenrouter.engine.config import EngineConfig, SubserverConfig
from tokenrouter.engine.parameters import declarations as declarations_of, shown_default
from tokenrouter.engine.sampling import InputLimits
from tokenrouter.routing.curve import CurveSettings
from tokenrouter.routing.online_bstar import OnlineSettings
from tokenrouter.triton.settings import (DEFAULT_CHECKPOINT, LLMSettings, ModelRole, RequestLimits, RouterSettings,
                                         llm_parameters, read_parameter, router_parameters)


@pytest.fixture
def weights(tmp_path, monkeypatch):
    """A weights folder holding the default checkpoint (a config.json is all path resolution checks)."""
    ckpt = tmp_path / DEFAULT_CHECKPOINT
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    monkeypatch.setenv("TOKENROUTER_WEIGHTS", str(tmp_path))
    return tmp_path


# ------------------------------------------------------------------------------------ router
def test_router_defaults_are_the_documented_ones(weights):
    s = RouterSettings.from_parameters({})
    # the dataclass's defaults are the parameters' defaults (one source), with the path resolved
    # and the algorithm's parameters as the algorithm validated them
    _, rstitch_params = configure("rstitch", "{}", 2)
    assert s == dataclasses.replace(RouterSettings(), tokenizer_path=str(weights / DEFAULT_CHECKPOINT),
                                    algorithm_params=rstitch_params)
    assert s.models == ("slm", "llm") and s.algorithm == "rstitch" and s.transport == "zmq"
    assert (s.default_max_tokens, s.context_length, s.max_concurrent_requests) == (16, 0, 16)
    assert (s.peer_timeout_s, s.peer_restart_s, s.heartbeat_interval_s, s.heartbeat_timeout_s) == (600, 5, 0.5, 2)
    assert s.on_peer_failure == "fail" and s.remote_models == {}
    assert s.limits == RequestLimits(max_input_bytes=None, max_queued_requests=64, queue_timeout_s=60,
                                     sampling=InputLimits())
    assert s.curve == CurveSettings(enabled=True) and s.online == OnlineSettings(enabled=False)
    # empty values and unexpanded ${…} placeholders are unset parameters
    assert RouterSettings.from_parameters({"transport": "", "default_max_tokens": "${MAX}", "models": " "}) == s


def test_router_overrides_one_of_each_kind(weights, tmp_path):
    tok = tmp_path / "other-tokenizer"
    tok.mkdir()
    (tok / "config.json").write_text("{}")
    s = RouterSettings.from_parameters({
        "models": " a, b,",                                 # list
        "algorithm": "random", "algorithm_params": '{"p": 0.25}',  # JSON object
        "tokenizer_path": str(tok),                          # path (absolute: taken as is)
        "max_concurrent_requests": "4",                      # int
        "peer_timeout_s": "2.5",                             # float
        "transport": " Triton ",                             # choice (case and spaces ignored)
        "on_peer_failure": "FALLBACK",
        "online_adaptation": "yes",                          # bool
        "online_quantum_s": "0.001",
        "max_json_depth": "3", "max_input_bytes": "1000", "queue_timeout_s": "0",  # limits
        "curve": "off",
    })
    assert s.models == ("a", "b") and s.algorithm == "random"
    assert s.algorithm_params == configure("random", '{"p": 0.25}', 2)[1] and s.algorithm_params["p"] == 0.25
    assert s.tokenizer_path == str(tok)
    assert s.max_concurrent_requests == 4 and s.peer_timeout_s == 2.5
    assert s.transport == "triton" and s.on_peer_failure == "fallback"
    assert s.online.enabled is True and s.online.quantum_s == 0.001 and s.online.interval_s == 2.0
    assert s.limits.sampling == dataclasses.replace(InputLimits(), max_json_depth=3)
    assert s.limits.max_input_bytes == 1000 and s.limits.queue_timeout_s == 0
    assert s.curve.enabled is False


def test_router_remote_models_and_their_checks(weights):
    s = RouterSettings.from_parameters({"remote_models": '{"llm": ["tcp://h1:5", "tcp://h2:5"]}',
                                        "curve_secret_key_file": "/k/router.key_secret"})
    assert s.remote_models == {"llm": ["tcp://h1:5", "tcp://h2:5"]}
    assert s.curve.secret_key_file == "/k/router.key_secret"
    with pytest.raises(ValueError, match=r"remote_models names \['big'\], not in models \['slm', 'llm'\]"):
        RouterSettings.from_parameters({"remote_models": '{"big": "tcp://h:1"}'})
    with pytest.raises(ValueError, match="remote_models needs transport zmq"):
        RouterSettings.from_parameters({"remote_models": '{"llm": "tcp://h:1"}', "transport": "triton"})


@pytest.mark.parametrize("params, message", [
    ({"max_concurrent_requests": "many"}, "config parameter 'max_concurrent_requests': cannot read 'many' as int"),
    ({"max_concurrent_requests": "0"}, "max_concurrent_requests must be >= 1, got 0"),
    ({"peer_timeout_s": "soon"}, "config parameter 'peer_timeout_s': cannot read 'soon' as float"),
    ({"online_adaptation": "maybe"}, "config parameter 'online_adaptation': cannot read 'maybe' as bool"),
    ({"transport": "http"}, "transport must be one of zmq, triton, got 'http'"),
    ({"on_peer_failure": "retry"}, "on_peer_failure must be one of fail, fallback, got 'retry'"),
    ({"peer_restart_s": "0"}, "peer_restart_s must be > 0"),
    ({"init_timeout_s": "-1"}, "init_timeout_s must be >= 0"),
    ({"heartbeat_interval_s": "3"}, "heartbeat_interval_s \\(3.0\\) and heartbeat_timeout_s"),
    ({"max_input_bytes": "0"}, "max_input_bytes must be >= 1"),
    ({"default_max_tokens": "0"}, "default_max_tokens must be >= 1, got 0"),
    ({"context_length": "-1"}, "context_length must be >= 0, got -1"),
    ({"peer_timeout_s": "-1"}, "peer_timeout_s must be >= 0"),
    ({"max_queued_requests": "-1"}, "max_queued_requests must be >= 0"),
    ({"queue_timeout_s": "-0.5"}, "queue_timeout_s must be >= 0"),
    ({"max_json_depth": "0"}, "max_json_depth must be >= 1, got 0"),
    ({"grammar_compile_timeout_ms": "1.5"}, "config parameter 'grammar_compile_timeout_ms': cannot read '1.5' as int"),
    ({"online_adaptation": "true", "online_interval_s": "0"},
     r"interval_s \(config parameter online_interval_s\) must be a finite number > 0, got 0.0"),
    ({"online_window_s": "inf"}, r"window_s \(config parameter online_window_s\) must be a finite number > 0"),
    ({"online_min_gain": "nan"}, r"min_gain \(config parameter online_min_gain\) must be a finite number >= 0"),
    ({"online_min_request_steps": "0"}, r"\(config parameter online_min_request_steps\) must be >= 1"),
    ({"online_quantum_s": "0"}, r"quantum_s \(config parameter online_quantum_s\) must be a finite number > 0"),
    ({"online_fixed_thresholds": '{"big": 2}'}, "'online_fixed_thresholds' must be a JSON object"),
    ({"online_quantum_s": "fast"}, "'online_quantum_s' must be 'auto' or seconds"),
    ({"algorithm": "nope"}, "unknown routing algorithm 'nope'"),
    ({"algorithm_params": "[1]"}, "algorithm_params must be a JSON object"),
    ({"models": "slm"}, "needs between 2 and 2 models"),
    ({"remote_models": "{"}, "remote_models is not valid JSON"),
    ({"curve": "maybe"}, "config parameter 'curve' must be on or off"),
])
def test_router_refuses_a_bad_value_naming_it(weights, params, message):
    with pytest.raises(ValueError, match=message):
        RouterSettings.from_parameters(params)


def test_router_refuses_a_missing_tokenizer(weights):
    with pytest.raises(FileNotFoundError, match="no-such-tokenizer"):
        RouterSettings.from_parameters({"tokenizer_path": "no-such-tokenizer"})


# ------------------------------------------------------------------------------------ LLM
def test_llm_defaults_are_the_engine_and_subserver_configs_own(weights):
    s = LLMSettings.from_parameters({})
    # one source: the engine's and the decode loop's settings are their configs, defaults and all
    assert s == LLMSettings(engine=EngineConfig(model_path=str(weights / DEFAULT_CHECKPOINT)))
    assert s.subserver == SubserverConfig()
    assert (s.engine.dtype, s.engine.kv_pool_tokens, s.engine.max_running_requests,
            s.engine.context_length) == ("float32", 16384, 32, None)
    assert (s.subserver.delayed_batch_size, s.subserver.max_wait_s, s.subserver.stream_interval,
            s.subserver.prefill_chunk_tokens) == (1, 0.005, 1, 512)
    assert (s.subserver.queue_timeout_s, s.subserver.max_queued_requests, s.drain_timeout_s,
            s.router_timeout_s) == (60, 256, 30, 10)
    # prefix caching is on by default, in the served models and in an engine built directly
    assert s.engine.prefix_cache is True and EngineConfig(model_path="m").prefix_cache is True
    assert s.engine.cuda_graph is True and s.engine.attention_backend is None
    assert s.peer_endpoint is None and s.lockstep_group == "" and s.event_log == ""
    # the engine and subserver take these keyword arguments, as plain picklable dicts
    assert EngineConfig(**s.engine_kwargs()) == s.engine and SubserverConfig(**s.subserver_kwargs()) == s.subserver
    assert pickle.loads(pickle.dumps((s.engine_kwargs(), s.subserver_kwargs()))) == (s.engine_kwargs(),
                                                                                     s.subserver_kwargs())
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.drain_timeout_s = 1.0


def test_llm_settings_copy_no_engine_or_subserver_field():
    """LLMSettings composes the configs: none of their fields is declared again beside them."""
    own = {f.name for f in dataclasses.fields(LLMSettings)}
    for cls in (EngineConfig, SubserverConfig):
        assert not own & {f.name for f in dataclasses.fields(cls)}, cls


def test_llm_overrides_one_of_each_kind(weights):
    s = LLMSettings.from_parameters({
        "dtype": "bfloat16",                       # str
        "kv_pool_tokens": "4096",                  # int
        "mem_fraction_static": "0.45",             # float
        "prefix_cache": "false", "cuda_graph": "0",  # bool
        "context_length": "0",                     # 0: the model's own
        "attention_backend": "fa3",
        "delayed_batch_max_wait_us": "250",        # µs → s
        "delayed_batch_size": "0",                 # < 1 reads as 1
        "drain_timeout_s": "2.5",                  # the model process's
        "peer_endpoint": "tcp://0.0.0.0:5555", "curve_authorized_keys_dir": "/k/authorized_keys",
    })
    e, sub = s.engine, s.subserver
    assert e.dtype == "bfloat16" and e.kv_pool_tokens == 4096 and e.mem_fraction_static == 0.45
    assert e.prefix_cache is False and e.cuda_graph is False and e.context_length is None
    assert e.attention_backend == "fa3" and sub.max_wait_s == 250e-6 and sub.delayed_batch_size == 1
    assert s.drain_timeout_s == 2.5
    assert s.peer_endpoint == "tcp://0.0.0.0:5555" and s.curve.authorized_keys_dir == "/k/authorized_keys"
    assert s.engine_kwargs()["kv_pool_tokens"] == 4096 and s.subserver_kwargs()["max_wait_s"] == 250e-6


@pytest.mark.parametrize("params, message", [
    ({"kv_pool_tokens": "lots"}, "config parameter 'kv_pool_tokens': cannot read 'lots' as int"),
    ({"prefix_cache": "sometimes"}, "config parameter 'prefix_cache': cannot read 'sometimes' as bool"),
    ({"router_timeout_s": "10s"}, "config parameter 'router_timeout_s': cannot read '10s' as float"),
    ({"queue_timeout_s": "-1"}, "queue_timeout_s must be >= 0"),
    ({"prefill_chunk_tokens": "-5"}, "prefill_chunk_tokens must be >= 0"),
    ({"delayed_batch_max_wait_us": "-3"}, r"max_wait_s \(config parameter delayed_batch_max_wait_us\) must be >= 0"),
    ({"kv_pool_tokens": "0"}, "kv_pool_tokens must be >= 1"),
    ({"dtype": "bf16"}, "dtype must be one of auto, float32, bfloat16, float16, got 'bf16'"),
    ({"cpu_linear_weights": "fast"}, "cpu_linear_weights must be one of dual, packed, rowmajor"),
    ({"drain_timeout_s": "-1"}, "drain_timeout_s must be >= 0"),
    ({"init_timeout_s": "-1"}, "init_timeout_s must be >= 0"),
    ({"curve": "maybe"}, "config parameter 'curve' must be on or off"),
])
def test_llm_refuses_a_bad_value_naming_it(weights, params, message):
    with pytest.raises(ValueError, match=message):
        LLMSettings.from_parameters(params)


def test_llm_refuses_a_missing_checkpoint(weights):
    with pytest.raises(FileNotFoundError, match="model_path 'absent-model'"):
        LLMSettings.from_parameters({"model_path": "absent-model"})


# ----------------------------------------------------------------------- the documented defaults
MODELS_SECTION, ROUTER_SECTION = "## The models (`slm`, `llm`)", "## The router (`token_router`)"


def _tables(section: str) -> dict:
    """``{parameter: default cell}`` of the parameter tables of docs/configuration.md's ``section``."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "configuration.md").read_text()
    body = text.split(section, 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in body.splitlines():
        m = re.match(r"\| `([a-z_0-9]+)` \| ([^|]*) \|", line)
        if m:
            assert m.group(1) not in rows, f"{m.group(1)} has two rows"
            rows[m.group(1)] = m.group(2).strip()
    return rows


def _disagreements(rows: dict, declared: list) -> list:
    """What the page's rows and the declarations ``(parameter, field, Param, default)`` disagree on:
    rows of no declared parameter, declared parameters without a row, and defaults that differ (a
    cell may add a parenthesis after the declared default: ``0 (SGLang's default)``)."""
    shown = {key: shown_default(name, p, default) for key, name, p, default in declared}
    out = [f"{key}: a row, not declared" for key in sorted(set(rows) - set(shown))]
    out += [f"{key}: declared, no row" for key in sorted(set(shown) - set(rows))]
    out += [f"{key}: the page says {rows[key]!r}, declared {v!r}" for key, v in shown.items()
            if key in rows and not (rows[key] == v or rows[key].startswith(v + " ("))]
    return out


def test_configuration_page_lists_every_llm_parameter_with_its_declared_default():
    """docs/configuration.md's tables of the models hold exactly the declared parameters (the CURVE
    keys included), each with the declared default."""
    assert _disagreements(_tables(MODELS_SECTION), llm_parameters()) == []


def test_configuration_page_lists_every_router_parameter_with_its_declared_default():
    """docs/configuration.md's tables of the router (Routing, Limits, Failures, Models on other servers,
    Online adaptation) hold exactly the router's declared parameters, each with the declared default."""
    declared = router_parameters()
    assert len({key for key, *_ in declared}) == len(declared), "a parameter declared twice"
    assert _disagreements(_tables(ROUTER_SECTION), declared) == []


def test_the_page_check_can_fail():
    """The rendering the page is held to changes with the declaration, and the check reports a
    changed default, a missing row and an extra row (it is not vacuous)."""
    p = dict((key, (name, p, default)) for key, name, p, default in llm_parameters())
    name, decl, default = p["delayed_batch_max_wait_us"]
    assert shown_default(name, decl, default) == "5000" and shown_default(name, decl, 0.004) == "4000"
    name, decl, default = p["prefix_cache"]
    assert shown_default(name, decl, default) == "`true`" and _tables(MODELS_SECTION)["prefix_cache"] == "`true`"
    assert shown_default(*p["model_path"]) == f"`{DEFAULT_CHECKPOINT}`"

    rows, declared = _tables(ROUTER_SECTION), router_parameters()
    r = {key: (name, p, default) for key, name, p, default in declared}
    assert shown_default(*r["max_stop_strings"]) == "16" and rows["max_stop_strings"] == "16"
    assert shown_default(*r["online_quantum_s"]) == "`auto`" and shown_default(*r["models"]) == "`slm,llm`"
    changed = [(key, name, p, 17 if key == "max_stop_strings" else default) for key, name, p, default in declared]
    assert _disagreements(rows, changed) == ["max_stop_strings: the page says '16', declared '17'"]
    assert _disagreements({k: v for k, v in rows.items() if k != "transport"}, declared) == [
        "transport: declared, no row"]
    assert _disagreements({**rows, "max_prompt_bytes": "1"}, declared) == ["max_prompt_bytes: a row, not declared"]


def test_model_role_is_declared_and_refused_naming_it():
    assert ModelRole.from_parameters({}).role == "llm" and ModelRole.from_parameters({"role": "router"}).role == "router"
    with pytest.raises(ValueError, match="role must be one of llm, router, got 'Router'"):
        ModelRole.from_parameters({"role": "Router"})


def test_read_parameter_kinds():
    p = {"i": "7", "f": "0.5", "b": "On", "s": " x ", "e": "", "ph": "${X}"}
    assert read_parameter(p, "i", 0, int) == 7 and read_parameter(p, "f", 0.0, float) == 0.5
    assert read_parameter(p, "b", False, bool) is True and read_parameter(p, "s", "") == " x "
    assert read_parameter(p, "e", 3, int) == 3 and read_parameter(p, "ph", "d") == "d"
    assert read_parameter(p, "absent", None, int) is None
    with pytest.raises(ValueError, match="config parameter 's': cannot read ' x ' as int"):
        read_parameter(p, "s", 0, int)


# ------------------------------------------------------------------------- configure at run time
def test_configure_reads_the_declared_scheduling_parameters():
    """A running model's ``configure`` op reads the same declarations as its config: units (µs -> s),
    kinds and ranges; no clamping at run time; other keys are not its to read."""
    from tokenrouter.triton.settings import RUNTIME_SCHEDULING, scheduling_changes

    keys = {p.parameter(n) for n, p, _ in declarations_of(SubserverConfig)}
    assert set(RUNTIME_SCHEDULING) <= keys
    got = scheduling_changes(SubserverConfig(), {"delayed_batch_size": 3, "delayed_batch_max_wait_us": 2500,
                                                 "stream_interval": "2", "readmit_on_resume": True,
                                                 "prefill_chunk_tokens": 0, "prefix_cache": False})
    assert got == {"delayed_batch_size": 3, "max_wait_s": 0.0025, "stream_interval": 2,
                   "readmit_on_resume": True, "prefill_chunk_tokens": 0}
    assert scheduling_changes(SubserverConfig(), {"delayed_batch_max_wait_us": 7000.0}) == {"max_wait_s": 0.007}


@pytest.mark.parametrize("cfg, message", [
    ({"prefill_chunk_tokens": 1.7}, "prefill_chunk_tokens must be an integer >= 0, got 1.7"),
    ({"prefill_chunk_tokens": True}, "prefill_chunk_tokens must be an integer >= 0, got True"),
    ({"prefill_chunk_tokens": "abc"}, "prefill_chunk_tokens must be an integer >= 0, got 'abc'"),
    ({"delayed_batch_size": 0}, "delayed_batch_size must be an integer >= 1, got 0"),  # clamped at load, not here
    ({"delayed_batch_max_wait_us": -1}, "delayed_batch_max_wait_us must be an integer >= 0, got -1"),
    ({"stream_interval": float("nan")}, "stream_interval must be an integer >= 1"),
    ({"readmit_on_resume": 1}, "readmit_on_resume must be true or false, got 1"),
])
def test_configure_refuses_a_bad_value_naming_it(cfg, message):
    from tokenrouter.triton.settings import scheduling_changes

    with pytest.raises(ValueError, match="^configure: " + re.escape(message)):
        scheduling_changes(SubserverConfig(), cfg)
