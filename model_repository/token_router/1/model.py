"""``token_router``: client-facing decoupled BLS model (implementation: tokenrouter.triton_router)."""

import os
import sys


def _setup():
    import locale

    for loc in ("C.UTF-8", "en_US.UTF-8"):
        try:
            locale.setlocale(locale.LC_ALL, loc)  # the stub runs in the C locale
            break
        except locale.Error:
            pass
    here = os.path.dirname(os.path.realpath(__file__))
    src = os.environ.get("TOKENROUTER_SRC") or os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(here))),
                                                            "python_backend_src")
    if src not in sys.path:
        sys.path.insert(0, src)
    from tokenrouter import sglang_cpu_compat

    sglang_cpu_compat.install()  # transformers imports torchvision; see the module


_setup()

from tokenrouter.triton_router import TritonPythonModel  # noqa: E402,F401
