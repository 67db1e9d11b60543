"""SGLang 0.5.23 on a CPU: the compatibility shims and the CPU kernels, applied only without a GPU.

* :mod:`.shims` (:func:`install`): what SGLang's CPU engine expects and a plain CPU host with
  PyPI wheels lacks (``sgl_kernel``'s CPU build, an importable ``torchvision``), and less import
  noise.  Call :func:`install` before the first ``import sglang``; the engine calls it itself.
* :mod:`.linear` (:func:`prepack_linear_weights`): linear weights packed once for oneDNN, so a
  decode step of 4-16 requests costs little more than one of 1-3.
* :mod:`.attention` (:func:`patch_torch_native_extend`): the torch_native backend's attention
  computes only the new tokens' rows and attends decode rows and short resumes in padded
  batches instead of a Python loop over the requests; it also installs :mod:`.rope`, the
  rotary embedding that takes each step's cos/sin once.
* :mod:`.kernel_caches` (:func:`bound_kernel_caches`, :func:`warm_kernel_caches`): PyTorch's and
  oneDNN's per-shape primitive caches bounded, and optionally filled at load.
"""

from .attention import patch_torch_native_extend
from .kernel_caches import bound_kernel_caches, warm_kernel_caches
from .linear import prepack_linear_weights
from .shims import cuda_available, install

__all__ = ["install", "cuda_available", "patch_torch_native_extend", "prepack_linear_weights",
           "bound_kernel_caches", "warm_kernel_caches"]
