"""Command-line client: stream a prompt's answer from ``token_router`` and print the routing summary.

Usage::

    python -m tokenrouter.tools.cli "What is the capital of France?"
    python -m tokenrouter.tools.cli --url localhost:8001 --max-tokens 128 --temperature 0.7 --trace "Tell me a story"

Uses Triton's gRPC streaming API (tritonclient), as any Triton client would.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from typing import Any, Dict, Optional

import numpy as np

from . import GRPC_URL_HELP, default_grpc_url

__all__ = ["grpc_input", "stream_generate", "RequestAborted", "main"]


def grpc_input(name: str, array: np.ndarray, dtype: str):
    """A ``tritonclient.grpc.InferInput`` named ``name`` holding ``array`` (Triton dtype ``dtype``,
    e.g. ``"BYTES"``, ``"BOOL"``, ``"INT64"``; shape taken from the array)."""
    import tritonclient.grpc as grpcclient

    x = grpcclient.InferInput(name, list(array.shape), dtype)
    x.set_data_from_numpy(array)
    return x


def _inputs(grpcclient, prompt: str, sampling: Dict[str, Any], stream: bool, chat: bool, trace: bool):
    t = grpc_input
    return [
        t("text_input", np.array([prompt.encode("utf-8")], dtype=np.object_), "BYTES"),
        t("stream", np.array([stream]), "BOOL"),
        t("sampling_parameters", np.array([json.dumps(sampling).encode()], dtype=np.object_), "BYTES"),
        t("apply_chat_template", np.array([chat]), "BOOL"),
        t("return_routing_trace", np.array([trace]), "BOOL"),
    ]


class RequestAborted(RuntimeError):
    """A streamed request the client gave up on (:func:`stream_generate`'s ``abort``); it was cancelled."""


def stream_generate(url: str, prompt: str, sampling: Dict[str, Any], *, chat: bool = True,
                    trace: bool = False, model: str = "token_router", on_text=None,
                    timeout_s: float = 600.0, abort: Optional[threading.Event] = None) -> Dict[str, Any]:
    """Stream one request through gRPC and return the final fields.

    Args:
        url: gRPC address ``host:port``.
        prompt: prompt text.
        sampling: sampling parameters dict (max_tokens, temperature, …).
        chat: apply the model's chat template.
        trace: ask for the per-token model trace.
        on_text: callback receiving each text delta as it arrives (called on the gRPC
            stream's thread, in order).
        timeout_s: seconds to wait for the next response (the request is cancelled
            on the server when none comes).
        abort: when this event is set the request is cancelled on the server and
            :class:`RequestAborted` is raised (checked every 0.1 s).

    Returns:
        dict with ``text``, ``finish_reason``, ``num_input_tokens``,
        ``num_output_tokens``, ``routing_summary`` (dict) and ``routing_trace``.

    Raises:
        RuntimeError: the server answered with an error, or sent nothing for ``timeout_s``.
        RequestAborted: ``abort`` was set before the final response.
    """
    import tritonclient.grpc as grpcclient

    text: list = []
    out: Dict[str, Any] = {}
    failure: list = []
    done = threading.Event()
    last = [time.monotonic()]  # arrival of the latest response

    def on_response(result, error) -> None:
        # each response is read on the stream's own thread: no hand-over to the caller per chunk
        last[0] = time.monotonic()
        if done.is_set():
            return
        try:
            if error is not None:
                raise RuntimeError(str(error))
            delta = result.as_numpy("text_output")
            if delta is not None and delta.size:
                s = delta.reshape(-1)[0].decode("utf-8")
                text.append(s)
                if on_text:
                    on_text(s)
            for name in ("finish_reason", "routing_summary", "routing_trace"):
                v = result.as_numpy(name)
                if v is not None and v.size:
                    out[name] = v.reshape(-1)[0].decode("utf-8")
            for name in ("num_input_tokens", "num_output_tokens"):
                v = result.as_numpy(name)
                if v is not None and v.size:
                    out[name] = int(v.reshape(-1)[0])
            final = result.get_response().parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                done.set()
        except Exception as e:  # noqa: BLE001 - re-raised in the caller
            failure.append(e)
            done.set()

    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=on_response)
    finished = False
    try:
        try:
            client.async_stream_infer(model, _inputs(grpcclient, prompt, sampling, True, chat, trace),
                                      enable_empty_final_response=True)
        except Exception as e:  # noqa: BLE001
            # a stream that broke (server unreachable) reports the cause to the callback;
            # tritonclient's own exception then only says the stream is no longer valid
            if done.wait(0.5) and failure:
                raise failure[0] from e
            raise
        last[0] = time.monotonic()
        poll = 1.0 if abort is None else 0.1
        while not done.wait(min(poll, max(0.0, last[0] + timeout_s - time.monotonic()))):
            if abort is not None and abort.is_set():
                raise RequestAborted(f"{model} request aborted by the client")
            if time.monotonic() - last[0] >= timeout_s:
                raise RuntimeError(f"{model} sent nothing for {timeout_s:g} s")
        if failure:
            raise failure[0]
        finished = True
        out["text"] = "".join(text)
        if "routing_summary" in out:
            out["routing_summary"] = json.loads(out["routing_summary"])
        if "routing_trace" in out:
            out["routing_trace"] = json.loads(out["routing_trace"])
        return out
    finally:
        client.stop_stream(cancel_requests=not finished)  # a request given up on is cancelled, not awaited
        client.close()


def main(argv: Optional[list] = None) -> int:
    """CLI entry point; returns the process exit code."""
    ap = argparse.ArgumentParser(prog="python -m tokenrouter.tools.cli", description=__doc__.split("\n\n")[0])
    ap.add_argument("prompt")
    ap.add_argument("--url", default=default_grpc_url(), help=GRPC_URL_HELP)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=None)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--threshold", type=float, default=None, help="override the routing threshold")
    ap.add_argument("--no-chat", action="store_true", help="send the prompt raw (no chat template)")
    ap.add_argument("--trace", action="store_true", help="print which model wrote each token")
    a = ap.parse_args(argv)
    sampling: Dict[str, Any] = {"max_tokens": a.max_tokens, "temperature": a.temperature}
    if a.top_p is not None:
        sampling["top_p"] = a.top_p
    if a.seed is not None:
        sampling["seed"] = a.seed
    if a.threshold is not None:
        sampling["routing_threshold"] = a.threshold
    streamed = []

    def show(text: str) -> None:
        streamed.append(True)
        sys.stdout.write(text)
        sys.stdout.flush()

    try:
        out = stream_generate(a.url, a.prompt, sampling, chat=not a.no_chat, trace=a.trace, on_text=show)
    except KeyboardInterrupt:  # Ctrl-C: the stream closes, and the server cancels the request
        print(("\n" if streamed else "") + "cancelled", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001
        print(("\n" if streamed else "") + f"error: {e}", file=sys.stderr)
        return 1
    s = out.get("routing_summary", {})
    print()
    print(f"--- finish_reason={out.get('finish_reason')} input_tokens={out.get('num_input_tokens')} "
          f"output_tokens={out.get('num_output_tokens')}")
    by = s.get("tokens_by_model", {})
    total = sum(by.values()) or 1
    print("--- routing (" + s.get("algorithm", "?") + "): " +
          ", ".join(f"{m} wrote {n} ({100.0 * n / total:.0f}%)" for m, n in by.items()) +
          f"; handoffs {s.get('handoffs', 0)} {s.get('handoffs_by_pair', {})}")
    if a.trace and "routing_trace" in out:
        names = out["routing_trace"]["models"]
        print("--- trace: " + "".join(str(i) for i in out["routing_trace"]["trace"]) +
              "  (" + ", ".join(f"{i}={n}" for i, n in enumerate(names)) + ")")
    return 0


if __name__ == "__main__":
    sys.exit(main())
