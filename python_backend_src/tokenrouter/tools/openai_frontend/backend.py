"""The front end's Triton client: one ``token_router`` request per HTTP request, on a gRPC stream."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, AsyncIterator, Dict, List, Optional, Tuple

import numpy as np

from .errors import BackendError

__all__ = ["GenerationOutput", "TritonBackend"]


@dataclass
class GenerationOutput:
    """One response of ``token_router``.

    Attributes:
        text: ``text_output`` (a delta when streaming; the whole completion in the
            final response of a non-streamed request).
        final: the last response of the request.
        finish_reason: ``stop`` or ``length`` (final response only).
        prompt_tokens / completion_tokens: ``num_input_tokens`` /
            ``num_output_tokens`` (final response only).
        routing_summary / routing_trace: decoded JSON (final response only).
        logprobs: the ``logprobs`` output, decoded JSON (vllm_backend's: per output token of this
            response ``{"<id>": {"logprob", "rank", "decoded_token"}, ...}``), when the request's
            ``sampling_parameters`` asked for them.
    """

    text: str = ""
    final: bool = False
    finish_reason: Optional[str] = None
    prompt_tokens: Optional[int] = None
    completion_tokens: Optional[int] = None
    routing_summary: Optional[Dict[str, Any]] = None
    routing_trace: Optional[Dict[str, Any]] = None
    logprobs: Optional[List[Any]] = None


class TritonBackend:
    """Sends requests to ``token_router`` over a Triton gRPC stream (``tritonclient.grpc.aio``).

    Args:
        url: Triton gRPC address ``host:port``.
        model: the Triton model (``token_router``).

    Create it inside the running event loop (the gRPC channel binds to it).
    """

    def __init__(self, url: str, model: str = "token_router"):
        import tritonclient.grpc.aio as grpcaio

        self.url, self.model = url, model
        self._grpc = grpcaio
        self.client = grpcaio.InferenceServerClient(url)

    async def close(self) -> None:
        await self.client.close()

    async def model_ready(self) -> bool:
        """Whether Triton answers and reports the model ready (False on any error)."""
        try:
            return bool(await self.client.is_model_ready(self.model))
        except Exception:  # noqa: BLE001 - unreachable server, unknown model
            return False

    async def model_parameters(self) -> Dict[str, str]:
        """The ``parameters`` of the model's Triton config (string values)."""
        cfg = await self.client.get_model_config(self.model, as_json=True)
        params = cfg.get("config", {}).get("parameters", {}) or {}
        return {k: (v.get("string_value", "") if isinstance(v, dict) else str(v)) for k, v in params.items()}

    def _inputs(self, prompt: str, sampling: Dict[str, Any], stream: bool, trace: bool) -> List[Any]:
        from ..cli import grpc_input as t

        return [
            t("text_input", np.array([prompt.encode("utf-8")], dtype=np.object_), "BYTES"),
            t("stream", np.array([stream]), "BOOL"),
            t("sampling_parameters", np.array([json.dumps(sampling).encode("utf-8")], dtype=np.object_), "BYTES"),
            t("apply_chat_template", np.array([False]), "BOOL"),
            t("exclude_input_in_output", np.array([True]), "BOOL"),
            t("return_routing_trace", np.array([trace]), "BOOL"),
        ]

    async def generate(self, prompt: str, sampling: Dict[str, Any], *, stream: bool, trace: bool = False,
                       request_id: str = "") -> AsyncIterator[GenerationOutput]:
        """Run one request; yield its responses, the last with ``final=True``.

        Args:
            prompt: the prompt text, sent as is (``apply_chat_template`` false,
                ``exclude_input_in_output`` true).
            sampling: the ``sampling_parameters`` object (sent as JSON with typed values).
            stream: ask for text deltas (else one final response with the whole text).
            trace: ask for ``routing_trace``.
            request_id: Triton request id (shows in the server's logs).

        Raises:
            BackendError: the router or Triton answered with an error, or the gRPC
                call failed (e.g. Triton is not reachable).

        Closing the generator before the final response (``aclose()``, or the
        task awaiting it being cancelled) cancels the gRPC call, and with it the
        request on the server.
        """
        done = asyncio.Event()
        req = {"model_name": self.model, "inputs": self._inputs(prompt, sampling, stream, trace),
               "request_id": request_id, "parameters": {"triton_enable_empty_final_response": True}}

        async def requests():
            yield req
            await done.wait()  # keep the stream open until the final response

        call = self.client.stream_infer(requests())
        finished = False
        try:
            while True:
                try:
                    result, error = await call.__anext__()
                except StopAsyncIteration:
                    raise BackendError("Triton closed the stream before the final response") from None
                except self._grpc_errors() as e:
                    raise BackendError(_rpc_message(e, self.url)) from None
                if error is not None:
                    finished = True
                    raise BackendError(str(error.message() if hasattr(error, "message") else error))
                out = _decode(result)
                if out.final:
                    finished = True
                    yield out
                    return
                if out.text or out.logprobs:
                    yield out
        finally:
            done.set()
            if not finished:
                call.cancel()

    def _grpc_errors(self) -> Tuple[type, ...]:
        import grpc

        return (grpc.aio.AioRpcError, self._grpc.InferenceServerException)


def _rpc_message(e: Exception, url: str) -> str:
    """The message of a failed gRPC call (``UNAVAILABLE`` names the Triton address ``url``)."""
    code = getattr(e, "code", None)
    try:
        name = code().name if callable(code) else ""
    except Exception:  # noqa: BLE001
        name = ""
    details = e.details() if hasattr(e, "details") and callable(e.details) else str(e)
    if name == "UNAVAILABLE":
        return f"Triton at {url} is unavailable: {details}"
    return f"Triton gRPC error {name}: {details}".strip()


def _decode(result) -> GenerationOutput:
    """A tritonclient ``InferResult`` of ``token_router`` as a :class:`GenerationOutput`."""
    out = GenerationOutput()
    params = result.get_response().parameters
    p = params.get("triton_final_response")
    out.final = bool(p is not None and p.bool_param)

    def one(name):
        v = result.as_numpy(name)
        if v is None or not v.size:
            return None
        return v.reshape(-1)[0]

    t = one("text_output")
    if t is not None:
        out.text = t.decode("utf-8") if isinstance(t, bytes) else str(t)
    fr = one("finish_reason")
    if fr is not None:
        out.finish_reason = fr.decode() if isinstance(fr, bytes) else str(fr)
    for name, attr in (("num_input_tokens", "prompt_tokens"), ("num_output_tokens", "completion_tokens")):
        v = one(name)
        if v is not None:
            setattr(out, attr, int(v))
    for name in ("routing_summary", "routing_trace", "logprobs"):
        v = one(name)
        if v is not None:
            setattr(out, name, json.loads(v))
    return out
