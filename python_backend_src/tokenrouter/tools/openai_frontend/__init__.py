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
TokenRouter's ``routing_threshold``. Chat ``logprobs`` / ``top_logprobs`` (0 … 20) and a
completion's ``logprobs`` (0 … 5) return each token's logprob from the model that wrote it
(:mod:`.logprobs`). ``return_routing_trace: true`` adds the
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

The package, one job per module: :mod:`.app` (the FastAPI application, its lifespan and
error handlers), :mod:`.routes` (the endpoints), :mod:`.schemas` (request and response
bodies, the request's validation), :mod:`.streaming` (SSE, client disconnects, the
shutdown grace period), :mod:`.backend` (the Triton gRPC client), :mod:`.chat` (the chat
template), :mod:`.logprobs` (logprobs in OpenAI's shapes), :mod:`.state` (settings and what the
application holds), :mod:`.errors`
(OpenAI's error format) and :mod:`.server` (the command line).
"""

from .app import TooLargeAsOpenAIError, create_app
from .backend import GenerationOutput, TritonBackend
from .chat import load_tokenizer, render_chat
from .errors import BackendError, OpenAIError
from .server import DEFAULT_MAX_CONNECTIONS, DEFAULT_PORT, main
from .state import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_MESSAGES

__all__ = ["OpenAIError", "TritonBackend", "BackendError", "GenerationOutput", "create_app",
           "render_chat", "load_tokenizer", "main", "TooLargeAsOpenAIError", "DEFAULT_PORT",
           "DEFAULT_MAX_BODY_BYTES", "DEFAULT_MAX_MESSAGES", "DEFAULT_MAX_CONNECTIONS"]
