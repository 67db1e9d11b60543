"""Triton transport: every visit of a request to a model is a decoupled BLS request.

The router's ``transport: triton`` mode (see :mod:`tokenrouter.triton.router_model`).
Where the ZeroMQ channel (:mod:`tokenrouter.routing.peer`) sends PeerReqs past
Triton, here each *segment* — one visit of a request to a model — is a Triton
request to that model (inputs ``request_id``, ``op = run``, ``input_ids`` = the
token suffix the model has not seen, ``peer_req`` = the PeerReq header JSON),
and its token chunks come back as the model's decoupled responses.  So every
handoff passes Triton's scheduler: the model's ``dynamic_batching`` block groups
arrivals (see ``docs/transport.md``) and ``/v2/models/<model>/stats`` counts them.
``release`` is a request with ``op = release``; ``stats`` / ``configure`` /
``ping`` likewise.  The inputs are an op's wire values and the ``event`` output an
event's JSON, both from :mod:`tokenrouter.protocol`'s codec, so the model answers
them with the dispatcher its ZeroMQ channel uses.  :class:`TritonTransport` is a
:class:`~tokenrouter.routing.segments.Transport` (the same as
:class:`~tokenrouter.routing.peer.PeerClient`).

Threading — what the Triton 2.51 Python backend (python_backend r24.10) allows
-------------------------------------------------------------------------------
* ``InferenceRequest.exec(decoupled=True)`` blocks until the model's *first*
  response (with the dynamic batcher that includes the queue delay), and the
  returned ``ResponseIterator`` has only a blocking ``__next__``.
  ``async_exec(decoupled=True)`` exists but is ``loop.run_in_executor(None,
  exec)``: the same blocking call on asyncio's default thread pool, returning the
  same synchronous iterator — it offers no single-threaded multiplexing.  One
  thread issuing every BLS call would therefore serialise the submissions, and
  Triton's batcher could never see two arrivals at once.
* Concurrent ``exec`` / ``__next__`` from several threads is what ``async_exec``
  itself does, and the stub synchronises it: ``exec`` and ``__next__`` release
  the GIL while they wait, shared memory and the stub→server message queue are
  mutex-protected, each iterator has its own mutex, the response-iterator map
  its own.
* What did corrupt the stub's heap (a version of this router that iterated BLS
  streams from many threads crashed under load): when a stream's final response
  arrives, the stub's *utils* thread (a C++ thread, no GIL) drops the stub's
  reference to the iterator; if Python had already dropped its own, the
  iterator, its responses and their tensors are destroyed on that thread and
  each tensor's ``numpy`` array is decref'ed without the GIL (python_backend
  fixed this after r24.10 by taking the GIL in ``~PbTensor``).  Here every
  finished iterator is kept (:meth:`TritonTransport.bury`) until a *fence* has
  passed — a ``request.is_cancelled()`` call that started after the stream
  finished and returned: the utils thread handles its messages in order, so by
  then it has dropped its reference, and the last one goes on a Python thread
  holding the GIL.  The router's client I/O thread makes those calls in its
  cancellation sweep and then calls :meth:`TritonTransport.fence_passed`.
* Python objects of the backend (requests, responses, tensors) are only created
  and read on the *pump* threads, one per open BLS stream (:class:`_Pump`): a
  pump makes the call, reads each response into plain Python values and puts
  them on the segment's queue; the router's worker thread reads that queue
  exactly as it reads :meth:`PeerClient.segment`'s.  No pump sends client
  responses, touches metrics or checks cancellation: those stay on the client
  I/O thread.

Failure: a model whose stub died is found in two ways — its advert's process is
gone (checked every ``liveness_interval_s``, as the ZeroMQ client does), or a BLS
call answers "Stub process ... is not healthy" (or the model is unknown / not
ready).  Either marks the model *down*: its open segments end at once with
:class:`~tokenrouter.routing.peer.PeerDownError` and new calls raise it.  A pump
blocked on a dead stub's stream stays blocked (the 2.51 backend sends nothing
more); it holds no lock and only its thread is lost.
"""

from __future__ import annotations

import collections
import logging
import queue
import re
import threading
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

import numpy as np

from ..proc import process_alive, process_start_time
from ..protocol import Event, Failed, OpWire, decode_event, is_final
from ..routing.segments import DownMarks, PeerDown, PeerDownError, SegmentTransport

logger = logging.getLogger(__name__)

__all__ = ["TritonTransport", "is_down_error"]

#: BLS error messages (Triton's, lower-cased) that mean the model's process is gone or the model is
#: not loaded: "Stub process 'llm_0_0' is not healthy.", "Request for unknown model: ...", "... is not ready"
DOWN_MARKERS = ("is not healthy", "stub process", "unknown model", "is not ready", "is not found")
#: errors the models themselves send start with "model <name>: " (a request error, not a dead model)
_OWN_ERROR = re.compile(r"^model [\w.\-]+: ")


def is_down_error(message: str) -> bool:
    """True when a BLS error ``message`` says the model cannot be reached (not a request error)."""
    m = message or ""
    return not _OWN_ERROR.match(m) and any(k in m.lower() for k in DOWN_MARKERS)


class _Pump:
    """One BLS stream, on its own thread: exec, read every response, hand the values on.

    Args:
        transport: the owning :class:`TritonTransport` (BLS module, burial, down marking).
        model: target model name.
        wire: the op's wire values (the request's inputs).
        out: callable(ids, event) receiving each response as typed values (a response
            without an event is skipped); a stream that ends without a final event ends
            with a :class:`~tokenrouter.protocol.Failed`.  None for fire-and-forget calls.
        after: an Event to wait for before the call (a release of the same request
            on the same model that must reach the model first), or None.
        on_sent: callable() run once ``exec`` has returned (the model received the request)
            or the call failed.
    """

    def __init__(self, transport: "TritonTransport", model: str, wire: OpWire,
                 out: Optional[Callable[[List[int], Event], None]],
                 after: Optional[threading.Event] = None, on_sent: Optional[Callable[[], None]] = None):
        self.t, self.model, self.wire, self.out = transport, model, wire, out
        self.after, self.on_sent = after, on_sent
        self.ended = False  # a final event was handed on
        threading.Thread(target=self._run, name=f"bls-{model}-{wire.op}", daemon=True).start()

    def _emit(self, ids: List[int], ev: Event) -> None:
        self.ended = self.ended or is_final(ev) or isinstance(ev, PeerDown)
        if self.out is not None:
            self.out(ids, ev)

    def _sent(self) -> None:
        if self.on_sent is not None:
            cb, self.on_sent = self.on_sent, None
            cb()

    def _request(self):
        pb = self.t.pb_utils
        w = self.wire
        return pb.InferenceRequest(
            model_name=self.model, requested_output_names=["output_ids", "event"],
            inputs=[pb.Tensor("request_id", np.asarray([[w.rid.encode()]], dtype=np.object_)),
                    pb.Tensor("op", np.asarray([[w.op.encode()]], dtype=np.object_)),
                    pb.Tensor("input_ids", np.asarray(list(w.tokens), dtype=np.int64).reshape(1, -1)),
                    pb.Tensor("peer_req", np.asarray([[w.payload.encode()]], dtype=np.object_))])

    def _run(self) -> None:
        it = req = None
        try:
            if self.after is not None:
                self.after.wait(30)
            req = self._request()
            it = req.exec(decoupled=True)
            self._sent()
            for resp in it:  # always to the final response: an unfinished iterator blocks where it is freed
                try:
                    self._handle(resp)
                except Exception as e:  # noqa: BLE001 - e.g. a response without valid JSON
                    self._emit([], Failed(message=f"model {self.model}: bad response: {e}"))
        except Exception as e:  # noqa: BLE001 - this stream only
            logger.exception("BLS %s to %s failed", self.wire.op, self.model)
            self._emit([], Failed(message=f"model {self.model}: BLS call failed: {e}"))
        finally:
            self._sent()
            if not self.ended:
                self._emit([], Failed(message=f"model {self.model} ended the {self.wire.op!r} stream "
                                              "without a final event"))
            self.t.bury(it, req)

    def _handle(self, resp) -> None:
        if resp.has_error():
            msg = resp.error().message()
            if is_down_error(msg):
                self.t.mark_down(self.model, f"model {self.model} is down: {msg}")
                self._emit([], PeerDown(message=f"model {self.model} is down: {msg}"))
            else:  # the model's INVALID_ARG: it refused the input (protocol.Failed.refused)
                code = resp.error().code()
                self._emit([], Failed(message=msg, refused=code == self.t.pb_utils.TritonError.INVALID_ARG))
            return
        pb = self.t.pb_utils
        ev_t = pb.get_output_tensor_by_name(resp, "event")
        if ev_t is None:  # a response without values (e.g. only the final flag)
            return
        ids_t = pb.get_output_tensor_by_name(resp, "output_ids")
        ids = [] if ids_t is None else ids_t.as_numpy().reshape(-1).tolist()
        self._emit(ids, decode_event(ev_t.as_numpy().reshape(-1)[0]))


class TritonTransport(SegmentTransport):
    """Router side of the Triton transport (see module docstring); segments and calls from
    :class:`~tokenrouter.routing.segments.SegmentTransport`.

    Args:
        resolve: callable(model) → ``{"pid": int, "start": int | None, ...}`` of the model's
            stub process (its advert; called on a model's first use and after it is
            marked up), or a dict without ``pid`` when unknown (no liveness watch then).
        stall_timeout_s: a segment whose model sends nothing this long fails with
            :class:`PeerChannelError` (seconds; 0 = wait forever).
        tick_s: while waiting, :meth:`segment` yields ``([], TICK)`` every
            ``tick_s`` seconds so that the caller can check cancellation (and at once
            on :meth:`interrupt`).
        on_down: optional callable(model, reason), called once each time a model is marked down.
        liveness_interval_s: seconds between two checks of the models' processes.
        pb_utils: the ``triton_python_backend_utils`` module (injected so this module
            imports outside a stub).
    """

    reply_endpoint = ""  # no reply socket: responses come back through Triton

    def __init__(self, resolve: Callable[[str], Dict[str, Any]], *, stall_timeout_s: float = 600.0,
                 tick_s: float = 0.05, on_down: Optional[Callable[[str, str], None]] = None,
                 liveness_interval_s: float = 0.25, pb_utils=None):
        if pb_utils is None:
            import triton_python_backend_utils as pb_utils  # noqa: PLC0415 - only inside a stub
        super().__init__(tick_s, stall_timeout_s)
        self.pb_utils = pb_utils
        self._resolve = resolve
        self.liveness_interval_s = float(liveness_interval_s)
        self._lock = threading.Lock()
        self._procs: Dict[str, Tuple[int, Optional[int]]] = {}  # model -> (pid, start time)
        self._known: set = set()  # models resolved since their last down mark
        self._marks = DownMarks(on_down)  # the segments' owner: the model's name
        self._releasing: Dict[Tuple[str, str], threading.Event] = {}
        self._grave: Deque[Tuple[int, tuple]] = collections.deque()
        self._grave_seq = 0
        self._grave_lock = threading.Lock()
        self._stop = threading.Event()
        self._monitor = threading.Thread(target=self._watch, name="bls-liveness", daemon=True)
        self._monitor.start()

    # ------------------------------------------------------- burial / fence
    def bury(self, *objs) -> None:
        """Keep finished BLS objects alive until :meth:`fence_passed` (see module docstring)."""
        with self._grave_lock:
            self._grave_seq += 1
            self._grave.append((self._grave_seq, objs))

    def fence_mark(self) -> int:
        """Sequence number of the newest burial; give it to :meth:`fence_passed` after the fence call."""
        with self._grave_lock:
            return self._grave_seq

    def fence_passed(self, mark: int) -> int:
        """Drop burials up to ``mark`` (on the calling thread); returns how many were dropped.

        Call only after a ``request.is_cancelled()`` that went to the server and
        that started after :meth:`fence_mark` returned ``mark``.
        """
        dropped = []
        with self._grave_lock:
            while self._grave and self._grave[0][0] <= mark:
                dropped.append(self._grave.popleft())
        n = len(dropped)
        del dropped  # the last references go here, on this (Python, GIL-holding) thread
        return n

    def buried(self) -> int:
        """Finished BLS streams not yet released by a fence."""
        with self._grave_lock:
            return len(self._grave)

    # ------------------------------------------------------------ liveness
    def _know(self, model: str) -> None:
        """Resolve ``model``'s process once (after each down mark), for the liveness watch."""
        reason = self._marks.reason(model)
        if reason is not None:
            raise PeerDownError(model, reason)
        with self._lock:
            if model in self._known:
                return
        info = self._resolve(model) or {}
        self._set_proc(model, info)

    def _set_proc(self, model: str, info: Dict[str, Any]) -> None:
        with self._lock:
            self._known.add(model)
            if info.get("pid"):
                pid = int(info["pid"])
                start = info.get("start")
                self._procs[model] = (pid, process_start_time(pid) if start is None else start)

    def _watch(self) -> None:
        while not self._stop.wait(self.liveness_interval_s):
            with self._lock:
                procs = list(self._procs.items())
            for model, (pid, start) in procs:
                if not process_alive(pid, start):
                    self.mark_down(model, f"model {model} is down: its process (pid {pid}) exited")

    def mark_down(self, model: str, reason: str) -> bool:
        """Mark ``model`` down: end its open segments with :class:`PeerDownError`, refuse new calls.

        Returns:
            True when the model was up until now (``on_down`` is then called).
        """
        with self._lock:
            self._procs.pop(model, None)
            self._known.discard(model)
        was_up = self._marks.set(model, reason)
        self._segments.fail(reason, owner=model)
        if was_up:
            self._marks.notify(model, reason)
        return was_up

    def mark_up(self, model: str, resolved: Any) -> None:
        """Watch the process in ``resolved`` (an advert dict) for ``model`` and clear its down mark."""
        info = resolved if isinstance(resolved, dict) else {}
        with self._lock:
            self._procs.pop(model, None)
        self._marks.clear(model)
        self._set_proc(model, info)
        logger.warning("model %s is up again", model)

    def down(self) -> Dict[str, str]:
        """Models marked down now: ``{model: reason}``."""
        return self._marks.snapshot()

    def is_down(self, model: str) -> bool:
        """True while ``model`` is marked down (its stub died; see :meth:`mark_down`)."""
        return model in self._marks

    # ----------------------------------------------------------- transport
    def _after_release(self, model: str, rid: str) -> Optional[threading.Event]:
        """The pending release of ``rid`` on ``model`` a new segment must wait for, or None."""
        with self._lock:
            return self._releasing.get((model, rid))

    def _start(self, model: str, wire: OpWire) -> Tuple[int, "queue.Queue", None]:
        """Register a segment on ``model`` and start its BLS stream (a ``run`` waits for a release of
        the same request on the same model to reach the model first).

        Raises:
            PeerDownError: the model is down.
        """
        if wire.op == "run":
            self._know(model)  # resolves its process for the liveness watch
        seg, q = self._segments.open(model)
        try:
            reason = self._marks.reason(model)  # checked after the segment is open: no lost mark
            if reason is not None:
                raise PeerDownError(model, reason)
            _Pump(self, model, wire, lambda ids, ev: q.put((ids, ev)),
                  after=self._after_release(model, wire.rid) if wire.op == "run" else None)
        except BaseException:
            self._segments.close(seg)
            raise
        return seg, q, None

    def release(self, model: str, rid: str) -> None:
        """Free ``rid``'s state on ``model`` (a BLS ``release``; does not wait for it).

        A later segment of the same request on the same model waits until the
        release has reached the model.  Nothing is sent to a model marked down.
        """
        if self.is_down(model):
            return
        sent = threading.Event()
        with self._lock:
            self._releasing[(model, rid)] = sent

        def done() -> None:
            sent.set()
            with self._lock:
                if self._releasing.get((model, rid)) is sent:
                    del self._releasing[(model, rid)]

        _Pump(self, model, OpWire("release", rid), None, on_sent=done)

    def close(self) -> None:
        """Stop the liveness watch (burials stay until the process ends: no fence can pass any more)."""
        self._stop.set()
        self._monitor.join(timeout=2)
