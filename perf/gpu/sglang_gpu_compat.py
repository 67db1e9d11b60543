"""SGLang 0.5.23 on a CUDA host that has neither ``sgl_kernel`` nor flashinfer.

The GPU benchmark (``perf/gpu/run.py``) carries SGLang to a machine whose Python has
torch, transformers and Triton but no PyPI: the ``sglang-kernel`` (several hundred MB)
and flashinfer wheels do not fit in what travels there.  SGLang imports ``sgl_kernel``
symbols at module import time on CUDA hosts; on the path this benchmark runs, none of
them is called when

* every fused op (RMSNorm, SiluAndMul, rotary embedding, ...) is forced onto its
  torch reference, ``forward_native`` (SGLang's own switch
  ``SGLANG_FORCE_FUSED_OP_BACKEND=torch``), and
* attention runs on SGLang's ``torch_native`` backend (``torch.nn.functional.
  scaled_dot_product_attention`` over the KV pool), sampling on torch
  (``sampling_backend="pytorch"``; TokenRouter samples from the logits itself).

:func:`install` registers a module ``sgl_kernel`` (and its submodules) whose every
attribute is a stand-in: importing, subclassing and attribute chains work, calling
one raises ``NotImplementedError`` naming the symbol, so a kernel the path does need
shows up as a clear error instead of a wrong result.  It does nothing where the real
``sgl_kernel`` imports.  Call it before the first ``import sglang``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types

__all__ = ["install", "install_import_shims", "installed", "patch_loaded_sglang", "STUBBED"]

#: top-level packages replaced by stand-ins when they are not importable
STUBBED = ("sgl_kernel",)

_installed = False


class _Missing:
    """A symbol of a stubbed package: attribute chains work, calls raise."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"{self._name} is not available on this host (no sgl_kernel); "
                                  "the GPU benchmark runs SGLang's torch paths only")

    def __repr__(self) -> str:
        return f"<missing {self._name}>"

    def __bool__(self) -> bool:
        return False


class _StubModule(types.ModuleType):
    def __init__(self, name: str):
        super().__init__(name)
        self.__path__ = []  # a package: submodule imports go through the finder
        self.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        self.__file__ = None

    def __getattr__(self, attr: str):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        full = f"{self.__name__}.{attr}"
        if full in sys.modules:
            return sys.modules[full]
        if attr[:1].isupper():  # a class SGLang may subclass or isinstance-check
            return type(attr, (), {"__module__": self.__name__})
        return _Missing(full)


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots):
        self.roots = tuple(roots)

    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return _StubModule(spec.name)

    def exec_module(self, module):
        return None


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _stub_ipython_display() -> bool:
    """A module ``IPython.display`` with no-op ``HTML``/``display`` where IPython is absent.

    ``import sglang`` reaches ``sglang.utils``, which imports them for notebook output
    only; IPython and its ten dependencies are not worth carrying for that.
    """
    if _importable("IPython"):
        return False
    pkg, disp = types.ModuleType("IPython"), types.ModuleType("IPython.display")
    pkg.__path__ = []
    disp.HTML = lambda *a, **k: None
    disp.display = lambda *a, **k: None
    pkg.display = disp
    sys.modules.setdefault("IPython", pkg)
    sys.modules.setdefault("IPython.display", disp)
    return True


def install_import_shims() -> bool:
    """Import shims every host of the bundle needs (CPU too): :func:`_stub_ipython_display`."""
    return _stub_ipython_display()


def install(force: bool = False) -> bool:
    """Stub the missing CUDA kernel packages and force SGLang's torch op paths.

    Args:
        force: stub even where the real package imports (tests of this module).

    Returns:
        True when the stand-ins were installed (now or earlier), False when the real
        ``sgl_kernel`` is there (then nothing is changed).
    """
    global _installed
    if _installed:
        return True
    missing = [r for r in STUBBED if force or not _importable(r)]
    if not missing:
        return False
    sys.meta_path.insert(0, _StubFinder(missing))
    os.environ.setdefault("SGLANG_FORCE_FUSED_OP_BACKEND", "torch")
    _installed = True
    return True


def patch_loaded_sglang() -> list:
    """After :func:`install`: SGLang paths that would build CUDA code at run time use their torch ones.

    The KV-cache store (``memory_pool.can_use_store_cache``) compiles a kernel with nvcc through
    tvm-ffi on first use and, where that fails, tries again at every call; here it takes its
    torch path (``index_put`` into the pool) from the start. Returns what was patched.
    """
    patched = []
    from sglang.srt.mem_cache import memory_pool

    if hasattr(memory_pool, "can_use_store_cache"):
        memory_pool.can_use_store_cache = lambda *args, **kwargs: False
        patched.append("memory_pool.can_use_store_cache")
    return patched


def installed() -> bool:
    """Whether :func:`install` put the stand-ins in place in this process."""
    return _installed
