"""Resident memory of a running tritonserver and its Python stubs, sampled over time.

A soak (:mod:`tokenrouter.tools.soak`) must show that no process grows with traffic. This module
finds the processes of one server from ``/proc`` (the tritonserver and one Triton Python stub per
model instance, named by the instance, e.g. ``llm_0_0``), samples their resident set size (RSS) at
a fixed period in a background thread, and summarises each process's series after a warm-up:
its range and its least-squares slope.

Linux only (``/proc``). Memory is in MiB (2**20 bytes), times in seconds since the sampler started.
"""

from __future__ import annotations

import os
import re
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence

__all__ = ["server_processes", "rss_mb", "status_mb", "RSSSampler", "summarize"]

_STUB = b"triton_python_backend_stub"
_INSTANCE = re.compile(rb"[A-Za-z][\w.-]*_\d+_\d+")  # a stub's model instance: <model>_<group>_<index>


def server_processes(server_pid: int) -> Dict[str, int]:
    """The live processes of one tritonserver: ``{"tritonserver": pid, "<model>_<g>_<i>": pid}``.

    A stub is a ``triton_python_backend_stub`` child of ``server_pid`` (not a zombie); its name is
    the model instance in its arguments (``llm_0_0``). A server that is gone gives ``{}``.
    """
    out: Dict[str, int] = {}
    if not os.path.exists(f"/proc/{int(server_pid)}"):
        return out
    out["tritonserver"] = int(server_pid)
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            with open(f"/proc/{d}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2:].split()
        if not argv or not argv[0].endswith(_STUB) or fields[0] == b"Z" or int(fields[1]) != int(server_pid):
            continue
        inst = next((a.decode() for a in argv if _INSTANCE.fullmatch(a)), None)
        if inst:
            out[inst] = int(d)
    return out


def rss_mb(pid: int, field: str = "VmRSS") -> Optional[float]:
    """Resident memory of ``pid`` in MiB, or None when it is gone.

    ``field`` is a line of ``/proc/PID/status``: ``VmRSS`` (all resident pages), ``RssAnon`` (the
    anonymous ones: heap, tensors, KV), ``RssFile`` (file-backed pages of libraries and mapped
    weights, which the kernel may drop and read again under memory pressure) or ``RssShmem``
    (shared memory, e.g. the Python backend's pool between tritonserver and a stub: counted in
    both processes; VmRSS = RssAnon + RssFile + RssShmem).
    """
    return status_mb(pid, (field,)).get(field)


def status_mb(pid: int, fields) -> Dict[str, float]:
    """Several of :func:`rss_mb`'s figures of ``pid`` from one read of ``/proc/PID/status`` (one
    instant), in MiB: ``{field: MiB}``, empty when the process is gone."""
    out: Dict[str, float] = {}
    try:
        with open(f"/proc/{int(pid)}/status") as f:
            for line in f:
                name = line.split(":", 1)[0]
                if name in fields:
                    out[name] = round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return {}
    return out


class RSSSampler:
    """Samples the RSS of every process of one server every ``every_s`` seconds, in a thread.

    Args:
        server_pid: the tritonserver's pid.
        every_s: sampling period (s, > 0).

        probe: called at each sample; what it returns (a JSON-able dict, e.g. the models' heap
            statistics from their ``stats`` op) is kept in the sample's ``"probe"``; an exception
            it raises is kept as ``{"error": str}``.

    ``samples`` is a list of ``{"t_s": float, "rss_mb": {name: MiB}, "anon_mb": {name: MiB},
    "shmem_mb": {name: MiB}, "file_mb": {name: MiB}, "pid": {name: pid}}`` (``VmRSS``,
    ``RssAnon``, ``RssShmem`` and ``RssFile``, see :func:`rss_mb`; with ``probe`` also
    ``"probe"``), the first taken by :meth:`start`; a process that restarted keeps its name with a
    new pid.
    """

    def __init__(self, server_pid: int, every_s: float = 30.0,
                 probe: Optional[Callable[[], Dict[str, object]]] = None) -> None:
        if every_s <= 0:
            raise ValueError(f"every_s must be > 0, got {every_s}")
        self.server_pid, self.every_s = int(server_pid), float(every_s)
        self.probe = probe
        self.samples: List[Dict[str, object]] = []
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._t0 = 0.0

    def sample(self) -> Dict[str, object]:
        """Take one sample now (also called by the thread) and return it."""
        procs = server_processes(self.server_pid)
        keys = {"VmRSS": "rss_mb", "RssAnon": "anon_mb", "RssShmem": "shmem_mb", "RssFile": "file_mb"}
        s = {"t_s": round(time.monotonic() - self._t0, 1), **{key: {} for key in keys.values()}}
        for n, p in procs.items():
            for field, mib in status_mb(p, keys).items():
                s[keys[field]][n] = mib
        s["pid"] = procs
        if self.probe is not None:
            try:
                s["probe"] = self.probe()
            except Exception as e:  # noqa: BLE001 -- a model down for a kill must not stop the sampling
                s["probe"] = {"error": str(e)}
        self.samples.append(s)
        return s

    def elapsed_s(self) -> float:
        """Seconds since :meth:`start` on the samples' clock (``t_s``)."""
        return time.monotonic() - self._t0

    def start(self) -> "RSSSampler":
        self._t0 = time.monotonic()
        self.sample()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample()

    def stop(self) -> List[Dict[str, object]]:
        """Stop the thread, take a last sample and return all of them."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.every_s + 5)
        self.sample()
        return self.samples


def _drift(series: Sequence[tuple]) -> float:
    """Growth of one process over its ``(t_s, MiB)`` samples, robust to what one step holds at the
    moment of a sample: the median of the last third of the samples minus that of the first third
    (MiB, rounded to 0.1)."""
    k = max(1, len(series) // 3)
    first, last = sorted(r for _, r in series[:k]), sorted(r for _, r in series[-k:])
    return round(last[len(last) // 2] - first[len(first) // 2], 1)


def _slope_per_h(ts: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ``ys`` against ``ts`` (s), in units of ``ys`` per hour."""
    n = len(ts)
    mt, my = sum(ts) / n, sum(ys) / n
    var = sum((t - mt) ** 2 for t in ts)
    return 0.0 if var == 0 else 3600.0 * sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / var


def summarize(samples: Sequence[Dict[str, object]], warmup_s: float, window_s: float,
              settle_s: float = 0.0, key: str = "rss_mb",
              until_s: Optional[float] = None) -> Dict[str, Dict[str, float]]:
    """Per process: RSS at the start, after warm-up and at the end, and over the last window.

    Args:
        samples: :attr:`RSSSampler.samples`.
        warmup_s: samples before this time (s) are warm-up and left out of the window and slope.
        window_s: length of the final window (s) whose range (max - min) is the flatness figure.
        settle_s: after a process restarts (its pid changed), its samples for this long (s) are
            left out too: a reloading model grows from nothing to its loaded size.
        key: the samples' figure to summarise: ``"rss_mb"``, ``"anon_mb"``, ``"shmem_mb"`` or ``"file_mb"``.
        until_s: the end of the load (s, on the samples' clock): later samples (a server left idle,
            which gives memory back) count for ``end_mb`` only, not for the window and slope;
            None: every sample counts.

    Returns:
        ``{name: {"start_mb", "after_warmup_mb", "end_mb", "window_min_mb", "window_max_mb",
        "window_range_mb", "process_range_mb", "process_span_s", "slope_mb_per_h", "restarts",
        "samples"}}``.  ``window_range_mb`` spans every incarnation of the name in the window (a
        restarted stub is a new process, loaded anew); ``process_range_mb`` is the largest range of
        any one process (one pid) in the window, over ``process_span_s`` seconds of its samples: the
        growth of a running process, and the buffers of the step in flight at each sample;
        ``process_drift_mb`` (the largest in size over the processes in the window) is the median of
        a process's last third of samples minus that of its first third: its growth alone.  The
        window and slope keys are absent for a process with
        fewer than 2 samples in them.
    """
    names = sorted({n for s in samples for n in s.get(key, {})})
    end_t = max((s["t_s"] for s in samples), default=0.0)
    if until_s is not None:
        end_t = min(end_t, until_s)
    out: Dict[str, Dict[str, float]] = {}
    for name in names:
        series = [(s["t_s"], s[key][name], s["pid"].get(name)) for s in samples if name in s.get(key, {})]
        restarts, last_pid, restarted_at = 0, series[0][2], -1e18
        kept, life = [], []  # life: the incarnation (restart count) of each kept sample
        for t, r, pid in series:
            if pid != last_pid:
                restarts, last_pid, restarted_at = restarts + 1, pid, t
            if warmup_s <= t <= end_t and t - restarted_at >= settle_s:
                kept.append((t, r))
                life.append(restarts)
        d: Dict[str, float] = {"start_mb": series[0][1], "end_mb": series[-1][1], "restarts": restarts,
                               "samples": len(series)}
        if kept:
            d["after_warmup_mb"] = kept[0][1]
        win = [(t, r, i) for (t, r), i in zip(kept, life) if t >= end_t - window_s]
        if len(win) >= 2:
            ys = [r for _, r, _i in win]
            d.update(window_min_mb=min(ys), window_max_mb=max(ys), window_range_mb=round(max(ys) - min(ys), 1))
            lives = {}
            for t, r, i in win:
                lives.setdefault(i, []).append((t, r))
            spans = [v for v in lives.values() if len(v) >= 2]
            if spans:
                widest = max(spans, key=lambda v: max(r for _, r in v) - min(r for _, r in v))
                d.update(process_range_mb=round(max(r for _, r in widest) - min(r for _, r in widest), 1),
                         process_span_s=round(widest[-1][0] - widest[0][0], 1),
                         process_drift_mb=max((_drift(v) for v in spans), key=abs))
        if len(kept) >= 2:
            d["slope_mb_per_h"] = round(_slope_per_h([t for t, _ in kept], [r for _, r in kept]), 1)
        out[name] = d
    return out
