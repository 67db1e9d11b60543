"""The endpoints: ``GET /health``, ``GET /v1/models``, ``GET /v1/models/{model}``,
``POST /v1/completions`` and ``POST /v1/chat/completions`` (both with SSE streaming)."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Annotated, Any, Dict, Optional

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from .chat import render_chat
from .errors import BackendError, ClientGone, OpenAIError, ServerDraining, backend_error, shutting_down
from .logprobs import LogprobsFormatter, chat_top_logprobs, completion_logprobs
from .schemas import (ChatCompletionRequest, CompletionRequest, RequestBase, ResponseHead, check_model,
                      full_response, sampling_parameters)
from .state import FrontendState
from .streaming import race, sse_stream, watch
from .structured import Structured, guided_error_param, structured_request
from .tool_calls import ToolCallStream

__all__ = ["router"]

router = APIRouter()


def _state(request: Request) -> FrontendState:
    return request.app.state.tokenrouter


State = Annotated[FrontendState, Depends(_state)]


@router.get("/health")
async def health(st: State):
    if await st.backend.model_ready():
        return {"status": "ok", "triton": st.triton_url, "model": st.model}
    return JSONResponse({"status": "unavailable", "triton": st.triton_url, "model": st.model}, status_code=503)


@router.get("/v1/models")
async def list_models(st: State):
    return {"object": "list", "data": [st.model_card()]}


@router.get("/v1/models/{name:path}")
async def get_model(name: str, st: State):
    if name != st.served:
        raise OpenAIError(404, f"The model '{name}' does not exist", param="model", code="model_not_found")
    return st.model_card()


def _completion_prompt(body: CompletionRequest) -> str:
    """The prompt of ``/v1/completions``: one string (a list holding one string is taken too).

    Raises:
        OpenAIError: 400 for the fields not supported (``echo``, ``suffix``, ``best_of`` > 1),
            token ids or several prompts, or an empty prompt.
    """
    if body.echo:
        raise OpenAIError(400, "echo is not supported", param="echo", code="unsupported_parameter")
    if body.suffix:
        raise OpenAIError(400, "suffix is not supported", param="suffix", code="unsupported_parameter")
    if body.best_of not in (None, 1):
        raise OpenAIError(400, "best_of must be 1", param="best_of", code="unsupported_value")
    prompt = body.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise OpenAIError(400, "prompt must be one string (lists of prompts and token ids are not supported)",
                          param="prompt", code="unsupported_value")
    if not prompt.strip():
        raise OpenAIError(400, "prompt is empty", param="prompt", code="invalid_value")
    return prompt


def _check_chat(body: ChatCompletionRequest, max_messages: int) -> None:
    """400 for more than ``max_messages`` messages."""
    if len(body.messages) > max_messages:
        raise OpenAIError(400, f"messages has {len(body.messages)} entries; the limit is {max_messages} "
                          f"(--max-messages)", param="messages", code="too_many_messages")


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, st: State):
    check_model(body, st.served)
    prompt = _completion_prompt(body)
    sp = sampling_parameters(body, body.max_tokens)
    n_logprobs = completion_logprobs(body.logprobs)
    logprobs = None
    if n_logprobs is not None:
        sp["logprobs"] = n_logprobs
        logprobs = LogprobsFormatter(chat=False, n=n_logprobs, tokenizer=await st.get_tokenizer())
    return await _generate(st, request, body, prompt, sp, chat=False, logprobs=logprobs)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, st: State):
    check_model(body, st.served)
    _check_chat(body, st.max_messages)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    sp = sampling_parameters(body, max_tokens)
    n_logprobs = chat_top_logprobs(body.logprobs, body.top_logprobs)
    structured = structured_request(body.response_format, body.tools, body.tool_choice)
    if structured.guided is not None:
        sp["guided_decoding"] = structured.guided
    tok = await st.get_tokenizer()
    prompt = render_chat(tok, body.messages, body.chat_template_kwargs, tools=structured.tools)
    logprobs = None
    if n_logprobs is not None:
        sp["logprobs"] = n_logprobs
        logprobs = LogprobsFormatter(chat=True, n=n_logprobs, tokenizer=tok)
    return await _generate(st, request, body, prompt, sp, chat=True, structured=structured, logprobs=logprobs)


async def _generate(st: FrontendState, request: Request, body: RequestBase, prompt: str, sp: Dict[str, Any], *,
                    chat: bool, structured: Structured = Structured(),
                    logprobs: Optional[LogprobsFormatter] = None):
    """Send one request to the router; answer with the whole completion, or an SSE stream.

    Until the router's first response, a client that disconnects gets nothing (499, the request
    cancelled) and the end of the shutdown grace period a 503; a router error is answered in
    OpenAI's format (:func:`backend_error`; a grammar the router refused names the field it came
    from: ``response_format`` or ``tools``).  With ``structured.parse_tools`` the output's
    ``<tool_call>`` blocks become ``tool_calls`` (streamed as deltas).  With ``logprobs`` (a
    request that asks for them) each choice, and each chunk, carries its tokens' ``logprobs``.
    """
    head = ResponseHead(("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, int(time.time()), st.served, chat)
    gen = st.backend.generate(prompt, sp, stream=bool(body.stream), trace=bool(body.return_routing_trace),
                              request_id=head.id)
    watcher = asyncio.ensure_future(watch(request, st.draining))
    try:
        first = await race(gen.__anext__(), watcher)
    except BackendError as e:
        watcher.cancel()
        await gen.aclose()
        err = backend_error(str(e), chat)
        err.param = guided_error_param(str(e), structured) or err.param
        return err.response()
    except ClientGone:
        await gen.aclose()
        return JSONResponse({}, status_code=499)
    except ServerDraining:
        await gen.aclose()
        return shutting_down().response()
    except BaseException:
        watcher.cancel()
        await gen.aclose()
        raise
    if not body.stream:
        watcher.cancel()
        await gen.aclose()
        return JSONResponse(full_response(head, first, parse_tools=structured.parse_tools, logprobs=logprobs))
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    tools = ToolCallStream() if structured.parse_tools else None
    return StreamingResponse(sse_stream(head, first, gen, watcher, include_usage, tools, logprobs),
                             media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
