"""What the front end reads and writes: the request bodies (pydantic), their validation into
``token_router``'s ``sampling_parameters``, and the response bodies (whole and SSE chunks)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Union, get_args

from pydantic import BaseModel, ConfigDict, field_validator

from .backend import GenerationOutput
from .errors import OpenAIError
from .logprobs import LogprobsFormatter, parse_router_logprobs
from .tool_calls import parse_tool_calls

__all__ = ["CompletionRequest", "ChatCompletionRequest", "RequestBase", "MAX_SEED", "sampling_parameters",
           "check_model", "ResponseHead", "usage", "full_response", "chunk", "sse_event"]

#: the largest seed the router accepts (torch.Generator seeds are signed 64-bit)
MAX_SEED = 2**63 - 1


# ------------------------------------------------------------- request models
class _StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: Optional[bool] = False


class RequestBase(BaseModel):
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

    @field_validator("max_tokens", "temperature", "top_p", "n", "seed", "presence_penalty", "frequency_penalty",
                     "top_k", "min_tokens", "repetition_penalty", "routing_threshold", "max_completion_tokens",
                     "logprobs", "top_logprobs", "best_of", mode="before", check_fields=False)
    @classmethod
    def _not_a_boolean(cls, v: Any, info) -> Any:
        """JSON ``true``/``false`` is no number: pydantic's lax mode would read it as 1/0 (``max_tokens:
        true`` as 1, ``routing_threshold: false`` as 0); Triton's generate endpoint refuses it too.
        A field declared boolean (chat's ``logprobs``) keeps it."""
        if isinstance(v, bool) and bool not in get_args(cls.model_fields[info.field_name].annotation):
            raise ValueError(f"{info.field_name} must be a number, got {json.dumps(v)}")
        return v


class CompletionRequest(RequestBase):
    """``POST /v1/completions`` body."""

    prompt: Union[str, List[str], List[int], List[List[int]]]
    echo: Optional[bool] = False
    logprobs: Optional[int] = None
    best_of: Optional[int] = None
    suffix: Optional[str] = None


class ChatCompletionRequest(RequestBase):
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
#: vLLM-style extensions and their neutral values (not sent: token_router rejects keys it lacks)
_EXTENSIONS = (("top_k", (0, -1)), ("min_tokens", (0,)), ("repetition_penalty", (1.0,)),
               ("presence_penalty", (0.0,)), ("frequency_penalty", (0.0,)), ("ignore_eos", (False,)),
               ("stop_token_ids", ([],)))


def _reject_unsupported(req: RequestBase) -> None:
    """400 for an unknown field, ``n`` other than 1, or ``logit_bias``."""
    extra = sorted(set(req.model_extra or {}) - _IGNORED_FIELDS)
    if extra:
        raise OpenAIError(400, f"Unrecognized request argument supplied: {extra[0]}", param=extra[0],
                          code="unsupported_parameter")
    if req.n is not None and req.n != 1:
        raise OpenAIError(400, f"n must be 1 (token_router writes one choice per request), got {req.n}",
                          param="n", code="unsupported_value")
    if req.logit_bias:
        raise OpenAIError(400, "logit_bias is not supported", param="logit_bias", code="unsupported_parameter")


def sampling_parameters(req: RequestBase, max_tokens: Optional[int]) -> Dict[str, Any]:
    """Validate a request's generation settings; return ``sampling_parameters`` (typed JSON values).

    Args:
        req: the request body.
        max_tokens: the completion's token limit (chat: ``max_completion_tokens`` or ``max_tokens``).

    Raises:
        OpenAIError: 400 naming the field.
    """
    _reject_unsupported(req)
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
    for key, neutral in _EXTENSIONS:  # sent only when they change something
        v = getattr(req, key)
        if v is not None and v not in neutral:
            sp[key] = v
    if req.routing_threshold is not None:
        sp["routing_threshold"] = req.routing_threshold
    return sp


def check_model(req: RequestBase, served: str) -> None:
    """404 ``model_not_found`` unless the request names the served model ``served``."""
    if req.model != served:
        raise OpenAIError(404, f"The model '{req.model}' does not exist; this server serves '{served}'",
                          param="model", code="model_not_found")


# ------------------------------------------------------------- response bodies
@dataclass(frozen=True)
class ResponseHead:
    """What every body of one response carries: ``id``, ``created`` (Unix seconds), ``model``;
    ``chat``: a chat completion (else a text completion)."""

    id: str
    created: int
    model: str
    chat: bool

    def fields(self, obj: str) -> Dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"


def usage(out: GenerationOutput) -> Dict[str, int]:
    """``usage``: the router's prompt and completion token counts and their sum."""
    p, c = out.prompt_tokens or 0, out.completion_tokens or 0
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def full_response(head: ResponseHead, out: GenerationOutput, parse_tools: bool = False,
                  logprobs: Optional[LogprobsFormatter] = None) -> Dict[str, Any]:
    """The body of a non-streamed (chat) completion from the router's final response ``out``;
    with ``parse_tools`` its ``<tool_call>`` blocks become the message's ``tool_calls``
    (``finish_reason`` ``tool_calls`` when the model stopped after them); with ``logprobs`` the
    choice's ``logprobs`` of every output token (else null)."""
    lp = logprobs.format(parse_router_logprobs(out.logprobs)) if logprobs is not None else None
    if logprobs is not None and lp is None:
        lp = logprobs.format_empty()
    if head.chat:
        message: Dict[str, Any] = {"role": "assistant", "content": out.text}
        finish = out.finish_reason
        if parse_tools:
            content, calls = parse_tool_calls(out.text)
            if calls:
                message = {"role": "assistant", "content": content, "tool_calls": calls}
                finish = "tool_calls" if finish == "stop" else finish
        choice = {"index": 0, "message": message, "logprobs": lp, "finish_reason": finish}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": out.text, "logprobs": lp, "finish_reason": out.finish_reason}
        obj = "text_completion"
    resp = {**head.fields(obj), "choices": [choice], "usage": usage(out), "system_fingerprint": None,
            "routing_summary": out.routing_summary}
    if out.routing_trace is not None:
        resp["routing_trace"] = out.routing_trace
    return resp


def chunk(head: ResponseHead, text: Optional[str], finish: Optional[str] = None,
          role: bool = False, delta: Optional[Dict[str, Any]] = None,
          logprobs: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """One streamed chunk: a text delta (chat: ``delta.content``, and ``delta.role`` when ``role``)
    with ``finish_reason`` ``finish``; chat: ``delta`` given is sent as it is (tool-call deltas);
    ``logprobs``: the choice's ``logprobs`` object of the chunk's tokens (else null)."""
    if head.chat:
        delta = dict(delta or {})
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
    return {**head.fields(head.chunk_object), "choices": [choice]}


def sse_event(obj: Dict[str, Any]) -> str:
    """One server-sent event: ``data: <JSON>`` and a blank line."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
