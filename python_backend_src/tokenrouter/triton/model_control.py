"""Triton's model-control API, called over the server's own HTTP endpoint from inside a stub.

Why not ``pb_utils.load_model``: in Triton 2.51's Python backend a stub's
model-control call and the responses that stub sends travel through one
message channel, so while a model loads (about 20 s for the demo) every
response of the calling stub (the router's streams, a model's tokens) waits.
A plain HTTP request to the server's repository API does the same load without
touching the stub's channel, so the caller keeps serving.

The server's HTTP port is read from the parent process's command line (the
stub's parent is ``tritonserver``): ``--http-port`` (default 8000),
``--allow-http`` (default true).  The API is Triton's
`repository extension <https://github.com/triton-inference-server/server/blob/main/docs/protocol/extension_model_repository.md>`_:
``POST /v2/repository/models/<name>/load`` and ``…/unload``.

Every function raises :class:`ModelControlError` when the HTTP endpoint is off or the
server refuses (e.g. not ``--model-control-mode=explicit``); callers fall back to
``pb_utils``.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
import urllib.request
from typing import List, Optional

from ..proc import server_pid

__all__ = ["ModelControlError", "server_http_url", "load", "unload", "is_ready", "reload"]


class ModelControlError(RuntimeError):
    """The model-control request could not be made or the server refused it."""


def _server_args(pid: Optional[int] = None) -> List[str]:
    pid = server_pid() if pid is None else int(pid)
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode("utf-8", "replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def _flag(args: List[str], name: str) -> Optional[str]:
    """Value of ``--name=V`` or ``--name V`` (the last one wins, as in tritonserver)."""
    value = None
    for i, a in enumerate(args):
        if a.startswith(name + "="):
            value = a.split("=", 1)[1]
        elif a == name and i + 1 < len(args):
            value = args[i + 1]
    return value


def server_http_url(pid: Optional[int] = None) -> Optional[str]:
    """``http://127.0.0.1:<port>`` of the tritonserver process ``pid`` (default: this stub's
    parent), or None when it is not a tritonserver or it runs with ``--allow-http=false``."""
    args = _server_args(pid)
    if not args or "tritonserver" not in os.path.basename(args[0]):
        return None
    if str(_flag(args, "--allow-http") or "true").lower() in ("false", "0", "no", "off"):
        return None
    port = _flag(args, "--http-port") or "8000"
    try:
        port_n = int(port)
    except ValueError:
        return None
    return f"http://127.0.0.1:{port_n}"


def _post(url: str, timeout_s: float) -> None:
    req = urllib.request.Request(url, data=b"{}", method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            resp.read()
    except urllib.error.HTTPError as e:
        try:
            msg = json.loads(e.read() or b"{}").get("error", str(e))
        except ValueError:
            msg = str(e)
        raise ModelControlError(f"{url}: {msg}") from None
    except (urllib.error.URLError, OSError) as e:
        raise ModelControlError(f"{url}: {e}") from None


def _base(base_url: Optional[str]) -> str:
    base = base_url or server_http_url()
    if base is None:
        raise ModelControlError("the server's HTTP endpoint is not known (not a tritonserver child, "
                                "or --allow-http=false)")
    return base


def load(model: str, base_url: Optional[str] = None, timeout_s: float = 600.0) -> None:
    """Load (or reload) ``model``; returns once the server has loaded it.

    Raises:
        ModelControlError: HTTP off, server unreachable, or the load refused or failed.
    """
    _post(f"{_base(base_url)}/v2/repository/models/{urllib.parse.quote(model)}/load", timeout_s)


def unload(model: str, base_url: Optional[str] = None, timeout_s: float = 120.0) -> None:
    """Unload ``model`` (returns when the server accepted it; the unload itself may still run).

    Raises:
        ModelControlError: as :func:`load`.
    """
    _post(f"{_base(base_url)}/v2/repository/models/{urllib.parse.quote(model)}/unload", timeout_s)


def is_ready(model: str, base_url: Optional[str] = None, timeout_s: float = 10.0) -> bool:
    """Whether the server reports ``model`` ready (``GET /v2/models/<name>/ready``).

    Raises:
        ModelControlError: HTTP off or the server unreachable.
    """
    url = f"{_base(base_url)}/v2/models/{urllib.parse.quote(model)}/ready"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status == 200
    except urllib.error.HTTPError:
        return False
    except (urllib.error.URLError, OSError) as e:
        raise ModelControlError(f"{url}: {e}") from None


def reload(model: str, fallback=None) -> None:
    """Unload ``model`` if the server counts it ready (a dead stub still counts), then load it.

    Args:
        model: the model's name.
        fallback: ``pb_utils`` (the caller's Triton Python backend utilities), used when the
            server's HTTP endpoint is not known: its ``unload_model`` / ``load_model`` do the
            same, but hold the calling stub's responses until the load returns.

    Raises:
        ModelControlError: the server refused (e.g. not ``--model-control-mode=explicit``) or
            could not be reached.
        Exception: whatever ``fallback``'s calls raise.
    """
    base = server_http_url()
    if base is None:
        if fallback is None:
            raise ModelControlError("the server's HTTP endpoint is not known and no fallback was given")
        if fallback.is_model_ready(model):
            fallback.unload_model(model)
        fallback.load_model(model_name=model)
        return
    if is_ready(model, base):
        unload(model, base)
    load(model, base)
