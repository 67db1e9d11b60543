"""Router training (tokenrouter.tools.train_routers): the critical/neutral rule and a tiny run.

The tiny run trains on the demo pair (SmolLM2-135M; the labelling SLM is its fake-quantised copy)
with five prompts, so that every step of the recipe runs: LLM trajectories, teacher-forced
features, rollouts at the divergences, the four routers (draft-verify's included), their files,
the ``router=auto`` lookup and draft-verify's rule loading its file.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tokenrouter.algorithms import configure
from tokenrouter.algorithms.learned import DV_FEATURES, find_router, load_router
from tokenrouter.tools import train_routers as tr

STOP = 0


@pytest.mark.parametrize("cont, orig, neutral", [
    ([5, 6, 7, 8], [9, 5, 6, 7, 8, 10], True),          # re-joins one token later
    ([5, 6, 7, 8], [5, 6, 7, 8], True),                  # the same text
    ([5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 5, 6, 7, 8], False),  # the trajectory's text, but too far ahead
    ([5, 6, 7, 9], [5, 6, 7, 8, 9], False),              # never the same last K tokens
    ([5, 6, STOP, 1], [4, 5, 6, STOP], True),            # both end, with the same ending
    ([5, 6, STOP], [5, 6, 7, 8, 9, 10], False),          # the rollout ends, the trajectory goes on
    ([5, 6, 7, 8], [5, 6, STOP], False),                 # the trajectory ends, the rollout goes on
    ([5, 6], [5, 6, 7], False),                          # shorter than K: cannot re-join
])
def test_rejoins(cont, orig, neutral):
    assert tr.rejoins(cont, orig, {STOP}, 4) is neutral


def test_thresholds_at_shares_route_that_share():
    pv = torch.linspace(0, 1, 1001)
    above = tr.thresholds_at_shares(pv, defer_below=False)
    below = tr.thresholds_at_shares(pv, defer_below=True)
    for share in tr.SHARES:
        assert abs(float((pv >= above[str(share)]).float().mean()) - share) < 0.01
        assert abs(float((pv < below[str(share)]).float().mean()) - share) < 0.01


def test_tiny_training_run_writes_routers_that_auto_finds(tmp_path, monkeypatch):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in (
        "Write a Python function that reverses a string.", "Name three colours.",
        "Write a haiku about rain.", "What is 17 times 3?", "Explain what a list is in Python.")))
    out = tmp_path / "routers"
    rc = tr.main(["--prompts", str(prompts), "--max-new-tokens", "12", "--rollout-tokens", "4",
                  "--rejoin-tokens", "2", "--epochs", "2", "--r2r-width", "16", "--r2r-depth", "2",
                  "--citer-width", "16", "--out", str(out), "--name", "tiny", "--threads", "2"])
    assert rc == 0
    files = {k: out / f"{k}_tiny.pt" for k in ("r2r", "citer", "colm", "dv")}
    assert all(f.is_file() for f in files.values())
    r2r = load_router(str(files["r2r"]), "r2r")
    rates = r2r.meta["rates"]
    assert 0.0 <= rates["critical"] <= rates["diff"] <= 1.0
    assert r2r.meta["target"] == "critical" and r2r.meta["slm"] == "smollm2-135m-instruct"
    # the recorded command names no folder of this machine (a shipped file carries it)
    assert str(tmp_path) not in r2r.meta["command"]
    assert "--prompts prompts.jsonl" in r2r.meta["command"] and "--out routers" in r2r.meta["command"]
    assert set(r2r.meta["metrics"]["threshold_at_share"]) == {str(s) for s in tr.SHARES}
    assert load_router(str(files["citer"]), "citer").meta["target"] == "1 - critical"
    assert load_router(str(files["colm"]), "colm").meta["target"] == "diff"
    dv = load_router(str(files["dv"]), "dv")
    assert dv.meta["features"] == list(DV_FEATURES) and dv.meta["target"] == "critical"
    assert dv.meta["llm"] == "smollm2-135m-instruct" and dv.arch["in_dim"] == len(DV_FEATURES)
    met = dv.meta["metrics"]
    assert 0 < met["train_n"] and 0 < met["val_n"] <= round(rates["diff"] * dv.meta["positions"])
    assert set(met["kept_at_alpha"]) == {str(a) for a in tr.DV_ALPHAS}
    kept = [met["kept_at_alpha"][str(a)] for a in tr.DV_ALPHAS]
    assert kept == sorted(kept, reverse=True)  # a larger alpha keeps fewer drafts
    _, params = configure("draft_verify", {"rule": "router", "router": str(files["dv"])}, 2)
    assert params["router"] == str(files["dv"])
    # router=auto picks the file trained for model 0's checkpoint, from the routers folder
    monkeypatch.setattr("tokenrouter.algorithms.learned.ROUTERS_DIR", str(out))
    assert find_router("r2r", os.path.join("weights", "smollm2-135m-instruct")) == str(files["r2r"])
    with pytest.raises(ValueError, match="no shipped colm router was trained for model 0 'other-model'"):
        find_router("colm", "other-model")
    assert find_router("dv", os.path.join("weights", "smollm2-135m-instruct"), key="llm") == str(files["dv"])


def test_recorded_command_leaves_out_local_folders(repo_root):
    cmd = tr.recorded_command(["--prompts", str(repo_root / "data" / "router_prompts_code.jsonl"), "/x/y/m.jsonl",
                               "--data=/tmp/w/labels.pt", "--out", "/home/u/r", "--max-prompts", "48",
                               "--slm", "/srv/weights/qwen2.5-coder-0.5b-instruct", "--name", "n"])
    assert cmd == ("python -m tokenrouter.tools.train_routers --prompts data/router_prompts_code.jsonl m.jsonl "
                   "--data=labels.pt --out r --max-prompts 48 --slm qwen2.5-coder-0.5b-instruct --name n")


def test_kinds_are_checked():
    with pytest.raises(SystemExit):
        tr.main(["--kinds", "r2r,judge"])


def test_prompt_files_with_a_system_turn(repo_root, tmp_path):
    """A prompt line may carry the system turn the deployment sends (the math tasks' instruction):
    the labelling renders it through the chat template before the user's prompt."""
    math = tr.load_prompts(str(repo_root / "data" / "router_prompts_math.jsonl"))
    assert len(math) >= 64 and all(m[0]["role"] == "system" and "\\boxed{}" in m[0]["content"] for m in math)
    assert all(m[-1]["role"] == "user" for m in math)
    code = tr.load_prompts(str(repo_root / "data" / "router_prompts_code.jsonl"))
    assert all(len(m) == 1 and m[0]["role"] == "user" for m in code)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "x", "sytem": "typo"}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1: expected"):
        tr.load_prompts(str(bad))


def test_a_missing_router_file_names_the_shipped_ones():
    from tokenrouter.algorithms.learned import resolve_router_path

    with pytest.raises(ValueError, match=r"router file 'r2r_nope.pt' not found .*shipped: \[.*'r2r_qwen2.5-coder-0.5b.pt'"):
        resolve_router_path("r2r_nope.pt")
    # with the algorithm's kind, only the files of that kind
    with pytest.raises(ValueError, match=r"shipped r2r routers: \['r2r_qwen2.5-coder-0.5b.pt'") as e:
        resolve_router_path("r2r_nope.pt", "r2r")
    assert "citer_" not in str(e.value) and "r2r_smollm2-135m.pt" in str(e.value)
