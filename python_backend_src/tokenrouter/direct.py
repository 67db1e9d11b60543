"""The no-Triton path: the same subservers and router logic, without Triton.

Each model runs in its own worker process (SGLang keeps one model per process)
with exactly the engine and decode loop the Triton models use; the router logic
(:mod:`tokenrouter.router_core`) talks to them over multiprocessing queues
instead of BLS.  This is the benchmark's ``no-triton`` baseline: the limit the
Triton path is measured against (Triton's request/response path, BLS round
trips and the Python backend's IPC are what it removes).
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import queue
import threading
from typing import Any, Dict, Iterator, List, Optional, Tuple

__all__ = ["DirectCluster"]


def _worker(name: str, engine_kwargs: Dict[str, Any], sched_kwargs: Dict[str, Any], cmd_q, out_q) -> None:
    from . import sglang_cpu_compat

    sglang_cpu_compat.install()
    from .engine import EngineConfig, SGLangEngine
    from .protocol import PeerReq
    from .subserver import Subserver, SubserverConfig

    sub = Subserver(SGLangEngine(EngineConfig(**engine_kwargs)), name, SubserverConfig(**sched_kwargs))
    out_q.put((None, "ready", [], {}))
    while True:
        cmd = cmd_q.get()
        op = cmd[0]
        if op == "run":
            _, seg, header, tokens = cmd

            def sink(kind, toks, info, seg=seg):
                out_q.put((seg, kind, list(toks), info))

            try:
                sub.submit(PeerReq.from_wire(header, tokens), sink)
            except Exception as e:  # noqa: BLE001
                out_q.put((seg, "error", [], {"message": str(e)}))
        elif op == "release":
            sub.release(cmd[1])
        elif op == "call":
            _, seg, what, kw = cmd
            try:
                if what == "stats":
                    res = sub.stats()
                else:
                    sub.reconfigure(**kw)
                    res = {}
                out_q.put((seg, "result", [], res))
            except Exception as e:  # noqa: BLE001
                out_q.put((seg, "error", [], {"message": str(e)}))
        elif op == "stop":
            sub.stop()
            return


class DirectCluster:
    """Model subservers in worker processes, driven without Triton.

    Args:
        models: ``{name: (engine_kwargs, subserver_kwargs)}`` in deployment order
            (keyword arguments of :class:`~tokenrouter.engine.EngineConfig` and
            :class:`~tokenrouter.subserver.SubserverConfig`).
        start_timeout_s: seconds to wait for every model to load.

    Raises:
        RuntimeError: a worker did not come up.
    """

    FINAL = ("handoff", "finished", "cancelled", "error", "result")

    def __init__(self, models: Dict[str, Tuple[Dict[str, Any], Dict[str, Any]]], start_timeout_s: float = 600):
        ctx = mp.get_context("spawn")
        self._out = ctx.Queue()
        self._cmd: Dict[str, Any] = {}
        self._procs = []
        for name, (ek, sk) in models.items():
            q = ctx.Queue()
            p = ctx.Process(target=_worker, args=(name, ek, sk, q, self._out), daemon=True, name=f"direct-{name}")
            p.start()
            self._cmd[name], self._procs = q, self._procs + [p]
        for _ in models:
            try:
                seg, kind, _, _ = self._out.get(timeout=start_timeout_s)
            except queue.Empty:
                self.close()
                raise RuntimeError("a direct worker did not start") from None
        self._segs: Dict[int, "queue.Queue"] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._demux = threading.Thread(target=self._pump, daemon=True)
        self._demux.start()

    def _pump(self) -> None:
        while True:
            item = self._out.get()
            if item is None:
                return
            seg = item[0]
            with self._lock:
                q = self._segs.get(seg)
            if q is not None:
                q.put(item[1:])

    def _new_seg(self) -> Tuple[int, "queue.Queue"]:
        seg, q = next(self._ids), queue.Queue()
        with self._lock:
            self._segs[seg] = q
        return seg, q

    def _drop(self, seg: int) -> None:
        with self._lock:
            self._segs.pop(seg, None)

    def segment(self, model: str, rid: str, tokens: List[int], header: str) -> Iterator[Tuple[List[int], dict]]:
        """Run one visit of ``rid`` on ``model``; yield (committed tokens, event) until its final event.

        Raises:
            RuntimeError: the model reported an error.
        """
        seg, q = self._new_seg()
        try:
            self._cmd[model].put(("run", seg, header, list(tokens)))
            while True:
                kind, toks, info = q.get()
                if kind == "error":
                    raise RuntimeError(f"model {model}: {info.get('message', 'error')}")
                yield toks, {"kind": kind, **info}
                if kind in self.FINAL:
                    return
        finally:
            self._drop(seg)

    def release(self, model: str, rid: str) -> None:
        """Free ``rid``'s state on ``model``."""
        self._cmd[model].put(("release", rid))

    def _call(self, model: str, what: str, **kw) -> dict:
        seg, q = self._new_seg()
        try:
            self._cmd[model].put(("call", seg, what, kw))
            kind, _, info = q.get(timeout=60)
            if kind == "error":
                raise RuntimeError(info.get("message"))
            return info
        finally:
            self._drop(seg)

    def stats(self, model: str) -> dict:
        """The model's Subserver.stats()."""
        return self._call(model, "stats")

    def configure(self, model: str, **settings: Any) -> None:
        """Subserver.reconfigure on ``model`` (delayed_batch_size, max_wait_s, …)."""
        self._call(model, "configure", **settings)

    def close(self) -> None:
        """Stop the workers."""
        for q in self._cmd.values():
            q.put(("stop",))
        for p in self._procs:
            p.join(timeout=20)
            if p.is_alive():
                p.terminate()
        self._out.put(None)


class DirectRouter:
    """Router logic of ``token_router`` over a :class:`DirectCluster` (no Triton).

    Args:
        cluster: the running models.
        models: model names in deployment order.
        tokenizer_path: checkpoint folder with the tokenizer.
        algorithm: routing algorithm name; ``params`` its parameters.
    """

    def __init__(self, cluster: DirectCluster, models: List[str], tokenizer_path: str, algorithm: str,
                 params: Optional[Dict[str, Any]] = None):
        from . import sglang_cpu_compat

        sglang_cpu_compat.install()
        from transformers import AutoTokenizer

        from .algorithms import get_algorithm
        from .router_core import stop_token_ids

        self.cluster, self.models, self.algorithm = cluster, list(models), algorithm
        self.algo_cls = get_algorithm(algorithm)
        self.params = self.algo_cls.validate_params(params or {}, len(models))
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        self.stop_ids = stop_token_ids(self.tokenizer)
        self._ids = itertools.count()

    def segment(self, model, rid, tokens, header):
        return self.cluster.segment(model, rid, tokens, header)

    def release(self, model, rid):
        self.cluster.release(model, rid)

    def generate(self, prompt: str, sampling: Dict[str, Any], chat: bool = True, on_text=None) -> Dict[str, Any]:
        """One request; returns the fields ``token_router`` would (text, counts, routing_summary)."""
        import json

        from .detok import IncrementalDetokenizer
        from .router_core import drive, encode_prompt, make_header
        from .sampling import parse_sampling_parameters

        sp = parse_sampling_parameters(json.dumps(sampling))
        rid = f"direct-{next(self._ids)}"
        ids = encode_prompt(self.tokenizer, prompt, chat)
        header = make_header(rid, sp, self.algorithm, self.params, self.models, self.stop_ids)
        detok = IncrementalDetokenizer(self.tokenizer, sp.stop)
        r = drive(self, header, ids, self.algo_cls.first_model(self.params, rid=rid, sampling=header.sampling),
                  detok, on_delta=on_text)
        tail = detok.flush()
        if tail and on_text:
            on_text(tail)
        return {"text": detok.text, "finish_reason": r.finish, "num_input_tokens": r.n_prompt,
                "num_output_tokens": len(r.output_ids),
                "routing_summary": {"tokens_by_model": {m: r.tokens_by_model.get(m, 0) for m in self.models},
                                    "handoffs": r.handoffs, "handoffs_by_pair": r.pairs}}
