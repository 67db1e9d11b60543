"""The messages of the Triton stubs' I/O queues: one small frozen dataclass per kind.

Each stub has one thread that calls into the Python backend's response and metrics API (the
backend's stub is not safe for concurrent calls from several threads); every other thread hands
it work through a queue of these messages, and the thread dispatches on their type.

* The router's *client I/O* queue (:mod:`tokenrouter.triton.router_model`, ``_client_io``):
  responses to a client (:class:`TextChunk`, :class:`FinalOutputs`, :class:`ErrorReply`,
  :class:`BusyReply`) and work for the thread itself (:class:`RequestMetrics`,
  :class:`BusyCount`, :class:`IOCall`, :class:`EndpointQuery`).
* A model's *Triton I/O* queue (:mod:`tokenrouter.triton.llm_model`, ``_io_loop``): responses to
  the router or an operator (:class:`TokensReply`, :class:`ErrorReply`) and :class:`CloseIO`.

``sender`` is the request's Triton response sender (``request.get_response_sender()``).  Every
reply but a non-final :class:`TextChunk` / :class:`TokensReply` is the request's final response.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Union

__all__ = ["TextChunk", "FinalOutputs", "ErrorReply", "BusyReply", "RequestMetrics", "BusyCount",
           "IOCall", "EndpointQuery", "TokensReply", "CloseIO", "Reply"]


@dataclass(frozen=True)
class TextChunk:
    """A streamed text delta (router, ``stream`` requests): one non-final ``text_output`` response.

    Attributes:
        sender: the request's response sender.
        text: the detokenised delta (UTF-8 safe, stop strings applied).
        logprobs: the ``logprobs`` output of the tokens since the previous response (vllm_backend's
            JSON; :func:`tokenrouter.triton.request.logprobs_json`), or None (not asked for).
    """

    sender: Any
    text: str
    logprobs: Optional[str] = None


@dataclass(frozen=True)
class FinalOutputs:
    """The request's last response (router): its output tensors, sent with the final flag.

    Attributes:
        sender: the request's response sender.
        outputs: output name → numpy array (``text_output``, ``finish_reason``, ...).
    """

    sender: Any
    outputs: Dict[str, Any]


@dataclass(frozen=True)
class ErrorReply:
    """A final error response: Triton's INVALID_ARG (HTTP 400) for the client's error, else INTERNAL
    (HTTP 500).

    Attributes:
        sender: the request's response sender.
        message: the error message the client reads.
        invalid: the request's input was refused (bad input, or a request that can never fit).
    """

    sender: Any
    message: str
    invalid: bool = False

    def triton_error(self, pb_utils: Any) -> Any:
        """This reply as ``pb_utils.TritonError`` (the module passed in: no Triton import here)."""
        code = pb_utils.TritonError.INVALID_ARG if self.invalid else pb_utils.TritonError.INTERNAL
        return pb_utils.TritonError(self.message, code)


@dataclass(frozen=True)
class BusyReply:
    """A final refusal because the server is busy: Triton's UNAVAILABLE code (router).

    Attributes:
        sender: the request's response sender.
        message: starts with :data:`tokenrouter.engine.subserver.BUSY_PREFIX` and names the limit.
    """

    sender: Any
    message: str


@dataclass(frozen=True)
class RequestMetrics:
    """One request's outcome for the router's metrics (no response).

    Attributes:
        observed: a failure reason (``"refused"``, ``"invalid"``, ``"error"``, ``"cancelled"``)
            or a finished request's observation
            (:func:`tokenrouter.triton.metrics.observe_request`).
    """

    observed: Any


@dataclass(frozen=True)
class BusyCount:
    """One request refused or ended as busy, for the router's metrics (no response).

    Attributes:
        reason: ``"queue_full"`` or ``"queue_timeout"``.
    """

    reason: str


@dataclass(frozen=True)
class IOCall:
    """Work that must run on the I/O thread (metric updates, restart kicks); its errors are logged.

    Attributes:
        fn: called with no arguments.
    """

    fn: Callable[[], Any]


@dataclass(frozen=True)
class EndpointQuery:
    """Ask a model for its inter-model endpoint over BLS (router, a model without an advert).

    Attributes:
        model: the model's name.
        answer: set to ``{"endpoint", "pid", "start"}``, or to the exception of the BLS call.
    """

    model: str
    answer: "Future[Dict[str, Any]]"


@dataclass(frozen=True)
class TokensReply:
    """A model's response (``output_ids`` INT64 and the JSON ``event``), final or not.

    Attributes:
        sender: the request's response sender.
        tokens: token ids (may be empty).
        event: the event (:data:`tokenrouter.protocol.ModelEvent`: a segment's, or an op's
            answer), encoded by the I/O thread.
        final: send with the final flag.
    """

    sender: Any
    tokens: List[int]
    event: Any
    final: bool = True


@dataclass(frozen=True)
class CloseIO:
    """End a model's Triton I/O thread once the messages queued before this one are sent."""


#: a response for a Triton request
Reply = Union[TextChunk, FinalOutputs, ErrorReply, BusyReply, TokensReply]
