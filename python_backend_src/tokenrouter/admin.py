"""Operator calls to a model subserver (``stats``, ``configure``, ``release``) over Triton gRPC.

The LLM models are decoupled, so each call is one request on a gRPC stream
answered by one final response whose ``event`` output is JSON.
"""

from __future__ import annotations

import json
import queue
from typing import Any, Dict, Optional

import numpy as np

__all__ = ["model_op", "model_stats", "configure"]


def model_op(url: str, model: str, op: str, payload: Optional[Dict[str, Any]] = None,
             request_id: str = "admin", timeout_s: float = 60.0) -> Dict[str, Any]:
    """Send ``op`` to ``model`` at gRPC ``url``; return the decoded ``event`` JSON.

    Raises:
        RuntimeError: the model answered with an error.
    """
    import tritonclient.grpc as grpcclient

    def inp(name, arr, dtype):
        x = grpcclient.InferInput(name, list(arr.shape), dtype)
        x.set_data_from_numpy(arr)
        return x

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
