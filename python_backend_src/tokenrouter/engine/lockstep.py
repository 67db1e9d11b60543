"""Lock-step execution across model processes (the *lock-step* baseline).

The official implementations of token-level routing step every model in one
synchronous loop: a global step runs the SLM's batch, then the LLM's batch, and
the next global step starts only when all models are done (paper §Problem,
"step desynchronisation").  Our subservers live in separate Triton stub
processes, so lock-step is emulated with a *turn ring* in shared memory: the
models take turns in a fixed order; on its turn a model runs one step if it has
ready requests (else passes at once) and then hands the turn to the next.
Only the model holding the turn writes the counter, so no lock is needed.

:class:`LockStep` is the decode loop's strategy for this baseline
(:class:`tokenrouter.engine.strategy.DecodeStrategy`; the product's is
:class:`~tokenrouter.engine.strategy.Autonomous`).  A subserver runs it while its
``SubserverConfig.lockstep`` holds a :class:`TurnRing`.
"""

from __future__ import annotations

import mmap
import os
import struct
import tempfile
import time
from typing import Any, Callable, Optional

from ..proc import server_pid

__all__ = ["TurnRing", "LockStep", "default_ring_path"]

#: seconds the decode loop of a lock-step member blocks on its inbox before it polls the ring again
RING_POLL_S = 0.0005


def default_ring_path(group: str) -> str:
    """Shared file for a ring: per server process (the stubs' parent) and group name."""
    safe = "".join(c if c.isalnum() else "_" for c in group)
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(base, f"tokenrouter-lockstep-{server_pid()}-{safe}")


class TurnRing:
    """A turn counter shared by ``size`` processes through a memory-mapped file.

    Args:
        path: file backing the counter (created if missing).
        index: this member's position in the ring (0-based).
        size: number of members.

    Raises:
        ValueError: ``index`` not in ``[0, size)``.
    """

    def __init__(self, path: str, index: int, size: int):
        if not 0 <= index < size:
            raise ValueError(f"lock-step index {index} outside a ring of {size}")
        self.index, self.size = index, size
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < 8:
                os.write(fd, b"\0" * 8)
            self._mm = mmap.mmap(fd, 8)
        finally:
            os.close(fd)

    def turn(self) -> int:
        """Current value of the turn counter."""
        return struct.unpack_from("<Q", self._mm, 0)[0]

    def mine(self) -> bool:
        """True when it is this member's turn."""
        return self.turn() % self.size == self.index

    def pass_turn(self) -> None:
        """Give the turn to the next member (call only while holding it)."""
        struct.pack_into("<Q", self._mm, 0, self.turn() + 1)

    def wait(self, timeout_s: float, poll_s: float = 0.0002) -> bool:
        """Wait up to ``timeout_s`` for this member's turn; True if it came."""
        end = time.perf_counter() + timeout_s
        while not self.mine():
            if time.perf_counter() >= end:
                return False
            time.sleep(poll_s)
        return True


class LockStep:
    """Decode strategy of the lock-step baseline: step only on this model's turn of ``ring``.

    On its turn the model runs one step if it has ready requests, then passes the turn (also
    when it had nothing to run), so a global step is one step of each model in ring order.  No
    delayed batching: every ready request joins the step.  The loop polls the ring every
    :data:`RING_POLL_S` seconds.

    Args:
        ring: this model's :class:`TurnRing`.
    """

    def __init__(self, ring: TurnRing):
        self.ring = ring

    def wait_timeout(self, sub: Any) -> Optional[float]:
        return RING_POLL_S

    def run(self, sub: Any, step: Callable[[], None]) -> None:
        if self.ring.mine():
            if sub.ready:
                step()
            self.ring.pass_turn()
