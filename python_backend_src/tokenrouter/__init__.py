"""TokenRouter: token-level LLM routing served by NVIDIA Triton Inference Server.

The library behind the Triton models in ``model_repository/``, one subpackage per layer; a
layer imports only the layers below it (``[tool.importlinter]`` in pyproject.toml):

* ``tools``: operator tools (``python -m tokenrouter.tools.<name>``; ``tokenrouter.<name>`` until
  0.1.0) and the no-Triton benchmark path (``tools.direct``);
* ``triton``: Triton adapters: the decoupled LLM model, the BLS router model, the Triton
  transport, the router's metrics, model control and the stub guard;
* ``routing``: request-centric routing: ``router_core.drive``, the ZeroMQ inter-model channel,
  online B*; ``algorithms``: the routing algorithms (route/send/receive plugins);
* ``engine``: one LLM's execution: the SGLang engine with its private KV pool, the
  autonomous subserver (scheduler, decode loop, pending/resume), sampling, detokenisation;
* neutral modules every layer may use: ``protocol`` (PeerReq, StepResult) and ``proc``
  (process identity: start times, liveness, the serving tritonserver's pid).
"""

__version__ = "0.2.0"
