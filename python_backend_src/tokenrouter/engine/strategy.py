"""When the decode loop runs a step: its :class:`DecodeStrategy`.

:class:`Autonomous` (each model at its own pace, with delayed batching: the product) or
:class:`~tokenrouter.engine.lockstep.LockStep` (the lock-step baseline: the models take turns).

*Delayed batching* (paper §Design): a step starts only when at least ``B`` requests are ready,
or when every request the model holds is ready (none is pending at a peer, so none can come
back), or when the oldest ready request has waited ``max_wait_s`` (so a lone request never
starves).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional, Protocol

__all__ = ["DecodeStrategy", "Autonomous"]


class DecodeStrategy(Protocol):
    """When the decode loop runs a step.  The loop reads its inbox, then calls :meth:`run` once a pass.

    ``sub`` is the :class:`~tokenrouter.engine.subserver.Subserver` (its ``ready`` and ``requests``,
    ``config``, ``_wait_deadline``).

    Implementations: :class:`Autonomous` (the product) and
    :class:`~tokenrouter.engine.lockstep.LockStep` (the lock-step baseline).
    """

    def wait_timeout(self, sub: Any) -> Optional[float]:
        """Seconds the loop may block on its inbox before the next pass (None: until a message comes)."""

    def run(self, sub: Any, step: Callable[[], None]) -> None:
        """Call ``step()`` (one forward step of up to ``max_batch`` ready requests) if one is due now."""


class Autonomous:
    """Each model steps at its own pace, with delayed batching (paper §Design).

    A step is due when at least ``delayed_batch_size`` (B_i) requests are ready, or when every
    request the model holds is ready (none is pending at a peer, so only a brand-new request
    could still join), or when the oldest ready request has waited ``max_wait_s``.  Stateless.
    """

    def wait_timeout(self, sub: Any) -> Optional[float]:
        if not sub.ready:
            return 0.5 if sub._wait_deadline else None  # a waiting request's deadline is checked
        if self.enough_ready(sub):
            return 0.0
        oldest = next(iter(sub.ready.values())).ready_since
        return max(0.0, sub.config.max_wait_s - (time.perf_counter() - oldest))

    @staticmethod
    def enough_ready(sub: Any) -> bool:
        """B_i requests are ready, or every request the model holds is."""
        return len(sub.ready) >= min(sub.config.delayed_batch_size, len(sub.requests))

    def run(self, sub: Any, step: Callable[[], None]) -> None:
        if sub.ready and self.wait_timeout(sub) == 0.0:
            step()
