"""tokenrouter's metrics on Triton's metrics endpoint: every family is declared once, as a
:class:`Family` in a table, and created with :class:`Families`.

The router's LLM-serving metrics (:data:`ROUTER_FAMILIES`, :class:`RouterMetrics`) are
named as Triton's vllm_backend names its own (``vllm:…``), with the prefix
``tokenrouter:``; every series has the labels ``model`` and ``version`` of the
router model (as vllm_backend's), so several router models can share a server.

Histograms (seconds; one observation per request unless said otherwise)
    ``tokenrouter:time_to_first_token_seconds``  arrival at the router → first output token back from a model
    ``tokenrouter:time_per_output_token_seconds`` (last token − first token) / (output tokens − 1),
                                                   requests with 2 or more output tokens
    ``tokenrouter:e2e_request_latency_seconds``   arrival → final response queued
    ``tokenrouter:request_queue_time_seconds``    arrival → start of the request's first forward step
                                                   on its first model (router queue + model admission
                                                   + delayed-batching wait)
    ``tokenrouter:handoff_latency_seconds``       one per handoff: handoff event → the peer's first
                                                   response (labels ``from``, ``to``)
Counters
    ``tokenrouter:prompt_tokens_total``
    ``tokenrouter:generation_tokens_total``       label ``writer`` = the model that wrote the tokens
    ``tokenrouter:request_success_total``         label ``finished_reason`` (``stop``, ``length``)
    ``tokenrouter:request_failure_total``         label ``reason`` (``cancelled``, ``error``: failed while
                                                  running; ``invalid``: bad input; ``refused``: a model it
                                                  needs is down or the server is shutting down)
    ``tokenrouter:handoffs_total``                labels ``from``, ``to``
    ``tokenrouter:request_busy_total``            requests answered "busy" (Triton UNAVAILABLE, "busy: ..."),
                                                  label ``reason`` (``queue_full``: the router's or a model's
                                                  queue was full; ``queue_timeout``: the request waited past
                                                  its queue timeout); not counted as failures
    ``tokenrouter:spec_decode_num_drafts_total``  speculative decoding: verifications (rounds), as vLLM's
    ``tokenrouter:spec_decode_num_draft_tokens_total``  drafted tokens sent for verification
    ``tokenrouter:spec_decode_num_accepted_tokens_total``  of those, accepted (acceptance rate =
                                                  accepted / draft tokens)
Gauges
    ``tokenrouter:num_requests_running``          requests being driven through the models
    ``tokenrouter:num_requests_waiting``          accepted, waiting for a router worker

Each model subserver (:mod:`tokenrouter.triton.llm_model`) publishes its own
(:data:`MODEL_FAMILIES`, :class:`ModelMetrics`; label ``model``): the KV gauges
``tokenrouter_kv_tokens_in_use``, ``tokenrouter_kv_rows_in_use``,
``tokenrouter_active_requests``; the token counters ``tokenrouter_extend_tokens_total``,
``tokenrouter_decode_tokens_total``, ``tokenrouter_handoffs_out_total``; and the prefix cache's,
named as vLLM's ``prefix_cache_queries`` / ``prefix_cache_hits``, all in tokens:
``tokenrouter_prefix_cache_queries_total``, ``tokenrouter_prefix_cache_hits_total``,
``tokenrouter_prefix_cache_evicted_tokens_total``, gauges ``tokenrouter_prefix_cache_tokens``
(KV the cache holds) and ``tokenrouter_prefix_cache_evictable_tokens`` (of those, read by no request).

Every call into ``pb_utils`` is an IPC to the server, so :class:`RouterMetrics`
is used from one thread only (the router's client I/O thread); request threads
hand it :class:`RequestObservation` records.  :class:`ModelMetrics` is used from a
model's Triton I/O thread only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

__all__ = ["Family", "Families", "RouterMetrics", "ModelMetrics", "RequestObservation", "observe_request",
           "ROUTER_FAMILIES", "MODEL_FAMILIES", "METRIC_NAMES", "TTFT_BUCKETS", "TPOT_BUCKETS", "E2E_BUCKETS",
           "HANDOFF_BUCKETS", "FAILURE_REASONS", "BUSY_REASONS"]


@dataclass(frozen=True)
class Family:
    """The declaration of one metric family.

    Attributes:
        name: the family's full name, as it appears on the metrics endpoint.
        kind: ``counter``, ``gauge`` or ``histogram``.
        description: the family's help text.
        buckets: a histogram's bucket upper bounds, in the family's unit (None for the other kinds).
    """

    name: str
    kind: str
    description: str
    buckets: Optional[Tuple[float, ...]] = None


class Families:
    """Declared metric families, created on Triton's metrics endpoint, and their series.

    Every call into ``pb_utils`` is an IPC to the server: use one object from one thread only.

    Args:
        pb_utils: the ``triton_python_backend_utils`` module.
        declared: key → :class:`Family`; the keys name the families in :meth:`series`.
        labels: the labels every series carries (updated by :meth:`series`' own).

    Raises:
        KeyError: a family's kind is not ``counter``, ``gauge`` or ``histogram``.
        Whatever ``pb_utils.MetricFamily`` raises (e.g. a server without metrics).
    """

    def __init__(self, pb_utils, declared: Mapping[str, Family], labels: Optional[Mapping[str, str]] = None):
        kinds = {"counter": pb_utils.MetricFamily.COUNTER, "gauge": pb_utils.MetricFamily.GAUGE,
                 "histogram": pb_utils.MetricFamily.HISTOGRAM}
        self._declared = dict(declared)
        self._families = {key: pb_utils.MetricFamily(name=f.name, description=f.description, kind=kinds[f.kind])
                          for key, f in self._declared.items()}
        self._base = dict(labels or {})
        self._series: Dict[Tuple[str, Tuple[Tuple[str, str], ...]], Any] = {}

    def series(self, key: str, **labels: str):
        """The series of family ``key`` with the base labels updated by ``labels`` (created at the first call).

        Raises:
            KeyError: ``key`` is not a declared family (or the families were closed).
        """
        lab = {**self._base, **labels}
        k = (key, tuple(sorted(lab.items())))
        s = self._series.get(k)
        if s is None:
            fam, buckets = self._families[key], self._declared[key].buckets
            s = fam.Metric(labels=lab, buckets=list(buckets)) if buckets is not None else fam.Metric(labels=lab)
            self._series[k] = s
        return s

    def close(self) -> None:
        """Drop every series and family (call in ``finalize`` while the stub is alive: left to the
        interpreter's final garbage collection, their destructors crash the stub on exit)."""
        self._series.clear()
        self._families.clear()


PREFIX = "tokenrouter:"
#: ``reason`` label values of ``request_failure_total``
FAILURE_REASONS = ("cancelled", "error", "invalid", "refused")
#: ``reason`` label values of ``request_busy_total``
BUSY_REASONS = ("queue_full", "queue_timeout")
#: vllm_backend's buckets (vLLM's ``Metrics``), seconds
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)
#: handoffs are IPC round trips plus the peer's extend step: finer at the low end
HANDOFF_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                   30.0)


def _router(short: str, kind: str, description: str, buckets: Optional[Tuple[float, ...]] = None) -> Family:
    return Family(PREFIX + short, kind, description, buckets)


#: the router's families (module docstring), by short name
ROUTER_FAMILIES: Dict[str, Family] = {f.name[len(PREFIX):]: f for f in (
    _router("time_to_first_token_seconds", "histogram", "Time to first token (arrival to first output token)",
            TTFT_BUCKETS),
    _router("time_per_output_token_seconds", "histogram", "Mean time per output token after the first, per request",
            TPOT_BUCKETS),
    _router("e2e_request_latency_seconds", "histogram", "End-to-end request latency", E2E_BUCKETS),
    _router("request_queue_time_seconds", "histogram", "Arrival to the start of the request's first forward step",
            E2E_BUCKETS),
    _router("handoff_latency_seconds", "histogram", "Handoff event to the peer model's first response",
            HANDOFF_BUCKETS),
    _router("prompt_tokens_total", "counter", "Prompt tokens processed"),
    _router("generation_tokens_total", "counter", "Output tokens generated, by the model that wrote them"),
    _router("request_success_total", "counter", "Requests finished, by finish reason"),
    _router("request_failure_total", "counter", "Requests cancelled or failed"),
    _router("handoffs_total", "counter", "Handoffs between models, by pair"),
    _router("request_busy_total", "counter", "Requests answered busy (a full queue or a queue timeout)"),
    _router("spec_decode_num_drafts_total", "counter", "Speculative decoding: verification rounds"),
    _router("spec_decode_num_draft_tokens_total", "counter", "Speculative decoding: drafted tokens verified"),
    _router("spec_decode_num_accepted_tokens_total", "counter", "Speculative decoding: drafted tokens accepted"),
    _router("num_requests_running", "gauge", "Requests being driven through the models"),
    _router("num_requests_waiting", "gauge", "Requests waiting for a router worker"),
)}
#: full metric family names of the router, as they appear on the metrics endpoint
METRIC_NAMES = [f.name for f in ROUTER_FAMILIES.values()]

#: a model subserver's families (module docstring), by the key of the snapshot that sets them
MODEL_FAMILIES: Dict[str, Family] = {
    "kv_tokens_in_use": Family("tokenrouter_kv_tokens_in_use", "gauge", "KV token slots allocated (running + pending)"),
    "kv_rows_in_use": Family("tokenrouter_kv_rows_in_use", "gauge", "KV request rows held (running + pending)"),
    "active": Family("tokenrouter_active_requests", "gauge", "requests held by the model (running + pending)"),
    "extend_tokens": Family("tokenrouter_extend_tokens_total", "counter",
                            "tokens run through extend (prefill + resume)"),
    "decode_tokens": Family("tokenrouter_decode_tokens_total", "counter", "tokens run through decode"),
    "handoffs_out": Family("tokenrouter_handoffs_out_total", "counter", "requests handed to a peer"),
    "prefix_cache_queries": Family("tokenrouter_prefix_cache_queries_total", "counter",
                                   "prompt tokens looked up in the prefix cache"),
    "prefix_cache_hits": Family("tokenrouter_prefix_cache_hits_total", "counter",
                                "prompt tokens whose KV the prefix cache held"),
    "prefix_cache_tokens": Family("tokenrouter_prefix_cache_tokens", "gauge", "KV tokens the prefix cache holds"),
    "prefix_cache_evictable_tokens": Family("tokenrouter_prefix_cache_evictable_tokens", "gauge",
                                            "KV tokens the prefix cache holds that no request reads"),
    "prefix_cache_evicted_tokens": Family("tokenrouter_prefix_cache_evicted_tokens_total", "counter",
                                          "KV tokens evicted from the prefix cache"),
}


@dataclass
class RequestObservation:
    """What one finished request contributes to the metrics (all times in seconds).

    Attributes:
        prompt_tokens: prompt length in tokens.
        tokens_by_model: output tokens written by each model (model name → count).
        finish: ``stop``, ``length``, ``cancelled`` or ``error``.
        ttft_s: arrival → first output token, None without output.
        tpot_s: mean time per output token after the first, None with < 2 tokens.
        e2e_s: arrival → end.
        queue_s: arrival → first forward step, None if unknown.
        handoffs: ``(from, to, latency_s or None)`` per handoff.
        spec_rounds, spec_drafted, spec_accepted: speculative decoding: verifications, drafted
            tokens and accepted drafted tokens (0 for other algorithms).
    """

    prompt_tokens: int
    tokens_by_model: Dict[str, int]
    finish: str
    e2e_s: float
    ttft_s: Optional[float] = None
    tpot_s: Optional[float] = None
    queue_s: Optional[float] = None
    handoffs: List[Tuple[str, str, Optional[float]]] = field(default_factory=list)
    spec_rounds: int = 0
    spec_drafted: int = 0
    spec_accepted: int = 0


def observe_request(arrival_t: float, end_t: float, routed, models: List[str],
                    worker_start_t: Optional[float] = None) -> RequestObservation:
    """Build a :class:`RequestObservation` from a :class:`~tokenrouter.routing.router_core.RoutedRequest`.

    Args:
        arrival_t: ``time.monotonic()`` when ``execute`` received the request.
        end_t: ``time.monotonic()`` when the final response was queued.
        routed: the request's ``RoutedRequest`` (its ``first_step_t``,
            ``first_token_t``, ``last_token_t`` are on the same monotonic clock;
            the models run on the same host, where CLOCK_MONOTONIC is shared).
        models: the deployment's model names (indices of ``handoff_log``).
        worker_start_t: when a router worker started the request; the queue
            time falls back to it when the first model reported no step start.
    """
    r = routed
    n_out = len(r.output_ids)
    ttft = None if r.first_token_t is None else max(0.0, r.first_token_t - arrival_t)
    tpot = None
    if n_out >= 2 and r.first_token_t is not None and r.last_token_t is not None:
        tpot = max(0.0, r.last_token_t - r.first_token_t) / (n_out - 1)
    start = r.first_step_t if r.first_step_t is not None else worker_start_t
    queue = None if start is None else max(0.0, start - arrival_t)
    gaps = list(r.handoff_gaps_s)
    hand = []
    for i, h in enumerate(r.handoff_log):
        hand.append((models[h["from"]], models[h["to"]], gaps[i] if i < len(gaps) else None))
    return RequestObservation(prompt_tokens=r.n_prompt, tokens_by_model=dict(r.tokens_by_model),
                              finish=r.finish or "error", e2e_s=max(0.0, end_t - arrival_t), ttft_s=ttft,
                              tpot_s=tpot, queue_s=queue, handoffs=hand,
                              spec_rounds=len(getattr(r, "spec_rounds", ())),
                              spec_drafted=int(getattr(r, "drafted", 0)), spec_accepted=int(getattr(r, "accepted", 0)))


class RouterMetrics:
    """The router's metric families and series (use from one thread).

    Args:
        pb_utils: the ``triton_python_backend_utils`` module.
        model: the router model's name (label ``model``); ``version``: its version.
        models: the deployment's model names (series by writer and by pair are
            created up front, so every series exists, at 0, from the start).

    Raises:
        Whatever ``pb_utils.MetricFamily`` raises (e.g. a server without metrics).
    """

    def __init__(self, pb_utils, model: str, version: str, models: List[str]):
        self._families = Families(pb_utils, ROUTER_FAMILIES, {"model": model, "version": str(version)})
        self._get = self._families.series
        self._gauges = {"running": None, "waiting": None}
        # create the fixed series now: dashboards see them (at 0) before any request
        for short in ("time_to_first_token_seconds", "time_per_output_token_seconds",
                      "e2e_request_latency_seconds", "request_queue_time_seconds", "prompt_tokens_total",
                      "num_requests_running", "num_requests_waiting", "spec_decode_num_drafts_total",
                      "spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total"):
            self._get(short)
        for reason in ("stop", "length"):
            self._get("request_success_total", finished_reason=reason)
        for reason in FAILURE_REASONS:
            self._get("request_failure_total", reason=reason)
        for reason in BUSY_REASONS:
            self._get("request_busy_total", reason=reason)
        for m in models:
            self._get("generation_tokens_total", writer=m)
        for a in models:
            for b in models:
                if a != b:
                    self._get("handoffs_total", **{"from": a, "to": b})
                    self._get("handoff_latency_seconds", **{"from": a, "to": b})

    def record(self, ob: RequestObservation) -> None:
        """Add one finished request (see :class:`RequestObservation`)."""
        self._get("prompt_tokens_total").increment(float(ob.prompt_tokens))
        for m, n in ob.tokens_by_model.items():
            if n:
                self._get("generation_tokens_total", writer=m).increment(float(n))
        if ob.finish in ("stop", "length"):
            self._get("request_success_total", finished_reason=ob.finish).increment(1.0)
        else:
            self._get("request_failure_total", reason=ob.finish).increment(1.0)
        self._get("e2e_request_latency_seconds").observe(ob.e2e_s)
        if ob.ttft_s is not None:
            self._get("time_to_first_token_seconds").observe(ob.ttft_s)
        if ob.tpot_s is not None:
            self._get("time_per_output_token_seconds").observe(ob.tpot_s)
        if ob.queue_s is not None:
            self._get("request_queue_time_seconds").observe(ob.queue_s)
        for a, b, lat in ob.handoffs:
            self._get("handoffs_total", **{"from": a, "to": b}).increment(1.0)
            if lat is not None:
                self._get("handoff_latency_seconds", **{"from": a, "to": b}).observe(lat)
        if ob.spec_rounds:
            self._get("spec_decode_num_drafts_total").increment(float(ob.spec_rounds))
            self._get("spec_decode_num_draft_tokens_total").increment(float(ob.spec_drafted))
            self._get("spec_decode_num_accepted_tokens_total").increment(float(ob.spec_accepted))

    def record_failure(self, reason: str) -> None:
        """Count a request that ended without a result (one of :data:`FAILURE_REASONS`)."""
        self._get("request_failure_total", reason=reason).increment(1.0)

    def record_busy(self, reason: str) -> None:
        """Count a request answered "busy" (one of :data:`BUSY_REASONS`)."""
        self._get("request_busy_total", reason=reason).increment(1.0)

    def set_load(self, running: int, waiting: int) -> None:
        """Set the running / waiting gauges (only when they changed: each set is an IPC)."""
        if self._gauges["running"] != running:
            self._get("num_requests_running").set(float(running))
            self._gauges["running"] = running
        if self._gauges["waiting"] != waiting:
            self._get("num_requests_waiting").set(float(waiting))
            self._gauges["waiting"] = waiting

    def close(self) -> None:
        """Drop every series and family (call in ``finalize`` while the stub is alive)."""
        self._families.close()


class ModelMetrics:
    """A model subserver's metric families (:data:`MODEL_FAMILIES`), one series each, label ``model``
    (use from one thread).

    Args:
        pb_utils: the ``triton_python_backend_utils`` module.
        model: the model's name.

    Raises:
        Whatever ``pb_utils.MetricFamily`` raises (e.g. a server without metrics).
    """

    def __init__(self, pb_utils, model: str):
        self._families = Families(pb_utils, MODEL_FAMILIES, {"model": model})
        self._series = {key: self._families.series(key) for key in MODEL_FAMILIES}
        #: counter key -> the value published so far (counters advance by a snapshot's increase)
        self._counted: Dict[str, float] = {k: 0.0 for k, f in MODEL_FAMILIES.items() if f.kind == "counter"}

    def publish(self, snapshot: Mapping[str, float]) -> None:
        """Publish one snapshot of the model's counters: a gauge is set to its value, a counter
        advances by its increase since the last snapshot (a decrease is ignored).

        Args:
            snapshot: a value for every key of :data:`MODEL_FAMILIES` (tokens, rows or requests).

        Raises:
            KeyError: a key is missing (nothing is published after :meth:`close`).
        """
        for key, series in self._series.items():
            v = float(snapshot[key])
            if key not in self._counted:
                series.set(v)
            elif v > self._counted[key]:
                series.increment(v - self._counted[key])
                self._counted[key] = v

    def close(self) -> None:
        """Drop every series and family (call in ``finalize`` while the stub is alive)."""
        self._series.clear()
        self._families.close()
