"""OpenAI-compatible HTTP front end for ``token_router`` (FastAPI + uvicorn, Triton gRPC streaming).

Endpoints: ``GET /v1/models``, ``GET /v1/models/{model}``, ``POST /v1/completions``,
``POST /v1/chat/completions`` (both with SSE streaming) and ``GET /health``.
Every request becomes one ``token_router`` request on a Triton gRPC stream;
a client that disconnects (or cancels a stream) cancels that gRPC call, and the
router then frees the request's KV on every model.

Run it beside a Triton server that serves ``token_router``::

    python -m tokenrouter.tools.openai_frontend --triton-url localhost:8001 --port 9000

(``deploy/serve`` starts it on ``--openai-port``, default 9000.)

Request fields (OpenAI semantics): ``model``, ``max_tokens`` (chat also
``max_completion_tokens``), ``temperature`` (0 … 2; 0 = greedy), ``top_p``
(0 < p ≤ 1), ``stop`` (a string or a list), ``seed`` (0 … 2^63−1), ``n`` (1
only), ``stream`` and ``stream_options.include_usage``. vLLM-style extensions
are passed on to ``token_router``'s ``sampling_parameters``: ``top_k``,
``ignore_eos``, ``min_tokens``, ``repetition_penalty``, ``presence_penalty``,
``frequency_penalty``, ``stop_token_ids`` (neutral values are not sent), and
TokenRouter's ``routing_threshold``. ``return_routing_trace: true`` adds the
per-token ``routing_trace``; ``chat_template_kwargs`` go to the chat template.
An unknown field gets a 400 naming it.

Responses carry ``usage`` (prompt / completion tokens as counted by the
router), ``finish_reason`` (``stop`` or ``length``) and the extension field
``routing_summary`` (algorithm, ``tokens_by_model``, ``handoffs``, …; in a
stream, on the chunk with the ``finish_reason``). Errors use OpenAI's format
``{"error": {"message", "type", "param", "code"}}``.

Limits (each refusal names the limit and its value; ``docs/reliability.md``): the request
body is at most ``--max-body-bytes`` (default 4 MiB), checked on ``Content-Length`` and on
the bytes received before the body is read whole: 413 ``request_too_large``; a chat has at
most ``--max-messages`` messages (default 256): 400; more than ``--max-connections`` (default
256) at once are answered 503 by uvicorn.  The router's own limits (prompt bytes,
stop strings, ...) come back as 400 naming them.  A busy server (a full queue, a queue
timeout: the router's Triton ``UNAVAILABLE``) is a 503 ``server_busy`` with ``Retry-After``.

Chat messages (any number of turns, roles ``system``/``developer``, ``user``,
``assistant``; content a string or a list of text parts) are rendered with the
tokenizer's chat template here and sent as raw text, since ``token_router``'s
``apply_chat_template`` input wraps one user turn only. The tokenizer is the
folder given by ``--tokenizer``, else the ``tokenizer_path`` parameter of the
Triton model's config (resolved under ``$TOKENROUTER_WEIGHTS``), loaded on the
first chat request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import sys
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Dict, List, Optional, Tuple, Union

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import GRPC_URL_HELP, default_grpc_url

__all__ = ["OpenAIError", "TritonBackend", "BackendError", "GenerationOutput", "create_app",
           "render_chat", "main", "DEFAULT_PORT"]

logger = logging.getLogger("tokenrouter.tools.openai_frontend")

#: default HTTP port of the front end (``deploy/serve --openai-port``)
DEFAULT_PORT = 9000
#: the largest seed the router accepts (torch.Generator seeds are signed 64-bit)
MAX_SEED = 2**63 - 1
#: default ``--max-body-bytes``: the largest request body read (413 above it)
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
#: default ``--max-messages``: the most chat messages in one request
DEFAULT_MAX_MESSAGES = 256
#: default ``--max-connections``: connections served at once (uvicorn's ``limit_concurrency``)
DEFAULT_MAX_CONNECTIONS = 256
#: start of the router's "busy" messages (tokenrouter.engine.subserver.BUSY_PREFIX)
BUSY_PREFIX = "busy: "


# --------------------------------------------------------------------------- errors
class OpenAIError(Exception):
    """An error answered in OpenAI's format with an HTTP status.

    Args:
        status: HTTP status code (400 bad request, 404 unknown model, 500, 503).
        message: human-readable text.
        type: OpenAI error type (``invalid_request_error``, ``server_error``, …).
        param: the request field at fault, or None.
        code: a short machine-readable code, or None.
    """

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None,
                 headers: Optional[Dict[str, str]] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> Dict[str, Any]:
        """``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        """The error as the OpenAI API sends it: ``{"error": {...}}`` with this HTTP status."""
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class BackendError(RuntimeError):
    """``token_router`` (or Triton) answered a request with an error; ``str()`` is its message."""


class _ClientGone(Exception):
    """The HTTP client disconnected while its request was running."""


class _ServerDraining(Exception):
    """The front end is shutting down and the request's grace period is over."""


SHUTTING_DOWN = "server is shutting down"


def _shutting_down() -> "OpenAIError":
    """The error a request still running after the shutdown grace period ends with (503)."""
    return OpenAIError(503, SHUTTING_DOWN, type="server_error", code="server_shutting_down")


#: substrings of the router's messages for bad input (its ClientError texts); anything
#: else from the router is a server-side failure
_CLIENT_ERROR_HINTS = ("context length", "parameters.", "sampling_parameters", "text_input", "unknown keys",
                       "has no threshold", "routing_threshold")


def _backend_error(msg: str, chat: bool = False) -> OpenAIError:
    """Map an error message from Triton / ``token_router`` to an :class:`OpenAIError`.

    ``chat``: the request was a chat completion, whose prompt field is ``messages``.
    """
    prompt_param = "messages" if chat else "prompt"
    low = msg.lower()
    if BUSY_PREFIX in msg:  # a full queue or a queue timeout: overload, not failure
        return OpenAIError(503, msg, type="server_error", code="server_busy", headers={"Retry-After": "1"})
    if any(h in low for h in _CLIENT_ERROR_HINTS):
        m = re.search(r"parameters\.(\w+)", msg) or re.search(r"unknown keys[^\[]*\['(\w+)'", msg)
        if m:
            param = m.group(1)
            # the request's field by its OpenAI name, not by token_router's input it travelled in
            msg = re.sub(r"\bsampling_parameters\.(?=\w)", "", msg)
        elif "context length" in low:
            param = "max_tokens" if "max_tokens" in low else prompt_param
        else:
            param = prompt_param if "text_input" in low else None
        return OpenAIError(400, msg, param=param)
    if "unknown model" in low or "not ready" in low or "unavailable" in low:
        return OpenAIError(503, msg, type="server_error", code="backend_unavailable")
    return OpenAIError(500, msg, type="server_error")


# ----------------------------------------------------------------- Triton client
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
    """

    text: str = ""
    final: bool = False
    finish_reason: Optional[str] = None
    prompt_tokens: Optional[int] = None
    completion_tokens: Optional[int] = None
    routing_summary: Optional[Dict[str, Any]] = None
    routing_trace: Optional[Dict[str, Any]] = None


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
        from .cli import grpc_input as t

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
                if out.text:
                    yield out
        finally:
            done.set()
            if not finished:
                call.cancel()

    def _grpc_errors(self) -> Tuple[type, ...]:
        import grpc

        return (grpc.aio.AioRpcError, self._grpc.InferenceServerException)


def _rpc_message(e: Exception, url: str) -> str:
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
    for name in ("routing_summary", "routing_trace"):
        v = one(name)
        if v is not None:
            setattr(out, name, json.loads(v))
    return out


# ------------------------------------------------------------------- tokenizer
def load_tokenizer(path: str):
    """A Hugging Face tokenizer from a checkpoint folder (for its chat template).

    Uses ``PreTrainedTokenizerFast`` when the folder has ``tokenizer.json`` (no
    torch import), else ``AutoTokenizer``.

    Raises:
        OSError / ValueError: the folder holds no loadable tokenizer.
    """
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(path)
    from ..engine.sglang_cpu_compat import install

    install()  # transformers' model imports load torchvision (a CUDA build here)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def render_chat(tokenizer, messages: Any, template_kwargs: Optional[Dict[str, Any]] = None) -> str:
    """Render OpenAI chat ``messages`` into the prompt text with the tokenizer's chat template.

    Args:
        tokenizer: a Hugging Face tokenizer with a ``chat_template``.
        messages: list of ``{"role", "content"}``; roles ``system``, ``developer``
            (rendered as ``system``), ``user``, ``assistant``; content a string or a
            list of ``{"type": "text", "text": …}`` parts (joined).
        template_kwargs: extra variables for the template (e.g. ``enable_thinking``).

    Returns:
        The prompt text ending with the generation prompt (the assistant turn's
        header). When the tokenizer adds a BOS token itself on encoding, a BOS
        the template wrote is removed so the router does not get two.

    Raises:
        OpenAIError: 400 for a malformed message, an unsupported role or content
            part, a tokenizer without a chat template, or a template error.
    """
    if not isinstance(messages, list) or not messages:
        raise OpenAIError(400, "messages must be a non-empty list", param="messages")
    conv = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise OpenAIError(400, f"{where} must be an object", param=where)
        role = m.get("role")
        if role not in _ROLES:
            raise OpenAIError(400, f"{where}.role {role!r} is not supported (system, developer, user, "
                              "assistant; tools are not supported)", param=f"{where}.role")
        if m.get("tool_calls") or m.get("function_call"):
            raise OpenAIError(400, f"{where}: tool calls are not supported", param=f"{where}.tool_calls")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise OpenAIError(400, f"{where}.content[{j}]: only text parts are supported",
                                      param=f"{where}.content")
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise OpenAIError(400, f"{where}.content must be a string or a list of text parts",
                              param=f"{where}.content")
        conv.append({"role": _ROLES[role], "content": content})
    if not getattr(tokenizer, "chat_template", None):
        raise OpenAIError(400, "the model's tokenizer has no chat template; use /v1/completions",
                          param="messages")
    try:
        text = tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=False,
                                             **(template_kwargs or {}))
    except Exception as e:  # noqa: BLE001 - jinja2 TemplateError, raise_exception() in templates
        raise OpenAIError(400, f"chat template: {e}", param="messages") from None
    bos = getattr(tokenizer, "bos_token", None)
    if bos and text.startswith(bos):
        ids = tokenizer.encode("a")
        if ids and ids[0] == tokenizer.bos_token_id:
            text = text[len(bos):]
    return text


# ------------------------------------------------------------- request models
class _StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: Optional[bool] = False


class _Common(BaseModel):
    """Fields shared by completions and chat completions (unknown ones land in ``model_extra``)."""

    model_config = ConfigDict(extra="allow")
    model: str
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    n: Optional[int] = None
    stop: Optional[Union[str, List[str]]] = None
    seed: Optional[int] = None
    stream: Optional[bool] = False
    stream_options: Optional[_StreamOptions] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[Dict[str, float]] = None
    user: Optional[str] = None
    # vLLM-style and TokenRouter extensions
    top_k: Optional[int] = None
    min_tokens: Optional[int] = None
    repetition_penalty: Optional[float] = None
    ignore_eos: Optional[bool] = None
    stop_token_ids: Optional[List[int]] = None
    routing_threshold: Optional[float] = None
    return_routing_trace: Optional[bool] = False


class CompletionRequest(_Common):
    """``POST /v1/completions`` body."""

    prompt: Union[str, List[str], List[int], List[List[int]]]
    echo: Optional[bool] = False
    logprobs: Optional[int] = None
    best_of: Optional[int] = None
    suffix: Optional[str] = None


class ChatCompletionRequest(_Common):
    """``POST /v1/chat/completions`` body."""

    messages: List[Any]
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = None
    tools: Optional[List[Any]] = None
    tool_choice: Optional[Any] = None
    response_format: Optional[Dict[str, Any]] = None
    chat_template_kwargs: Optional[Dict[str, Any]] = None


#: accepted and ignored (they change nothing for a single text completion)
_IGNORED_FIELDS = {"metadata", "store", "service_tier", "parallel_tool_calls", "modalities", "prediction"}


def _sampling(req: _Common, max_tokens: Optional[int]) -> Dict[str, Any]:
    """Validate a request's generation settings; return ``sampling_parameters`` (typed JSON values).

    Raises:
        OpenAIError: 400 naming the field.
    """
    extra = sorted(set(req.model_extra or {}) - _IGNORED_FIELDS)
    if extra:
        raise OpenAIError(400, f"Unrecognized request argument supplied: {extra[0]}", param=extra[0],
                          code="unsupported_parameter")
    if req.n is not None and req.n != 1:
        raise OpenAIError(400, f"n must be 1 (token_router writes one choice per request), got {req.n}",
                          param="n", code="unsupported_value")
    if req.logit_bias:
        raise OpenAIError(400, "logit_bias is not supported", param="logit_bias", code="unsupported_parameter")
    sp: Dict[str, Any] = {}
    if max_tokens is not None:
        if max_tokens < 1:
            raise OpenAIError(400, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens",
                              code="invalid_value")
        sp["max_tokens"] = max_tokens
    if req.temperature is not None:
        if not 0.0 <= req.temperature <= 2.0:
            raise OpenAIError(400, f"temperature must be between 0 and 2, got {req.temperature}",
                              param="temperature", code="invalid_value")
        sp["temperature"] = req.temperature
    if req.top_p is not None:
        if not 0.0 < req.top_p <= 1.0:
            raise OpenAIError(400, f"top_p must be in (0, 1], got {req.top_p}", param="top_p", code="invalid_value")
        sp["top_p"] = req.top_p
    if req.seed is not None:
        if not 0 <= req.seed <= MAX_SEED:
            raise OpenAIError(400, f"seed must be between 0 and {MAX_SEED}, got {req.seed}", param="seed",
                              code="invalid_value")
        sp["seed"] = req.seed
    if req.stop is not None:
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop)
        if any(not s for s in stop):
            raise OpenAIError(400, "stop strings must not be empty", param="stop", code="invalid_value")
        if stop:
            sp["stop"] = stop
    # extensions: sent only when they change something (token_router rejects keys it lacks)
    for key, neutral in (("top_k", (0, -1)), ("min_tokens", (0,)), ("repetition_penalty", (1.0,)),
                         ("presence_penalty", (0.0,)), ("frequency_penalty", (0.0,)), ("ignore_eos", (False,)),
                         ("stop_token_ids", ([],))):
        v = getattr(req, key)
        if v is not None and v not in neutral:
            sp[key] = v
    if req.routing_threshold is not None:
        sp["routing_threshold"] = req.routing_threshold
    return sp


def _check_model(req: _Common, served: str) -> None:
    if req.model != served:
        raise OpenAIError(404, f"The model '{req.model}' does not exist; this server serves '{served}'",
                          param="model", code="model_not_found")


# ------------------------------------------------------------------------- app
@dataclass
class _State:
    backend: Optional[TritonBackend] = None
    tokenizer: Any = None
    tokenizer_lock: Optional[asyncio.Lock] = None
    tokenizer_path: Optional[str] = None
    created: int = field(default_factory=lambda: int(time.time()))
    loop: Optional[asyncio.AbstractEventLoop] = None
    draining: Optional[asyncio.Event] = None  # set: requests still running end with SHUTTING_DOWN

    def drain(self, grace_s: float) -> None:
        """Begin the shutdown: requests still running after ``grace_s`` seconds end with a
        "server is shutting down" error (streams: an error event and ``[DONE]``; others: 503),
        and their Triton requests are cancelled.  Safe from any thread, a signal handler
        included; a no-op before the application started."""
        if self.loop is None or self.draining is None:
            return
        draining = self.draining
        self.loop.call_soon_threadsafe(lambda: self.loop.call_later(max(0.0, grace_s), draining.set))


def create_app(triton_url: str, *, model: str = "token_router", served_model_name: Optional[str] = None,
               tokenizer_path: Optional[str] = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               max_messages: int = DEFAULT_MAX_MESSAGES) -> FastAPI:
    """The FastAPI application.

    Args:
        triton_url: Triton gRPC address ``host:port``.
        model: the Triton model requests go to.
        served_model_name: the name clients use in ``model`` (default: ``model``).
        tokenizer_path: checkpoint folder whose chat template renders chat
            messages; default: the Triton model's ``tokenizer_path`` parameter,
            resolved as the server resolves it.
        max_body_bytes: the largest request body in bytes; a larger one is answered 413
            before it is read whole (its ``Content-Length``, else the bytes as they arrive:
            FastAPI's ``max_body_size``).
        max_messages: the most chat messages in one request (400 above).
    """
    served = served_model_name or model
    st = _State(tokenizer_path=tokenizer_path)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        st.backend = TritonBackend(triton_url, model)
        st.tokenizer_lock = asyncio.Lock()
        st.loop, st.draining = asyncio.get_running_loop(), asyncio.Event()
        try:
            yield
        finally:
            await st.backend.close()

    app = FastAPI(title="TokenRouter OpenAI-compatible API", lifespan=lifespan, max_body_size=max_body_bytes)
    app.state.tokenrouter = st

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        if e.status_code == 413:  # FastAPI's body limit: before the body was read whole
            size = request.headers.get("content-length")
            got = f"is {size} bytes" if size else f"is over {max_body_bytes} bytes"
            return OpenAIError(413, f"request body {got}; the limit is {max_body_bytes} bytes (--max-body-bytes)",
                               code="request_too_large").response()
        return OpenAIError(e.status_code, str(e.detail), type="invalid_request_error" if e.status_code < 500
                           else "server_error").response()

    @app.exception_handler(OpenAIError)
    async def _openai_error(_request: Request, e: OpenAIError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        msg = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            return OpenAIError(400, f"request body is not valid JSON: {first.get('ctx', {}).get('error', msg)}",
                               code="invalid_json").response()
        return OpenAIError(400, f"{param}: {msg}" if param else msg, param=param, code="invalid_value").response()

    @app.exception_handler(Exception)
    async def _internal_error(_request: Request, e: Exception):
        logger.exception("openai front end: internal error")
        return OpenAIError(500, f"internal error: {e}", type="server_error").response()

    def _model_card() -> Dict[str, Any]:
        return {"id": served, "object": "model", "created": st.created, "owned_by": "tokenrouter"}

    @app.get("/health")
    async def health():
        if await st.backend.model_ready():
            return {"status": "ok", "triton": triton_url, "model": model}
        return JSONResponse({"status": "unavailable", "triton": triton_url, "model": model}, status_code=503)

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [_model_card()]}

    @app.get("/v1/models/{name:path}")
    async def get_model(name: str):
        if name != served:
            raise OpenAIError(404, f"The model '{name}' does not exist", param="model", code="model_not_found")
        return _model_card()

    async def _tokenizer():
        if st.tokenizer is not None:
            return st.tokenizer
        async with st.tokenizer_lock:
            if st.tokenizer is None:
                path = st.tokenizer_path
                if path is None:
                    from ..triton.common import resolve_model_path

                    try:
                        params = await st.backend.model_parameters()
                        path = resolve_model_path(params.get("tokenizer_path") or "smollm2-135m-instruct")
                    except Exception as e:  # noqa: BLE001
                        raise OpenAIError(503, f"cannot find the tokenizer of {model!r} (give --tokenizer): {e}",
                                          type="server_error", code="tokenizer_unavailable") from None
                try:
                    st.tokenizer = await asyncio.to_thread(load_tokenizer, path)
                except Exception as e:  # noqa: BLE001
                    raise OpenAIError(500, f"cannot load the tokenizer from {path}: {e}",
                                      type="server_error") from None
                st.tokenizer_path = path
        return st.tokenizer

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        _check_model(body, served)
        if body.echo:
            raise OpenAIError(400, "echo is not supported", param="echo", code="unsupported_parameter")
        if body.suffix:
            raise OpenAIError(400, "suffix is not supported", param="suffix", code="unsupported_parameter")
        if body.best_of not in (None, 1):
            raise OpenAIError(400, "best_of must be 1", param="best_of", code="unsupported_value")
        if body.logprobs:
            raise OpenAIError(400, "logprobs are not supported", param="logprobs", code="unsupported_parameter")
        prompt = body.prompt
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise OpenAIError(400, "prompt must be one string (lists of prompts and token ids are not supported)",
                              param="prompt", code="unsupported_value")
        if not prompt.strip():
            raise OpenAIError(400, "prompt is empty", param="prompt", code="invalid_value")
        sp = _sampling(body, body.max_tokens)
        return await _generate(request, body, prompt, sp, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        _check_model(body, served)
        if body.logprobs or body.top_logprobs:
            raise OpenAIError(400, "logprobs are not supported", param="logprobs", code="unsupported_parameter")
        if body.tools:
            raise OpenAIError(400, "tools are not supported", param="tools", code="unsupported_parameter")
        if body.tool_choice not in (None, "none"):
            raise OpenAIError(400, "tool_choice is not supported", param="tool_choice", code="unsupported_parameter")
        if body.response_format and body.response_format.get("type") not in (None, "text"):
            raise OpenAIError(400, "response_format other than text is not supported", param="response_format",
                              code="unsupported_value")
        if len(body.messages) > max_messages:
            raise OpenAIError(400, f"messages has {len(body.messages)} entries; the limit is {max_messages} "
                              f"(--max-messages)", param="messages", code="too_many_messages")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        sp = _sampling(body, max_tokens)
        tok = await _tokenizer()
        prompt = render_chat(tok, body.messages, body.chat_template_kwargs)
        return await _generate(request, body, prompt, sp, chat=True)

    async def _generate(request: Request, body: _Common, prompt: str, sp: Dict[str, Any], *, chat: bool):
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        trace = bool(body.return_routing_trace)
        gen = st.backend.generate(prompt, sp, stream=bool(body.stream), trace=trace, request_id=rid)
        watcher = asyncio.ensure_future(_watch(request, st.draining))
        try:
            first = await _race(gen.__anext__(), watcher)
        except BackendError as e:
            watcher.cancel()
            await gen.aclose()
            return _backend_error(str(e), chat).response()
        except _ClientGone:
            await gen.aclose()
            return JSONResponse({}, status_code=499)
        except _ServerDraining:
            await gen.aclose()
            return _shutting_down().response()
        except BaseException:
            watcher.cancel()
            await gen.aclose()
            raise
        if not body.stream:
            watcher.cancel()
            await gen.aclose()
            return JSONResponse(_full_response(rid, created, served, first, chat))
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_sse(rid, created, served, first, gen, watcher, chat, include_usage),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return app


async def _wait_disconnect(request: Request) -> None:
    """Return when the HTTP client has disconnected (the request body is already read)."""
    while True:
        msg = await request.receive()
        if msg.get("type") == "http.disconnect":
            return


async def _watch(request: Request, draining: Optional[asyncio.Event]) -> str:
    """Return ``"gone"`` when the HTTP client disconnects, ``"drain"`` when the front end's
    shutdown grace period is over (``draining`` set), whichever comes first."""
    waits = [asyncio.ensure_future(_wait_disconnect(request))]
    if draining is not None:
        waits.append(asyncio.ensure_future(draining.wait()))
    try:
        done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
    return "gone" if waits[0] in done else "drain"


async def _race(aw, watcher: "asyncio.Future") -> Any:
    """Await ``aw`` unless ``watcher`` (:func:`_watch`) finishes first; then cancel ``aw``.

    Raises:
        _ClientGone: the client disconnected first.
        _ServerDraining: the front end's shutdown grace period ended first.
    """
    fut = asyncio.ensure_future(aw)
    try:
        done, _ = await asyncio.wait({fut, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this task was cancelled (e.g. Starlette saw the disconnect first)
        fut.cancel()
        await asyncio.wait({fut})
        raise
    if fut in done:
        return fut.result()
    fut.cancel()
    await asyncio.wait({fut})
    if watcher.done() and not watcher.cancelled() and watcher.result() == "drain":
        raise _ServerDraining()
    raise _ClientGone()


def _usage(out: GenerationOutput) -> Dict[str, int]:
    p, c = out.prompt_tokens or 0, out.completion_tokens or 0
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _full_response(rid: str, created: int, served: str, out: GenerationOutput, chat: bool) -> Dict[str, Any]:
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": out.text}, "logprobs": None,
                  "finish_reason": out.finish_reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": out.text, "logprobs": None, "finish_reason": out.finish_reason}
        obj = "text_completion"
    resp = {"id": rid, "object": obj, "created": created, "model": served, "choices": [choice],
            "usage": _usage(out), "system_fingerprint": None, "routing_summary": out.routing_summary}
    if out.routing_trace is not None:
        resp["routing_trace"] = out.routing_trace
    return resp


def _sse_event(obj: Dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _sse(rid: str, created: int, served: str, first: GenerationOutput, gen, watcher, chat: bool,
               include_usage: bool) -> AsyncIterator[str]:
    """The SSE stream of one request: chunks, the finish chunk (with ``routing_summary``),
    the usage chunk when asked, ``[DONE]``. Cancelled or abandoned, it cancels the Triton request."""
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(text: Optional[str], finish: Optional[str] = None, role: bool = False) -> Dict[str, Any]:
        if chat:
            delta: Dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return {"id": rid, "object": obj, "created": created, "model": served, "choices": [choice]}

    try:
        if chat:
            yield _sse_event(chunk("", role=True))
        out = first
        while True:
            if out.text:
                yield _sse_event(chunk(out.text))
            if out.final:
                last = chunk(None if chat else "", out.finish_reason)
                last["routing_summary"] = out.routing_summary
                if out.routing_trace is not None:
                    last["routing_trace"] = out.routing_trace
                yield _sse_event(last)
                if include_usage:
                    yield _sse_event({"id": rid, "object": obj, "created": created, "model": served,
                                      "choices": [], "usage": _usage(out)})
                break
            try:
                out = await _race(gen.__anext__(), watcher)
            except BackendError as e:
                yield _sse_event(_backend_error(str(e), chat).body())
                break
            except _ServerDraining:
                yield _sse_event(_shutting_down().body())
                break
        yield "data: [DONE]\n\n"
    except _ClientGone:
        pass
    finally:
        watcher.cancel()
        await gen.aclose()


# ------------------------------------------------------------------------- CLI
class TooLargeAsOpenAIError:
    """ASGI wrapper: a 413 from the body limit (Starlette answers it as plain text, outside the
    application's exception handlers) is sent in OpenAI's error format instead.

    Args:
        app: the ASGI application (:func:`create_app`).
        max_body_bytes: the limit, named in the message.
    """

    def __init__(self, app, max_body_bytes: int):
        self.app, self.max_body_bytes = app, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        replaced = False

        async def send_413_as_openai(message):
            nonlocal replaced
            if message["type"] == "http.response.start" and message.get("status") == 413:
                replaced = True
                size = dict(scope.get("headers") or []).get(b"content-length", b"").decode() or None
                got = f"is {size} bytes" if size else f"is over {self.max_body_bytes} bytes"
                err = OpenAIError(413, f"request body {got}; the limit is {self.max_body_bytes} bytes "
                                       f"(--max-body-bytes)",
                                  code="request_too_large")
                body = json.dumps(err.body()).encode()
                await send({"type": "http.response.start", "status": 413,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
            if not replaced:
                await send(message)

        await self.app(scope, receive, send_413_as_openai)


def _exit_with(pid: int, server) -> None:
    """Ask uvicorn to stop once process ``pid`` has ended (polls once a second)."""
    def watch():
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                logger.warning("process %d has ended; stopping", pid)
                server.should_exit = True
                return
            except PermissionError:
                pass
            time.sleep(1.0)

    threading.Thread(target=watch, name="exit-with-pid", daemon=True).start()


def main(argv: Optional[List[str]] = None) -> int:
    """Command line: serve the OpenAI-compatible API until interrupted; returns the exit code."""
    ap = argparse.ArgumentParser(prog="python -m tokenrouter.tools.openai_frontend",
                                 description="OpenAI-compatible HTTP API in front of Triton's token_router.")
    ap.add_argument("--triton-url", default=default_grpc_url(), help=GRPC_URL_HELP)
    ap.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    ap.add_argument("--port", type=int, default=int(os.environ.get("TOKENROUTER_OPENAI_PORT", DEFAULT_PORT)),
                    help=f"HTTP port (default $TOKENROUTER_OPENAI_PORT or {DEFAULT_PORT})")
    ap.add_argument("--model", default="token_router", help="Triton model to send requests to")
    ap.add_argument("--served-model-name", default=None, help="model name clients use (default: --model)")
    ap.add_argument("--tokenizer", default=None,
                    help="checkpoint folder with the chat template (default: the model's tokenizer_path)")
    ap.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    ap.add_argument("--graceful-shutdown-s", type=float, default=5.0,
                    help="on SIGINT/SIGTERM, seconds in-flight requests may still run; then they end "
                         "with a 'server is shutting down' error (streams: an error event and [DONE]) "
                         "and their Triton requests are cancelled; default 5")
    ap.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                    help=f"largest request body in bytes; larger ones get a 413 before they are read whole "
                         f"(default {DEFAULT_MAX_BODY_BYTES})")
    ap.add_argument("--max-messages", type=int, default=DEFAULT_MAX_MESSAGES,
                    help=f"most chat messages in one request (default {DEFAULT_MAX_MESSAGES})")
    ap.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                    help="most connections and requests at once (uvicorn's limit_concurrency); more are "
                         f"answered 503 at once, so that the bodies being read stay bounded "
                         f"(default {DEFAULT_MAX_CONNECTIONS})")
    ap.add_argument("--exit-with-pid", type=int, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if not 0 < a.port < 65536:
        ap.error(f"--port must be 1-65535, got {a.port}")
    if a.max_body_bytes < 1 or a.max_messages < 1 or a.max_connections < 1:
        ap.error("--max-body-bytes, --max-messages and --max-connections must be >= 1")
    if not a.graceful_shutdown_s >= 0:
        ap.error(f"--graceful-shutdown-s must be >= 0, got {a.graceful_shutdown_s}")
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")

    import uvicorn

    app = create_app(a.triton_url, model=a.model, served_model_name=a.served_model_name, tokenizer_path=a.tokenizer,
                     max_body_bytes=a.max_body_bytes, max_messages=a.max_messages)
    st: _State = app.state.tokenrouter

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:  # SIGINT / SIGTERM: in-flight requests get the grace
            st.drain(a.graceful_shutdown_s)
            super().handle_exit(sig, frame)

    # uvicorn's own timeout is the backstop: it cancels whatever still runs 2 s after the grace
    server = _Server(uvicorn.Config(TooLargeAsOpenAIError(app, a.max_body_bytes), host=a.host, port=a.port,
                                    log_level=a.log_level,
                                    timeout_graceful_shutdown=a.graceful_shutdown_s + 2.0,
                                    limit_concurrency=a.max_connections))
    if a.exit_with_pid:
        _exit_with(a.exit_with_pid, server)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it handled, once it has shut down
        pass
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
