"""scheduler_model — TokenRouter's delayed-batching model: DTMC, B* search, simulator, config writer.

Pure numpy/scipy (protobuf + tritonclient only for writing Triton configs and for calibration). Follows the
TokenRouter paper's "DTMC for B*" (delayed batching): M models, a closed population of N
requests, step latency L_i(b) (s), routing matrix P = [p_ij], committed tokens C = [c_ij];
an idle model starts a batch once B_i requests are queued; T(B) in tokens/s; B* = argmax over
Σ_i (B_i − 1) < N.

Modules:
    system         the modelled system and PROFILE.json parsing
    dtmc           exact chain, stationary π, T(B)
    search         B* search (exact, or crn-racing for large N)
    approx         vectorised common-random-numbers simulation and racing
    simulate       per-request discrete-event simulator (also non-geometric run lengths)
    online         sliding-window re-estimation of P, C, L_i and B*
    latency        step-latency model: monotone robust fit in rows and extend tokens
    calibrate      the calibration file (synthetic steps timed on a running server by its client,
                   ``python -m tokenrouter.tools.admin calibrate``) and its use in the latency fit
    profile        routing event log → PROFILE.json
    config_writer  B* → Triton config.pbtxt
    cli            ``python -m scheduler_model solve|profile|simulate``
"""

from .errors import (
    ConfigWriteError,
    DeadlockError,
    EventLogError,
    InfeasibleThresholdsError,
    PeriodicChainError,
    ProfileError,
    ReducibleChainError,
    SchedulerModelError,
    StateSpaceTooLargeError,
)
from .system import System

__all__ = [
    "System",
    "SchedulerModelError",
    "ProfileError",
    "EventLogError",
    "InfeasibleThresholdsError",
    "DeadlockError",
    "ReducibleChainError",
    "PeriodicChainError",
    "StateSpaceTooLargeError",
    "ConfigWriteError",
]
