"""Write B* into Triton model configs (config.pbtxt) with Triton's model-config protobuf.

For each model i of the profile, ``MODEL_REPOSITORY/<name>/config.pbtxt`` is parsed with
``tritonclient.grpc.model_config_pb2.ModelConfig`` and ``google.protobuf.text_format`` (no regular
expressions), and these fields are set — every other field is kept as parsed::

    max_batch_size: max(current, B*_i)            # Triton needs max_batch_size ≥ preferred size
    dynamic_batching { preferred_batch_size: [B*_i] max_queue_delay_microseconds: W_i }
    parameters { key: "delayed_batch_size"        value { string_value: "<B*_i>" } }
    parameters { key: "delayed_batch_max_wait_us" value { string_value: "<W_i>" } }

With ``transport="triton"`` (the router's ``transport: triton``, where every arrival at a model is
a Triton request) Triton's dynamic batcher does the delayed batching of arrivals, so the decode
loop's own rule is turned off instead: ``delayed_batch_size`` 1 and ``delayed_batch_max_wait_us`` 0
(docs/transport.md explains the split).

Protobuf text format has no notion of comments, so comments inside the message are lost; the
leading comment block of the file (lines starting with ``#`` before the first field) is kept.

The delay bound W_i (µs) — how long model i's decode loop may hold an idle step waiting for its
queue to reach B*_i — follows from flow balance in the closed network (paper, DTMC section):
every request-step at model j routes by row j of P, so the long-run request-step rates
ρ (requests/s) satisfy ρ = ρ P, i.e. ρ = T(B*) · v / Σ_j v_j Σ_l p_jl c_jl with v the
stationary vector of P and T(B*) in tokens/s. Model i receives requests from its peers at
λ_i = Σ_{j≠i} ρ_j p_ji per second, so collecting the B*_i − 1 requests beyond the first takes
(B*_i − 1)/λ_i on average; requests arrive in bursts at peers' completion instants, so one step
of the slowest peer, max_{j≠i} L_j(max batch), is added::

    W_i = 0                                                   if B*_i = 1
    W_i = ceil(1e6 · ((B*_i − 1)/λ_i + max_{j≠i} L_j(max batch)))   otherwise

If λ_i = 0 (no peer hands to i, or T = 0, or v is not unique), W_i = ceil(1e6 · (B*_i ·
max_{j≠i} L_j(max batch))) is used instead. The bound only matters when live traffic falls
below the modelled N (bursty arrivals): in the closed model the queue reaches B*_i anyway.
"""

from __future__ import annotations

import math
import os
from typing import Dict, List, Mapping, Optional

import numpy as np

from .errors import ConfigWriteError
from .system import System

PARAM_BATCH = "delayed_batch_size"
PARAM_WAIT = "delayed_batch_max_wait_us"


def _pb():
    try:
        from google.protobuf import text_format
        from tritonclient.grpc import model_config_pb2
    except ImportError as exc:  # pragma: no cover - environment problem
        raise ConfigWriteError(f"tritonclient[grpc] and protobuf are needed to write configs: {exc}") from None
    return model_config_pb2, text_format


def request_step_rates(system: System, throughput_tokens_per_s: float) -> Optional[np.ndarray]:
    """ρ (M,) in request-steps/s from flow balance ρ = ρ P and T = Σ_j ρ_j Σ_l p_jl c_jl.

    Returns None when P's stationary vector is not unique or T·(v·ctok) is zero.
    """
    P = system.P
    M = system.M
    w, V = np.linalg.eig(P.T)
    ones = np.isclose(w, 1.0, atol=1e-9)
    if ones.sum() != 1:
        return None
    v = np.real(V[:, np.flatnonzero(ones)[0]])
    v = v / v.sum()
    if np.any(v < -1e-12):
        return None
    v = np.clip(v, 0, None)
    per = float(v @ system.expected_tokens_per_request_step())
    if per <= 0 or throughput_tokens_per_s <= 0:
        return None
    return throughput_tokens_per_s * v / per


def max_wait_us(system: System, B_star: Mapping[str, int], throughput_tokens_per_s: float) -> Dict[str, int]:
    """W_i in µs for every model (derivation in the module docstring)."""
    rho = request_step_rates(system, throughput_tokens_per_s)
    out = {}
    for i, m in enumerate(system.models):
        B = int(B_star[m])
        if B <= 1:
            out[m] = 0
            continue
        peers = [j for j in range(system.M) if j != i]
        slowest = max((system.latency_s(j, system.max_batch[j]) for j in peers), default=0.0)
        lam = 0.0 if rho is None else float(sum(rho[j] * system.P[j, i] for j in peers))
        if lam > 0:
            w = (B - 1) / lam + slowest
        else:
            w = B * slowest
        out[m] = int(math.ceil(1e6 * w))
    return out


def _split_header(text: str) -> tuple:
    lines = text.splitlines(keepends=True)
    head = []
    for ln in lines:
        if ln.strip() == "" or ln.lstrip().startswith("#"):
            head.append(ln)
        else:
            break
    while head and head[-1].strip() == "":
        head.pop()
    return "".join(head), text


#: router transports (``token_router`` parameter ``transport``) the configs can be written for
TRANSPORTS = ("zmq", "triton")


def update_config_text(text: str, B: int, wait_us: int, *, name: str = "", transport: str = "zmq") -> tuple:
    """Return (new text, list of change messages) for one config.pbtxt's text.

    ``transport="zmq"`` writes B and the wait into both the dynamic batcher and the decode
    loop's delayed batching; ``"triton"`` into the batcher only, the loop getting 1 and 0.

    Raises:
        ConfigWriteError: the text does not parse as a ModelConfig, or an unknown transport.
    """
    if transport not in TRANSPORTS:
        raise ConfigWriteError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    pb, text_format = _pb()
    cfg = pb.ModelConfig()
    try:
        text_format.Parse(text, cfg)
    except text_format.ParseError as exc:
        raise ConfigWriteError(f"config.pbtxt of {name!r} does not parse as a Triton ModelConfig: {exc}") from None
    msgs = []
    if cfg.max_batch_size < B:
        msgs.append(f"{name}: raised max_batch_size from {cfg.max_batch_size} to {B} "
                    "(Triton requires max_batch_size >= preferred_batch_size)")
        cfg.max_batch_size = B
    db = cfg.dynamic_batching
    del db.preferred_batch_size[:]
    db.preferred_batch_size.append(B)
    db.max_queue_delay_microseconds = int(wait_us)
    loop_B, loop_wait = (int(B), int(wait_us)) if transport == "zmq" else (1, 0)
    cfg.parameters[PARAM_BATCH].string_value = str(loop_B)
    cfg.parameters[PARAM_WAIT].string_value = str(loop_wait)
    msgs.append(f"{name}: preferred_batch_size [{B}], max_queue_delay_microseconds {wait_us}, "
                f"{PARAM_BATCH}={loop_B}, {PARAM_WAIT}={loop_wait}")
    header, _ = _split_header(text)
    body = text_format.MessageToString(cfg)
    return (header + "\n" + body if header else body), msgs


def write_configs(model_repository: str, B_star: Mapping[str, int], wait_us: Mapping[str, int],
                  transport: str = "zmq") -> List[str]:
    """Write B* and W into MODEL_REPOSITORY/<model>/config.pbtxt for every model in B_star
    (``transport``: see :func:`update_config_text`).

    All configs are parsed and checked before any is written.

    Returns:
        Change messages (one per model, plus one per raised max_batch_size).
    Raises:
        ConfigWriteError: missing repository, model directory or config.pbtxt; unparsable config.
    """
    if not os.path.isdir(model_repository):
        raise ConfigWriteError(f"model repository {model_repository!r} is not a directory")
    updates = []
    msgs: List[str] = []
    for m, B in B_star.items():
        d = os.path.join(model_repository, m)
        if not os.path.isdir(d):
            raise ConfigWriteError(f"model directory {d!r} missing (models are named by the profile's 'models')")
        path = os.path.join(d, "config.pbtxt")
        if not os.path.isfile(path):
            raise ConfigWriteError(f"{path!r} missing")
        with open(path, "r", encoding="utf-8") as fh:
            text = fh.read()
        new, mm = update_config_text(text, int(B), int(wait_us[m]), name=m, transport=transport)
        updates.append((path, new))
        msgs.extend(mm)
    for path, new in updates:
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(new)
        os.replace(tmp, path)
    return msgs
