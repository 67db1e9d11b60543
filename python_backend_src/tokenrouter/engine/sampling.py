"""Client sampling parameters (vLLM-backend conventions) and batched sampling.

``sampling_parameters`` is a JSON object string, as in Triton's vllm_backend:
``{"max_tokens": 64, "temperature": 0.7, "top_p": 0.9, "top_k": 40, "seed": 1,
"stop": ["\\n\\n"], "ignore_eos": false, "routing_threshold": 0.05}``; structured output with
vLLM's guided-decoding forms (``"guided_decoding": {"json": {...schema...}}``, ``regex``,
``choice``, ``grammar``, ``json_object``; :mod:`tokenrouter.engine.grammar`).
Values are read as vllm_backend reads them: a number may also be given as a
numeric string (``"32"``, as genai-perf sends it), a boolean as ``"true"`` /
``"false"``, and ``null`` means "the default".  Unknown keys are rejected, so a
typo never silently changes behaviour.  When the request has no
``sampling_parameters`` input, the same keys are read from the request's
parameters (HTTP generate's ``"parameters"`` object, gRPC request parameters).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from ..protocol import MAX_TOP_LOGPROBS, TokenLogprobs
from .grammar import GUIDED_KEYS, GuidedSpec, parse_guided
from .parameters import check_ranges, declarations, documented, param

__all__ = ["as_json", "SamplingParams", "filtered_probs", "parse_sampling_parameters", "validate_sampling", "BatchSampler",
           "normalized_entropy", "apply_penalties", "MAX_SEED", "SAMPLING_EPS", "SAMPLER_KEYS", "MAX_LOGPROBS",
           "logprobs_count", "token_logprobs", "InputLimits", "DEFAULT_LIMITS", "json_depth", "check_json_text"]


@documented
@dataclass(frozen=True)
class InputLimits:
    """Bounds on a client's sampling parameters, checked before any work that grows with them.

    Each refusal is a ``ValueError`` naming the limit (its config parameter) and its value.  The
    router reads them from its config parameters of the same names, declared here
    (:func:`~tokenrouter.engine.parameters.param`; :class:`tokenrouter.triton.settings.RequestLimits`).

    Raises:
        ValueError: a limit that is not an integer, or out of its declared range (naming it).
    """

    max_sampling_parameters_bytes: int = param(64 * 1024, unit="bytes", ge=1, doc=(
        "size of the ``sampling_parameters`` JSON (or of the request's parameters), checked on the raw "
        "bytes before JSON parsing"))
    max_json_depth: int = param(8, unit="levels", ge=1, doc=(
        "nesting depth of that JSON (``{\"stop\": [\"x\"]}`` is 2), checked on the raw text before parsing"))
    max_stop_strings: int = param(16, unit="strings", ge=1, doc="number of ``stop`` strings")
    max_stop_string_bytes: int = param(1024, unit="bytes", ge=1, doc="UTF-8 bytes of one stop string")
    max_stop_token_ids: int = param(1024, unit="token ids", ge=1, doc="number of ``stop_token_ids``")
    max_grammar_bytes: int = param(32 * 1024, unit="bytes", ge=1, doc=(
        "UTF-8 bytes of a guided-decoding schema, regex, grammar or choice list"))
    max_schema_depth: int = param(32, unit="levels", ge=1, doc="nesting depth of a guided-decoding JSON schema")
    grammar_compile_timeout_ms: int = param(3000, unit="ms", ge=1, doc=(
        "a new grammar may take this long to compile (the router compiles it before the request runs; "
        "one past the limit is refused, and so are its later copies)"))

    def __post_init__(self) -> None:
        for name, _, _ in declarations(InputLimits):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{name} must be an integer, got {v!r}")
        check_ranges(self)


#: the limits applied when the caller gives none
DEFAULT_LIMITS = InputLimits()

_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_JSON_BRACKET = re.compile(r"[\[\]{}]")


def json_depth(text: str) -> int:
    """Nesting depth of a JSON text (objects and arrays; ``1`` = ``{}``), read without parsing it.

    Brackets inside strings do not count; the text need not be valid JSON (the parser
    reports that later).  Time and memory are linear in ``len(text)``.
    """
    depth = deepest = 0
    for m in _JSON_BRACKET.finditer(_JSON_STRING.sub('""', text)):
        if m.group() in "[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth = max(0, depth - 1)
    return deepest


@dataclass
class SamplingParams:
    """Validated per-request sampling parameters (vLLM ``SamplingParams`` semantics).

    Attributes:
        max_tokens: output budget in tokens (>= 1).
        temperature: softmax temperature; 0 (or below ``SAMPLING_EPS`` = 1e-5)
            means greedy (argmax).
        top_p: nucleus mass in (0, 1].
        top_k: keep the k most likely tokens; 0 or -1 disables.
        seed: per-request RNG seed (deterministic sampling), or None.
        stop: stop strings; the output is cut before the first one (or after
            it with ``include_stop_str_in_output``).
        ignore_eos: keep generating after EOS (benchmarks).
        routing_threshold: per-request override of the routing algorithm's
            threshold parameter, or None.
        repetition_penalty: > 0; 1 = off.  Logits of tokens seen in the prompt
            or the output are divided by it when positive, multiplied when
            negative (CTRL, Keskar et al. 2019, as vLLM applies it).
        presence_penalty: in [-2, 2]; subtracted once from the logit of every
            token already in the output (OpenAI / vLLM definition).
        frequency_penalty: in [-2, 2]; subtracted from a token's logit once per
            occurrence in the output (OpenAI / vLLM definition).
        min_tokens: EOS and ``stop_token_ids`` cannot be sampled before this
            many output tokens (0 <= min_tokens <= max_tokens).
        stop_token_ids: extra token ids that end the request (kept in the
            output token ids, as in vLLM).
        include_stop_str_in_output: keep the matched stop string in the text.
        skip_special_tokens: leave special tokens out of the text (default true).
        logprobs: None (off), or N in 0 … :data:`MAX_LOGPROBS` (vLLM's ``logprobs``): return
            each output token's log-probability (natural log), its rank and the N most
            likely tokens with theirs, all under the raw distribution of the model that
            wrote the token (log-softmax of its logits, before temperature, penalties,
            top-k / top-p and a grammar's mask: vLLM's default ``raw_logprobs``).
            ``true`` is read as 0, ``false`` as None.
        guided: what the output must match (:class:`~tokenrouter.engine.grammar.GuidedSpec`:
            a JSON schema, any JSON object, a regex, a choice of strings or an EBNF grammar),
            or None.  Both models mask their logits with one grammar state (constrained decoding).
        max_tokens_given: False where ``max_tokens`` is the caller's default
            (the request set none), so that errors about it can say so.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: Optional[int] = None
    stop: List[str] = field(default_factory=list)
    ignore_eos: bool = False
    routing_threshold: Optional[float] = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    stop_token_ids: List[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: Optional[int] = None
    guided: Optional[GuidedSpec] = None
    max_tokens_given: bool = field(default=True, compare=False, repr=False)

    def sampler_dict(self) -> Dict[str, Any]:
        """The subset the model subservers need (travels in the PeerReq)."""
        d: Dict[str, Any] = {"temperature": self.temperature, "top_p": self.top_p,
                             "top_k": self.top_k, "seed": self.seed}
        # only non-defaults travel, so PeerReqs of plain requests stay as before
        if self.repetition_penalty != 1.0:
            d["repetition_penalty"] = self.repetition_penalty
        if self.presence_penalty:
            d["presence_penalty"] = self.presence_penalty
        if self.frequency_penalty:
            d["frequency_penalty"] = self.frequency_penalty
        if self.min_tokens:
            d["min_tokens"] = self.min_tokens
        if self.logprobs is not None:
            d["logprobs"] = self.logprobs
        if self.guided is not None:
            d["guided"] = self.guided.wire()
        return d


#: keys a client may set (``max_tokens_given`` is the parser's own note, not an input; ``guided`` is
#: set through one of the guided-decoding keys)
_KEYS = (set(SamplingParams.__dataclass_fields__) - {"max_tokens_given", "guided"}) | set(GUIDED_KEYS)
#: keys of the sampler dict a model accepts in a PeerReq (see SamplingParams.sampler_dict)
SAMPLER_KEYS = frozenset({"temperature", "top_p", "top_k", "seed", "repetition_penalty", "presence_penalty",
                          "frequency_penalty", "min_tokens", "logprobs", "guided"})
#: torch.Generator seeds are 64-bit signed
MAX_SEED = 2**63 - 1
#: the most top alternatives a request may ask for per token (:data:`tokenrouter.protocol.MAX_TOP_LOGPROBS`)
MAX_LOGPROBS = MAX_TOP_LOGPROBS
def as_json(value: Any) -> str:
    """``value`` as the JSON text a request would carry (``true``, ``"ten"``, ``null``, ``NaN``), for
    error messages about request fields; its ``repr`` where it has no JSON form."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


#: temperatures below this are greedy, as in vLLM (logits / t would overflow float32)
SAMPLING_EPS = 1e-5


def _to_number(key: str, v: Any, kind) -> Union[int, float]:
    """A JSON number or a numeric string (vllm_backend sends ``"32"``) as ``kind``; ValueError naming key."""
    what = "an integer" if kind is int else "a number"
    if isinstance(v, str):
        s = v.strip()
        try:
            v = int(s) if kind is int and s.lstrip("+-").isdigit() else float(s)
        except ValueError:
            raise ValueError(f"sampling_parameters.{key} must be {what}, got {as_json(v)}") from None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"sampling_parameters.{key} must be {what}, got {as_json(v)}")
    if not math.isfinite(v):
        raise ValueError(f"sampling_parameters.{key} must be a finite number, got {as_json(v)}")
    if kind is int and not float(v).is_integer():
        raise ValueError(f"sampling_parameters.{key} must be {what}, got {as_json(v)}")
    return kind(v)


def _to_bool(key: str, v: Any) -> bool:
    """true/false, or the strings "true"/"false" (any case) as vllm_backend accepts them."""
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.strip().lower() in ("true", "false"):
        return v.strip().lower() == "true"
    raise ValueError(f"sampling_parameters.{key} must be true or false, got {as_json(v)}")


def check_json_text(text: str, what: str, limits: InputLimits = DEFAULT_LIMITS) -> None:
    """Size and nesting-depth checks of a JSON text before it is parsed.

    Raises:
        ValueError: longer than ``max_sampling_parameters_bytes`` (characters, a lower bound of
            its UTF-8 bytes) or nested deeper than ``max_json_depth``; the message names the limit.
    """
    if len(text) > limits.max_sampling_parameters_bytes:
        raise ValueError(f"{what} is {len(text)} bytes; the limit is {limits.max_sampling_parameters_bytes} "
                         f"(max_sampling_parameters_bytes)")
    d = json_depth(text)
    if d > limits.max_json_depth:
        raise ValueError(f"{what} is nested {d} levels deep; the limit is {limits.max_json_depth} "
                         f"(max_json_depth)")


def _load(src: Union[None, str, Dict[str, Any]], limits: InputLimits = DEFAULT_LIMITS) -> Dict[str, Any]:
    if src is None:
        return {}
    if isinstance(src, dict):
        return dict(src)
    check_json_text(src, "sampling_parameters", limits)
    if not src.strip():
        return {}
    try:
        d = json.loads(src)
    except json.JSONDecodeError as e:
        raise ValueError(f"sampling_parameters is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise ValueError("sampling_parameters must be a JSON object")
    return d


def parse_sampling_parameters(text: Union[None, str, Dict[str, Any]],
                              default_max_tokens: int = 16, source: str = "sampling_parameters",
                              limits: Optional[InputLimits] = None) -> SamplingParams:
    """Parse and validate sampling parameters (vllm_backend's value forms).

    Args:
        text: JSON object string, an already-parsed dict (request parameters),
            or None/empty for defaults.  Numbers may be numeric strings,
            booleans "true"/"false"; a ``null`` value means the default.
        default_max_tokens: ``max_tokens`` when not given.
        source: where the keys came from, named in error messages:
            ``sampling_parameters`` (the input) or ``parameters`` (the request's
            parameters).  Request parameters are scalars, so there ``stop`` and
            ``stop_token_ids`` may also be given as a JSON array in a string
            (``"[\"\\n\", \"END\"]"``, ``"[2, 7]"``).
        limits: :class:`InputLimits` (default :data:`DEFAULT_LIMITS`): size and depth of
            the JSON (checked before parsing), number and length of stop strings, number of
            stop token ids.

    Raises:
        ValueError: not JSON, not an object, unknown keys, or a value that
            cannot be converted (``"ten"``), is not finite (NaN, ±Infinity) or
            is out of range (the message names the key and ``source``); or a
            limit exceeded (the message names the limit and its value).
    """
    limits = limits or DEFAULT_LIMITS
    try:
        d = _load(text, limits)
        if source != "sampling_parameters":
            d = _arrays_from_strings(d, limits)
        return _parse(d, default_max_tokens, limits)
    except ValueError as e:
        if source == "sampling_parameters":
            raise
        raise ValueError(str(e).replace("sampling_parameters", source)) from None


def _arrays_from_strings(d: Dict[str, Any], limits: InputLimits = DEFAULT_LIMITS) -> Dict[str, Any]:
    """``stop`` / ``stop_token_ids`` given as a JSON array in a string (request parameters are scalars)."""
    out = dict(d)
    for key in ("stop", "stop_token_ids"):
        v = out.get(key)
        if isinstance(v, str) and v.lstrip().startswith("["):
            check_json_text(v, f"sampling_parameters.{key}", limits)
            try:
                arr = json.loads(v)
            except json.JSONDecodeError as e:
                if key == "stop_token_ids":
                    raise ValueError(f"sampling_parameters.stop_token_ids: {v!r} is not a JSON array of "
                                     f"token ids ({e})") from None
                continue  # a literal stop string that starts with "[" (e.g. "[END"), used as is
            if isinstance(arr, list):
                out[key] = arr
    if isinstance(out.get("stop_token_ids"), (int, str)) and not isinstance(out.get("stop_token_ids"), bool):
        out["stop_token_ids"] = [out["stop_token_ids"]]  # one id
    return out


def _parse(d: Dict[str, Any], default_max_tokens: int, limits: InputLimits = DEFAULT_LIMITS) -> SamplingParams:
    p = SamplingParams(max_tokens=default_max_tokens)
    unknown = set(d) - _KEYS
    if unknown:
        raise ValueError(f"unknown keys in sampling_parameters: {sorted(unknown)}; "
                         f"allowed: {sorted(_KEYS)}")
    d = {k: v for k, v in d.items() if v is not None}  # null = the default (vllm_backend drops them)

    def num(key, kind, lo=None, hi=None, lo_open=False):
        v = _to_number(key, d[key], kind)
        if lo is not None and (v <= lo if lo_open else v < lo):
            raise ValueError(f"sampling_parameters.{key} must be {'>' if lo_open else '>='} {lo}, got {v}")
        if hi is not None and v > hi:
            raise ValueError(f"sampling_parameters.{key} must be <= {hi}, got {v}")
        return v

    if "max_tokens" in d:
        p.max_tokens = num("max_tokens", int, 1)
    else:
        p.max_tokens_given = False
    if "temperature" in d:
        p.temperature = num("temperature", float, 0.0)
    if "top_p" in d:
        p.top_p = num("top_p", float, 0.0, 1.0, lo_open=True)
    if "top_k" in d:
        p.top_k = num("top_k", int, -1)
    if "seed" in d:
        p.seed = num("seed", int, 0, MAX_SEED)
    if "routing_threshold" in d:
        p.routing_threshold = num("routing_threshold", float)
    if "repetition_penalty" in d:
        p.repetition_penalty = num("repetition_penalty", float, 0.0, lo_open=True)
    if "presence_penalty" in d:
        p.presence_penalty = num("presence_penalty", float, -2.0, 2.0)
    if "frequency_penalty" in d:
        p.frequency_penalty = num("frequency_penalty", float, -2.0, 2.0)
    if "min_tokens" in d:
        p.min_tokens = num("min_tokens", int, 0)
        if p.min_tokens > p.max_tokens:
            raise ValueError(f"sampling_parameters.min_tokens ({p.min_tokens}) must be <= max_tokens "
                             f"({p.max_tokens})")
    for key in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
        if key in d:
            setattr(p, key, _to_bool(key, d[key]))
    if "logprobs" in d:
        v = d["logprobs"]
        if isinstance(v, bool) or (isinstance(v, str) and v.strip().lower() in ("true", "false")):
            p.logprobs = 0 if _to_bool("logprobs", v) else None
        else:
            p.logprobs = num("logprobs", int, 0, MAX_LOGPROBS)
    if "stop" in d:
        s = d["stop"]
        if isinstance(s, str):
            s = [s]
        if not isinstance(s, list) or not all(isinstance(x, str) and x for x in s):
            raise ValueError("sampling_parameters.stop must be a non-empty string or a list of them")
        if len(s) > limits.max_stop_strings:
            raise ValueError(f"sampling_parameters.stop has {len(s)} strings; the limit is "
                             f"{limits.max_stop_strings} (max_stop_strings)")
        longest = max(len(x.encode("utf-8")) for x in s)  # a few strings, each bounded by the JSON size
        if longest > limits.max_stop_string_bytes:
            raise ValueError(f"sampling_parameters.stop has a string of {longest} bytes; the limit is "
                             f"{limits.max_stop_string_bytes} (max_stop_string_bytes)")
        p.stop = s
    if "stop_token_ids" in d:
        s = d["stop_token_ids"]
        if not isinstance(s, list):
            raise ValueError(f"sampling_parameters.stop_token_ids must be a list of token ids, got {as_json(s)}")
        if len(s) > limits.max_stop_token_ids:
            raise ValueError(f"sampling_parameters.stop_token_ids has {len(s)} ids; the limit is "
                             f"{limits.max_stop_token_ids} (max_stop_token_ids)")
        p.stop_token_ids = [num_item for num_item in
                            (_to_number("stop_token_ids", x, int) for x in s)]
        if any(t < 0 for t in p.stop_token_ids):
            raise ValueError("sampling_parameters.stop_token_ids must be non-negative token ids")
    p.guided = parse_guided(d, limits.max_grammar_bytes, limits.max_schema_depth, json_depth)
    return p


def validate_sampling(sampling: Dict[str, Any]) -> None:
    """Check a PeerReq's sampler dict (see :meth:`SamplingParams.sampler_dict`) as a model receives it.

    Raises:
        ValueError: an unknown key, or a value of the wrong type or out of range
            (the router checks client input earlier; this guards the models' own endpoints).
    """
    if not isinstance(sampling, dict):
        raise ValueError("sampling must be a JSON object")
    unknown = set(sampling) - SAMPLER_KEYS
    if unknown:
        raise ValueError(f"unknown sampling keys {sorted(unknown)}")
    d = {k: v for k, v in sampling.items() if v is not None and k not in ("min_tokens", "logprobs", "guided")}
    parse_sampling_parameters(d)
    if "min_tokens" in sampling:
        _to_number("min_tokens", sampling["min_tokens"], int)
    if "logprobs" in sampling:
        v = sampling["logprobs"]
        if not isinstance(v, bool) and not (isinstance(v, int) and 0 <= v <= MAX_LOGPROBS):
            raise ValueError(f"sampling.logprobs must be true, false or an integer in [0, {MAX_LOGPROBS}], got {as_json(v)}")
    if sampling.get("guided") is not None:
        GuidedSpec.from_wire(sampling["guided"])


def logprobs_count(sampling: Dict[str, Any]) -> Optional[int]:
    """How many top alternatives a PeerReq's sampler dict asks for per token: None (no logprobs),
    or N in 0 … :data:`MAX_LOGPROBS` (``true``, an older router's form, is 0)."""
    v = sampling.get("logprobs")
    if v is None or v is False:
        return None
    return 0 if v is True else int(v)


def token_logprobs(logp: torch.Tensor, token: int, n: int) -> Tuple[float, TokenLogprobs]:
    """One committed token's logprob, rank and top-``n`` alternatives (vLLM's sample logprobs).

    Args:
        logp: float32 ``[V]``, the raw log-softmax of the logits of the model that wrote the
            token (natural log; before temperature, penalties and any grammar mask).
        token: the committed token id.
        n: how many of the most likely tokens to return (0 … :data:`MAX_LOGPROBS`).

    Returns:
        ``(logprob, TokenLogprobs)``: ``logprob = logp[token]``; ``rank`` is vLLM's, the number of
        tokens whose logprob is >= the token's (1 = most likely); ``ids`` / ``logprobs`` the ``n``
        most likely tokens, most likely first (``torch.topk``: ties in index order).
    """
    lp = logp[token]
    rank = int((logp >= lp).sum())
    if n > 0:
        top = torch.topk(logp, min(n, logp.shape[-1]))
        ids, lps = top.indices.tolist(), top.values.tolist()
    else:
        ids, lps = [], []
    return float(lp), TokenLogprobs(rank=rank, ids=ids, logprobs=lps)


def apply_penalties(row: torch.Tensor, p: Dict[str, Any], context: Optional[Tuple[Sequence[int], int]]
                    ) -> torch.Tensor:
    """Apply repetition / presence / frequency penalties to one row of logits.

    Args:
        row: float32 logits ``[V]`` (not modified).
        p: the request's sampler dict (``repetition_penalty``, ``presence_penalty``,
            ``frequency_penalty``; absent = off).
        context: ``(token_ids, n_output)``: the request's tokens so far (prompt +
            output, all models together) and how many of the last ones are output.

    Returns:
        float32 ``[V]``: the penalised logits (``row`` itself when no penalty applies).

    Formulas as in vLLM's sampler: repetition (CTRL, Keskar et al. 2019) on
    prompt and output tokens, logit / r if > 0 else logit * r; presence and
    frequency (OpenAI API) on output tokens, logit -= presence * [count > 0] +
    frequency * count.
    """
    rep = float(p.get("repetition_penalty", 1.0) or 1.0)
    pres = float(p.get("presence_penalty", 0.0) or 0.0)
    freq = float(p.get("frequency_penalty", 0.0) or 0.0)
    if context is None or (rep == 1.0 and not pres and not freq):
        return row
    tokens, n_out = context
    vocab = row.shape[-1]
    row = row.clone()
    if rep != 1.0 and len(tokens):
        seen = torch.as_tensor(list(set(int(t) for t in tokens if 0 <= int(t) < vocab)), dtype=torch.long)
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / rep, vals * rep)
    if (pres or freq) and n_out > 0:
        out = torch.as_tensor([int(t) for t in tokens[len(tokens) - n_out:] if 0 <= int(t) < vocab],
                              dtype=torch.long)
        counts = torch.bincount(out, minlength=vocab).to(row.dtype)
        row -= freq * counts + pres * (counts > 0).to(row.dtype)
    return row


def normalized_entropy(logp: torch.Tensor) -> torch.Tensor:
    """Entropy of a distribution divided by log V, per row.

    Args:
        logp: float log-probabilities ``[B, V]`` (``log_softmax`` of the logits).

    Returns:
        float32 tensor ``[B]`` in [0, 1].  R-Stitch's uncertainty score
        (normalised entropy, H / log V).  Tokens at -inf (masked by a grammar) count 0.

    The probabilities are ``softmax(logp)``, equal to ``exp(logp)`` as ``logp`` is normalised (to
    rounding): PyTorch's CPU ``exp`` takes a slow path on -inf and on inputs below about -87 (a
    result that underflows), 10-50 times slower than on others, where softmax's kernel does not
    (8 rows of 151,936 with all but a few at -inf: about 6 ms against 1 ms on a 2-core Xeon).
    """
    return -(torch.softmax(logp, dim=-1) * logp.clamp_min(torch.finfo(logp.dtype).min)).sum(-1) \
        / math.log(logp.shape[-1])


def filtered_probs(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Probabilities of temperature-scaled logits after top-k, then top-p (vLLM's order).

    Args:
        scaled: float32 ``[V]`` logits already divided by the temperature.
        top_k: keep the k largest logits (0 or >= V: all).
        top_p: keep the smallest set of most probable tokens whose mass reaches ``top_p``
            (1.0: all).

    Returns:
        float32 ``[V]`` probabilities; after top-p the kept mass is not renormalised (it sums
        to at most 1; ``torch.multinomial`` does not need it, a caller that does divides).
    """
    row = scaled
    if 0 < top_k < row.shape[-1]:
        kth = torch.topk(row, top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, -1)
    if top_p < 1.0:
        sp, si = torch.sort(probs, descending=True)
        cum = torch.cumsum(sp, -1)
        sp = sp.masked_fill(cum - sp > top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, si, sp)
    return probs


class BatchSampler:
    """Samples one token per row from a batch of logits, per-request settings.

    Greedy rows (temperature below ``SAMPLING_EPS``) take the argmax; others apply temperature,
    top-k and top-p, then draw with the request's own ``torch.Generator``
    (seeded when the request gave a seed, so output is reproducible whatever
    the batch composition).
    """

    def __init__(self):
        self._gens: Dict[str, torch.Generator] = {}

    def generator(self, rid: str, seed: Optional[int]) -> torch.Generator:
        """The request's generator (created on first use)."""
        g = self._gens.get(rid)
        if g is None:
            g = torch.Generator()
            if seed is not None:
                g.manual_seed(int(seed))
            else:
                g.seed()
            self._gens[rid] = g
        return g

    def forget(self, rid: str) -> None:
        """Drop a finished request's generator."""
        self._gens.pop(rid, None)

    def sample(self, logits: torch.Tensor, rids: Sequence[str],
               params: Sequence[Dict[str, Any]], errors: Optional[Dict[int, str]] = None,
               contexts: Optional[Sequence[Optional[Tuple[Sequence[int], int, Sequence[int]]]]] = None
               ) -> torch.Tensor:
        """Sample next tokens.

        Args:
            logits: float32 ``[B, V]``.
            rids: request ids, length B.
            params: per-row sampler dicts (:meth:`SamplingParams.sampler_dict`).
            errors: if given, a row whose sampling fails is recorded here
                (row index → message) instead of failing the whole batch; its
                token is then the argmax and must not be used.
            contexts: per row ``(token_ids, n_output, stop_token_ids)`` or None:
                the request's tokens so far (prompt + output of every model),
                how many are output and the ids that end it; needed by the
                penalties and ``min_tokens`` (rows without context skip them).
                The same on every model, so routing never changes their meaning.

        Returns:
            int64 tensor ``[B]`` of token ids.

        Raises:
            RuntimeError: a row's sampling failed and ``errors`` is None.
        """
        out = torch.argmax(logits, dim=-1)
        for i, p in enumerate(params):
            try:
                tok = self._sample_row(logits[i], rids[i], p, None if contexts is None else contexts[i])
            except (RuntimeError, ValueError) as e:
                if errors is None:
                    raise
                errors[i] = f"sampling failed: {e}"
                continue
            if tok is not None:
                out[i] = tok
        return out

    def _sample_row(self, logits_row: torch.Tensor, rid: str, p: Dict[str, Any],
                    context: Optional[Tuple[Sequence[int], int, Sequence[int]]] = None) -> Optional[int]:
        """One row's sampled token id, or None for greedy on unmodified logits (the argmax)."""
        row = logits_row
        if context is not None:
            tokens, n_out, stop_ids = context
            row = apply_penalties(row, p, (tokens, n_out))
            min_tokens = int(p.get("min_tokens") or 0)
            if n_out < min_tokens and stop_ids:
                row = row.clone() if row is logits_row else row
                ids = torch.as_tensor([t for t in stop_ids if 0 <= t < row.shape[-1]], dtype=torch.long)
                row[ids] = float("-inf")
        t = float(p.get("temperature", 1.0))
        if t < SAMPLING_EPS:  # greedy (vLLM's convention); 1/t would overflow the softmax
            return None if row is logits_row else int(torch.argmax(row))
        probs = filtered_probs(row.float() / t, int(p.get("top_k") or 0), float(p.get("top_p", 1.0)))
        return int(torch.multinomial(probs, 1, generator=self.generator(rid, p.get("seed")))[0])
