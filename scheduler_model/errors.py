"""Exceptions raised by :mod:`scheduler_model`.

Every failure mode the issue names (infeasible thresholds, deadlocks, reducible
or periodic chains, malformed profiles or event logs, state spaces too large for
the exact chain) has its own class so callers can react to it instead of
receiving a silent number.
"""

from __future__ import annotations


class SchedulerModelError(Exception):
    """Base class of every error raised by scheduler_model."""


class ProfileError(SchedulerModelError, ValueError):
    """A profile (PROFILE.json) or a system description is malformed or inconsistent."""


class EventLogError(ProfileError):
    """A routing event log line is malformed (bad JSON, missing or ill-typed field)."""


class InfeasibleThresholdsError(SchedulerModelError, ValueError):
    """Thresholds B violate the feasibility condition sum_i (B_i - 1) < N (paper, DTMC section)
    or a bound 1 <= B_i <= max batch size."""


class DeadlockError(SchedulerModelError):
    """A reachable state has every model idle and no queue reaching its threshold:
    the closed system stops and the long-run throughput is zero."""


class ReducibleChainError(SchedulerModelError):
    """The reachable part of the chain has more than one closed (recurrent) class, so the
    long-run throughput depends on the initial state and no single T(B) exists."""


class PeriodicChainError(SchedulerModelError):
    """The recurrent class is periodic and the caller asked for ``on_periodic='error'``."""


class StateSpaceTooLargeError(SchedulerModelError):
    """The exact chain exceeds ``max_states`` (or its state key exceeds 63 bits)."""


class ConfigWriteError(SchedulerModelError):
    """A Triton model repository or config.pbtxt cannot be read or written."""
