"""A model's autonomous subserver: its decode loop, which reads as schedule -> forward -> process.

Paper §Design, "Execution (model-centric)" and "Handoff–resume": one subserver
per LLM with its own scheduler thread (the *decode loop*), its own engine and
KV pool.  A request handed to a peer becomes *pending*: skipped by the loop,
its KV rows kept; when a PeerReq brings it back, only the new tokens are
appended and run as an extend.  It is released (KV freed) when it ends, fails
or is cancelled.

Other threads reach the loop through its *inbox* (:mod:`tokenrouter.engine.inbox`).  A pass of
the loop handles the inbox's messages, then lets its :class:`~tokenrouter.engine.strategy.DecodeStrategy`
decide whether a step is due; a step is, as SGLang's ``event_loop_normal`` and vLLM's
``EngineCore.step``: *schedule* (:func:`~tokenrouter.engine.schedule.plan_step`: the ready
requests, chunked prefill), *forward* (the engine), *process* (the output processor).

The subserver's other jobs live in its bases, one module each: a PeerReq's arrival
(:mod:`~tokenrouter.engine.admission`), the admin operations (:mod:`~tokenrouter.engine.admin`),
a step's results (:mod:`~tokenrouter.engine.output_processor`).  Answers go to *sinks*
(:mod:`tokenrouter.engine.request`).
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

import torch

from ..protocol import FinishReason, PeerReq
from .admin import AdminOpsMixin
from .admission import AdmissionMixin
from .config import SubserverConfig
from .constrained import ConstrainedDecoding
from .host_memory import HostMemoryTrimmer, apply_mmap_threshold
from .inbox import LoopCall, Release, Stop, Submit, SubmitGroup
from .lockstep import LockStep
from .output_processor import OutputProcessorMixin
from .request import BUSY_PREFIX, FINAL_KINDS, LocalRequest, Sink
from .sampling import BatchSampler
from .schedule import StepPlan, plan_step
from .sequence import ForwardOutput
from .strategy import Autonomous, DecodeStrategy

logger = logging.getLogger(__name__)

#: the subserver's face to the layers above: these names are imported from here
__all__ = ["Subserver", "SubserverConfig", "LocalRequest", "FINAL_KINDS", "BUSY_PREFIX", "DecodeStrategy",
           "Autonomous", "Submit", "SubmitGroup", "Release", "LoopCall", "Stop"]


class Subserver(AdmissionMixin, AdminOpsMixin, OutputProcessorMixin):
    """Decode loop of one model: its inbox, its steps, the end of its requests.

    Args:
        engine: an :class:`~tokenrouter.engine.sglang_engine.SGLangEngine` (owned by the loop thread).
        name: this model's name; a PeerReq's ``models`` list locates it (its
            index there is the ``model_index`` its routing algorithm sees).
        config: :class:`SubserverConfig`.
        event_sink: optional callable receiving routing events (dicts in
            scheduler_model's event format: ``step`` and ``handoff``).
        on_pass: optional callable run by the loop after every pass (a step, or a wait that
            ended), e.g. to snapshot metrics: it must be cheap and limit its own rate.
        configure_algorithm: the routing-algorithm registry,
            ``configure_algorithm(name, params, n_models)`` → ``(algorithm class, checked params)``
            (:func:`tokenrouter.algorithms.configure`; raises ValueError for a bad name or params).
            The subserver builds one instance per request and model from a PeerReq's
            ``algorithm`` and ``params``; the algorithms sit above the engine, so it is handed in.
    """

    def __init__(self, engine, name: str,
                 config: Optional[SubserverConfig] = None,
                 event_sink: Optional[Callable[[dict], None]] = None,
                 on_pass: Optional[Callable[[], None]] = None, *,
                 configure_algorithm: Callable[[str, Any, int], Tuple[type, Dict[str, Any]]]):
        self.engine = engine
        self._configure_algorithm = configure_algorithm
        self.name = name
        self.config = config or SubserverConfig()
        self.event_sink = event_sink
        self.on_pass = on_pass
        self.sampler = BatchSampler()
        # constrained decoding: guided requests' matchers and masks (engine/constrained.py)
        self.constrained = ConstrainedDecoding(engine.config.model_path, engine.vocab_size, self.config.max_batch)
        self.requests: Dict[str, LocalRequest] = {}
        self.ready: "collections.OrderedDict[str, LocalRequest]" = collections.OrderedDict()
        self.waiting: Deque[tuple] = collections.deque()  # (peer_req, sink) awaiting KV
        self._wait_deadline: Dict[str, float] = {}  # rid in waiting -> its queue deadline (monotonic)
        self.reserved = 0
        self.inbox: "queue.Queue" = queue.Queue()  # Submit, SubmitGroup, Release, LoopCall, Stop
        self.strategy: DecodeStrategy = self._choose_strategy()
        self.counters = collections.Counter()
        self.trimmer = HostMemoryTrimmer(self.config.malloc_trim_interval_s)
        #: the mmap threshold this process runs with (bytes; 0: the C library's own, dynamic one)
        self.mmap_threshold_bytes = apply_mmap_threshold(self.config.malloc_mmap_threshold_bytes)
        if self.mmap_threshold_bytes:
            logger.info("%s: glibc's mmap threshold fixed at %d bytes", self.name, self.mmap_threshold_bytes)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"decode-loop-{self.name}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ public API
    def submit(self, peer_req: PeerReq, sink: Sink) -> None:
        """Queue a PeerReq (new request or a resume) for this model.  Thread-safe.  A new grammar
        (guided decoding) is compiled here, on the caller's thread, not on the decode loop's."""
        self.constrained.prepare(peer_req.sampling)
        self.inbox.put(Submit(peer_req, sink))

    def submit_group(self, items: List[tuple]) -> None:
        """Queue several ``(peer_req, sink)`` at once: the loop receives them all before its
        next step decision, so the ready ones enter the same step (Triton's dynamic batcher
        grouped them: router ``transport: triton``).  Thread-safe."""
        for peer_req, _ in items:
            self.constrained.prepare(peer_req.sampling)
        self.inbox.put(SubmitGroup(list(items)))

    def release(self, rid: str) -> None:
        """End ``rid`` here: close its running segment (``cancelled``) and free its KV.  Thread-safe."""
        self.inbox.put(Release(rid))

    def call(self, fn: Callable[[], Any], timeout: float = 30.0) -> Any:
        """Run ``fn`` on the loop thread and return its result (for statistics)."""
        box: Dict[str, Any] = {}
        done = threading.Event()

        def job():
            try:
                box["v"] = fn()
            except Exception as e:  # noqa: BLE001
                box["e"] = e
            done.set()

        self.inbox.put(LoopCall(job))
        if not done.wait(timeout):
            raise TimeoutError("decode loop did not answer")
        if "e" in box:
            raise box["e"]
        return box["v"]


    def stop(self) -> None:
        """Stop the loop; close every open segment with ``cancelled``."""
        self._stop.set()
        self.inbox.put(Stop())
        self._thread.join(timeout=10)


    # ------------------------------------------------------------- the loop
    def _choose_strategy(self) -> DecodeStrategy:
        """The loop's strategy for the current settings: lock-step when a turn ring is set."""
        ring = self.config.lockstep
        return Autonomous() if ring is None else LockStep(ring)

    def _loop(self) -> None:
        while not self._stop.is_set():
            timeout = self.strategy.wait_timeout(self)
            try:
                msg = self.inbox.get(timeout=timeout)
            except queue.Empty:
                msg = None
            try:
                if msg is not None:
                    self._handle(msg)
                    while True:
                        try:
                            self._handle(self.inbox.get_nowait())
                        except queue.Empty:
                            break
                if self._wait_deadline:
                    self._expire_waiting()
                self.strategy.run(self, self._step)
                self.trimmer.maybe_trim()
                if self.on_pass is not None:
                    self.on_pass()
            except Exception:  # noqa: BLE001 - the loop must survive anything
                logger.exception("decode loop of %s: unexpected error", self.name)
                self._fail_all("internal error in the decode loop of model " + self.name)
        for rid in list(self.requests):
            self._release(rid, "cancelled", "server shutting down")

    def _handle(self, msg) -> None:
        match msg:
            case Submit(peer_req=peer_req, sink=sink):
                self._receive_guarded(peer_req, sink)
            case SubmitGroup(items=items):
                for peer_req, sink in items:
                    self._receive_guarded(peer_req, sink)
            case Release(rid=rid):
                self._release(rid, "cancelled", "released by the router")
                self._admit_waiting()
            case LoopCall(fn=fn):
                fn()
            case Stop():
                pass  # the loop checks its stop flag

    # ---------------------------------------------------------------- release
    def _end_segment(self, lr: LocalRequest, kind: str, info: Dict[str, Any]) -> None:
        sink, lr.sink = lr.sink, None
        self.ready.pop(lr.rid, None)
        toks, lr.unflushed = lr.unflushed, []
        if sink is not None:
            info = {**info, "scores": lr.algo.take_scores(), **self._token_info(lr)}
            try:
                sink(kind, toks, info)
            except Exception:  # noqa: BLE001
                logger.exception("sink of %s failed", lr.rid)

    def _release(self, rid: str, kind: str, message: str) -> None:
        for i, (pr, sink) in enumerate(self.waiting):
            if pr.rid == rid:
                del self.waiting[i]
                self._wait_deadline.pop(rid, None)
                sink(kind, [], {"message": message})
                return
        lr = self.requests.pop(rid, None)
        if lr is None:
            return
        if lr.sink is not None:
            self.counters[kind] += 1
            self._end_segment(lr, kind, {"message": message, "finish_reason": FinishReason.CANCELLED.value})
        self.ready.pop(rid, None)
        self.engine.release(lr.seq, cache=kind != "error")  # a failed step's KV is not cached
        self.sampler.forget(rid)
        self.constrained.release(rid)
        self.reserved -= lr.reserved_tokens

    def _fail_all(self, message: str) -> None:
        for rid in list(self.requests):
            self.counters["errors"] += 1
            lr = self.requests[rid]
            if lr.sink is not None:
                self._end_segment(lr, "error", {"message": message})
            self._release(rid, "error", message)

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def _step(self) -> None:
        """One step: schedule, forward, process."""
        plan = self._schedule()
        out = self._forward(plan)
        if out is not None:
            self._process(plan, out)

    def _schedule(self) -> StepPlan:
        """The step's rows: the oldest ``max_batch`` ready requests, within the chunked-prefill budget;
        a request's first step ends its queue time (``first_step_t``)."""
        plan = plan_step(list(self.ready.values())[: self.config.max_batch], self.config.prefill_chunk_tokens)
        self.counters["prefill_chunks"] += len(plan.held)
        t = time.monotonic()
        for lr in plan.batch:
            if not lr.prefilled and not lr.header.resume and lr.header.num_generated == 0 \
                    and lr.seq.kv_len == lr.seq.cached_tokens:
                lr.first_step_t = t
        return plan

    def _forward(self, plan: StepPlan) -> Optional[ForwardOutput]:
        """Run the step's forward; None when it failed (its requests then failed, the loop serves on)."""
        try:
            out = self.engine.forward([lr.seq for lr in plan.batch])
        except Exception as e:  # noqa: BLE001 - fail these requests, keep serving
            logger.exception("forward failed on %s", self.name)
            plan.restore_held()
            for lr in plan.batch:
                self.counters["errors"] += 1
                self._end_segment(lr, "error", {"message": f"forward failed on model {self.name}: {e}"})
                self._release(lr.rid, "error", str(e))
            return None
        plan.t_fwd = time.perf_counter()
        plan.restore_held()
        return out

    def _process(self, plan: StepPlan, out: ForwardOutput) -> None:
        """The step's results (:meth:`process_batch_result`) of the rows that sampled a token."""
        batch, out = plan.sampled_rows(out)
        if not batch:  # only partial prefills ran: nothing to sample
            self._account_partial_step(out, plan.t0, plan.t_fwd, len(plan.held))
            return
        try:
            self.process_batch_result(batch, out, plan.t0, plan.t_fwd, plan.has_prefill)
        except Exception as e:  # noqa: BLE001 - fail this batch's requests, keep serving the rest
            logger.exception("step failed on %s", self.name)
            for lr in batch:
                if lr.rid in self.requests:
                    self.counters["errors"] += 1
                    self._release(lr.rid, "error", f"step failed on model {self.name}: {e}")
