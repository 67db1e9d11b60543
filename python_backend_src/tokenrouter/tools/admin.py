"""Operator calls to a model subserver (``stats``, ``configure``, ``calibrate``, ``events``) and the router's readiness probe, over Triton gRPC.

The LLM models are decoupled, so each call is one request on a gRPC stream
answered by one final response whose ``event`` output is JSON.

Command line (prints JSON)::

    python -m tokenrouter.tools.admin stats                       # slm and llm at localhost:8001
    python -m tokenrouter.tools.admin stats --models llm --url host:8001
    python -m tokenrouter.tools.admin configure --models llm '{"delayed_batch_size": 2}'
    python -m tokenrouter.tools.admin calibrate --models slm,llm '{"batch_sizes": [1, 2, 4, 8], "context": 256}' -o calib.json
    python -m tokenrouter.tools.admin events --models llm '{"since": 0, "limit": 100}'   # recent routing events
    python -m tokenrouter.tools.admin flush --models slm,llm      # empty the prefix caches

``calibrate`` writes the calibration file (:mod:`scheduler_model.calibrate`) that
``python -m scheduler_model profile`` and ``solve`` take with ``--calibration``; its defaults are
batch sizes 1, 2, 4, 8, 16, 32, a context of 256 tokens and 8 decode steps.

    python -m tokenrouter.tools.admin ready                       # readiness probe covering every model
    python -m tokenrouter.tools.admin keys DIR                    # CURVE keys for models served over TCP

``keys`` writes DIR/server.key(_secret) (the models'), DIR/router.key(_secret) (the
routers') and DIR/authorized_keys/router.key; existing keys are kept unless ``--force``
(see :mod:`tokenrouter.routing.curve`).
"""

from __future__ import annotations

import json
import queue
from typing import Any, Dict, Optional

import numpy as np

from . import GRPC_URL_HELP, default_grpc_url

__all__ = ["model_op", "model_stats", "configure", "calibrate", "events", "flush", "router_ready", "main"]


def model_op(url: str, model: str, op: str, payload: Optional[Dict[str, Any]] = None,
             request_id: str = "admin", timeout_s: float = 60.0) -> Dict[str, Any]:
    """Send ``op`` to ``model`` at gRPC ``url``; return the decoded ``event`` JSON.

    Raises:
        RuntimeError: the model answered with an error.
    """
    import tritonclient.grpc as grpcclient

    from .cli import grpc_input as inp

    q: "queue.Queue" = queue.Queue()
    c = grpcclient.InferenceServerClient(url)
    c.start_stream(callback=lambda result, error: q.put((result, error)))
    try:
        c.async_stream_infer(model, [
            inp("request_id", np.array([[request_id.encode()]], dtype=np.object_), "BYTES"),
            inp("op", np.array([[op.encode()]], dtype=np.object_), "BYTES"),
            inp("input_ids", np.zeros((1, 0), dtype=np.int64), "INT64"),
            inp("peer_req", np.array([[json.dumps(payload or {}).encode()]], dtype=np.object_), "BYTES"),
        ])
        result, error = q.get(timeout=timeout_s)
        if error is not None:
            raise RuntimeError(f"{model} {op}: {error}")
        return json.loads(result.as_numpy("event").reshape(-1)[0])
    finally:
        c.stop_stream()
        c.close()


def model_stats(url: str, model: str) -> Dict[str, Any]:
    """Counters, KV usage and step-time breakdown of one model (see Subserver.stats)."""
    return model_op(url, model, "stats")


def configure(url: str, model: str, **settings: Any) -> Dict[str, Any]:
    """Change a model's scheduling settings at run time (delayed_batch_size, …)."""
    return model_op(url, model, "configure", settings)


def flush(url: str, model: str) -> Dict[str, Any]:
    """Empty ``model``'s prefix cache (its ``flush`` op); prefixes that requests in flight read stay.

    Returns:
        ``{"kind": "flushed", "model", "flushed_tokens", "prefix_cache_tokens"}`` (tokens).
    """
    return model_op(url, model, "flush")


def calibrate(url: str, model: str, batch_sizes=(1, 2, 4, 8), context: int = 256, decode_steps: int = 8,
              timeout_s: float = 3600.0) -> Dict[str, Any]:
    """Time synthetic steps of ``model`` at each batch size (the model's ``calibrate`` op).

    The model must be idle (no request running or pending). Returns the op's answer:
    ``{"kind": "calibration", "model", "context", "decode_steps", "table": [{"batch_size",
    "decode_latency_s" (list, s), "decode_median_s", "resume_latency_s", "resume_extend_tokens",
    "prefill"}], "seconds", "kv_tokens_in_use_after", "kv_rows_in_use_after"}``.

    Raises:
        RuntimeError: the model refused (busy, KV pool too small, bad arguments).
    """
    return model_op(url, model, "calibrate", {"batch_sizes": [int(b) for b in batch_sizes],
                                               "context": int(context), "decode_steps": int(decode_steps)},
                    timeout_s=timeout_s)
def events(url: str, model: str, since: int = 0, limit: Optional[int] = None) -> Dict[str, Any]:
    """The model's routing events after cursor ``since`` (its ``events`` op; what the router's
    online B* adaptation reads).

    Returns:
        ``{"kind": "events", "model", "events": [...], "cursor" (the next ``since``), "dropped",
        "reset", "delayed_batch_size", "delayed_batch_max_wait_us"}``
        (:meth:`tokenrouter.engine.event_ring.EventRing.read`).

    Raises:
        RuntimeError: bad arguments (``since`` < 0, ``limit`` outside 1..5000).
    """
    req: Dict[str, Any] = {"since": since}
    if limit is not None:
        req["limit"] = limit
    return model_op(url, model, "events", req)


def router_ready(url: str, router: str = "token_router", timeout_s: float = 30.0,
                 allow_degraded: bool = False) -> Dict[str, Any]:
    """Readiness of the whole routed path: one 1-token request through ``router``.

    Triton's ``/v2/health/ready`` only says that every model is loaded; it stays
    200 while a model's stub is dead.  This request is refused at once by a
    router in ``on_peer_failure: fail`` mode while a model it needs is down, and
    comes back ``degraded`` from one in ``fallback`` mode.

    Args:
        url: Triton gRPC address (host:port).
        router: the router model.
        timeout_s: seconds to wait for the answer.
        allow_degraded: count a degraded answer (fallback mode, a model down) as ready.

    Returns:
        ``{"ready": bool, "reason": str, "degraded": [models]}``.
    """
    import tritonclient.grpc as grpcclient

    from .cli import grpc_input as inp

    q: "queue.Queue" = queue.Queue()
    c = grpcclient.InferenceServerClient(url)
    try:
        c.start_stream(callback=lambda result, error: q.put((result, error)))
        c.async_stream_infer(router, [
            inp("text_input", np.array([b"ready?"], dtype=np.object_), "BYTES"),
            inp("sampling_parameters", np.array([b'{"max_tokens": 1, "temperature": 0}'], dtype=np.object_),
                "BYTES")])
        try:
            result, error = q.get(timeout=timeout_s)
        except queue.Empty:
            return {"ready": False, "reason": f"no answer from {router} in {timeout_s:.0f} s", "degraded": []}
        if error is not None:
            return {"ready": False, "reason": str(error), "degraded": []}
        summ = result.as_numpy("routing_summary")
        degraded = json.loads(summ.reshape(-1)[0]).get("degraded", []) if summ is not None and summ.size else []
        if degraded:
            return {"ready": bool(allow_degraded), "degraded": degraded,
                    "reason": f"degraded: {', '.join(degraded)} down (requests go on without it)"}
        return {"ready": True, "reason": "ok", "degraded": []}
    except Exception as e:  # noqa: BLE001 - a probe: not ready, with the reason
        return {"ready": False, "reason": str(e), "degraded": []}
    finally:
        try:
            c.stop_stream()
            c.close()
        except Exception:  # noqa: BLE001
            pass


def main(argv=None) -> int:
    """CLI: ``stats`` or ``configure`` for each of ``--models``; prints ``{model: answer}`` as JSON.
    ``ready``: readiness probe through the router (exit status 0 ready, 1 not).
    ``keys DIR``: write CURVE key files (prints their paths as JSON)."""
    import argparse
    import sys

    ap = argparse.ArgumentParser(prog="python -m tokenrouter.tools.admin", description=__doc__.split("\n\n")[0])
    ap.add_argument("op", choices=["stats", "configure", "calibrate", "events", "flush", "ready", "keys"])
    ap.add_argument("settings", nargs="?", default="",
                    help="configure: JSON object of scheduling settings, e.g. '{\"delayed_batch_size\": 2}'; "
                         "calibrate: optional JSON {\"batch_sizes\": [...], \"context\": C, \"decode_steps\": K}; "
                         "events: optional JSON {\"since\": cursor, \"limit\": n}; "
                         "keys: the folder to write CURVE keys into")
    ap.add_argument("--force", action="store_true", help="keys: replace existing keys")
    ap.add_argument("-o", "--output", help="write the JSON here instead of stdout")
    ap.add_argument("--url", default=default_grpc_url(), help=GRPC_URL_HELP)
    ap.add_argument("--models", default="slm,llm", help="comma-separated LLM models (default slm,llm)")
    ap.add_argument("--router", default="token_router", help="ready: the router model (default token_router)")
    ap.add_argument("--allow-degraded", action="store_true",
                    help="ready: a degraded answer (fallback mode, a model down) counts as ready")
    ap.add_argument("--timeout", type=float, default=30.0, help="ready: seconds to wait (default 30)")
    a = ap.parse_intermixed_args(argv)
    if a.op == "keys":
        from ..routing.curve import make_keys

        if not a.settings:
            ap.error("keys needs the folder to write the keys into")
        try:
            print(json.dumps(make_keys(a.settings, force=a.force), indent=1))
        except FileExistsError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        return 0
    if a.op == "ready":
        rep = router_ready(a.url, a.router, a.timeout, a.allow_degraded)
        print(json.dumps(rep))
        return 0 if rep["ready"] else 1
    settings: Dict[str, Any] = {}
    if a.op == "calibrate":
        try:
            settings = json.loads(a.settings or "{}")
        except json.JSONDecodeError as e:
            ap.error(f"calibrate takes a JSON object: {e}")
        if not isinstance(settings, dict) or set(settings) - {"batch_sizes", "context", "decode_steps"}:
            ap.error("calibrate takes a JSON object with batch_sizes, context, decode_steps")
        return _calibrate_file(a.url, [x.strip() for x in a.models.split(",") if x.strip()], settings, a.output)
    if a.op == "events":
        try:
            settings = json.loads(a.settings or "{}")
        except json.JSONDecodeError as e:
            ap.error(f"events takes a JSON object: {e}")
        if not isinstance(settings, dict) or set(settings) - {"since", "limit"}:
            ap.error("events takes a JSON object with since, limit")
    if a.op == "configure":
        try:
            settings = json.loads(a.settings)
        except json.JSONDecodeError as e:
            ap.error(f"configure takes a JSON object of settings: {e}")
        if not isinstance(settings, dict) or not settings:
            ap.error("configure takes a non-empty JSON object of settings")
    out: Dict[str, Any] = {}
    try:
        for m in [x.strip() for x in a.models.split(",") if x.strip()]:
            if a.op == "stats":
                out[m] = model_stats(a.url, m)
            elif a.op == "events":
                out[m] = events(a.url, m, **settings)
            elif a.op == "flush":
                out[m] = flush(a.url, m)
            else:
                out[m] = configure(a.url, m, **settings)
    except Exception as e:  # noqa: BLE001 - a CLI: report and exit non-zero
        if out:  # the models that answered before the error
            print(json.dumps(out, indent=1))
        print(f"error: {e}", file=sys.stderr)
        return 1
    _emit(out, a.output)
    return 0


def _emit(obj: Any, path: Optional[str]) -> None:
    text = json.dumps(obj, indent=1)
    if path:
        with open(path, "w") as fh:
            fh.write(text + "\n")
    else:
        print(text)


def _calibrate_file(url: str, models, settings: Dict[str, Any], path: Optional[str]) -> int:
    """``calibrate``: each model in turn; the calibration file (:func:`scheduler_model.calibrate.run_calibration`)
    to ``path`` or stdout. Exit status 1 (the error on stderr) if a model refuses or cannot be reached."""
    import sys

    from scheduler_model.calibrate import DEFAULT_BATCH_SIZES, run_calibration

    try:
        calib = run_calibration(url, models, settings.get("batch_sizes", DEFAULT_BATCH_SIZES),
                                context=settings.get("context", 256), decode_steps=settings.get("decode_steps", 8),
                                calibrate=calibrate)
    except Exception as e:  # noqa: BLE001 - a CLI: report and exit non-zero
        print(f"error: {e}", file=sys.stderr)
        return 1
    _emit(calib, path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
