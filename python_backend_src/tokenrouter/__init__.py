"""TokenRouter: token-level LLM routing served by NVIDIA Triton Inference Server.

Importable library used by the Triton models in ``model_repository/``:
engine (SGLang runner + private KV pool), subserver (per-model decode loop),
protocol (PeerReq), algorithms (route/send/receive plugins), sampling,
detokenisation and the Triton model implementations.
"""

__version__ = "0.1.0"
