"""Where a model's channel endpoint is found: fresh ``ipc://`` endpoints and the advert files.

A model advertises its endpoint and process (pid, start time) in a file named after the model and
its tritonserver (:func:`tokenrouter.proc.server_pid`) in the temporary directory; the router reads
it (``kind="peer"``), and the models watch the routers' (``kind="router"``) to release the
requests of a router that died.
"""

from __future__ import annotations

import glob
import json
import os
import tempfile
import uuid
from typing import Any, Dict, List, Optional

from ...proc import process_alive, process_start_time
from ...proc import server_pid as stub_server_pid

__all__ = ["default_endpoint", "advert_path", "write_advert", "read_advert", "remove_advert", "dead_routers",
           "unlink_ipc"]


def default_endpoint(role: str) -> str:
    """A fresh ``ipc://`` endpoint in the temporary directory, unique to this process.

    Args:
        role: a short label (model name or ``router``) included in the file name.
    """
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in role)[:40]
    return f"ipc://{tempfile.gettempdir()}/tokenrouter-{os.getpid()}-{safe}-{uuid.uuid4().hex[:8]}"


def advert_path(model: str, server_pid: Optional[int] = None, kind: str = "peer") -> str:
    """Path of the file in which ``model`` advertises its endpoint and process.

    One per model and tritonserver process (``server_pid``, default the
    tritonserver of this Triton stub, :func:`tokenrouter.proc.server_pid`, still
    right after that server died), in the temporary directory; ``kind`` is ``peer`` (an
    LLM model, read by the router) or ``router`` (a router, watched by the models).
    """
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in model)[:80]
    pid = stub_server_pid() if server_pid is None else int(server_pid)
    return os.path.join(tempfile.gettempdir(), f"tokenrouter-{pid}-{safe}.{kind}.json")


def write_advert(model: str, endpoint: str, kind: str = "peer") -> str:
    """Advertise ``endpoint`` and this process (pid, start time) for ``model``; returns the file's path.

    A previous advert of the same model whose process is gone (a killed stub
    that Triton restarted) is replaced, and its ``ipc://`` socket file removed.
    """
    path = advert_path(model, kind=kind)
    old = read_advert(model, alive_only=False, kind=kind)
    if old and old.get("pid") != os.getpid() and not process_alive(old["pid"], old.get("start")):
        unlink_ipc(str(old.get("endpoint", "")))
    me = {"endpoint": endpoint, "pid": os.getpid(), "start": process_start_time(os.getpid()), "model": model}
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(me, f)
    os.replace(tmp, path)
    return path


def read_advert(model: str, server_pid: Optional[int] = None, alive_only: bool = True,
                kind: str = "peer") -> Optional[Dict[str, Any]]:
    """The advert of ``model`` (``{"endpoint", "pid", "start", "model"}``), or None when there
    is none or (``alive_only``) its process is gone."""
    try:
        with open(advert_path(model, server_pid, kind), encoding="utf-8") as f:
            adv = json.load(f)
        int(adv["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if alive_only and not process_alive(int(adv["pid"]), adv.get("start")):
        return None
    return adv


def remove_advert(model: str, kind: str = "peer") -> None:
    """Remove this process's advert of ``model`` (at finalize); another process's is left alone."""
    adv = read_advert(model, alive_only=False, kind=kind)
    if adv and adv.get("pid") == os.getpid():
        try:
            os.unlink(advert_path(model, kind=kind))
        except OSError:
            pass


def dead_routers(server_pid: Optional[int] = None) -> List[str]:
    """Names of router models of this tritonserver whose advertised process is gone
    (killed or crashed without being unloaded)."""
    pid = stub_server_pid() if server_pid is None else int(server_pid)
    out = []
    for path in glob.glob(os.path.join(tempfile.gettempdir(), f"tokenrouter-{pid}-*.router.json")):
        try:
            with open(path, encoding="utf-8") as f:
                adv = json.load(f)
            if not process_alive(int(adv["pid"]), adv.get("start")):
                out.append(str(adv["model"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


def unlink_ipc(endpoint: str) -> None:
    """Remove the socket file of an ``ipc://`` endpoint (nothing for other endpoints or a missing file)."""
    if endpoint.startswith("ipc://"):
        try:
            os.unlink(endpoint[len("ipc://"):])
        except OSError:
            pass
