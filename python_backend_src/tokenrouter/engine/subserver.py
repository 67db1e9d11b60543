"""A model's autonomous subserver: admission, the decode loop, suspend/resume.

Paper §Design, "Execution (model-centric)" and "Handoff–resume": one subserver
per LLM with its own scheduler thread (the *decode loop*), its own engine and
KV pool.  A request handed to a peer becomes *pending*: skipped by the loop,
its KV rows kept; when a PeerReq brings it back, only the new tokens are
appended and run as an extend.  It is released (KV freed) when it ends, fails
or is cancelled.

*Delayed batching* (paper §Design): a step starts only when at least ``B``
requests are ready, or when every request the model holds is ready (none is
pending at a peer, so none can come back), or when the oldest ready request
has waited ``max_wait_s`` (so a lone request never starves).

The subserver talks to the outside world through *sinks*: a callable per
segment (one visit of a request to this model) receiving
``sink(kind, tokens, info)`` where ``kind`` is ``"tokens"`` (non-final chunk of
committed tokens) or one of the final kinds ``"handoff"``, ``"finished"``,
``"cancelled"``, ``"error"``.  Other threads reach the loop through its *inbox*, one small
message per kind (:class:`Submit`, :class:`SubmitGroup`, :class:`Release`, :class:`LoopCall`,
:class:`Stop`).

When the loop runs a step is its :class:`DecodeStrategy`, chosen from the settings:
:class:`Autonomous` (each model at its own pace, with delayed batching: the product) or
:class:`~tokenrouter.engine.lockstep.LockStep` (the lock-step baseline: the models take turns).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Optional, Protocol, Tuple

import torch

from ..protocol import FinishReason, PeerReq
from .lockstep import LockStep
from .output_processor import OutputProcessorMixin
from .sampling import BatchSampler, validate_sampling
from .sglang_engine import Sequence

logger = logging.getLogger(__name__)

Sink = Callable[[str, List[int], Dict[str, Any]], None]
FINAL_KINDS = ("handoff", "finished", "cancelled", "error")

__all__ = ["Subserver", "LocalRequest", "SubserverConfig", "FINAL_KINDS", "BUSY_PREFIX", "DecodeStrategy",
           "Autonomous", "Submit", "SubmitGroup", "Release", "LoopCall", "Stop"]

#: start of the message of a request refused or ended because the model is busy (its KV queue
#: is full, or the request waited past its queue timeout); the router answers it with Triton's
#: UNAVAILABLE code and this message, never as a failure
BUSY_PREFIX = "busy: "


@dataclass
class SubserverConfig:
    """Scheduling settings of one model's decode loop.

    Attributes:
        delayed_batch_size: B_i, ready requests needed to start a step (>= 1).
        max_wait_s: bound on the delayed-batching wait (seconds).
        stream_interval: committed tokens per streamed chunk (>= 1); a request's first
            output token goes out at once (TTFT), as with SGLang's ``stream_interval``.
        max_batch: most requests in one forward step.
        readmit_on_resume: std-serving baseline — a returning request is
            re-admitted as new: its KV is freed and its whole context
            re-prefilled (no pending state).
        lockstep: lock-step baseline — a :class:`~tokenrouter.engine.lockstep.TurnRing`
            this model steps in turn with its peers (the loop's strategy is then
            :class:`~tokenrouter.engine.lockstep.LockStep`), or None (own pace: :class:`Autonomous`).
        prefill_chunk_tokens: chunked prefill: the most new tokens of prefills and extends
            in one step (SGLang's ``chunked_prefill_size``; decode rows are not counted), so that
            a long prompt, or a long re-prefill, does not stop every other request for the whole
            of its prefill.  Extends take the budget shortest first, so a resume's few tokens
            never wait behind a long prompt; a request whose new tokens do not fit runs the part
            that does (a chunk) and the rest in later steps, one that gets none waits a step.
            Only a request's last chunk yields a token.  0: no chunking.
        queue_timeout_s: seconds a new request may wait for KV (or a running slot) in this
            model's queue; then it ends as busy (:data:`BUSY_PREFIX`).  A PeerReq's
            ``extras["queue_timeout_s"]`` (the router's, per request) lowers it.  0: no limit.
        max_queued_requests: most requests waiting for KV; one more is refused at once as busy.

    Raises:
        ValueError: a setting out of range (``delayed_batch_size`` or ``stream_interval`` < 1,
            ``max_wait_s`` or ``prefill_chunk_tokens`` < 0, ``max_batch`` < 1).
    """

    delayed_batch_size: int = 1
    max_wait_s: float = 0.005
    stream_interval: int = 1
    max_batch: int = 64
    readmit_on_resume: bool = False
    lockstep: Optional[Any] = None
    prefill_chunk_tokens: int = 512
    queue_timeout_s: float = 60.0
    max_queued_requests: int = 256

    def __post_init__(self) -> None:
        for name, lo in (("delayed_batch_size", 1), ("stream_interval", 1), ("max_batch", 1),
                         ("max_wait_s", 0), ("prefill_chunk_tokens", 0), ("queue_timeout_s", 0),
                         ("max_queued_requests", 0)):
            if getattr(self, name) < lo:
                raise ValueError(f"{name} must be >= {lo}, got {getattr(self, name)!r}")


@dataclass
class LocalRequest:
    """A request as held by one model.

    Attributes:
        rid: request id.
        seq: the engine sequence (tokens + KV position).
        header: latest PeerReq fields (tokens empty): budget, sampling, params.
        algo: this request's routing-algorithm instance for this model.
        loc: position anchor — tokens from here on were written by this model
            and not yet sent to peers.
        sink: current segment's sink, or None while pending.
        reserved_tokens: KV tokens reserved for the request's whole life.
        ready_since: time it became ready (for the delayed-batching bound).
        unflushed: committed tokens not yet streamed.
        prefilled: its prompt has been run (later extends are resumes).
        unflushed_logprobs: log-probabilities of ``unflushed`` (when the request asks for them).
        first_step_t: ``time.monotonic()`` at the start of the request's first
            step (its queue time ends there), until reported to the router.
        drafts: speculative decoding, drafting model: how many trailing ``seq.tokens`` are
            drafted tokens this model sent for verification and has not had confirmed (they
            are not output); on the next resume they are rolled back (:meth:`Subserver._rollback_drafts`).
        verify: speculative decoding, verifying model: the drafted token ids (the trailing
            ``len(verify)`` of ``seq.tokens``) the next step checks (one extend, logits at every
            drafted position: ``Sequence.verify_positions``); empty otherwise.
        spec_round: ``{"drafted", "accepted", "drafter"}`` of the latest verification, shipped
            to the router with the tokens it committed (``spec`` in the sink's info).
    """

    rid: str
    seq: Sequence
    header: PeerReq
    algo: Any  # a tokenrouter.algorithms.RoutingAlgorithm
    loc: int
    sink: Optional[Sink]
    reserved_tokens: int
    ready_since: float = 0.0
    unflushed: List[int] = field(default_factory=list)
    prefilled: bool = False
    unflushed_logprobs: List[float] = field(default_factory=list)
    first_step_t: Optional[float] = None
    drafts: int = 0
    verify: List[int] = field(default_factory=list)
    spec_round: Optional[Dict[str, int]] = None


# ------------------------------------------------------------------ the inbox
@dataclass(frozen=True)
class Submit:
    """Inbox: run ``peer_req`` here (a new request, or the resume of a pending one); answers go to ``sink``."""

    peer_req: PeerReq
    sink: Sink


@dataclass(frozen=True)
class SubmitGroup:
    """Inbox: several :class:`Submit` received before the loop's next step decision (one step for them all).

    Attributes:
        items: ``(peer_req, sink)`` pairs, in arrival order.
    """

    items: List[Tuple[PeerReq, Sink]]


@dataclass(frozen=True)
class Release:
    """Inbox: end request ``rid`` here (its running segment closes as ``cancelled``) and free its KV."""

    rid: str


@dataclass(frozen=True)
class LoopCall:
    """Inbox: run ``fn()`` on the loop thread, between two steps (statistics, settings, calibration).

    ``fn`` reports its own result and errors (:meth:`Subserver.call` wraps it so).
    """

    fn: Callable[[], None]


@dataclass(frozen=True)
class Stop:
    """Inbox: wake the loop so that it sees its stop flag (:meth:`Subserver.stop`)."""


# ------------------------------------------------------------ decode strategies
class DecodeStrategy(Protocol):
    """When the decode loop runs a step.  The loop reads its inbox, then calls :meth:`run` once a pass.

    Implementations: :class:`Autonomous` (the product) and
    :class:`~tokenrouter.engine.lockstep.LockStep` (the lock-step baseline).
    """

    def wait_timeout(self, sub: "Subserver") -> Optional[float]:
        """Seconds the loop may block on its inbox before the next pass (None: until a message comes)."""

    def run(self, sub: "Subserver", step: Callable[[], None]) -> None:
        """Call ``step()`` (one forward step of up to ``max_batch`` ready requests) if one is due now."""


class Autonomous:
    """Each model steps at its own pace, with delayed batching (paper §Design).

    A step is due when at least ``delayed_batch_size`` (B_i) requests are ready, or when every
    request the model holds is ready (none is pending at a peer, so only a brand-new request
    could still join), or when the oldest ready request has waited ``max_wait_s``.  Stateless.
    """

    def wait_timeout(self, sub: "Subserver") -> Optional[float]:
        if not sub.ready:
            return 0.5 if sub._wait_deadline else None  # a waiting request's deadline is checked
        if self.enough_ready(sub):
            return 0.0
        oldest = next(iter(sub.ready.values())).ready_since
        return max(0.0, sub.config.max_wait_s - (time.perf_counter() - oldest))

    @staticmethod
    def enough_ready(sub: "Subserver") -> bool:
        """B_i requests are ready, or every request the model holds is."""
        return len(sub.ready) >= min(sub.config.delayed_batch_size, len(sub.requests))

    def run(self, sub: "Subserver", step: Callable[[], None]) -> None:
        if sub.ready and self.wait_timeout(sub) == 0.0:
            step()


class Subserver(OutputProcessorMixin):
    """Decode loop of one model: admission, delayed batching, the step (its results: :class:`OutputProcessorMixin`).

    Args:
        engine: an :class:`~tokenrouter.engine.sglang_engine.SGLangEngine` (owned by the loop thread).
        name: this model's name; a PeerReq's ``models`` list locates it (its
            index there is the ``model_index`` its routing algorithm sees).
        config: :class:`SubserverConfig`.
        event_sink: optional callable receiving routing events (dicts in
            scheduler_model's event format: ``step`` and ``handoff``).
        on_idle: optional callable run by the loop after it processes work
            and has nothing ready (e.g. to refresh metrics).
        configure_algorithm: the routing-algorithm registry,
            ``configure_algorithm(name, params, n_models)`` → ``(algorithm class, checked params)``
            (:func:`tokenrouter.algorithms.configure`; raises ValueError for a bad name or params).
            The subserver builds one instance per request and model from a PeerReq's
            ``algorithm`` and ``params``; the algorithms sit above the engine, so it is handed in.
    """

    def __init__(self, engine, name: str,
                 config: Optional[SubserverConfig] = None,
                 event_sink: Optional[Callable[[dict], None]] = None,
                 on_idle: Optional[Callable[[], None]] = None, *,
                 configure_algorithm: Callable[[str, Any, int], Tuple[type, Dict[str, Any]]]):
        self.engine = engine
        self._configure_algorithm = configure_algorithm
        self.name = name
        self.config = config or SubserverConfig()
        self.event_sink = event_sink
        self.on_idle = on_idle
        self.sampler = BatchSampler()
        self.requests: Dict[str, LocalRequest] = {}
        self.ready: "collections.OrderedDict[str, LocalRequest]" = collections.OrderedDict()
        self.waiting: Deque[tuple] = collections.deque()  # (peer_req, sink) awaiting KV
        self._wait_deadline: Dict[str, float] = {}  # rid in waiting -> its queue deadline (monotonic)
        self.reserved = 0
        self.inbox: "queue.Queue" = queue.Queue()  # Submit, SubmitGroup, Release, LoopCall, Stop
        self.strategy: DecodeStrategy = self._choose_strategy()
        self.counters = collections.Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"decode-loop-{self.name}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ public API
    def submit(self, peer_req: PeerReq, sink: Sink) -> None:
        """Queue a PeerReq (new request or a resume) for this model.  Thread-safe."""
        self.inbox.put(Submit(peer_req, sink))

    def submit_group(self, items: List[tuple]) -> None:
        """Queue several ``(peer_req, sink)`` at once: the loop receives them all before its
        next step decision, so the ready ones enter the same step (Triton's dynamic batcher
        grouped them: router ``transport: triton``).  Thread-safe."""
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

    def calibrate(self, batch_sizes: List[int], context: int = 256, decode_steps: int = 8,
                  timeout: float = 3600.0) -> Dict[str, Any]:
        """Time synthetic steps at controlled batch sizes on the loop thread (step-latency calibration).

        Runs :meth:`tokenrouter.engine.sglang_engine.SGLangEngine.calibrate` between two steps of the decode
        loop, so no real step overlaps it; requests arriving meanwhile wait in the inbox.

        Returns:
            ``{"model", "context", "decode_steps", "table": [...], "seconds",
            "kv_tokens_in_use_after", "kv_rows_in_use_after"}`` (table rows: see
            ``SGLangEngine.calibrate``; times in seconds).
        Raises:
            RuntimeError: the model holds requests (running, pending or waiting for KV).
            ValueError: bad arguments or the KV pool cannot hold the largest batch.
            TimeoutError: the loop did not finish within ``timeout`` seconds.
        """
        def job():
            if self.requests or self.waiting:
                raise RuntimeError(f"model {self.name} holds {len(self.requests) + len(self.waiting)} "
                                   "requests: calibration runs only on an idle model")
            t0 = time.perf_counter()
            table = self.engine.calibrate(batch_sizes, context=context, decode_steps=decode_steps)
            return {"model": self.name, "context": int(context), "decode_steps": int(decode_steps),
                    "table": table, "seconds": time.perf_counter() - t0,
                    "kv_tokens_in_use_after": self.engine.kv_tokens_in_use(),
                    "kv_rows_in_use_after": self.engine.rows_in_use()}
        return self.call(job, timeout=timeout)

    def stats(self) -> Dict[str, Any]:
        """Counters and KV usage, read on the loop thread (consistent snapshot).

        Keys: kv_tokens_in_use, kv_capacity_tokens, kv_rows_in_use, active,
        pending, ready, waiting, steps, decode_tokens, extend_tokens,
        handoffs_out, finished, cancelled, errors and the step-time breakdown
        in seconds: step_time_s = forward_s (model forward incl. batch
        preparation) + route_s (sampling, entropy, route/send decisions) +
        send_s (streaming responses to the router); the delayed-batching settings
        delayed_batch_size (B_i) and delayed_batch_max_wait_us; prefill_chunks (partial
        prefills run: one per request and step whose new tokens did not all fit the step's
        ``prefill_chunk_tokens`` budget) and that setting; the prefix cache's sizes and
        counters in tokens (``prefix_cache_*``, ``kv_tokens_allocated``: see
        ``SGLangEngine.prefix_cache_stats``; ``kv_tokens_in_use`` leaves out what only the
        cache holds).
        """
        def snap():
            active = len(self.requests)
            ready = len(self.ready)
            return {
                "model": self.name,
                "kv_tokens_in_use": self.engine.kv_tokens_in_use(),
                "kv_capacity_tokens": self.engine.kv_capacity,
                "kv_rows_in_use": self.engine.rows_in_use(),
                "reserved_tokens": self.reserved,
                "active": active,
                "ready": ready,
                "pending": sum(1 for r in self.requests.values() if r.sink is None),
                "waiting": len(self.waiting),
                **{k: self.counters[k] for k in ("steps", "decode_tokens", "extend_tokens", "extend_runs",
                                                  "handoffs_out", "finished", "cancelled", "errors",
                                                  "requests_in", "prefill_chunks",
                                                  "draft_tokens", "verifications", "drafts_verified", "drafts_accepted",
                                                  "draft_tokens_rolled_back", "verify_kv_freed")},
                "step_time_s": self.counters["step_time_us"] / 1e6,
                "forward_s": self.counters["forward_us"] / 1e6,
                "route_s": self.counters["route_us"] / 1e6,
                "send_s": self.counters["send_us"] / 1e6,
                "decode_steps": self.counters["decode_steps"],
                "decode_step_forward_s": self.counters["decode_step_forward_us"] / 1e6,
                "resume_steps": self.counters["resume_steps"],
                "resume_step_forward_s": self.counters["resume_step_forward_us"] / 1e6,
                "delayed_batch_size": self.config.delayed_batch_size,
                "delayed_batch_max_wait_us": int(round(self.config.max_wait_s * 1e6)),
                "prefill_chunk_tokens": self.config.prefill_chunk_tokens,
                **self.engine.prefix_cache_stats(),
            }
        return self.call(snap)

    def flush_prefix_cache(self) -> Dict[str, Any]:
        """Empty the model's prefix cache, on the loop thread (between steps).

        Prefixes that running or pending requests read stay until those requests end.

        Returns:
            ``{"model", "flushed_tokens", "prefix_cache_tokens"}`` (tokens freed, tokens still cached).
        """
        def job():
            freed = self.engine.flush_prefix_cache()
            return {"model": self.name, "flushed_tokens": freed,
                    "prefix_cache_tokens": self.engine.prefix_cache_stats()["prefix_cache_tokens"]}
        return self.call(job)

    def reconfigure(self, **changes: Any) -> None:
        """Change scheduling settings at run time, on the loop thread (between steps).

        Keys: the fields of :class:`SubserverConfig` (``delayed_batch_size``, ``max_wait_s``,
        ``stream_interval``, ``readmit_on_resume``, ``lockstep``, ``prefill_chunk_tokens``, ...).
        Used for online adaptation of B* and to switch baselines without restarting the server
        (a change of ``lockstep`` switches the loop's :class:`DecodeStrategy`).

        Raises:
            ValueError: unknown key or a value out of range (checked as SubserverConfig checks it).
        """
        unknown = set(changes) - set(SubserverConfig.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown scheduling settings: {sorted(unknown)}")
        dataclasses.replace(self.config, **changes)  # validates the changed settings
        def job():
            for k, v in changes.items():
                setattr(self.config, k, v)
            self.strategy = self._choose_strategy()
        self.call(job)

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
                if not self.ready and self.on_idle is not None:
                    self.on_idle()
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

    def _receive_guarded(self, peer_req: PeerReq, sink: Sink) -> None:
        """:meth:`_receive`; an unexpected error fails that request only."""
        try:
            self._receive(peer_req, sink)
        except Exception as e:  # noqa: BLE001 - bad work fails that request only
            logger.exception("receive on %s failed", self.name)
            self.counters["errors"] += 1
            lr = self.requests.get(peer_req.rid)
            if lr is not None and lr.sink is sink:
                self._release(peer_req.rid, "error", str(e))  # answers sink through the segment's sink
            else:
                sink("error", [], {"message": f"model {self.name}: {e}"})

    # ------------------------------------------------------------- receive
    def _reservation(self, peer_req: PeerReq, known_tokens: int) -> int:
        return known_tokens + max(0, peer_req.max_tokens - peer_req.num_generated) + 1

    def _validate(self, peer_req: PeerReq, lr: Optional[LocalRequest]) -> None:
        """Reject a PeerReq this model cannot run (ValueError, for that request only)."""
        if lr is not None and lr.sink is not None:
            raise ValueError(f"request {peer_req.rid!r} is already running on model {self.name}")
        if lr is None and peer_req.resume:
            raise ValueError(f"request {peer_req.rid!r} has no state on model {self.name} to resume "
                             "(released or never admitted)")
        if lr is None and not peer_req.tokens:
            raise ValueError("a new request needs at least one token")
        if peer_req.max_tokens < 1 or not 0 <= peer_req.num_generated <= peer_req.max_tokens:
            raise ValueError(f"invalid budget: max_tokens={peer_req.max_tokens}, "
                             f"num_generated={peer_req.num_generated}")
        vocab = self.engine.vocab_size
        if any(not 0 <= t < vocab for t in peer_req.tokens):
            raise ValueError(f"token ids must be in [0, {vocab})")
        validate_sampling(peer_req.sampling)

    def _receive(self, peer_req: PeerReq, sink: Sink) -> None:
        self.counters["requests_in"] += 1
        lr = self.requests.get(peer_req.rid)
        try:
            self._validate(peer_req, lr)
            algo = self._make_algo(peer_req)
        except ValueError as e:
            self.counters["errors"] += 1
            sink("error", [], {"message": f"model {self.name}: {e}"})
            return
        if lr is None:
            need = self._reservation(peer_req, len(peer_req.tokens))
            if need > min(self.engine.kv_capacity, self.engine.context_length + 1):
                sink("error", [], {"message": (
                    f"request needs {need - 1} tokens of KV (prompt + max_tokens), model {self.name} "
                    f"has {self.engine.kv_capacity} in its pool and a context of {self.engine.context_length}")})
                return
            if self.reserved + need > self.engine.kv_capacity or \
                    len(self.requests) >= self.engine.config.max_running_requests:
                self._enqueue(peer_req, sink, need)
                return
            self._admit(peer_req, sink, algo, need)
            return
        # resume of a pending request
        tokens = algo.receive(peer_req)
        lr.header = peer_req
        lr.header.tokens = []
        lr.algo = algo
        if lr.drafts:
            tokens = self._rollback_drafts(lr, tokens)
        if self.config.readmit_on_resume:
            # std-serving baseline: forget the KV, re-prefill everything (no prefix cache either)
            self.engine.release(lr.seq, cache=False)
            lr.seq = self.engine.add(lr.rid, lr.seq.tokens + tokens, use_prefix_cache=False)
        else:
            lr.seq.tokens.extend(tokens)
        lr.loc = len(lr.seq.tokens)
        self._set_verify(lr, algo)
        lr.sink = sink
        self._make_ready(lr)

    def _rollback_drafts(self, lr: LocalRequest, tokens: List[int]) -> List[int]:
        """Speculative decoding, drafting model: drop the drafted tokens the verifier rejected.

        ``lr.seq`` ends with ``lr.drafts`` drafted tokens; ``tokens`` (the verifier's committed
        tokens: the accepted drafts, then its own, if any) start with the accepted ones.  The
        longest common prefix stays (its KV is reused), less its last token when that would
        leave nothing to run; the rest of the drafts leave the sequence and their KV slots are
        freed (:meth:`SGLangEngine.truncate`).  Leviathan et al. 2023, §2.3.

        Returns:
            the tokens still to append (``tokens`` minus the kept prefix).
        """
        base = len(lr.seq.tokens) - lr.drafts
        drafted = lr.seq.tokens[base:]
        keep = 0
        while keep < min(len(drafted), len(tokens)) and drafted[keep] == tokens[keep]:
            keep += 1
        if 0 < keep == len(tokens) < len(drafted):
            # every committed token is a draft that has KV here (a later draft step ran it), so no
            # token would be left to run: the last one is cut with the rest and appended again
            # (its logits, which the next draft needs, are recomputed).  Happens when the
            # verifier's own token equals the draft it replaced (draft-verify's rules)
            keep -= 1
        self.counters["draft_tokens_rolled_back"] += len(drafted) - keep
        self.engine.truncate(lr.seq, base + keep)
        lr.drafts = 0
        return tokens[keep:]

    def _set_verify(self, lr: LocalRequest, algo) -> None:
        """Speculative decoding, verifying model: mark the drafts the next step checks."""
        lr.verify = list(algo.drafts_to_verify())
        if lr.verify:
            lr.seq.verify_positions = len(lr.verify) + 1
            lr.loc = len(lr.seq.tokens) - len(lr.verify)

    def _make_algo(self, peer_req: PeerReq):
        if self.name not in peer_req.models:
            raise ValueError(f"model {self.name!r} is not in the request's model list {peer_req.models}")
        cls, params = self._configure_algorithm(peer_req.algorithm, peer_req.params, len(peer_req.models))
        algo = cls(peer_req.models.index(self.name), len(peer_req.models), params)
        algo.attach(self.engine)  # learned routers: hidden-state capture check, embeddings
        return algo

    def _admit(self, peer_req: PeerReq, sink: Sink, algo, need: int) -> None:
        tokens = algo.receive(peer_req)  # the PeerReq's tokens (+ drafts to verify: speculative)
        n_drafts = len(algo.drafts_to_verify())
        # drafts join after the add, so that a prefix-cache match never covers a drafted position
        seq = self.engine.add(peer_req.rid, tokens[:len(tokens) - n_drafts])
        seq.tokens.extend(tokens[len(tokens) - n_drafts:])
        hdr = peer_req
        hdr.tokens = []
        lr = LocalRequest(rid=hdr.rid, seq=seq, header=hdr, algo=algo, loc=len(tokens),
                          sink=sink, reserved_tokens=need)
        self._set_verify(lr, algo)
        self.reserved += need
        self.requests[lr.rid] = lr
        self._make_ready(lr)

    def _enqueue(self, peer_req: PeerReq, sink: Sink, need: int) -> None:
        """Queue a new request that must wait for KV (in order), or refuse it as busy when the
        queue is full (``max_queued_requests``)."""
        if len(self.waiting) >= self.config.max_queued_requests:
            self.counters["busy"] += 1
            sink("error", [], {"message": (
                f"{BUSY_PREFIX}model {self.name} has {len(self.waiting)} requests waiting for KV; the limit is "
                f"{self.config.max_queued_requests} (max_queued_requests; the request needs {need} tokens, "
                f"{self.engine.kv_capacity - self.reserved} of {self.engine.kv_capacity} are free); retry later")})
            return
        timeout = self.config.queue_timeout_s
        try:
            asked = float((peer_req.extras or {}).get("queue_timeout_s") or 0)
        except (TypeError, ValueError):
            asked = 0.0
        if asked > 0:
            timeout = min(timeout, asked) if timeout else asked
        if timeout:
            self._wait_deadline[peer_req.rid] = time.monotonic() + timeout
        self.waiting.append((peer_req, sink))

    def _expire_waiting(self) -> None:
        """End as busy every queued request past its queue deadline (order of the rest kept)."""
        now = time.monotonic()
        for peer_req, sink in [w for w in self.waiting if self._wait_deadline.get(w[0].rid, now) < now]:
            self.waiting.remove((peer_req, sink))
            del self._wait_deadline[peer_req.rid]
            self.counters["busy"] += 1
            sink("error", [], {"message": (
                f"{BUSY_PREFIX}model {self.name} had no KV free for the request within its queue timeout "
                f"(queue_timeout_s; {len(self.waiting)} requests still waiting, {self.reserved} of "
                f"{self.engine.kv_capacity} KV tokens reserved); retry later")})

    def _admit_waiting(self) -> None:
        while self.waiting:
            peer_req, sink = self.waiting[0]
            need = self._reservation(peer_req, len(peer_req.tokens))
            if self.reserved + need > self.engine.kv_capacity or \
                    len(self.requests) >= self.engine.config.max_running_requests:
                return
            self.waiting.popleft()
            self._wait_deadline.pop(peer_req.rid, None)
            algo = self._make_algo(peer_req)
            self._admit(peer_req, sink, algo, need)

    def _make_ready(self, lr: LocalRequest) -> None:
        if lr.seq.pending_tokens <= 0:
            # nothing new to run: the peer sent no token (cannot happen with the
            # built-in algorithms); hand it straight back as an error.
            self._end_segment(lr, "error", {"message": "resume without new tokens"})
            return
        lr.ready_since = time.perf_counter()
        self.ready[lr.rid] = lr

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
        batch = list(self.ready.values())[: self.config.max_batch]
        t0 = time.perf_counter()
        batch, held = self._plan_prefill_chunks(batch)
        seqs = [lr.seq for lr in batch]
        has_prefill = any(not lr.prefilled for lr in batch)
        t_mono = time.monotonic()
        for lr in batch:
            if not lr.prefilled and not lr.header.resume and lr.header.num_generated == 0 \
                    and lr.seq.kv_len == lr.seq.cached_tokens:
                lr.first_step_t = t_mono
        try:
            out = self.engine.forward(seqs)
        except Exception as e:  # noqa: BLE001 - fail these requests, keep serving
            logger.exception("forward failed on %s", self.name)
            self._restore_held(held)
            for lr in batch:
                self.counters["errors"] += 1
                self._end_segment(lr, "error", {"message": f"forward failed on model {self.name}: {e}"})
                self._release(lr.rid, "error", str(e))
            return
        t_fwd = time.perf_counter()
        if held:
            self._restore_held(held)
            batch, out = self._without_partial_rows(batch, out, held)
            if not batch:  # only partial prefills ran: nothing to sample
                self._count_partial_step(out, t0, t_fwd, len(held))
                return
        try:
            self.process_batch_result(batch, out, t0, t_fwd, has_prefill)
        except Exception as e:  # noqa: BLE001 - fail this batch's requests, keep serving the rest
            logger.exception("step failed on %s", self.name)
            for lr in batch:
                if lr.rid in self.requests:
                    self.counters["errors"] += 1
                    self._release(lr.rid, "error", f"step failed on model {self.name}: {e}")

    # ------------------------------------------------------------- chunked prefill
    def _plan_prefill_chunks(self, batch: List[LocalRequest]):
        """Share this step's budget of ``prefill_chunk_tokens`` new tokens among its extends.

        Decode rows (one new token) always run.  Extends (prompts, resumes, re-prefills) take
        the budget shortest first; the tokens of a request beyond its share are cut off its
        sequence for this step (a chunk runs), and a request with no share left sits this step
        out (it stays ready).  The first extend always gets a share, so every step runs.

        Returns:
            ``(rows to run, held)``: ``held`` maps rid to ``(sequence, held-back token ids)``;
            :meth:`_restore_held` puts the tokens back after the forward step.  Without
            chunking, or when every extend fits, ``(batch, {})``.
        """
        budget = self.config.prefill_chunk_tokens
        held: Dict[str, tuple] = {}
        if budget <= 0:
            return batch, held
        extends = sorted((lr for lr in batch if lr.seq.pending_tokens > 1), key=lambda lr: lr.seq.pending_tokens)
        if sum(lr.seq.pending_tokens for lr in extends) <= budget:
            return batch, held
        waiting = set()
        for lr in extends:
            n = lr.seq.pending_tokens
            if budget <= 0:
                waiting.add(lr.rid)
                continue
            run = min(n, budget)
            m = lr.seq.verify_positions
            if run < n and m > 1 and n - run < m:  # the drafted positions must be in the last chunk
                run = n - m if n - m > 0 else n
            if run < n:
                held[lr.rid] = (lr.seq, lr.seq.tokens[run - n:], m)
                del lr.seq.tokens[run - n:]
                lr.seq.verify_positions = 0
                self.counters["prefill_chunks"] += 1
            budget -= min(run, budget)
        return [lr for lr in batch if lr.rid not in waiting], held

    def _count_partial_step(self, out, t0: float, t_fwd: float, rows: int) -> None:
        """Counters and step event of a step that ran only partial prefills (no token sampled)."""
        self.counters["steps"] += 1
        self.counters["extend_tokens"] += out.extend_tokens
        self.counters["extend_runs"] += rows
        self.counters["step_time_us"] += int((time.perf_counter() - t0) * 1e6)
        self.counters["forward_us"] += int((t_fwd - t0) * 1e6)
        if self.event_sink is not None:
            self.event_sink({"event": "step", "model": self.name, "batch_size": rows,
                             "latency_s": round(out.latency_s, 6), "tokens_committed": 0,
                             "extend_tokens": out.extend_tokens, "t": time.time()})

    @staticmethod
    def _restore_held(held: Dict[str, tuple]) -> None:
        for seq, toks, m in held.values():
            seq.tokens.extend(toks)
            seq.verify_positions = m

    @staticmethod
    def _without_partial_rows(batch: List[LocalRequest], out, held: Dict[str, tuple]):
        """The step's requests and engine output without the rows of partial prefills.

        A partial prefill's logits follow a chunk of its prompt, not its last token, so they
        are dropped; the request stays ready and runs its next chunk in the next step.
        """
        keep = [i for i, lr in enumerate(batch) if lr.rid not in held]
        idx = torch.tensor(keep, dtype=torch.long)
        pos = getattr(out, "position_logits", None)
        out = dataclasses.replace(
            out, seqs=[out.seqs[i] for i in keep], logits=out.logits.index_select(0, idx),
            hidden=None if out.hidden is None else out.hidden.index_select(0, idx),
            num_extend=out.num_extend - len(held),
            position_logits=None if pos is None else [pos[i] for i in keep])
        return [batch[i] for i in keep], out
