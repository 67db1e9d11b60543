"""The request-centric routing interface: ``route`` / ``send`` / ``receive``.

Paper §Design, "Interface (request-centric)".  An algorithm is one class; an
instance lives in each model's subserver (``model_index`` tells which model it
serves among ``num_models``, in deployment order: model 0 is the SLM that writes
by default).  After every forward step the subserver calls :meth:`route` with a
:class:`~tokenrouter.protocol.StepResult`:

* ``0`` — stay: the sampled token is committed and the request keeps decoding here;
* ``k >= 1`` — hand over to peer ``k``: the ``k``-th entry of :meth:`peers`
  (all models but this one, in deployment order).  :meth:`commit_on_handoff`
  says whether the step's token is kept (e.g. R-Stitch's SLM discards its
  uncertain token so the LLM regenerates it).  :meth:`send` then packs the
  PeerReq, the request becomes *pending* here (KV kept) and the peer's
  :meth:`receive` turns the PeerReq into local work.

Observability: ``route`` sets :attr:`RoutingAlgorithm.last_score` to the score
its rule compared with the threshold (entropy, router probability, …; ``None``
when the rule has none, e.g. the LLM's unconditional hand-back).  The subserver
appends it to :attr:`RoutingAlgorithm.step_scores` after every step and ships
the buffered scores with each chunk it sends to the router
(:meth:`take_scores`), which puts them into the client's ``routing_trace``
(``scores`` per output token, ``handoffs`` with the score of the handoff step)
and into the ``handoff`` events of the event log (``score``).

Speculative decoding (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding"; Chen et al. 2023, "Accelerating Large Language Model Decoding
with Speculative Sampling") needs three more hooks, all no-ops by default:

* drafting model: :meth:`draft` turns a step's token into a *draft* (appended to the
  sequence, so the next step computes its KV, but not output: not streamed, not counted
  in ``num_generated``); ``send`` carries the drafts in ``PeerReq.extras``; when the
  request comes back, the subserver rolls back the drafts its committed tokens do not
  confirm (their KV freed) before appending the rest;
* verifying model: :meth:`drafts_to_verify` names the drafts (appended by ``receive``)
  the next step checks; that step runs them in one extend and returns the logits at every
  drafted position, and :meth:`verify` picks the tokens to commit (the accepted drafts,
  then the model's own next token, or -- :class:`Verdict` -- no token of its own when every
  draft is accepted, as draft-verify does); the rejected drafts' KV is freed.

Engine access: the subserver calls :meth:`attach` with its engine once per
instance, before the first ``route``; algorithms that need hidden states or
the token-embedding matrix take them there (and raise ValueError with a clear
message when the model does not capture hidden states).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import struct
from typing import Any, Callable, Dict, List, Optional, Union

from ..engine.sampling import as_json
from ..protocol import PeerReq, Status, StepResult, Verdict

__all__ = ["RoutingAlgorithm", "ParamSpec", "Verdict", "request_uniform", "request_key"]


class ParamSpec:
    """One algorithm parameter: type, default, bounds.

    Args:
        kind: ``float``, ``int``, ``bool`` or ``str``.
        default: value when not configured (may be ``None``: "decided by the
            algorithm", e.g. a learned router's threshold stored in its file).
        lo, hi: inclusive bounds (None: unbounded).
        doc: one-line description.
        parse: optional callable turning the raw value into the final one
            (raises ValueError); replaces the kind/bounds checks.
    """

    def __init__(self, kind, default, lo=None, hi=None, doc="", parse: Optional[Callable[[Any], Any]] = None):
        self.kind, self.default, self.lo, self.hi, self.doc = kind, default, lo, hi, doc
        self.parse = parse

    def check(self, name: str, value: Any) -> Any:
        """Return ``value`` converted to ``kind``; raise ValueError naming ``name`` and showing the
        value as the request's JSON wrote it (``true``, ``"0.5"``, ``null``)."""
        if self.parse is not None:
            try:
                return self.parse(value)
            except (TypeError, ValueError) as e:
                raise ValueError(f"routing parameter {name!r}: {e}") from None
        if self.kind is str:
            if not isinstance(value, str) or not value:
                raise ValueError(f"routing parameter {name!r} must be a non-empty string, got {as_json(value)}")
            return value
        if self.kind is bool:
            if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
                return value.lower() in ("true", "1")
            if not isinstance(value, bool):
                raise ValueError(f"routing parameter {name!r} must be true/false, got {as_json(value)}")
            return value
        kind = {float: "a number", int: "an integer"}.get(self.kind, self.kind.__name__)
        try:
            v = self.kind(value)
        except (TypeError, ValueError):
            raise ValueError(f"routing parameter {name!r} must be {kind}, got {as_json(value)}") from None
        if isinstance(value, bool) or (self.kind is int and float(value) != v):
            raise ValueError(f"routing parameter {name!r} must be {kind}, got {as_json(value)}")
        if self.kind is float and not math.isfinite(v):
            raise ValueError(f"routing parameter {name!r} must be a finite number, got {as_json(value)}")
        if (self.lo is not None and v < self.lo) or (self.hi is not None and v > self.hi):
            raise ValueError(f"routing parameter {name!r}={v} outside [{self.lo}, {self.hi}]")
        return v


class RoutingAlgorithm:
    """Base class of token-level routing algorithms.

    Subclasses set :attr:`name`, :attr:`params_spec`, :attr:`threshold_param`
    and implement :meth:`route` (and, where the rule needs it,
    :meth:`commit_on_handoff`, :meth:`send`, :meth:`receive`).

    Args:
        model_index: index of the model this instance serves.
        num_models: M, the number of models in the deployment (>= 2).
        params: validated parameters (see :meth:`validate_params`).
    """

    name: str = ""
    #: parameter name -> ParamSpec
    params_spec: Dict[str, ParamSpec] = {}
    #: the parameter that ``sampling_parameters.routing_threshold`` overrides
    threshold_param: Optional[str] = None
    #: models the algorithm needs at least / at most
    min_models: int = 2
    max_models: Optional[int] = 2

    def __init__(self, model_index: int, num_models: int, params: Dict[str, Any]):
        self.model_index = model_index
        self.num_models = num_models
        self.params = params
        #: score the latest :meth:`route` compared with its threshold (None: no score)
        self.last_score: Optional[float] = None
        #: per-step scores not yet shipped to the router (filled by the subserver)
        self.step_scores: List[Optional[float]] = []

    def attach(self, engine) -> None:
        """Bind to the model's engine (called once by the subserver before ``route``).

        Default: nothing.  Learned routers check that hidden states are captured
        and fetch the input-embedding matrix here.

        Raises:
            ValueError: the engine cannot serve this algorithm (message says why).
        """
        return None

    def take_scores(self) -> List[Optional[float]]:
        """The buffered per-step scores (oldest first); empties the buffer."""
        out, self.step_scores = self.step_scores, []
        return out

    # --------------------------------------------------------------- config
    @classmethod
    def validate_params(cls, params: Optional[Dict[str, Any]], num_models: int) -> Dict[str, Any]:
        """Fill defaults and check types/bounds.

        Raises:
            ValueError: unknown parameter, bad value, or wrong number of models.
        """
        if num_models < cls.min_models or (cls.max_models is not None and num_models > cls.max_models):
            raise ValueError(f"algorithm {cls.name!r} needs between {cls.min_models} and "
                             f"{cls.max_models or 'any number of'} models, deployment has {num_models}")
        params = dict(params or {})
        unknown = set(params) - set(cls.params_spec)
        if unknown:
            raise ValueError(f"unknown parameters for algorithm {cls.name!r}: {sorted(unknown)}; "
                             f"allowed: {sorted(cls.params_spec)}")
        out = {}
        for k, spec in cls.params_spec.items():
            given = k in params and not (params[k] is None and spec.default is None)
            out[k] = spec.check(k, params[k]) if given else spec.default
        return out

    @classmethod
    def check_checkpoints(cls, params: Dict[str, Any], model_paths: List[Optional[str]]) -> None:
        """Check, before serving, that the models' checkpoints can run this algorithm (default:
        nothing to check).  Learned routers check their router file against model 0's checkpoint.

        Args:
            params: validated parameters.
            model_paths: each model's checkpoint folder, in the router's order; None for a
                model whose checkpoint is not known here (a remote one).

        Raises:
            ValueError: a checkpoint this algorithm cannot serve (the message says why).
        """
        return None

    def peers(self) -> List[int]:
        """Model indices of the peers; ``route`` returns 1-based positions in this list."""
        return [m for m in range(self.num_models) if m != self.model_index]

    def peer_model(self, k: int) -> int:
        """Model index of peer ``k`` (1-based)."""
        return self.peers()[k - 1]

    @staticmethod
    def first_model(params: Dict[str, Any], rid: Optional[str] = None,
                    sampling: Optional[Dict[str, Any]] = None) -> int:
        """Model that writes a request's first token (default: model 0, the SLM).

        Args:
            params: validated parameters.
            rid: request id; sampling: the request's sampling dict (its ``seed``)
                -- for algorithms whose choice is random (ME).
        """
        return 0

    # ------------------------------------------------------------ interface
    def route(self, result: StepResult) -> int:
        """Decide after a step: 0 = stay, k >= 1 = hand over to peer k."""
        raise NotImplementedError

    def commit_on_handoff(self, result: StepResult) -> bool:
        """Whether the step's token is committed when :meth:`route` hands over."""
        return True

    def send(self, req) -> PeerReq:
        """Pack a PeerReq: the tokens this model committed since its anchor ``req.loc``.

        Args:
            req: the model-local request (:class:`~tokenrouter.engine.subserver.LocalRequest`).
        """
        return dataclasses.replace(req.header, tokens=list(req.seq.tokens[req.loc:]),
                                   status=Status.RUNNING, extras=dict(req.header.extras))

    def receive(self, peer_req: PeerReq) -> List[int]:
        """Turn a PeerReq into local work: the tokens to append before resuming (or, for a
        new request, its first tokens).

        Default (paper): append the received suffix and queue the request to resume.

        Raises:
            ValueError: the PeerReq cannot be served (that request alone gets the error).
        """
        return list(peer_req.tokens)

    # ------------------------------------------------------ speculative hooks
    def draft(self, result: StepResult) -> Optional[int]:
        """Drafting model: the token id this step *drafts* instead of committing, or None.

        A draft is appended to the sequence (its KV is computed by the next step) but is not
        output; :meth:`route` still decides after the step (e.g. hand the drafts to the
        verifier after k of them).  Default: None (the step's token is committed as usual).
        """
        return None

    def drafts_to_verify(self) -> List[int]:
        """Verifying model: the drafted token ids at the end of what :meth:`receive` returned,
        to be checked by the next step (default: none)."""
        return []

    def verify(self, result: StepResult, position_logits, drafts: List[int],
               sampler=None) -> Union[List[int], Verdict]:
        """Verifying model: the tokens to commit after a step that ran ``drafts``.

        Args:
            result: the step's :class:`StepResult` (``state`` = the local request).
            position_logits: float32 ``[len(drafts) + 1, V]``: next-token logits before each
                draft and after the last one.
            drafts: the drafted token ids, in order.
            sampler: the subserver's :class:`~tokenrouter.engine.sampling.BatchSampler`
                (the request's random generator), for sampled verification.
        Returns:
            A list: the accepted prefix of ``drafts`` followed by exactly one token of this
            model's own (Leviathan et al. 2023, Algorithm 1); or a :class:`Verdict`, which says
            how many drafts it accepts and may end on the last draft with no token of its own.
            Default: no draft accepted, the greedy token.
        """
        return [int(position_logits[0].argmax())]


def request_uniform(tag: str, key: str, index: int) -> float:
    """A uniform number in [0, 1) that depends only on (tag, key, index).

    Randomised rules (ME's model draw, Co-LLM's compose mode) must give the same
    draw whichever model's instance asks (instances are per visit, and the
    router draws the first model), so the draw is a hash, not an RNG state.

    Args:
        tag: namespace (algorithm name and its seed parameter).
        key: request key: ``"seed:<n>"`` when the client gave a sampling seed,
            else ``"rid:<request id>"`` (see :func:`request_key`).
        index: output-token index the draw is for (0 = first output token).
    """
    h = hashlib.blake2b(f"{tag}|{key}|{index}".encode(), digest_size=8).digest()
    return (struct.unpack("<Q", h)[0] >> 11) / float(1 << 53)


def request_key(rid: Optional[str], sampling: Optional[Dict[str, Any]]) -> str:
    """The key of :func:`request_uniform`: the sampling seed if given, else the request id."""
    seed = (sampling or {}).get("seed")
    return f"seed:{int(seed)}" if seed is not None else f"rid:{rid}"
