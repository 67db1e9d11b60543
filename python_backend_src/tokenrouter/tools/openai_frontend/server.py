"""The command line: serve the application with uvicorn, with the shutdown grace period and limits."""

from __future__ import annotations

import argparse
import logging
import os
import threading
import time
from typing import List, Optional

from .. import GRPC_URL_HELP, default_grpc_url
from .app import TooLargeAsOpenAIError, create_app
from .state import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_MESSAGES, FrontendState

__all__ = ["main", "DEFAULT_PORT", "DEFAULT_MAX_CONNECTIONS"]

logger = logging.getLogger(__package__)

#: default HTTP port of the front end (``deploy/serve --openai-port``)
DEFAULT_PORT = 9000
#: default ``--max-connections``: connections served at once (uvicorn's ``limit_concurrency``)
DEFAULT_MAX_CONNECTIONS = 256


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


def _parser() -> argparse.ArgumentParser:
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
    return ap


def _args(argv: Optional[List[str]]) -> argparse.Namespace:
    """The parsed command line; exits with a usage error (code 2) on an invalid value."""
    ap = _parser()
    a = ap.parse_args(argv)
    if not 0 < a.port < 65536:
        ap.error(f"--port must be 1-65535, got {a.port}")
    if a.max_body_bytes < 1 or a.max_messages < 1 or a.max_connections < 1:
        ap.error("--max-body-bytes, --max-messages and --max-connections must be >= 1")
    if not a.graceful_shutdown_s >= 0:
        ap.error(f"--graceful-shutdown-s must be >= 0, got {a.graceful_shutdown_s}")
    return a


def main(argv: Optional[List[str]] = None) -> int:
    """Command line: serve the OpenAI-compatible API until interrupted; returns the exit code
    (0 after a clean shutdown, 1 when the server did not start, e.g. its port was taken)."""
    a = _args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")

    import uvicorn

    app = create_app(a.triton_url, model=a.model, served_model_name=a.served_model_name, tokenizer_path=a.tokenizer,
                     max_body_bytes=a.max_body_bytes, max_messages=a.max_messages)
    st: FrontendState = app.state.tokenrouter

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
