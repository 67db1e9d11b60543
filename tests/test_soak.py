"""Sustained concurrent load with frequent handoffs, cancellations and bad input (a short soak).

Before the ZeroMQ inter-model channel, minutes of such load could crash the
router's Python stub (BLS response iterators driven from many threads). This
runs ``tokenrouter.tools.soak`` for a bounded time against the session's server
(after every other module that uses it: tests/conftest.py) and asserts its checks:
nothing hung, no valid request failed, malformed requests were rejected, KV returned
to zero on every model and the server still answers.
Length: $TOKENROUTER_SOAK_SECONDS (default 30 s of load; the soak tool itself runs as long as asked).
"""

from __future__ import annotations

import os

import pytest

from tokenrouter.tools.soak import run_soak


@pytest.mark.breaks_server  # its load runs after every other test of the shared server (tests/conftest.py)
def test_sustained_handoff_load(triton_server):
    rep = run_soak(triton_server.grpc_url, float(os.environ.get("TOKENROUTER_SOAK_SECONDS", "30")),
                   concurrency=8, thresholds=(0.1, 0.2, 0.3), request_timeout_s=240, seed=1,
                   disconnect_fraction=0.1, long_fraction=0.2, max_tokens=(4, 64),
                   server_pid=triton_server.process.pid, rss_every_s=2.0)
    assert rep["passed"], rep["problems"]
    kinds = rep["outcomes"]
    # clients that went away without cancelling were cleaned up like cancels (KV back to 0 above)
    assert kinds.get("disconnect", {}).get("cancelled", 0) > 0, kinds
    # every process of the server was sampled throughout, none restarted
    summary = rep["rss"]["summary"]
    assert {"tritonserver", "slm_0_0", "llm_0_0", "token_router_0_0"} <= set(summary), summary
    for name, d in summary.items():
        assert d["restarts"] == 0 and d["samples"] >= 5 and d["end_mb"] > 0, (name, d)
    assert summary["llm_0_0"]["end_mb"] > 100, summary  # a stub holding a model, not a stray process
    # the run really exercised what it claims: handoffs, cancellations and rejections happened
    assert rep["handoffs"] > 50, rep
    assert kinds.get("cancel", {}).get("cancelled", 0) > 0, kinds
    assert kinds.get("bad", {}).get("error", 0) > 0, kinds
    log = triton_server.log_tail(5000)
    assert "is not healthy" not in log and "Segmentation fault" not in log, log[-3000:]
