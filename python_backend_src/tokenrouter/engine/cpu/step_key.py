"""What ties a table cached by the CPU kernels to one forward step.

:func:`next_step` is called by every forward step's attention metadata init
(:mod:`.attention`); a cached table keeps the :data:`serial` it was built in, and the
:func:`version` of the tensors it was built from (a tensor changed in place gets a new one).
"""

from __future__ import annotations

import torch

__all__ = ["serial", "next_step", "version"]

#: bumped by every forward step's ``init_forward_metadata``: ties cached per-step tables to one step
serial = 0


def next_step() -> None:
    """A new forward step begins: tables cached for the last one are stale."""
    global serial
    serial += 1


def version(t: torch.Tensor) -> int:
    """``t``'s in-place version counter (-1 for an inference-mode tensor: identity alone tells)."""
    try:
        return t._version
    except RuntimeError:  # an inference-mode tensor has no version counter: identity alone
        return -1
