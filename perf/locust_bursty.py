"""Locust load shape that steps the number of streaming users between levels (bursty load).

The users are :class:`locustfile.StreamingUser` (``perf/locustfile.py``: streaming
``/generate_stream`` requests, TTFT / ITL / e2e entries, totals at the end); the shape
holds each level of ``TOKENROUTER_LEVELS`` for ``TOKENROUTER_STEP_S`` seconds, in turn,
for ``TOKENROUTER_DURATION_S`` seconds in all.  Users above a new, lower level finish
the request they are streaming before they stop when Locust runs with
``--stop-timeout`` (as ``perf/bursty_online.py`` does), so no request is cut off and
the throughput counts whole requests.

    TOKENROUTER_LEVELS=2,32 TOKENROUTER_STEP_S=30 TOKENROUTER_DURATION_S=240 \\
        locust -f perf/locust_bursty.py --headless --stop-timeout 600 --host http://localhost:8000

Environment (besides ``perf/locustfile.py``'s): TOKENROUTER_LEVELS (comma-separated user
counts, default ``2,32``), TOKENROUTER_STEP_S (seconds per level, default 30),
TOKENROUTER_DURATION_S (seconds of the whole shape, default 240).
"""

from __future__ import annotations

import os
from typing import Optional, Tuple

from locust import LoadTestShape

from locustfile import StreamingUser  # noqa: F401  (the users this shape drives)


def _levels(text: str):
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"TOKENROUTER_LEVELS must be comma-separated integers, got {text!r}") from None
    if not levels or any(n < 1 for n in levels):
        raise SystemExit(f"TOKENROUTER_LEVELS must list user counts >= 1, got {text!r}")
    return levels


LEVELS = _levels(os.environ.get("TOKENROUTER_LEVELS", "2,32"))
STEP_S = float(os.environ.get("TOKENROUTER_STEP_S", "30"))
DURATION_S = float(os.environ.get("TOKENROUTER_DURATION_S", "240"))


class SteppedUsers(LoadTestShape):
    """N(t) = LEVELS[⌊t / STEP_S⌋ mod len(LEVELS)] until DURATION_S (users spawn at once)."""

    def tick(self) -> Optional[Tuple[int, float]]:
        t = self.get_run_time()
        if t >= DURATION_S:
            return None
        n = LEVELS[int(t // STEP_S) % len(LEVELS)]
        return n, 1000.0
