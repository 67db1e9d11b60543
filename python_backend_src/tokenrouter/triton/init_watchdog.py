"""A bound on a model's load (no ``triton_python_backend_utils`` import here).

Triton waits for a Python model's ``initialize`` for as long as it takes: a load that hangs (a lock
never released, a peer that never answers) leaves the server not ready and says nothing in its log.
:class:`InitWatchdog` runs a model's ``init_*`` steps, logs each step as it starts (so the log
names the step a slow load is in), and, past ``init_timeout_s``, writes every thread's Python stack
to the stub's stderr (Triton's log) and ends the stub process: Triton then reports the load as
failed ("Stub process ... failed" / the model UNAVAILABLE with a reason), ``deploy/serve`` stops
waiting and says so, and a restart (of the server, or a reload of the model) starts afresh.

The timer is :func:`faulthandler.dump_traceback_later`: a C thread that needs no GIL, so it fires
even when the hang holds the interpreter.
"""

from __future__ import annotations

import faulthandler
import sys
import time
from typing import Any, Callable, Optional, TextIO

__all__ = ["InitWatchdog"]


class InitWatchdog:
    """Bound a model's ``initialize`` and name its steps in the log (one per process).

    Use as ``with InitWatchdog(name, timeout_s) as watch: watch.run(self.init_engine, args); ...``.

    Args:
        model: the model's name (for the log lines).
        timeout_s: seconds the whole load may take (> 0); 0 or None: no bound (steps still logged).
        stream: where the stacks go (default ``sys.stderr``: a Python stub's stderr is Triton's log);
            it must have a file descriptor.
        log: writes one line to the server's log (a model passes ``pb_utils.Logger.log_info``);
            default: a line on ``stream``.

    Raises:
        ValueError: ``timeout_s`` < 0.
    """

    def __init__(self, model: str, timeout_s: Optional[float], stream: Optional[TextIO] = None,
                 log: Optional[Callable[[str], Any]] = None):
        if timeout_s is not None and timeout_s < 0:
            raise ValueError(f"init_timeout_s must be >= 0, got {timeout_s}")
        self.model = model
        self.timeout_s = float(timeout_s or 0)
        self.stream = stream if stream is not None else sys.stderr
        self.log = log or (lambda line: print(line, file=self.stream, flush=True))
        self.step: Optional[str] = None
        self._t0 = 0.0

    def __enter__(self) -> "InitWatchdog":
        self._t0 = time.monotonic()
        if self.timeout_s > 0:
            # exit=True: after the stacks, the process ends (os._exit(1)), failing the load
            faulthandler.dump_traceback_later(self.timeout_s, exit=True, file=self.stream)
        return self

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Log the step (``fn``'s name, seconds since the load began) and run it; returns its result."""
        self.step = getattr(fn, "__name__", repr(fn))
        msg = (f"{self.model}: load step {self.step} at {time.monotonic() - self._t0:.1f} s"
               + (f" (the stub ends itself at {self.timeout_s:.0f} s: init_timeout_s)" if self.timeout_s > 0 else ""))
        self.log(msg)
        return fn(*args)

    def __exit__(self, *exc: Any) -> None:
        faulthandler.cancel_dump_traceback_later()
        if exc[0] is None:
            self.log(f"{self.model}: load done in {time.monotonic() - self._t0:.1f} s")
