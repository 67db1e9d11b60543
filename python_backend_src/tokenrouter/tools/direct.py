"""The no-Triton path: the same subservers and router logic, without Triton.

Each model runs in its own worker process (SGLang keeps one model per process)
with exactly the engine, decode loop and ZeroMQ inter-model channel the Triton
models use; the router logic (:mod:`tokenrouter.routing.router_core`) runs in the
calling process.  This is the benchmark's ``no-triton`` baseline: the limit the
Triton path is measured against (what it removes is Triton's client
request/response path and the Python backend stub's IPC).
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import queue
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from ..protocol import Configure, PeerReq, Stats

__all__ = ["DirectCluster"]


def _worker(name: str, engine_kwargs: Dict[str, Any], sched_kwargs: Dict[str, Any], cmd_q, out_q) -> None:
    from ..engine import cpu

    cpu.install()
    from ..engine.config import EngineConfig
    from ..engine.sglang_engine import SGLangEngine
    from ..algorithms import configure as configure_algorithm
    from ..engine.config import SubserverConfig
    from ..engine.op_dispatch import OpDispatcher
    from ..engine.subserver import Subserver
    from ..routing.peer import PeerServer

    sub = Subserver(SGLangEngine(EngineConfig(**engine_kwargs)), name, SubserverConfig(**sched_kwargs),
                    configure_algorithm=configure_algorithm)
    server = PeerServer(OpDispatcher(sub))
    out_q.put((name, server.endpoint))
    cmd_q.get()  # "stop"
    server.close()
    sub.stop()


class DirectCluster:
    """Model subservers in worker processes, driven without Triton over the ZeroMQ channel.

    Args:
        models: ``{name: (engine_kwargs, subserver_kwargs)}`` in deployment order
            (keyword arguments of :class:`~tokenrouter.engine.config.EngineConfig` and
            :class:`~tokenrouter.engine.config.SubserverConfig`).
        start_timeout_s: seconds to wait for every model to load.

    Raises:
        RuntimeError: a worker did not come up.
    """

    def __init__(self, models: Dict[str, Tuple[Dict[str, Any], Dict[str, Any]]], start_timeout_s: float = 600):
        from ..routing.peer import PeerClient

        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        self._stop_q: Dict[str, Any] = {}
        self._procs = []
        for name, (ek, sk) in models.items():
            q = ctx.Queue()
            p = ctx.Process(target=_worker, args=(name, ek, sk, q, out), daemon=True, name=f"direct-{name}")
            p.start()
            self._stop_q[name], self._procs = q, self._procs + [p]
        self.endpoints: Dict[str, str] = {}
        for _ in models:
            try:
                name, endpoint = out.get(timeout=start_timeout_s)
            except queue.Empty:
                self.close()
                raise RuntimeError("a direct worker did not start") from None
            self.endpoints[name] = endpoint
        self.peers = PeerClient(self.endpoints.__getitem__, tick_s=1.0)  # no cancellation to poll for

    @property
    def pids(self) -> Dict[str, int]:
        """Process id of each model's worker (model name → pid)."""
        return {p.name[len("direct-"):]: p.pid for p in self._procs}

    def segment(self, model: str, peer_req: PeerReq) -> Iterator[Tuple[List[int], Any]]:
        """One visit of ``peer_req`` to ``model`` (see :meth:`tokenrouter.routing.segments.Transport.segment`)."""
        return self.peers.segment(model, peer_req)

    def release(self, model: str, rid: str) -> None:
        """Free ``rid``'s state on ``model``."""
        self.peers.release(model, rid)

    def stats(self, model: str) -> dict:
        """The model's Subserver.stats()."""
        return self.peers.call(model, Stats())

    def configure(self, model: str, **settings: Any) -> None:
        """Subserver.reconfigure on ``model`` (delayed_batch_size, max_wait_s, …)."""
        self.peers.call(model, Configure(args=settings))

    def close(self) -> None:
        """Stop the workers."""
        if getattr(self, "peers", None) is not None:
            self.peers.close()
        for q in self._stop_q.values():
            q.put("stop")
        for p in self._procs:
            p.join(timeout=20)
            if p.is_alive():
                p.terminate()


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
        from ..engine import cpu

        cpu.install()
        from ..algorithms import configure as configure_algorithm
        from ..engine.detok import load_tokenizer, stop_token_ids

        self.cluster, self.models, self.algorithm = cluster, list(models), algorithm
        self.algo_cls, self.params = configure_algorithm(algorithm, params or {}, len(models))
        self.tokenizer = load_tokenizer(tokenizer_path)
        self.stop_ids = stop_token_ids(self.tokenizer)
        self._ids = itertools.count()

    def segment(self, model, peer_req):
        """One visit of ``peer_req`` to ``model``: the transport call of :func:`~tokenrouter.routing.router_core.drive`."""
        return self.cluster.segment(model, peer_req)

    def release(self, model, rid):
        """Free ``rid``'s KV on ``model`` (the request is finished or cancelled)."""
        self.cluster.release(model, rid)

    def generate(self, prompt: str, sampling: Dict[str, Any], chat: bool = True, on_text=None,
                 cancelled: Callable[[], bool] = lambda: False) -> Dict[str, Any]:
        """One request; returns the fields ``token_router`` would (text, counts, routing_summary).

        ``cancelled``: polled between the models' responses; True ends the request with
        ``finish_reason`` ``cancelled`` and the tokens written so far (every model's KV released).
        """
        import json

        from ..engine.detok import IncrementalDetokenizer
        from ..engine.sampling import parse_sampling_parameters
        from ..routing.router_core import drive, encode_prompt, make_header

        sp = parse_sampling_parameters(json.dumps(sampling))
        rid = f"direct-{next(self._ids)}"
        ids = encode_prompt(self.tokenizer, prompt, chat)
        header = make_header(rid, sp, self.algorithm, self.params, self.models, self.stop_ids)
        detok = IncrementalDetokenizer(self.tokenizer, sp.stop)
        r = drive(self, header, ids, self.algo_cls.first_model(self.params, rid=rid, sampling=header.sampling),
                  detok, on_delta=(lambda d, _r: on_text(d)) if on_text else None, cancelled=cancelled)
        tail = detok.flush()
        if tail and on_text:
            on_text(tail)
        return {"text": detok.text, "finish_reason": r.finish, "num_input_tokens": r.n_prompt,
                "num_output_tokens": len(r.output_ids),
                "routing_summary": {"tokens_by_model": {m: r.tokens_by_model.get(m, 0) for m in self.models},
                                    "handoffs": r.handoffs, "handoffs_by_pair": r.pairs}}
