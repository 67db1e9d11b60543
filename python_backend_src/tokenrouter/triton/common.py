"""Helpers shared by the Triton Python models (no ``triton_python_backend_utils`` import here)."""

from __future__ import annotations

import json
import locale
import os
from typing import Any, Dict, Optional

__all__ = ["prepare_stub_process", "model_parameters", "resolve_model_path", "param", "llm_settings"]


def prepare_stub_process() -> None:
    """Make the Triton Python stub's interpreter usable for torch.

    The stub runs Python isolated in the C locale, so the default text encoding
    is ASCII and torch's import fails; switch to C.UTF-8 (call before importing torch).
    """
    for loc in ("C.UTF-8", "en_US.UTF-8"):
        try:
            locale.setlocale(locale.LC_ALL, loc)
            break
        except locale.Error:
            continue
    os.environ.setdefault("PYTHONIOENCODING", "utf-8")


def model_parameters(model_config: Dict[str, Any]) -> Dict[str, str]:
    """``parameters { key: … value { string_value: … } }`` of a model config as a dict."""
    out = {}
    for k, v in (model_config.get("parameters") or {}).items():
        out[k] = v.get("string_value", "") if isinstance(v, dict) else str(v)
    return out


def param(params: Dict[str, str], key: str, default: Any, kind=str) -> Any:
    """Typed config parameter with a default; raises ValueError naming the key."""
    raw = params.get(key, "")
    if raw is None or str(raw).strip() == "" or str(raw).startswith("${"):
        return default
    try:
        if kind is bool:
            if str(raw).lower() in ("1", "true", "yes", "on"):
                return True
            if str(raw).lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        return kind(raw)
    except ValueError:
        raise ValueError(f"config parameter {key!r}: cannot read {raw!r} as {kind.__name__}") from None


def weights_dir() -> str:
    """Folder holding prepared checkpoints: ``$TOKENROUTER_WEIGHTS`` or ``~/.cache/tokenrouter/weights``."""
    return os.environ.get("TOKENROUTER_WEIGHTS") or os.path.join(
        os.environ.get("TOKENROUTER_CACHE") or os.path.expanduser("~/.cache/tokenrouter"), "weights")


def resolve_model_path(path: str) -> str:
    """Absolute checkpoint folder: ``path`` itself if absolute, else under :func:`weights_dir`.

    Raises:
        FileNotFoundError: the folder has no config.json (the message says how to prepare it).
    """
    full = path if os.path.isabs(path) else os.path.join(weights_dir(), path)
    if not os.path.isfile(os.path.join(full, "config.json")):
        raise FileNotFoundError(
            f"model_path {path!r} -> {full!r} has no config.json; run deploy/serve (or "
            f"python deploy/prepare_weights.py) to prepare the demo weights, or point model_path "
            f"at a Hugging Face checkpoint folder")
    return full


def json_or_empty(text: Optional[str]) -> Dict[str, Any]:
    """Parse a JSON object string; empty string -> {}."""
    if not text:
        return {}
    v = json.loads(text)
    if not isinstance(v, dict):
        raise ValueError("expected a JSON object")
    return v


#: default of the LLM models' ``prefix_cache`` parameter (docs/performance.md, "Prefix caching")
PREFIX_CACHE_DEFAULT = True


def llm_settings(params: Dict[str, str]):
    """EngineConfig and SubserverConfig keyword arguments from an LLM model's config parameters.

    Returns:
        ``(engine_kwargs, subserver_kwargs)`` — plain dicts (picklable), model_path resolved.
        ``lockstep_group``, ``event_log`` and ``gpu_id`` (the Triton instance's device) are
        left to the caller.
    """
    ctx = param(params, "context_length", 0, int)
    engine = dict(
        model_path=resolve_model_path(param(params, "model_path", "smollm2-135m-instruct")),
        dtype=param(params, "dtype", "float32"),
        kv_pool_tokens=param(params, "kv_pool_tokens", 16384, int),
        max_running_requests=param(params, "max_running_requests", 32, int),
        context_length=ctx or None,
        torch_threads=param(params, "torch_threads", 0, int),
        load_format=param(params, "load_format", "auto"),
        random_seed=param(params, "random_seed", 0, int),
        capture_hidden=param(params, "capture_hidden", False, bool),
        cpu_linear_weights=param(params, "cpu_linear_weights", "dual"),
        # GPU hosts (see EngineConfig): where the engine runs and how SGLang drives the GPU
        device=param(params, "device", "auto"),
        attention_backend=param(params, "attention_backend", "") or None,
        cuda_graph=param(params, "cuda_graph", True, bool),
        cuda_graph_max_bs=param(params, "cuda_graph_max_bs", 0, int),
        mem_fraction_static=param(params, "mem_fraction_static", 0.0, float),
        prefix_cache=param(params, "prefix_cache", PREFIX_CACHE_DEFAULT, bool),
    )
    sched = dict(
        delayed_batch_size=max(1, param(params, "delayed_batch_size", 1, int)),
        max_wait_s=param(params, "delayed_batch_max_wait_us", 5000, int) / 1e6,
        stream_interval=max(1, param(params, "stream_interval", 1, int)),
        readmit_on_resume=param(params, "readmit_on_resume", False, bool),
        prefill_chunk_tokens=param(params, "prefill_chunk_tokens", 512, int),
        queue_timeout_s=param(params, "queue_timeout_s", 60.0, float),
        max_queued_requests=param(params, "max_queued_requests", 256, int),
    )
    return engine, sched  # ranges: SubserverConfig checks them (ValueError naming the parameter)
