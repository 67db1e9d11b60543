"""A PeerReq's arrival at a model: checks, admission with KV reserved for life, the KV queue, resume.

A new request gets KV reserved for its whole life (prompt + ``max_tokens``), or waits in the
model's queue until that much is free (ending as busy past its queue timeout, or at once when
the queue is full); one that can never fit is refused at once.  A request that comes back from a
peer (*resume*) appends only the new tokens to its pending sequence: never a re-prefill (except
in the std-serving baseline, ``readmit_on_resume``).  Speculative decoding: a drafting model
rolls back the drafts its peer rejected, a verifying model marks the drafts its next step checks.
"""

from __future__ import annotations

import logging
import time
from typing import List, Optional

from ..protocol import PeerReq
from .request import BUSY_PREFIX, LocalRequest, Sink
from .sampling import validate_sampling

logger = logging.getLogger(__name__)

__all__ = ["AdmissionMixin"]


class AdmissionMixin:
    """Admission and resume of a :class:`~tokenrouter.engine.subserver.Subserver` (loop thread).

    Uses its ``engine``, ``name``, ``config``, ``counters``, ``requests``, ``ready``, ``waiting``
    (``(peer_req, sink)`` awaiting KV, in order), ``_wait_deadline`` (rid -> monotonic deadline),
    ``reserved`` (KV tokens), ``constrained`` (guided decoding), ``_configure_algorithm``,
    ``_end_segment`` and ``_release``.
    """

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
        except ValueError as e:  # the request's input: the client's error
            self.counters["errors"] += 1
            sink("error", [], {"message": f"model {self.name}: {e}", "refused": True})
            return
        try:
            algo = self._make_algo(peer_req)
        except ValueError as e:  # the deployment's (e.g. a router file for another model): a server error
            self.counters["errors"] += 1
            sink("error", [], {"message": f"model {self.name}: {e}", "refused": False})
            return
        if lr is None:
            need = self._reservation(peer_req, len(peer_req.tokens))
            if need > min(self.engine.kv_capacity, self.engine.context_length + 1):
                sink("error", [], {"message": (
                    f"request needs {need - 1} tokens of KV (prompt + max_tokens), model {self.name} "
                    f"has {self.engine.kv_capacity} in its pool and a context of {self.engine.context_length}"),
                    "refused": True})
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
        lr.draft_logprobs = []  # a visit's drafts' logprobs left with its handoff
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
        self.constrained.sync(lr)  # guided decoding: the catch-up tokens (ValueError: this request fails)
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
        err = self.constrained.attach(lr)  # guided decoding: the request's matcher
        if err is not None:
            self.counters["errors"] += 1
            self.engine.release(seq, cache=False)
            sink("error", [], {"message": f"model {self.name}: {err}", "refused": True})
            return
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
