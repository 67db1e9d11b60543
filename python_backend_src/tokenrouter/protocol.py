"""Messages between processes: the paper's ``PeerReq``, the ops a model serves, the events it
answers with, and their one codec; also the step results the routing algorithms see.

Paper §Design, "Interface (request-centric)": ``send(req)`` packs a PeerReq
{request id, the token suffix the peer has not seen (from the position anchor
``req.loc``), status running/finished, algorithm extras}; ``receive(peer_req)``
turns it into local work.

Ops and events are tagged structs (msgspec; the model is SGLang's ``io_struct.py``):

* an :class:`Op` goes from the router (or an operator tool) to a model: :class:`Run` (one
  *segment*: a PeerReq and the token suffix the model has not seen), :class:`Release`,
  :class:`Ping`, :class:`Stats`, :class:`Configure`, :class:`EventsQuery`, :class:`Calibrate`,
  :class:`Flush`, :class:`Endpoint`.  On the wire an op is four values, :class:`OpWire`
  (``op`` name, ``request_id``, ``peer_req`` text, ``input_ids``): the inputs of the model's
  Triton interface, and the frames of the ZeroMQ channel (:func:`encode_op`, :func:`decode_op`);
* a model answers with events: a segment streams :class:`Tokens` chunks and ends with one
  :class:`Handoff`, :class:`Finished`, :class:`Cancelled` or :class:`Failed`; any other op gets
  one :class:`Answer`.  On the wire an event is JSON ``{"kind": ..., ...}`` next to the token ids
  (INT64): the model's ``event`` / ``output_ids`` outputs, and the channel's frames
  (:func:`encode_event`, :func:`decode_event`).

Both transports (:mod:`tokenrouter.routing.peer`, :mod:`tokenrouter.triton.transport`) carry
the same values, so one dispatcher on the model side
(:class:`tokenrouter.engine.op_dispatch.OpDispatcher`) answers both, and the router's loop
(:func:`tokenrouter.routing.router_core.drive`) reads the same event types from either.

A request's types, from arrival to token (as SGLang's ``schedule_batch.py`` names a
batch's: ScheduleBatch -> ModelWorkerBatch -> ForwardBatch):

    Triton request -> ClientRequest -> RoutedRequest -> PeerReq -> LocalRequest -> Sequence

* :class:`~tokenrouter.triton.request.ClientRequest`: one client request in the router stub,
  parsed and checked: its response sender, prompt token ids,
  :class:`~tokenrouter.engine.sampling.SamplingParams`, algorithm parameters, output switches.
* :class:`~tokenrouter.routing.router_core.RoutedRequest`: the router's whole view while
  :func:`~tokenrouter.routing.router_core.drive` runs the request through the models: prompt +
  output token ids, which model wrote each token, handoffs; the final response's summary.
* :class:`PeerReq` (this module): one *segment*, a visit of the request to one model: the token
  suffix that model has not seen, the budget, sampling and algorithm state; sent again, by the
  model, as the handoff to its peer.
* :class:`~tokenrouter.engine.subserver.LocalRequest`: the request as one model holds it, running
  or *pending* (its KV kept while a peer writes): latest PeerReq header, routing-algorithm
  instance, position anchor ``loc``, the segment's sink, KV reservation.
* :class:`~tokenrouter.engine.sglang_engine.Sequence`: the token ids that model knows and how
  many of them have KV in its pool (SGLang's ``Req`` holds the row).  Each forward step gives a
  :class:`StepResult` per sequence, whose token the algorithm keeps or hands off.

Tokens travel back the other way: the subserver's sink (``"tokens"`` chunks and a final kind)
-> the model stub's I/O queue (:mod:`tokenrouter.triton.messages`) -> the router's segment queue
-> ``drive`` (detokenised) -> the router's client I/O queue -> the client.  The stages, step by
step: ``docs/architecture.md``, "The life of a request".
"""

from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Union

import msgspec

__all__ = ["Status", "PeerReq", "StepResult", "FinishReason", "Verdict",
           "Op", "Run", "Release", "Ping", "Stats", "Flush", "Endpoint", "ArgsOp", "Configure", "EventsQuery",
           "Calibrate", "OPS", "OpWire", "encode_op", "decode_op",
           "Event", "SpecRound", "TokenLogprobs", "MAX_TOP_LOGPROBS", "SegmentEvent", "Tokens", "Handoff", "Finished", "Cancelled", "Failed",
           "Answer", "ModelEvent", "SEGMENT_EVENTS", "is_final", "encode_event", "decode_event"]


class Status(str, enum.Enum):
    """Request status carried by a PeerReq."""

    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    """Why a request ended (vLLM / OpenAI terms)."""

    STOP = "stop"        # EOS token or a stop string
    LENGTH = "length"    # max_tokens reached
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclass
class PeerReq:
    """A request handed from one model to another (or from the router to a model).

    Attributes:
        rid: request id (unique while the request lives).
        tokens: the token suffix the receiving model has not seen, int token ids.
        status: :class:`Status`.
        num_generated: output tokens committed so far (all models together).
        max_tokens: output budget in tokens.
        stop_token_ids: token ids that end the request (EOS and friends).
        sampling: sampling parameters (temperature, top_p, top_k, seed).
        algorithm: routing algorithm name.
        params: algorithm parameters (e.g. ``{"tau": 0.03}``).
        extras: algorithm-specific data travelling with the request.
        step: forward steps the request has run, all models together (event logs).
        models: names of the deployment's models in order (model 0 writes first
            by default); route() peer indices refer to this list.
        resume: the receiving model already holds this request (set by the
            router); a resume of an unknown request is an error, never a new one.
        down_models: names of models that are down (``on_peer_failure:
            fallback``): a route() decision to hand off to one of them is
            treated as "stay" (the step's token is committed locally).
    """

    rid: str
    tokens: List[int] = field(default_factory=list)
    status: Status = Status.RUNNING
    num_generated: int = 0
    max_tokens: int = 16
    stop_token_ids: List[int] = field(default_factory=list)
    sampling: Dict[str, Any] = field(default_factory=dict)
    algorithm: str = "rstitch"
    params: Dict[str, Any] = field(default_factory=dict)
    extras: Dict[str, Any] = field(default_factory=dict)
    step: int = 0
    models: List[str] = field(default_factory=list)
    resume: bool = False
    down_models: List[str] = field(default_factory=list)

    def header_json(self) -> str:
        """JSON of every field but ``tokens`` (they travel as an INT64 tensor)."""
        d = asdict(self)
        d.pop("tokens")
        d["status"] = self.status.value
        return json.dumps(d, separators=(",", ":"))

    @classmethod
    def from_wire(cls, header: str, tokens: List[int]) -> "PeerReq":
        """Inverse of :meth:`header_json` plus the token tensor.

        Raises:
            ValueError: the header is not a JSON object of PeerReq fields, or has no ``rid``.
        """
        try:
            d = json.loads(header)
        except json.JSONDecodeError as e:
            raise ValueError(f"peer_req is not JSON: {e}") from None
        if not isinstance(d, dict):
            raise ValueError("peer_req must be a JSON object")
        known = set(cls.__dataclass_fields__) - {"tokens"}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown peer_req fields: {sorted(unknown)}")
        if not isinstance(d.get("rid"), str) or not d["rid"]:
            raise ValueError("peer_req needs a non-empty string rid")
        d["status"] = Status(d.get("status", "running"))
        return cls(tokens=list(tokens), **d)


@dataclass
class StepResult:
    """What ``route()`` sees after one forward step of one request.

    Attributes:
        rid: request id.
        model_index: index of the model that ran the step (deployment order).
        token_id: the sampled next token (int).
        norm_entropy: entropy of the sampling distribution divided by log V,
            in [0, 1] (R-Stitch's uncertainty score).
        prob: probability of ``token_id`` under the model's distribution.
        step: decoding step index of the request (0 = first output token).
        hidden: last hidden state, float32 tensor ``[H]``, when captured.
        logits: next-token logits, float32 tensor ``[V]``.
        state: the model-local :class:`~tokenrouter.engine.subserver.LocalRequest`.
    """

    rid: str
    model_index: int
    token_id: int
    norm_entropy: float
    prob: float
    step: int
    hidden: Optional[Any] = None
    logits: Optional[Any] = None
    state: Optional[Any] = None


class Verdict(NamedTuple):
    """A verification's outcome, as :meth:`~tokenrouter.algorithms.base.RoutingAlgorithm.verify` may return it.

    Attributes:
        tokens: the token ids to commit, in order: the accepted drafts (``drafts[:accepted]``),
            then at most one token of the verifying model's own.  No token of its own is
            allowed only when every draft is accepted (draft-verify's rule: the round then
            ends on the last draft).
        accepted: how many leading ``tokens`` are accepted drafts (the drafter's tokens in
            the trace), 0 <= accepted <= len(drafts).
    """

    tokens: List[int]
    accepted: int


# ---------------------------------------------------------------------------- ops: router -> model

class Op(msgspec.Struct, tag_field="op", kw_only=True):
    """An operation asked of one model; the subclass's tag is its ``op`` name on the wire."""

    @property
    def name(self) -> str:
        """The op's name on the wire (``run``, ``release``, ...)."""
        return type(self).__struct_config__.tag


class Run(Op, tag="run", kw_only=True):
    """Run one segment of a request on the model (a new request, or the resume of a pending one).

    Attributes:
        peer_req: the :class:`PeerReq`; its ``tokens`` are the suffix the model has not seen.

    The model answers with a stream of :class:`Tokens` and one final segment event.
    """

    peer_req: PeerReq


class Release(Op, tag="release", kw_only=True):
    """Free request ``rid``'s state on the model (KV, pending state); its running segment, if
    any, ends with :class:`Cancelled`.  Answer: ``released`` (the ZeroMQ channel sends none)."""

    rid: str


class Ping(Op, tag="ping"):
    """Liveness.  Answer: ``pong`` with ``{"pid", "instance", "model"}`` (``instance``: a random
    id of this model object, so a restarted model tells itself apart from a slow one)."""


class Stats(Op, tag="stats"):
    """Counters, KV usage and the step-time breakdown.  Answer: ``stats`` (``Subserver.stats()``)."""


class Flush(Op, tag="flush"):
    """Empty the prefix cache.  Answer: ``flushed`` with ``{"model", "flushed_tokens",
    "prefix_cache_tokens"}`` (tokens)."""


class Endpoint(Op, tag="endpoint"):
    """Where the model's ZeroMQ channel listens.  Answer: ``endpoint`` with ``{"endpoint", "pid",
    "start"}``."""


class ArgsOp(Op, kw_only=True):
    """An op with a JSON argument (``peer_req`` on the wire).

    Attributes:
        args: the decoded JSON value; the model checks it (a malformed one is that op's error).
    """

    args: Any = msgspec.field(default_factory=dict)


class Configure(ArgsOp, tag="configure"):
    """Change scheduling settings at run time (``args``: ``{"delayed_batch_size": B, ...}``).
    Answer: ``configured``."""


class EventsQuery(ArgsOp, tag="events"):
    """The model's recent routing events (``args``: ``{"since": cursor, "limit": n}``).
    Answer: ``events``."""


class Calibrate(ArgsOp, tag="calibrate"):
    """Time synthetic steps on an idle model (``args``: ``{"batch_sizes", "context",
    "decode_steps"}``).  Answer: ``calibration``."""


#: op name -> its type
OPS: Dict[str, type] = {t.__struct_config__.tag: t for t in
                        (Run, Release, Stats, Configure, Calibrate, Flush, Ping, EventsQuery, Endpoint)}


class OpWire(NamedTuple):
    """An op as it travels: the model's Triton inputs, the channel's frames.

    Attributes:
        op: the op's name.
        rid: the request id (``run``, ``release``; else "").
        payload: ``run``: the PeerReq header JSON (:meth:`PeerReq.header_json`); an
            :class:`ArgsOp`: its argument as JSON; else "".
        tokens: ``run``: the token suffix (int token ids); else empty.
    """

    op: str
    rid: str = ""
    payload: str = ""
    tokens: Sequence[int] = ()


def encode_op(op: Op) -> OpWire:
    """The wire values of ``op``."""
    match op:
        case Run(peer_req=pr):
            return OpWire(op.name, pr.rid, pr.header_json(), list(pr.tokens))
        case Release(rid=rid):
            return OpWire(op.name, rid)
        case ArgsOp(args=args):
            return OpWire(op.name, "", msgspec.json.encode(args).decode())
    return OpWire(op.name)


def decode_op(op: str, rid: str = "", payload: str = "", tokens: Sequence[int] = ()) -> Op:
    """The op of wire values (inverse of :func:`encode_op`); an empty ``op`` is ``run``.

    ``run`` takes its request id from ``rid`` (the header's must be there too, see
    :meth:`PeerReq.from_wire`).

    Raises:
        ValueError: an unknown op, ``run`` / ``release`` without ``rid``, a header that is
            not a PeerReq, an argument that is not JSON.
    """
    cls = OPS.get(op or "run")
    if cls is None:
        raise ValueError(f"unknown op {op!r}; expected {', '.join(OPS)}")
    if cls in (Run, Release) and not rid:
        raise ValueError("request_id is required")
    if cls is Run:
        pr = PeerReq.from_wire(payload or "{}", [int(t) for t in tokens])
        pr.rid = rid
        return Run(peer_req=pr)
    if cls is Release:
        return Release(rid=rid)
    if issubclass(cls, ArgsOp):
        try:
            return cls(args=msgspec.json.decode(payload or "{}"))
        except msgspec.DecodeError as e:
            raise ValueError(f"{op}: peer_req is not JSON: {e}") from None
    return cls()


# ------------------------------------------------------------------------ events: model -> router

class Event(msgspec.Struct, tag_field="kind", kw_only=True, omit_defaults=True):
    """A model's response; the subclass's tag is its ``kind`` on the wire.  Fields left None are
    not sent."""


class SpecRound(msgspec.Struct):
    """One speculative verification, shipped with the tokens it committed.

    Attributes:
        drafted: tokens drafted and verified.
        accepted: of those, the ones kept (the first ``accepted`` committed tokens are drafts).
        drafter: index of the model that drafted them (deployment order).
    """

    drafted: int
    accepted: int
    drafter: int


#: the most top alternatives per token a request may ask for (vLLM's default ``max_logprobs``, OpenAI's
#: ``top_logprobs`` bound)
MAX_TOP_LOGPROBS = 20


class TokenLogprobs(msgspec.Struct, array_like=True):
    """A committed token's place in the distribution it was written from, and the top alternatives.

    All under the raw distribution (log-softmax of the logits, natural log, before temperature,
    penalties and a grammar's mask: vLLM's default ``raw_logprobs``) of the model whose
    distribution decided the token: the model that wrote it; for a speculative draft the
    verifier kept, the model that drafted it (its writer in the router's trace).  On the wire a
    JSON array ``[rank, ids, logprobs]``.

    Attributes:
        rank: how many tokens have a logprob >= the token's (vLLM's rank; 1 = most likely).
        ids: the N most likely token ids, most likely first (N = the request's ``logprobs``;
            empty for 0).
        logprobs: their logprobs (floats <= 0), in the order of ``ids``.
    """

    rank: int
    ids: List[int] = msgspec.field(default_factory=list)
    logprobs: List[float] = msgspec.field(default_factory=list)


class SegmentEvent(Event, kw_only=True):
    """A response of a ``run`` segment; the token ids it commits travel beside it.

    Attributes:
        scores: per committed token, the router score the model's rule compared with its
            threshold (None where it has none).
        logprobs: per committed token, its logprob (only when the request asked for them:
            sampling ``logprobs`` N >= 0).
        top_logprobs: per committed token, its :class:`TokenLogprobs` (rank and the top N), sent
            with ``logprobs``.
        first_step_t: ``time.monotonic()`` when the request's first step started (sent once).
        spec: the speculative verification these tokens come from, if any.
    """

    scores: Optional[List[Optional[float]]] = None
    logprobs: Optional[List[Optional[float]]] = None
    top_logprobs: Optional[List[Optional[TokenLogprobs]]] = None
    first_step_t: Optional[float] = None
    spec: Optional[SpecRound] = None


class Tokens(SegmentEvent, tag="tokens"):
    """A chunk of committed tokens; the segment goes on (the only non-final event)."""


class Handoff(SegmentEvent, tag="handoff", kw_only=True):
    """The model hands the request to a peer; the request stays pending here, its KV kept.

    Attributes:
        to: the peer's name; ``to_index`` its index in ``PeerReq.models``.
        peer_req: the PeerReq header JSON for the peer (:meth:`header` decodes it).
        committed: the handoff step's token was kept here (it is among the tokens sent).
    """

    to: str
    to_index: int
    peer_req: str
    committed: bool

    def header(self) -> PeerReq:
        """The PeerReq the peer is to run (tokens empty: the router adds the suffix).

        Raises:
            ValueError: ``peer_req`` is not a PeerReq header.
        """
        return PeerReq.from_wire(self.peer_req, [])


class Finished(SegmentEvent, tag="finished", kw_only=True):
    """The request ended on this model (its state is freed).

    Attributes:
        finish_reason: a :class:`FinishReason` value (``stop``, ``length``).
        num_generated: output tokens of the whole request.
    """

    finish_reason: str
    num_generated: Optional[int] = None


class Cancelled(SegmentEvent, tag="cancelled", kw_only=True):
    """The segment ended because the request was released (its state is freed).

    Attributes:
        message: why (e.g. ``released by the router``).
        finish_reason: ``cancelled`` when sent.
    """

    message: Optional[str] = None
    finish_reason: Optional[str] = None


class Failed(SegmentEvent, tag="error", kw_only=True):
    """The op failed on the model (a segment's request is freed there).  The Triton interface
    sends it as the request's error, not as an event.

    Attributes:
        message: the error, starting with ``model <name>: `` for the model's own errors.
        refused: the model refused the request's input (a bad parameter, a request that can never
            fit its KV pool or context): the client's error (HTTP 400), not the server's.
    """

    message: str
    refused: bool = False


class Answer(msgspec.Struct):
    """The one answer to an op other than ``run``: ``{"kind": kind, **result}`` on the wire.

    Attributes:
        kind: ``released``, ``configured``, ``stats``, ``events``, ``calibration``, ``flushed``,
            ``pong`` or ``endpoint``.
        result: the answer's fields (a JSON object).
    """

    kind: str
    result: Dict[str, Any] = msgspec.field(default_factory=dict)


#: kind -> type of the events of a segment
SEGMENT_EVENTS: Dict[str, type] = {t.__struct_config__.tag: t for t in (Tokens, Handoff, Finished, Cancelled, Failed)}
#: everything a model sends
ModelEvent = Union[Tokens, Handoff, Finished, Cancelled, Failed, Answer]
_FINAL = (Handoff, Finished, Cancelled, Failed, Answer)


def is_final(event: Any) -> bool:
    """True for the last event of an op (every event but :class:`Tokens` and the router's own ticks)."""
    return isinstance(event, _FINAL)


def _builtin(obj: Any) -> Any:
    """numpy / torch scalars (a step's scores and logprobs) as Python numbers."""
    if hasattr(obj, "item"):
        return obj.item()
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


_encoder = msgspec.json.Encoder(enc_hook=_builtin)
_segment_decoder = msgspec.json.Decoder(Union[Tokens, Handoff, Finished, Cancelled, Failed])


def encode_event(event: ModelEvent) -> bytes:
    """The event's JSON (UTF-8): ``{"kind": ..., ...}``."""
    if isinstance(event, Answer):
        return _encoder.encode({"kind": event.kind, **event.result})
    return _encoder.encode(event)


def decode_event(data: Union[bytes, str]) -> ModelEvent:
    """The event of :func:`encode_event`'s JSON: a segment event by its ``kind``, any other kind
    an :class:`Answer`.

    Raises:
        ValueError: not a JSON object with a string ``kind``, or a segment event with missing
            or mistyped fields (``msgspec.ValidationError``).
    """
    try:
        return _segment_decoder.decode(data)
    except msgspec.ValidationError:
        d = msgspec.json.decode(data)
        if not isinstance(d, dict) or not isinstance(d.get("kind"), str) or d["kind"] in SEGMENT_EVENTS:
            raise
    kind = d.pop("kind")
    return Answer(kind, d)
