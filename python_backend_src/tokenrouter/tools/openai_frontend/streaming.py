"""A request's life beside its HTTP client: noticing a disconnect or the shutdown, and the SSE stream."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Dict, Iterator, Optional

from fastapi import Request

from .backend import GenerationOutput
from .errors import BackendError, ClientGone, ServerDraining, backend_error, shutting_down
from .logprobs import LogprobsFormatter, parse_router_logprobs
from .schemas import ResponseHead, chunk, sse_event, usage
from .tool_calls import ToolCallStream

__all__ = ["watch", "race", "sse_stream"]


async def _wait_disconnect(request: Request) -> None:
    """Return when the HTTP client has disconnected (the request body is already read)."""
    while True:
        msg = await request.receive()
        if msg.get("type") == "http.disconnect":
            return


async def watch(request: Request, draining: Optional[asyncio.Event]) -> str:
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


async def race(aw, watcher: "asyncio.Future") -> Any:
    """Await ``aw`` unless ``watcher`` (:func:`watch`) finishes first; then cancel ``aw``.

    Raises:
        ClientGone: the client disconnected first.
        ServerDraining: the front end's shutdown grace period ended first.
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
        raise ServerDraining()
    raise ClientGone()


def _final_events(head: ResponseHead, out: GenerationOutput, include_usage: bool,
                  tools: Optional[ToolCallStream] = None, logprobs: Optional[Dict[str, Any]] = None) -> Iterator[str]:
    """The finish chunk (with ``routing_summary``, ``routing_trace`` when asked, and the ``logprobs``
    of tokens no chunk carried yet), then the usage chunk when ``include_usage``; ``finish_reason``
    ``tool_calls`` after tool calls."""
    finish = out.finish_reason
    if tools is not None and tools.calls and finish == "stop":
        finish = "tool_calls"
    last = chunk(head, None if head.chat else "", finish, logprobs=logprobs)
    last["routing_summary"] = out.routing_summary
    if out.routing_trace is not None:
        last["routing_trace"] = out.routing_trace
    yield sse_event(last)
    if include_usage:
        yield sse_event({**head.fields(head.chunk_object), "choices": [], "usage": usage(out)})


async def sse_stream(head: ResponseHead, first: GenerationOutput, gen, watcher: "asyncio.Future",
                     include_usage: bool, tools: Optional[ToolCallStream] = None,
                     logprobs: Optional[LogprobsFormatter] = None) -> AsyncIterator[str]:
    """The SSE stream of one request: chunks, the finish chunk (with ``routing_summary``),
    the usage chunk when asked, ``[DONE]``. Cancelled or abandoned, it cancels the Triton request.

    Args:
        head: the response's id, creation time, model name and kind.
        first: the router's first response (already received).
        gen: :meth:`TritonBackend.generate`'s generator, for the rest.
        watcher: :func:`watch`'s future for this request.
        include_usage: ``stream_options.include_usage``.
        tools: parses ``<tool_call>`` blocks out of the text into ``tool_calls`` deltas, or None.
        logprobs: formats the tokens' logprobs (a request that asks for them), or None: each
            chunk carries those of the tokens the router sent with its text (tokens whose text
            is held back, or that make no chunk, go with the next chunk, at the latest the finish
            chunk).

    A router error or the end of the shutdown grace period ends the stream with an error event
    (OpenAI's format) and ``[DONE]``.
    """
    try:
        if head.chat:
            yield sse_event(chunk(head, "", role=True))
        out = first
        pending: list = []  # the router's logprobs of tokens no chunk has carried yet

        def take():
            nonlocal pending
            lp = logprobs.format(pending) if logprobs is not None else None
            pending = []
            return lp

        while True:
            if logprobs is not None:
                pending += parse_router_logprobs(out.logprobs)
            if out.text and tools is None:
                yield sse_event(chunk(head, out.text, logprobs=take()))
            elif tools is not None:
                for delta in tools.feed(out.text) + (tools.finish() if out.final else []):
                    yield sse_event(chunk(head, None, delta=delta, logprobs=take()))
            if out.final:
                for event in _final_events(head, out, include_usage, tools, take()):
                    yield event
                break
            try:
                out = await race(gen.__anext__(), watcher)
            except BackendError as e:
                yield sse_event(backend_error(str(e), head.chat).body())
                break
            except ServerDraining:
                yield sse_event(shutting_down().body())
                break
        yield "data: [DONE]\n\n"
    except ClientGone:
        pass
    finally:
        watcher.cancel()
        await gen.aclose()
