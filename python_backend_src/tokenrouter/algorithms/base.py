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
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional

from ..protocol import PeerReq, Status, StepResult

__all__ = ["RoutingAlgorithm", "ParamSpec"]


class ParamSpec:
    """One algorithm parameter: type, default, bounds.

    Args:
        kind: ``float``, ``int`` or ``bool``.
        default: value when not configured.
        lo, hi: inclusive bounds (None: unbounded).
        doc: one-line description.
    """

    def __init__(self, kind, default, lo=None, hi=None, doc=""):
        self.kind, self.default, self.lo, self.hi, self.doc = kind, default, lo, hi, doc

    def check(self, name: str, value: Any) -> Any:
        """Return ``value`` converted to ``kind``; raise ValueError naming ``name``."""
        if self.kind is bool:
            if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
                return value.lower() in ("true", "1")
            if not isinstance(value, bool):
                raise ValueError(f"routing parameter {name!r} must be true/false, got {value!r}")
            return value
        try:
            v = self.kind(value)
        except (TypeError, ValueError):
            raise ValueError(f"routing parameter {name!r} must be {self.kind.__name__}, got {value!r}") from None
        if isinstance(value, bool) or (self.kind is int and float(value) != v):
            raise ValueError(f"routing parameter {name!r} must be {self.kind.__name__}, got {value!r}")
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
            out[k] = spec.check(k, params[k]) if k in params else spec.default
        return out

    def peers(self) -> List[int]:
        """Model indices of the peers; ``route`` returns 1-based positions in this list."""
        return [m for m in range(self.num_models) if m != self.model_index]

    def peer_model(self, k: int) -> int:
        """Model index of peer ``k`` (1-based)."""
        return self.peers()[k - 1]

    @staticmethod
    def first_model(params: Dict[str, Any]) -> int:
        """Model that writes a request's first token (default: model 0, the SLM)."""
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
            req: the model-local request (:class:`~tokenrouter.subserver.LocalRequest`).
        """
        return dataclasses.replace(req.header, tokens=list(req.seq.tokens[req.loc:]),
                                   status=Status.RUNNING, extras=dict(req.header.extras))

    def receive(self, peer_req: PeerReq) -> List[int]:
        """Turn a PeerReq into local work: the tokens to append before resuming.

        Default (paper): append the received suffix and queue the request to resume.
        """
        return list(peer_req.tokens)
