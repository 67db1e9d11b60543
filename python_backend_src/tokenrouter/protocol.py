"""Messages exchanged between models: the paper's ``PeerReq`` and step results.

Paper §Design, "Interface (request-centric)": ``send(req)`` packs a PeerReq
{request id, the token suffix the peer has not seen (from the position anchor
``req.loc``), status running/finished, algorithm extras}; ``receive(peer_req)``
turns it into local work.  On the wire (Triton tensors between the router and
the model subservers) a PeerReq is JSON in a BYTES tensor plus the tokens as an
INT64 tensor.

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
from typing import Any, Dict, List, NamedTuple, Optional

__all__ = ["Status", "PeerReq", "StepResult", "FinishReason", "Verdict"]


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
