"""Errors of the OpenAI front end: OpenAI's error format, and the router's errors mapped onto it."""

from __future__ import annotations

import re
from typing import Any, Dict, Optional

from fastapi.responses import JSONResponse

__all__ = ["OpenAIError", "BackendError", "ClientGone", "ServerDraining", "SHUTTING_DOWN", "BUSY_PREFIX",
           "shutting_down", "backend_error"]

#: start of the router's "busy" messages (tokenrouter.engine.subserver.BUSY_PREFIX)
BUSY_PREFIX = "busy: "
#: the message of a request still running when the shutdown grace period ends
SHUTTING_DOWN = "server is shutting down"
#: substrings of the router's messages for bad input (its ClientError texts); anything
#: else from the router is a server-side failure
_CLIENT_ERROR_HINTS = ("context length", "parameters.", "sampling_parameters", "text_input", "unknown keys",
                       "has no threshold", "routing_threshold")


class OpenAIError(Exception):
    """An error answered in OpenAI's format with an HTTP status.

    Args:
        status: HTTP status code (400 bad request, 404 unknown model, 500, 503).
        message: human-readable text.
        type: OpenAI error type (``invalid_request_error``, ``server_error``, …).
        param: the request field at fault, or None.
        code: a short machine-readable code, or None.
        headers: extra response headers (e.g. ``Retry-After``), or None.
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


class ClientGone(Exception):
    """The HTTP client disconnected while its request was running."""


class ServerDraining(Exception):
    """The front end is shutting down and the request's grace period is over."""


def shutting_down() -> OpenAIError:
    """The error a request still running after the shutdown grace period ends with (503)."""
    return OpenAIError(503, SHUTTING_DOWN, type="server_error", code="server_shutting_down")


def backend_error(msg: str, chat: bool = False) -> OpenAIError:
    """Map an error message from Triton / ``token_router`` to an :class:`OpenAIError`.

    Args:
        msg: the router's (or Triton's) message.
        chat: the request was a chat completion, whose prompt field is ``messages``.

    Returns:
        503 ``server_busy`` with ``Retry-After: 1`` for the router's "busy" messages (a full
        queue, a queue timeout); 400 naming the field for bad input; 503
        ``backend_unavailable`` when Triton or the model is not there; else 500.
    """
    prompt_param = "messages" if chat else "prompt"
    low = msg.lower()
    if BUSY_PREFIX in msg:  # a full queue or a queue timeout: overload, not failure
        return OpenAIError(503, msg, type="server_error", code="server_busy", headers={"Retry-After": "1"})
    if any(h in low for h in _CLIENT_ERROR_HINTS):
        m = re.search(r"parameters\.(\w+)", msg) or re.search(r"unknown keys[^\[]*\['(\w+)'", msg)
        size = re.match(r"sampling_parameters is (\d+ bytes; the limit is .*)", msg)
        if size:  # the sampling fields this front end packed; only stop strings can be that long
            param, msg = "stop", f"stop and the other sampling fields take {size.group(1)}"
        elif prompt_size := re.match(r"text_input is (\d+ bytes; the limit is .*)", msg):
            # the prompt this front end rendered (the chat template around the messages)
            what = "the messages with the chat template take" if chat else "prompt is"
            param, msg = prompt_param, f"{what} {prompt_size.group(1)}"
        elif m:
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
