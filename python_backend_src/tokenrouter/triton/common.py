"""Helpers shared by the Triton Python models (no ``triton_python_backend_utils`` import here).

The models' config parameters are read by :mod:`tokenrouter.triton.settings`.
"""

from __future__ import annotations

import json
import locale
import os
from typing import Any, Dict, Optional

__all__ = ["prepare_stub_process", "model_parameters", "resolve_model_path", "weights_dir"]


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
            f"model_path {path!r} -> {full!r} has no config.json; prepare the pair's weights "
            f"once with `deploy/serve --pair PAIR` or `python deploy/prepare_weights.py --pair PAIR` "
            f"(PAIR: qwen-coder, demo or size-realistic), or point model_path at a Hugging Face "
            f"checkpoint folder")
    return full


def json_or_empty(text: Optional[str]) -> Dict[str, Any]:
    """Parse a JSON object string; empty string -> {}."""
    if not text:
        return {}
    v = json.loads(text)
    if not isinstance(v, dict):
        raise ValueError("expected a JSON object")
    return v
