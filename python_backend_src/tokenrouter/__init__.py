"""TokenRouter: token-level LLM routing served by NVIDIA Triton Inference Server.

The library behind the Triton models in ``model_repository/``, one subpackage per layer:

* ``triton``: Triton adapters: the decoupled LLM model, the BLS router model, the Triton
  transport, the router's metrics, model control and the stub guard;
* ``engine``: one LLM's execution: the SGLang engine with its private KV pool, the
  autonomous subserver (scheduler, decode loop, pending/resume), sampling, detokenisation;
* ``routing``: request-centric routing: ``router_core.drive``, the PeerReq protocol, the
  ZeroMQ inter-model channel, online B*, the no-Triton path;
* ``algorithms``: the routing algorithms (route/send/receive plugins);
* ``tools``: operator tools (``python -m tokenrouter.tools.<name>``; ``tokenrouter.<name>`` until 0.1.0).
"""

__version__ = "0.2.0"
