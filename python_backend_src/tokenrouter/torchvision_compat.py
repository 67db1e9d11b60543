"""Let PyPI's torchvision import beside the CPU build of torch, in any script of the environment.

The environment holds PyPI's torchvision, a CUDA build that SGLang imports at module level. Beside
the CPU torch its import fails with "operator torchvision::nms does not exist", and with it
``from transformers import Qwen2ForCausalLM``, ``python -m sglang.bench_serving`` and any user
script that touches them. Declaring the two operator schemas with ``torch.library`` (torch's own
mechanism) before torchvision loads lets it import; nothing calls them on a CPU host.

:func:`install_hook` runs at every interpreter start of the project environment (a line of
``site-packages/tokenrouter-checkout.pth``, written by ``deploy/env.sh``). It imports nothing
heavy: it only puts a finder first on ``sys.meta_path`` that, on the first ``import
torchvision``, imports torch, calls :func:`declare_torchvision_ops`, takes itself off and lets
the normal import go on. With a CUDA torch the schemas exist and nothing is declared.
"""

from __future__ import annotations

import sys

__all__ = ["declare_torchvision_ops", "install_hook"]

_libs: list = []  # the torch.library.Library objects, kept alive for the life of the process


def declare_torchvision_ops() -> bool:
    """Declare ``torchvision::nms`` and ``torchvision::qnms`` if torch lacks them; True if declared."""
    import torch

    try:
        torch.ops.torchvision.nms  # noqa: B018 - probe
        return False
    except (AttributeError, RuntimeError):
        pass
    lib = torch.library.Library("torchvision", "DEF")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _libs.append(lib)
    return True


class _TorchvisionFinder:
    """A ``sys.meta_path`` finder that prepares torch the first time torchvision is imported."""

    def find_spec(self, name, path=None, target=None):
        if name != "torchvision":
            return None
        uninstall_hook()
        try:
            declare_torchvision_ops()
        except Exception:  # noqa: BLE001 - never break an import over a compatibility step
            pass
        return None  # the regular finders import torchvision itself


_finder = _TorchvisionFinder()


def install_hook() -> None:
    """Put the finder first on ``sys.meta_path`` (idempotent; a no-op once torchvision is imported)."""
    if "torchvision" not in sys.modules and _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)


def uninstall_hook() -> None:
    """Take the finder off ``sys.meta_path``."""
    while _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
