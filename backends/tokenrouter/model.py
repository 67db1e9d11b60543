"""Triton Python-based backend ``tokenrouter``: one LLM subserver per model.

Selected in a model's config.pbtxt by ``backend: "tokenrouter"`` (as Triton's
vllm_backend is); the implementation lives in the importable library
``tokenrouter.triton_llm`` (python_backend_src/).
"""

import os
import sys


def _setup():
    from importlib import import_module  # noqa: F401

    import locale

    for loc in ("C.UTF-8", "en_US.UTF-8"):
        try:
            locale.setlocale(locale.LC_ALL, loc)  # the stub runs in the C locale
            break
        except locale.Error:
            pass
    src = os.environ.get("TOKENROUTER_SRC") or os.path.join(
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__)))), "python_backend_src")
    if src not in sys.path:
        sys.path.insert(0, src)


_setup()

from tokenrouter.triton_llm import TritonPythonModel  # noqa: E402,F401
