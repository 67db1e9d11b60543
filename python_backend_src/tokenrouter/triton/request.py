"""One client request of ``token_router``: its inputs read and checked, and its output tensors.

The router model (:mod:`tokenrouter.triton.router_model`) hands every Triton request to
:meth:`RequestParser.parse`, which returns a :class:`ClientRequest` or raises :class:`ClientError`
(an error for that request only); when the request ends, :func:`routing_summary` and
:func:`output_tensors` build its final response.  A new request input is read in its own step of
:meth:`RequestParser.parse` and carried on :class:`ClientRequest`; a new sampling key belongs to
:func:`tokenrouter.engine.sampling.parse_sampling_parameters`.

Client interface (Triton vllm_backend conventions)

Inputs
    ``text_input`` BYTES [1]              prompt (UTF-8)
    ``stream`` BOOL [1]                   stream text deltas (default false)
    ``sampling_parameters`` BYTES [1]     JSON: max_tokens, temperature, top_p, top_k,
                                          seed, stop, ignore_eos, routing_threshold,
                                          repetition_penalty, presence_penalty,
                                          frequency_penalty, min_tokens, stop_token_ids,
                                          include_stop_str_in_output, skip_special_tokens,
                                          logprobs (N top alternatives, 0-20; true = 0),
                                          guided_decoding (vLLM's structured
                                          output: json, regex, choice, grammar, json_object;
                                          also guided_json, guided_regex, ...)
                                          (vllm_backend value forms: "32",
                                          "true", null = default; see tokenrouter.engine.sampling).
                                          Absent: the request's parameters are read instead
                                          (HTTP generate "parameters", gRPC parameters).
    ``exclude_input_in_output`` BOOL [1]  non-streaming only: omit the prompt (default false)
    ``apply_chat_template`` BOOL [1]      wrap the prompt as a user turn (default false)
    ``return_routing_trace`` BOOL [1]     add the per-token model trace (default false)
    ``return_finish_reason``, ``return_num_input_tokens``, ``return_num_output_tokens``
                     BOOL [1]             vllm_backend's output switches; default true here
                                          (these outputs were always sent), false omits them
    ``return_logprobs`` BOOL [1]          add ``logprobs`` (default false)

    Triton's per-request ``timeout`` parameter (microseconds) lowers the router's
    ``queue_timeout_s`` for that request.

Outputs
    ``text_output`` BYTES, ``finish_reason`` BYTES, ``num_input_tokens`` INT32,
    ``num_output_tokens`` INT32, ``routing_summary`` BYTES (JSON:
    tokens_by_model, handoffs, handoffs_by_pair, algorithm, params and
    handoff_gap_s: seconds from each handoff to the peer's first response; with speculative
    decoding and draft-verify ``speculative``: rounds, drafted, accepted, acceptance_rate,
    tokens_per_llm_pass; with ``on_peer_failure: fallback`` ``degraded``: the models the
    request went on without),
    ``logprobs`` BYTES when asked (``return_logprobs`` or the ``logprobs`` sampling key), as
    vllm_backend sends it: a JSON list, one object per output token of the response (each
    response carries the tokens since the previous one), ``{"<token id>": {"logprob", "rank",
    "decoded_token"}, ...}``: the token itself first, then the N most likely tokens, most likely
    first (the token not repeated); all under the raw distribution of the model that wrote the
    token (:func:`logprobs_json`),
    ``routing_trace``
    BYTES (JSON: models, per-output-token model index ``trace``, output
    ``token_ids``, per-output-token router ``scores`` -- the score the writing
    model's rule compared with its threshold at that step, null where none --
    and ``handoffs``: one ``{"pos", "from", "to", "committed", "score"}`` per
    handoff, ``pos`` = output tokens committed when it happened, ``score`` =
    the handoff step's score; with ``committed`` false that step's token was
    discarded; with speculative decoding ``drafts``: one ``{"pos", "drafted", "accepted"}`` per
    verification) when asked.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Type

import numpy as np
import triton_python_backend_utils as pb_utils

from ..algorithms.base import RoutingAlgorithm
from ..engine.sampling import InputLimits, SamplingParams, check_json_text, parse_sampling_parameters
from ..routing.router_core import PromptTooLong, encode_prompt
from .settings import RequestLimits

__all__ = ["ClientError", "ClientRequest", "RequestParser", "OUTPUT_SWITCHES", "longest_token_bytes",
           "routing_summary", "output_tensors", "logprobs_json", "wants_logprobs"]


class ClientError(ValueError):
    """Bad input from the client: reported to that client only."""


def longest_token_bytes(tokenizer) -> int:
    """UTF-8 bytes of the longest token of ``tokenizer`` as text (special tokens included).

    A prompt of n tokens has at most n times this many bytes, so a text longer than
    ``context_length`` times it cannot fit the context (the default ``max_input_bytes``).
    Fast tokenizers decode each id (about 0.1 s for 50k ids); others fall back to the
    vocabulary's strings (an upper bound: byte-level BPE spells one byte with up to 2).
    """
    n = len(tokenizer)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        try:
            # + 1: SentencePiece-style decoders drop the leading space of a text's first token
            return 1 + max(len(backend.decode([i], skip_special_tokens=False).encode("utf-8")) for i in range(n))
        except Exception:  # noqa: BLE001 - fall back to the vocabulary's strings
            pass
    return max(1, max((len(t.encode("utf-8")) for t in tokenizer.get_vocab()), default=16))


def _opt_input(request, name: str):
    t = pb_utils.get_input_tensor_by_name(request, name)
    return None if t is None else t.as_numpy().reshape(-1)


def _bool_input(request, name: str, default: bool) -> bool:
    """The one value of BOOL input ``name``, ``default`` when absent or empty.

    Raises:
        ClientError: more than one value.
    """
    v = _opt_input(request, name)
    if v is None or v.size == 0:
        return default
    if v.size != 1:
        raise ClientError(f"{name} must hold exactly one value")
    return bool(v[0])


def _bytes_input(request, name: str, limit: Optional[int] = None, key: str = "") -> Optional[bytes]:
    """The one value of BYTES input ``name``; ``limit``: its most bytes (``key``: the limit's config key).

    Raises:
        ClientError: not one value, or longer than ``limit`` (checked before any decoding).
    """
    v = _opt_input(request, name)
    if v is None or v.size == 0:
        return None
    if v.size != 1:
        raise ClientError(f"{name} must hold exactly one value, got {v.size}")
    x = v[0]
    x = x if isinstance(x, bytes) else str(x).encode("utf-8")
    if limit is not None and len(x) > limit:
        raise ClientError(f"{name} is {len(x)} bytes; the limit is {limit} ({key})")
    return x


#: vllm_backend's opt-in output switches: input name → (output name, default here)
OUTPUT_SWITCHES = {"return_finish_reason": ("finish_reason", True),
                   "return_num_input_tokens": ("num_input_tokens", True),
                   "return_num_output_tokens": ("num_output_tokens", True),
                   "return_logprobs": ("logprobs", False)}

#: where a request's parameters come from, for the errors that name them
_REQUEST_PARAMETERS_ARE = ("request parameters: an HTTP generate body's top-level keys and its \"parameters\" "
                           "object, or gRPC request parameters")

#: request parameters Triton itself defines (KServe / Triton protocol), never sampling keys
_TRITON_RESERVED_PARAMETERS = frozenset({"sequence_id", "sequence_start", "sequence_end", "priority",
                                         "timeout", "binary_data_output", "binary_data_size", "headers"})


def _request_parameters(request, limits: Optional[InputLimits] = None) -> Optional[Dict[str, Any]]:
    """The request's parameters (HTTP generate ``"parameters"``, gRPC parameters) as a dict, or None.

    Read as sampling parameters when the ``sampling_parameters`` input is absent,
    as vllm_backend does.

    Raises:
        ClientError: the parameters are not a JSON object, or exceed ``limits`` (size, depth).
    """
    try:
        raw = request.parameters()
    except Exception:  # noqa: BLE001 - a stub without request parameters
        return None
    if not raw:
        return None
    if isinstance(raw, (str, bytes)):
        try:
            check_json_text(raw if isinstance(raw, str) else raw.decode("utf-8", "replace"), "parameters",
                            limits or InputLimits())
        except ValueError as e:
            raise ClientError(str(e)) from None
    try:
        d = json.loads(raw) if isinstance(raw, (str, bytes)) else dict(raw)
    except (ValueError, TypeError) as e:
        raise ClientError(f"request parameters are not a JSON object: {e}") from None
    if not isinstance(d, dict):
        raise ClientError("request parameters must be a JSON object")
    # Triton's own request parameters (set by clients and frontends, e.g. tritonclient's
    # enable_empty_final_response) are not sampling parameters
    d = {k: v for k, v in d.items() if not k.startswith("triton_") and k not in _TRITON_RESERVED_PARAMETERS}
    return d or None


def _timeout_s(request) -> float:
    """Triton's per-request ``timeout`` parameter in seconds (given in microseconds); 0 = none."""
    try:
        us = int(request.timeout())
    except Exception:  # noqa: BLE001 - a stub without request timeouts
        us = 0
    return us / 1e6 if us > 0 else 0.0


@dataclass
class ClientRequest:
    """One client request in the router stub, from :meth:`RequestParser.parse` to its final response.

    Attributes:
        rid: the request id (32 hex digits), also the PeerReq's.
        sender: Triton's response sender of the request.
        request: the Triton request (its cancellation is checked on the client I/O thread).
        prompt: the prompt text; ``prompt_ids``: its token ids (chat template applied if asked).
        sp: the checked sampling parameters.
        stream: stream text deltas; ``exclude_input``: leave the prompt out of a non-streamed
            ``text_output``; ``want_trace``: add ``routing_trace``.
        params: the algorithm's parameters for this request (the router's, with the request's
            ``routing_threshold``).
        outputs: output name → whether it is sent (vllm_backend's ``return_*`` switches).
        arrival_t: ``time.monotonic()`` when ``execute`` received it.
        queue_deadline: ``time.monotonic()`` past which waiting for a worker makes it busy
            (None: no limit).
        worker_start_t: when a router worker started it (None while it waits).
        cancelled: the client cancelled it; ``expired``: it was answered busy while it waited.
        logprobs_sent: output tokens whose logprobs a streamed response already carried.
    """

    rid: str
    sender: Any
    request: Any
    prompt: str
    prompt_ids: List[int]
    sp: SamplingParams
    stream: bool
    exclude_input: bool
    want_trace: bool
    params: Dict[str, Any]
    outputs: Dict[str, bool] = field(default_factory=dict)
    arrival_t: float = 0.0
    queue_deadline: Optional[float] = None
    worker_start_t: Optional[float] = None
    cancelled: bool = False
    expired: bool = False
    logprobs_sent: int = 0


@dataclass(frozen=True)
class RequestParser:
    """Reads and checks the inputs of ``token_router``'s requests (module docstring).

    Every size is checked before the work that grows with it (decoding, JSON parsing,
    tokenising).

    Attributes:
        tokenizer: the router's Hugging Face tokenizer.
        limits: the request limits (``max_input_bytes`` set).
        context_length: most tokens of prompt + output.
        default_max_tokens: ``max_tokens`` of a request that sets none.
        algorithm: the routing algorithm's name; ``algo_cls``: its class.
        base_params: the algorithm's checked parameters (``algorithm_params``).
        n_models: how many models the router routes between.
        vocab_size: the tokenizer's size, added tokens included (ids from it on are no token).
        grammar: the router's :class:`~tokenrouter.engine.grammar.GrammarCompiler`: a guided request's
            grammar is compiled (and cached) here first, so that one that does not compile, or not
            within ``grammar_compile_timeout_ms``, is a 400 naming the field.
    """

    tokenizer: Any
    limits: RequestLimits
    context_length: int
    default_max_tokens: int
    algorithm: str
    algo_cls: Type[RoutingAlgorithm]
    base_params: Dict[str, Any]
    n_models: int
    vocab_size: int
    grammar: Any = None

    def parse(self, request, arrival_t: float) -> ClientRequest:
        """Read and check one Triton request that arrived at ``arrival_t`` (``time.monotonic()``).

        Raises:
            ClientError: a bad input, naming the input and the limit it broke.
        """
        prompt = self._prompt(request)
        sp, source = self._sampling(request)
        params = self._algorithm_params(sp, source)
        ids = self._prompt_ids(request, prompt, sp)
        outputs = {out: _bool_input(request, name, dflt) for name, (out, dflt) in OUTPUT_SWITCHES.items()}
        if outputs["logprobs"] and sp.logprobs is None:
            sp.logprobs = 0  # return_logprobs alone: the sampled token's logprob
        return ClientRequest(rid=uuid.uuid4().hex, sender=request.get_response_sender(), request=request,
                             prompt=prompt, prompt_ids=ids, sp=sp,
                             stream=_bool_input(request, "stream", False),
                             exclude_input=_bool_input(request, "exclude_input_in_output", False),
                             want_trace=_bool_input(request, "return_routing_trace", False), params=params,
                             outputs=outputs, arrival_t=arrival_t,
                             queue_deadline=self._queue_deadline(request, arrival_t))

    def _prompt(self, request) -> str:
        """``text_input`` as text (at most ``max_input_bytes``)."""
        raw = _bytes_input(request, "text_input", self.limits.max_input_bytes, "max_input_bytes")
        if raw is None:
            raise ClientError("text_input is required")
        try:
            prompt = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ClientError(f"text_input is not valid UTF-8: {e}") from None
        if not prompt.strip():
            raise ClientError("text_input is empty")
        return prompt

    def _sampling(self, request) -> Tuple[SamplingParams, str]:
        """The sampling parameters and where they came from (``sampling_parameters`` or
        ``parameters``: the request's parameters, read when that input is absent)."""
        lim = self.limits
        sp_raw = _bytes_input(request, "sampling_parameters", lim.sampling.max_sampling_parameters_bytes,
                              "max_sampling_parameters_bytes")
        source = "sampling_parameters" if sp_raw is not None else "parameters"  # named in errors
        params = _request_parameters(request, lim.sampling)
        if sp_raw is not None and params:
            raise ClientError(f"request parameters {sorted(params)} beside the sampling_parameters input "
                              f"({_REQUEST_PARAMETERS_ARE}): send the sampling keys in one place")
        try:
            if sp_raw is not None:
                sp = parse_sampling_parameters(sp_raw.decode("utf-8"), self.default_max_tokens,
                                               limits=lim.sampling)
            else:
                sp = parse_sampling_parameters(params, self.default_max_tokens, source=source, limits=lim.sampling)
        except UnicodeDecodeError:
            raise ClientError("sampling_parameters is not valid UTF-8") from None
        except ValueError as e:
            raise ClientError(str(e) + ("" if sp_raw is not None else f" ({_REQUEST_PARAMETERS_ARE})")) from None
        if sp.guided is not None and self.grammar is not None:  # a 400 naming the field
            try:
                self.grammar.compile(sp.guided, timeout_s=lim.sampling.grammar_compile_timeout_ms / 1000)
            except (ValueError, RuntimeError) as e:
                raise ClientError(str(e).replace("sampling_parameters", source)) from None
        oov = [t for t in sp.stop_token_ids if t >= self.vocab_size]
        if oov:
            raise ClientError(f"{source}.stop_token_ids {oov} are not token ids of this tokenizer "
                              f"(vocabulary size {self.vocab_size})")
        return sp, source

    def _algorithm_params(self, sp: SamplingParams, source: str) -> Dict[str, Any]:
        """The algorithm's parameters, with the request's ``routing_threshold`` if it set one."""
        params = dict(self.base_params)
        if sp.routing_threshold is None:
            return params
        if not self.algo_cls.threshold_param:
            raise ClientError(f"algorithm {self.algorithm!r} has no threshold to override")
        try:
            return self.algo_cls.validate_params({**params, self.algo_cls.threshold_param: sp.routing_threshold},
                                                 self.n_models)
        except ValueError as e:
            raise ClientError(f"{source}.routing_threshold: {e}") from None

    def _prompt_ids(self, request, prompt: str, sp: SamplingParams) -> List[int]:
        """The prompt's token ids (``apply_chat_template``), checked with ``max_tokens`` against the
        context length."""
        ctx = self.context_length
        try:
            ids = encode_prompt(self.tokenizer, prompt, _bool_input(request, "apply_chat_template", False),
                                max_prompt_tokens=ctx - 1)
        except PromptTooLong as e:
            raise ClientError(f"{e}; the context length is {ctx}") from None
        if len(ids) >= ctx:
            raise ClientError(f"prompt has {len(ids)} tokens; the context length is {ctx}")
        if len(ids) + sp.max_tokens > ctx:
            budget = (f"max_tokens ({sp.max_tokens})" if sp.max_tokens_given else
                      f"the default max_tokens ({sp.max_tokens}; the request set none)")
            raise ClientError(f"prompt ({len(ids)} tokens) + {budget} exceeds the context length "
                              f"{ctx}: set max_tokens to at most {ctx - len(ids)}")
        return ids

    def _queue_deadline(self, request, arrival_t: float) -> Optional[float]:
        """When the request stops waiting for a worker: ``queue_timeout_s``, lowered by Triton's
        per-request ``timeout``; None where neither sets a limit."""
        t, own = self.limits.queue_timeout_s, _timeout_s(request)
        if own:
            t = min(t, own) if t else own
        return arrival_t + t if t else None


def routing_summary(routed, algorithm: str, params: Dict[str, Any], models: Sequence[str]) -> Dict[str, Any]:
    """``routing_summary`` of a finished request (module docstring) from its
    :class:`~tokenrouter.routing.router_core.RoutedRequest`; seconds rounded to µs."""
    r = routed
    summary = {"algorithm": algorithm, "params": params,
               "tokens_by_model": {m: r.tokens_by_model.get(m, 0) for m in models},
               "handoffs": r.handoffs, "handoffs_by_pair": r.pairs,
               "handoff_gap_s": [round(g, 6) for g in r.handoff_gaps_s]}
    if r.degraded:
        summary["degraded"] = r.degraded
    if r.spec_rounds:  # speculative decoding, draft-verify: drafts verified and accepted
        summary["speculative"] = {"rounds": len(r.spec_rounds), "drafted": r.drafted,
                                  "accepted": r.accepted,
                                  "acceptance_rate": round(r.accepted / r.drafted, 4) if r.drafted else None,
                                  "tokens_per_llm_pass": round(r.spec_tokens / len(r.spec_rounds), 4)}
    return summary


def _bytes_tensor(text: str) -> np.ndarray:
    return np.asarray([text.encode("utf-8")], dtype=np.object_)


def wants_logprobs(job: ClientRequest) -> bool:
    """Whether the request's responses carry ``logprobs`` (``return_logprobs`` or the sampling key)."""
    return bool(job.outputs.get("logprobs")) or job.sp.logprobs is not None


def logprobs_json(token_ids: Sequence[int], logprobs: Sequence[Optional[float]], tops: Sequence[Any],
                  strings) -> str:
    """vllm_backend's ``logprobs`` output for some output tokens: a JSON list, per token
    ``{"<id>": {"logprob": float, "rank": int, "decoded_token": str}, ...}``.

    Args:
        token_ids: the output tokens (int ids).
        logprobs: each one's logprob (natural log; None where its model sent none).
        tops: each one's :class:`~tokenrouter.protocol.TokenLogprobs` (rank, top-N ids and logprobs),
            or None.
        strings: a :class:`~tokenrouter.engine.detok.TokenStrings` (``decoded_token``: the id decoded
            alone).

    The token comes first, then its top N, most likely first (ranks 1 … N; the token is not
    repeated when it is among them: N or N + 1 entries), as vLLM's ``Logprob`` dicts.  A token
    without logprobs is ``null``.
    """
    out: List[Optional[Dict[str, Any]]] = []
    for tid, lp, top in zip(token_ids, logprobs, tops):
        if lp is None:
            out.append(None)
            continue
        d = {str(tid): {"logprob": lp, "rank": top.rank if top is not None else None,
                        "decoded_token": strings.text(tid)}}
        for r, (i, v) in enumerate(zip(top.ids, top.logprobs) if top is not None else (), 1):
            d.setdefault(str(i), {"logprob": v, "rank": r, "decoded_token": strings.text(i)})
        out.append(d)
    return json.dumps(out, ensure_ascii=False)


def output_tensors(job: ClientRequest, routed, text: str, summary: Dict[str, Any],
                   models: Sequence[str], strings=None) -> Dict[str, np.ndarray]:
    """The final response's outputs (module docstring), output name → tensor.

    Args:
        job: the request (its output switches, ``want_trace``, sampling ``logprobs`` and
            ``logprobs_sent``: the tokens whose logprobs streamed responses already carried).
        routed: its :class:`~tokenrouter.routing.router_core.RoutedRequest`.
        text: ``text_output``: the rest of the text when streamed, else the whole answer.
        summary: :func:`routing_summary`'s dict.
        models: the deployment's model names (``routing_trace``'s ``models``).
        strings: a :class:`~tokenrouter.engine.detok.TokenStrings` for ``logprobs`` (required when
            the request asks for them).
    """
    r = routed
    outputs = {
        "text_output": _bytes_tensor(text),
        "finish_reason": _bytes_tensor(r.finish),
        "num_input_tokens": np.asarray([r.n_prompt], dtype=np.int32),
        "num_output_tokens": np.asarray([len(r.output_ids)], dtype=np.int32),
        "routing_summary": _bytes_tensor(json.dumps(summary)),
    }
    for name, on in job.outputs.items():  # vllm_backend's return_* switches
        if name != "logprobs" and not on:
            outputs.pop(name, None)
    if wants_logprobs(job):
        start = job.logprobs_sent
        outputs["logprobs"] = _bytes_tensor(logprobs_json(r.output_ids[start:], r.logprobs[start:],
                                                          r.top_logprobs[start:], strings))
    if job.want_trace:
        trace = {"models": list(models), "trace": r.trace, "token_ids": r.output_ids,
                 "scores": r.scores, "handoffs": r.handoff_log}
        if r.spec_rounds:
            trace["drafts"] = r.spec_rounds
        outputs["routing_trace"] = _bytes_tensor(json.dumps(trace))
    return outputs
