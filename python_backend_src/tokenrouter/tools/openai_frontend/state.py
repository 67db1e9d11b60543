"""The front end's settings and what it holds while it runs (``app.state.tokenrouter``)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from .backend import TritonBackend
from .chat import load_tokenizer
from .errors import OpenAIError

__all__ = ["FrontendState", "DEFAULT_MAX_BODY_BYTES", "DEFAULT_MAX_MESSAGES"]

#: default ``--max-body-bytes``: the largest request body read (413 above it)
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
#: default ``--max-messages``: the most chat messages in one request
DEFAULT_MAX_MESSAGES = 256


@dataclass
class FrontendState:
    """One front end: its settings, and the Triton client and tokenizer it holds.

    Attributes:
        triton_url: Triton gRPC address ``host:port``.
        model: the Triton model requests go to.
        served: the model name clients use in ``model``.
        tokenizer_path: checkpoint folder of the chat template; None: the Triton model's
            ``tokenizer_path`` parameter, looked up on the first chat request.
        max_body_bytes: the largest request body in bytes (413 above).
        max_messages: the most chat messages in one request (400 above).
        created: the model card's ``created`` (Unix seconds).
        backend / tokenizer_lock / loop / draining: set by :meth:`open` in the running event loop;
            ``draining`` set: requests still running end with "server is shutting down".
    """

    triton_url: str
    model: str = "token_router"
    served: str = "token_router"
    tokenizer_path: Optional[str] = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_messages: int = DEFAULT_MAX_MESSAGES
    created: int = field(default_factory=lambda: int(time.time()))
    backend: Optional[TritonBackend] = None
    tokenizer: Any = None
    tokenizer_lock: Optional[asyncio.Lock] = None
    loop: Optional[asyncio.AbstractEventLoop] = None
    draining: Optional[asyncio.Event] = None

    async def open(self) -> None:
        """Connect to Triton (in the running event loop, which the gRPC channel binds to)."""
        self.backend = TritonBackend(self.triton_url, self.model)
        self.tokenizer_lock = asyncio.Lock()
        self.loop, self.draining = asyncio.get_running_loop(), asyncio.Event()

    async def close(self) -> None:
        await self.backend.close()

    def drain(self, grace_s: float) -> None:
        """Begin the shutdown: requests still running after ``grace_s`` seconds end with a
        "server is shutting down" error (streams: an error event and ``[DONE]``; others: 503),
        and their Triton requests are cancelled.  Safe from any thread, a signal handler
        included; a no-op before the application started."""
        if self.loop is None or self.draining is None:
            return
        draining = self.draining
        self.loop.call_soon_threadsafe(lambda: self.loop.call_later(max(0.0, grace_s), draining.set))

    def model_card(self) -> Dict[str, Any]:
        """The served model as ``/v1/models`` lists it."""
        return {"id": self.served, "object": "model", "created": self.created, "owned_by": "tokenrouter"}

    async def get_tokenizer(self):
        """The chat template's tokenizer, loaded (in a worker thread) on the first call.

        Raises:
            OpenAIError: 503 ``tokenizer_unavailable`` when its folder cannot be found from the
                Triton model's config; 500 when the folder holds no loadable tokenizer.
        """
        if self.tokenizer is not None:
            return self.tokenizer
        async with self.tokenizer_lock:
            if self.tokenizer is None:
                path = self.tokenizer_path
                if path is None:
                    path = await self._tokenizer_path_from_triton()
                try:
                    self.tokenizer = await asyncio.to_thread(load_tokenizer, path)
                except Exception as e:  # noqa: BLE001
                    raise OpenAIError(500, f"cannot load the tokenizer from {path}: {e}",
                                      type="server_error") from None
                self.tokenizer_path = path
        return self.tokenizer

    async def _tokenizer_path_from_triton(self) -> str:
        """The ``tokenizer_path`` parameter of the Triton model, resolved as the server resolves it."""
        from ...triton.common import resolve_model_path

        try:
            params = await self.backend.model_parameters()
            return resolve_model_path(params.get("tokenizer_path") or "smollm2-135m-instruct")
        except Exception as e:  # noqa: BLE001
            raise OpenAIError(503, f"cannot find the tokenizer of {self.model!r} (give --tokenizer): {e}",
                              type="server_error", code="tokenizer_unavailable") from None
