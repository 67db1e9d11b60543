"""The FastAPI application: its lifespan (the Triton client), the routes, and every error
answered in OpenAI's format (the body limit's 413 included, by :class:`TooLargeAsOpenAIError`)."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from .errors import OpenAIError
from .routes import router
from .state import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_MESSAGES, FrontendState

__all__ = ["create_app", "TooLargeAsOpenAIError"]

logger = logging.getLogger(__package__)


def create_app(triton_url: str, *, model: str = "token_router", served_model_name: Optional[str] = None,
               tokenizer_path: Optional[str] = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               max_messages: int = DEFAULT_MAX_MESSAGES) -> FastAPI:
    """The FastAPI application (its :class:`FrontendState` is ``app.state.tokenrouter``).

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
    st = FrontendState(triton_url, model=model, served=served_model_name or model, tokenizer_path=tokenizer_path,
                       max_body_bytes=max_body_bytes, max_messages=max_messages)
    app = FastAPI(title="TokenRouter OpenAI-compatible API", lifespan=_lifespan, max_body_size=max_body_bytes)
    app.state.tokenrouter = st
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(OpenAIError, _openai_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(Exception, _internal_error)
    app.include_router(router)
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI):
    st: FrontendState = app.state.tokenrouter
    await st.open()
    try:
        yield
    finally:
        await st.close()


def _too_large(max_body_bytes: int, content_length: Optional[str]) -> OpenAIError:
    """413 ``request_too_large`` naming the body's size (its ``Content-Length``) and the limit."""
    got = f"is {content_length} bytes" if content_length else f"is over {max_body_bytes} bytes"
    return OpenAIError(413, f"request body {got}; the limit is {max_body_bytes} bytes (--max-body-bytes)",
                       code="request_too_large")


async def _http_error(request: Request, e: StarletteHTTPException):
    if e.status_code == 413:  # FastAPI's body limit: before the body was read whole
        return _too_large(request.app.state.tokenrouter.max_body_bytes,
                          request.headers.get("content-length")).response()
    if e.status_code == 400 and e.detail == "There was an error parsing the body":  # FastAPI's, e.g. not UTF-8
        return OpenAIError(400, "request body is not valid JSON (UTF-8 encoded)", code="invalid_json").response()
    return OpenAIError(e.status_code, str(e.detail), type="invalid_request_error" if e.status_code < 500
                       else "server_error").response()


async def _openai_error(_request: Request, e: OpenAIError):
    return e.response()


async def _validation_error(_request: Request, e: RequestValidationError):
    errs = e.errors()
    first = errs[0] if errs else {}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid request")
    if first.get("type") == "json_invalid":
        return OpenAIError(400, f"request body is not valid JSON: {first.get('ctx', {}).get('error', msg)}",
                           code="invalid_json").response()
    if first.get("type") == "value_error":  # a validator of schemas.py: its message names the field
        msg = str(first.get("ctx", {}).get("error", msg))
        return OpenAIError(400, msg, param=param, code="invalid_value").response()
    return OpenAIError(400, f"{param}: {msg}" if param else msg, param=param, code="invalid_value").response()


async def _internal_error(_request: Request, e: Exception):
    logger.exception("openai front end: internal error")
    return OpenAIError(500, f"internal error: {e}", type="server_error").response()


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
                body = _too_large(self.max_body_bytes, size).response().body  # as every other error
                await send({"type": "http.response.start", "status": 413,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
            if not replaced:
                await send(message)

        await self.app(scope, receive, send_413_as_openai)
