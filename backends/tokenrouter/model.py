"""Triton Python-based backend ``tokenrouter`` (selected by ``backend: "tokenrouter"``).

One backend serves both kinds of TokenRouter model, chosen by the config
parameter ``role``:

* ``llm`` (default): one LLM subserver — ``tokenrouter.triton.llm_model``;
* ``router``: the client-facing BLS router — ``tokenrouter.triton.router_model``.

The implementations live in the importable library (python_backend_src/); this
file only prepares the stub's interpreter and dispatches, as vllm_backend's
model.py does for its engine.
"""

import json
import os
import sys


def _setup():
    import locale

    for loc in ("C.UTF-8", "en_US.UTF-8"):
        try:
            locale.setlocale(locale.LC_ALL, loc)  # the stub runs in the C locale; torch needs UTF-8
            break
        except locale.Error:
            pass
    # the stub ignores PYTHONPATH: find the library next to this backend (or via TOKENROUTER_SRC)
    src = os.environ.get("TOKENROUTER_SRC") or os.path.join(
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__)))), "python_backend_src")
    if src not in sys.path:
        sys.path.insert(0, src)
    # scheduler_model (the B* solver the router's online adaptation uses) sits next to it
    root = os.environ.get("TOKENROUTER_ROOT") or os.path.dirname(src)
    if os.path.isdir(os.path.join(root, "scheduler_model")) and root not in sys.path:
        sys.path.append(root)
    from tokenrouter.engine import sglang_cpu_compat
    from tokenrouter.triton import stub_guard

    stub_guard.start_reaper()  # first: kills this stub if its server dies and leaves it hung
    sglang_cpu_compat.install()  # before transformers/sglang are imported; no-op with a GPU


_setup()


class TritonPythonModel:
    """Dispatches to the router or LLM implementation named by the ``role`` parameter."""

    def initialize(self, args):
        params = json.loads(args["model_config"]).get("parameters") or {}
        role = (params.get("role") or {}).get("string_value", "llm") or "llm"
        if role == "router":
            from tokenrouter.triton.router_model import TritonPythonModel as impl
        elif role == "llm":
            from tokenrouter.triton.llm_model import TritonPythonModel as impl
        else:
            raise ValueError(f"config parameter role must be 'llm' or 'router', got {role!r}")
        self._impl = impl()
        self._impl.initialize(args)

    def execute(self, requests):
        return self._impl.execute(requests)

    def finalize(self):
        self._impl.finalize()
