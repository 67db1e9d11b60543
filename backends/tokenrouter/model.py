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


def _setup():
    import locale

    for loc in ("C.UTF-8", "en_US.UTF-8"):
        try:
            locale.setlocale(locale.LC_ALL, loc)  # the stub runs in the C locale; torch needs UTF-8
            break
        except locale.Error:
            pass
    # tokenrouter and scheduler_model are installed in the stub's venv (pyproject.toml;
    # deploy/env.sh points the venv at this checkout)
    from tokenrouter.engine import cpu
    from tokenrouter.triton import stub_guard

    stub_guard.start_reaper()  # first: kills this stub if its server dies and leaves it hung
    cpu.install()  # before transformers/sglang are imported; no-op with a GPU


# _setup() runs from initialize(), not at import: Triton's Python backend also imports this file in a
# short-lived stub of its own for each model it loads (to offer auto_complete_config, which this
# backend does not define), and that stub need not import torch (seconds of a model's load).


class TritonPythonModel:
    """Dispatches to the router or LLM implementation named by the ``role`` parameter."""

    def initialize(self, args):
        _setup()
        from tokenrouter.triton.common import model_parameters
        from tokenrouter.triton.settings import ModelRole  # role's default and values are declared there

        role = ModelRole.from_parameters(model_parameters(json.loads(args["model_config"]))).role
        if role == "router":
            from tokenrouter.triton.router_model import TritonPythonModel as impl
        else:
            from tokenrouter.triton.llm_model import TritonPythonModel as impl
        self._impl = impl()
        self._impl.initialize(args)

    def execute(self, requests):
        return self._impl.execute(requests)

    def finalize(self):
        self._impl.finalize()
