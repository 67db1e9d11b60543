"""Constrained decoding: what a request's output must match, its compiled grammar, its matcher.

A client asks for structured output in ``sampling_parameters`` with vLLM's forms
(:func:`parse_guided`): ``guided_decoding`` (vllm_backend; ``structured_outputs`` is vLLM's later
name for the same object) holding one of ``json`` (a JSON schema), ``json_object`` (any JSON
object), ``regex``, ``choice`` (a list of strings), ``grammar`` (EBNF, xgrammar's dialect of
GBNF) or ``structural_tag`` (xgrammar's structural tag, as JSON text: the OpenAI front end forces a
tool call with one), or the flat ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``.
Whatever the form, it becomes one :class:`GuidedSpec`, which travels in the PeerReq's sampler
dict (key ``guided``) to every model the request visits.

Grammars are compiled with PyPI ``xgrammar`` (what SGLang and vLLM use) against the tokenizer's
vocabulary, once per spec and process (:class:`GrammarCompiler`, an LRU cache).  Each model keeps
one :class:`RequestGrammar` (an xgrammar ``GrammarMatcher``) per request, kept equal to the
request's output tokens whichever model wrote them (:meth:`RequestGrammar.sync`): that is what
lets two models obey one grammar state across handoffs.  The models must share one tokenizer,
which token-level routing requires anyway.

JSON schemas compile in xgrammar's strict mode (no properties beyond the schema's unless it
allows them) with compact whitespace (``{"a": 1, "b": [2, 3]}``: one space after ``:`` and
``,``, no newlines), so that a model cannot spend its budget on whitespace.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

__all__ = ["GuidedSpec", "GUIDED_KINDS", "GUIDED_KEYS", "parse_guided", "GrammarCompiler", "GrammarTimeout",
           "RequestGrammar", "allows_any", "apply_bitmask", "allocate_bitmask", "grammar_of"]

logger = logging.getLogger(__name__)

#: the kinds of :class:`GuidedSpec`
GUIDED_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
#: client keys of ``sampling_parameters`` that ask for guided decoding (one at most)
GUIDED_KEYS = ("guided_decoding", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
               "guided_grammar")
_FLAT = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
#: keys of the guided_decoding object that are accepted and have no effect (vLLM's backend choice)
_IGNORED = ("backend", "whitespace_pattern", "disable_fallback", "disable_any_whitespace",
            "disable_additional_properties")


@dataclasses.dataclass(frozen=True)
class GuidedSpec:
    """What a request's output must match.

    Attributes:
        kind: one of :data:`GUIDED_KINDS`.
        value: ``json``: the JSON schema as compact JSON text; ``regex``: the regular
            expression; ``grammar``: the EBNF text; ``choice``: the strings as a JSON array;
            ``json_object``: empty; ``structural_tag``: its JSON as compact text.
        field: the client field it came from, named in errors (e.g.
            ``sampling_parameters.guided_decoding.json``); not compared, not sent.
    """

    kind: str
    value: str
    field: str = dataclasses.field(default="", compare=False)

    @property
    def key(self) -> str:
        """A short digest of kind and value: the compile cache's key and the log's name for it."""
        return hashlib.blake2b(f"{self.kind}\0{self.value}".encode(), digest_size=12).hexdigest()

    def wire(self) -> Dict[str, str]:
        """The PeerReq form: ``{"kind", "value"}``."""
        return {"kind": self.kind, "value": self.value}

    @classmethod
    def from_wire(cls, d: Any) -> "GuidedSpec":
        """Inverse of :meth:`wire`.

        Raises:
            ValueError: not ``{"kind": one of GUIDED_KINDS, "value": str}``.
        """
        if not isinstance(d, dict) or set(d) != {"kind", "value"} or d["kind"] not in GUIDED_KINDS \
                or not isinstance(d["value"], str):
            raise ValueError(f"sampling.guided must be {{\"kind\": one of {list(GUIDED_KINDS)}, \"value\": a string}}")
        return cls(d["kind"], d["value"], "sampling.guided")


def _text_bytes(text: str) -> int:
    return len(text.encode("utf-8"))


def parse_guided(d: Dict[str, Any], max_bytes: int, max_depth: int, depth: Callable[[str], int],
                 source: str = "sampling_parameters") -> Optional[GuidedSpec]:
    """The guided-decoding request among sampling parameters ``d`` (vLLM's forms), or None.

    Args:
        d: the sampling parameters (keys of :data:`GUIDED_KEYS` are read; null values are absent).
        max_bytes: the largest schema / regex / grammar / choice list in UTF-8 bytes
            (``max_grammar_bytes``).
        max_depth: the deepest nesting of a JSON schema (``max_schema_depth``).
        depth: the nesting depth of a JSON text, read without parsing it
            (:func:`tokenrouter.engine.sampling.json_depth`).
        source: the parameters' name in error messages.

    Returns:
        A :class:`GuidedSpec` (a schema given as an object or as JSON text, both compacted), or
        None when no key asks for one.  Only the form is checked here: whether a schema, regex or
        grammar compiles is :class:`GrammarCompiler`'s job.

    Raises:
        ValueError: more than one form, an unknown key of the object, a value of the wrong type,
            an empty one, or over a limit; the message names the field (``source.key.sub``).
    """
    given = [k for k in GUIDED_KEYS if d.get(k) is not None]
    if not given:
        return None
    if len(given) > 1:
        raise ValueError(f"{source}: give one of {given}, not several")
    key = given[0]
    if key in _FLAT:
        return _one(_FLAT[key], d[key], f"{source}.{key}", max_bytes, max_depth, depth)
    obj = d[key]
    where = f"{source}.{key}"
    if isinstance(obj, str):  # request parameters are scalars: the object as JSON text
        obj = _load_json(obj, where, max_bytes + 1024, max_depth, depth)
    if not isinstance(obj, dict):
        raise ValueError(f"{where} must be an object with one of {[k for k in GUIDED_KINDS]}")
    unknown = sorted(set(obj) - set(GUIDED_KINDS) - set(_IGNORED))
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; allowed: {list(GUIDED_KINDS)}")
    kinds = [k for k in GUIDED_KINDS if obj.get(k) not in (None, False)]
    if len(kinds) != 1:
        raise ValueError(f"{where} must set exactly one of {list(GUIDED_KINDS)}, got {kinds or 'none'}")
    kind = kinds[0]
    return _one(kind, obj[kind], f"{where}.{kind}", max_bytes, max_depth, depth)


def _load_json(text: str, where: str, max_bytes: int, max_depth: int, depth: Callable[[str], int]) -> Any:
    """``text`` parsed as JSON after its size and depth checks (ValueError naming ``where`` and the limit)."""
    if _text_bytes(text) > max_bytes:
        raise ValueError(f"{where} is {_text_bytes(text)} bytes; the limit is {max_bytes} (max_grammar_bytes)")
    if depth(text) > max_depth:
        raise ValueError(f"{where} is nested {depth(text)} levels deep; the limit is {max_depth} (max_schema_depth)")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where} is not valid JSON: {e}") from None


def _one(kind: str, v: Any, where: str, max_bytes: int, max_depth: int, json_depth: Callable[[str], int]
         ) -> GuidedSpec:
    """One spec from its client value (see :func:`parse_guided`)."""
    if kind == "json_object":
        if v is not True:
            raise ValueError(f"{where} must be true")
        return GuidedSpec("json_object", "", where)
    if kind in ("json", "structural_tag"):
        if isinstance(v, str):
            v = _load_json(v, where, max_bytes, max_depth, json_depth)
        if not isinstance(v, (dict, bool)) or (kind == "structural_tag" and not isinstance(v, dict)):
            what = "a JSON schema" if kind == "json" else "a structural tag"
            raise ValueError(f"{where} must be {what} (an object), got {type(v).__name__}")
        text = json.dumps(v, separators=(",", ":"), ensure_ascii=False)
        if json_depth(text) > max_depth:
            raise ValueError(f"{where} is nested {json_depth(text)} levels deep; the limit is {max_depth} "
                             f"(max_schema_depth)")
    elif kind == "choice":
        if not isinstance(v, list) or not v or not all(isinstance(s, str) and s for s in v):
            raise ValueError(f"{where} must be a non-empty list of non-empty strings")
        text = json.dumps(v, ensure_ascii=False)
    else:  # regex, grammar
        if not isinstance(v, str) or not v.strip():
            raise ValueError(f"{where} must be a non-empty string")
        text = v
    if _text_bytes(text) > max_bytes:
        raise ValueError(f"{where} is {_text_bytes(text)} bytes; the limit is {max_bytes} (max_grammar_bytes)")
    return GuidedSpec(kind, text, where)


#: compiled once when the vocabulary is prepared (see GrammarCompiler._init)
_WARM_SCHEMA = json.dumps({"type": "object", "properties": {
    "s": {"type": "string"}, "i": {"type": "integer"}, "n": {"type": "number"}, "b": {"type": "boolean"},
    "a": {"type": "array", "items": {"type": "string"}}, "o": {"type": "object"}, "z": {"type": "null"}}})


class GrammarTimeout(ValueError):
    """A grammar took longer than the compile limit (``grammar_compile_timeout_ms``)."""


class _Start(threading.Event):
    """Set when a compile leaves the queue; ``at``: when (``time.monotonic()`` seconds)."""

    at = 0.0


class GrammarCompiler:
    """One process's grammar compiler: the tokenizer's vocabulary for xgrammar, compiled grammars
    cached by spec (least recently used first out).  Thread-safe.

    Args:
        tokenizer: a Hugging Face tokenizer, or a callable returning one (called once, in the
            background thread that prepares the vocabulary).
        vocab_size: rows of the model's logits (>= the tokenizer's length; the extra ids are
            never allowed).
        stop_token_ids: ids that end a request (EOS and the chat end-of-turn markers): a grammar
            allows them once its text is complete, and only then.
        cache_size: compiled grammars kept.
        workers: compiles that may run at once (each on one thread).

    The vocabulary is prepared (``xgrammar.TokenizerInfo``: 1-5 s for 50k-150k tokens, then one
    JSON schema compiled to prepare what all share) in a background thread started by
    :meth:`start`; a compile waits for it.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int], cache_size: int = 256,
                 workers: int = 2):
        self._tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.stop_token_ids = sorted(int(t) for t in stop_token_ids)
        self.cache_size = int(cache_size)
        self._lock = threading.Lock()
        self._cache: "collections.OrderedDict[GuidedSpec, Any]" = collections.OrderedDict()
        #: specs that failed (their message) or ran past a limit: refused again at once
        self._failed: "collections.OrderedDict[GuidedSpec, str]" = collections.OrderedDict()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grammar-compile")
        self._ready = threading.Event()
        self._compiler = None
        self._init_error: Optional[BaseException] = None
        self._started = False
        self._workers = int(workers)
        self._submitted = 0  # compiles queued or running
        self.counters = collections.Counter()

    def start(self) -> "GrammarCompiler":
        """Prepare the vocabulary in a background thread (idempotent); returns self."""
        with self._lock:
            if self._started:
                return self
            self._started = True
        threading.Thread(target=self._init, name="grammar-vocab", daemon=True).start()
        return self

    def _init(self) -> None:
        try:
            import xgrammar as xgr

            tok = self._tokenizer if hasattr(self._tokenizer, "get_vocab") else self._tokenizer()
            t0 = time.perf_counter()
            info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_token_ids)
            compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            # xgrammar's first JSON-schema compile prepares what every later one shares (its
            # string, number and whitespace rules' token masks: 0.5-5 s); do it here, not on a request
            compiler.compile_json_schema(_WARM_SCHEMA, any_whitespace=False)
            self._compiler = compiler
            logger.info("grammar vocabulary of %d tokens ready in %.1f s", self.vocab_size, time.perf_counter() - t0)
        except BaseException as e:  # noqa: BLE001 - reported to every compile
            logger.exception("grammar vocabulary could not be prepared")
            self._init_error = e
        finally:
            self._ready.set()

    def cached(self, spec: GuidedSpec) -> Optional[Any]:
        """The compiled grammar of ``spec`` if in the cache (marked as used), else None."""
        with self._lock:
            cg = self._cache.get(spec)
            if cg is not None:
                self._cache.move_to_end(spec)
            return cg

    def compile(self, spec: GuidedSpec, timeout_s: Optional[float] = None) -> Any:
        """The compiled grammar of ``spec`` (an ``xgrammar.CompiledGrammar``), from the cache or compiled now.

        Args:
            spec: what to compile.
            timeout_s: the most seconds the compile itself may take, counted from its start
                (the wait for the vocabulary is not counted); None: no limit.  A compile past it
                goes on in the background, but its spec is refused from then on.  The wait for a
                free worker behind other compiles is bounded by ``timeout_s`` too; one refused
                for that is refused this time only.

        Raises:
            ValueError: the schema, regex or grammar does not compile (xgrammar's reason), naming
                ``spec.field``; :class:`GrammarTimeout` past ``timeout_s``.
            RuntimeError: the vocabulary could not be prepared.
        """
        cg = self.cached(spec)
        if cg is not None:
            self.counters["hits"] += 1
            return cg
        with self._lock:
            failed = self._failed.get(spec)
        if failed is not None:
            raise (GrammarTimeout if "grammar_compile_timeout_ms" in failed else ValueError)(
                f"{spec.field}: {failed}")
        self.start()
        self._ready.wait()
        if self._init_error is not None:
            raise RuntimeError(f"constrained decoding is unavailable: {self._init_error}")
        with self._lock:
            free = self._submitted < self._workers  # a worker is free: no wait behind others
            self._submitted += 1
        started = _Start()
        fut = self._pool.submit(self._compile_now, spec, started)
        fut.add_done_callback(self._count_done)
        # the wait for a worker is bounded by timeout_s too, unless one was free (a slow thread
        # start on a loaded host is not another grammar's fault)
        if not started.wait(timeout=None if free else timeout_s):
            fut.cancel()
            self.counters["busy"] += 1
            raise GrammarTimeout(f"{spec.field}: the grammar compiler is busy with other new grammars "
                                 f"(grammar_compile_timeout_ms); retry later")
        try:
            return fut.result(timeout=None if timeout_s is None
                              else max(0.0, started.at + timeout_s - time.monotonic()))
        except FutureTimeout:
            msg = (f"the grammar did not compile within {timeout_s * 1000:.0f} ms "
                   f"(grammar_compile_timeout_ms); simplify it")
            self._remember_failure(spec, msg)
            self.counters["timeouts"] += 1
            raise GrammarTimeout(f"{spec.field}: {msg}") from None

    def _count_done(self, _fut: Any) -> None:
        with self._lock:
            self._submitted -= 1

    def _remember_failure(self, spec: GuidedSpec, msg: str) -> None:
        with self._lock:
            self._failed[spec] = msg
            while len(self._failed) > self.cache_size:
                self._failed.popitem(last=False)

    def _compile_now(self, spec: GuidedSpec, started: "_Start") -> Any:
        started.at = time.monotonic()
        started.set()
        cg = self.cached(spec)  # compiled while this one waited for a worker
        if cg is not None:
            return cg
        return self._compile_spec(spec, time.perf_counter())

    def _compile_spec(self, spec: GuidedSpec, t0: float) -> Any:
        c = self._compiler
        try:
            if spec.kind == "json":
                cg = c.compile_json_schema(spec.value, any_whitespace=False, strict_mode=True)
            elif spec.kind == "json_object":
                cg = c.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            elif spec.kind == "regex":
                cg = c.compile_regex(spec.value)
            elif spec.kind == "structural_tag":
                cg = c.compile_structural_tag(spec.value)
            elif spec.kind == "choice":
                choices = json.loads(spec.value)
                cg = c.compile_grammar("root ::= " + " | ".join(_ebnf_literal(s) for s in choices))
            else:
                cg = c.compile_grammar(spec.value)
        except (RuntimeError, ValueError, TypeError) as e:
            what = {"json": "invalid JSON schema", "json_object": "invalid JSON schema", "regex": "invalid regex",
                    "choice": "invalid choice", "grammar": "invalid grammar",
                    "structural_tag": "invalid structural tag"}[spec.kind]
            msg = f"{what}: {_xgrammar_reason(e)}"
            self._remember_failure(spec, msg)
            self.counters["invalid"] += 1
            raise ValueError(f"{spec.field}: {msg}") from None
        dt = time.perf_counter() - t0
        self.counters["compiled"] += 1
        logger.debug("grammar %s (%s) compiled in %.3f s", spec.key, spec.kind, dt)
        with self._lock:
            self._cache[spec] = cg
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return cg


def _ebnf_literal(s: str) -> str:
    """``s`` as a double-quoted EBNF string literal (JSON's escapes, which xgrammar's EBNF reads)."""
    return json.dumps(s, ensure_ascii=False)


def _xgrammar_reason(e: BaseException) -> str:
    """xgrammar's message without its source location prefix (``[time] file.cc:line: ``)."""
    text = str(e).strip()
    if text.startswith("[") and ".cc:" in text:
        text = text.split(": ", 1)[-1] if ": " in text else text
    return text.splitlines()[0] if text else type(e).__name__


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """An int32 ``[rows, ceil(vocab_size / 32)]`` token bitmask (bit set: token allowed), all set."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def allows_any(bitmask: torch.Tensor, row: int, vocab_size: int) -> bool:
    """Whether ``bitmask[row]`` allows any token id below ``vocab_size`` (a look at
    ``ceil(vocab_size / 32)`` int32 words, not at the logits).

    Args:
        bitmask: int32 ``[rows, >= ceil(vocab_size / 32)]`` (bit set: token allowed).
        row: the row to read.
        vocab_size: rows of the model's logits (bits at and past it are ignored).
    """
    full, rest = divmod(int(vocab_size), 32)
    words = bitmask[row]
    if full and bool(words[:full].any()):
        return True
    return bool(rest) and bool(int(words[full]) & ((1 << rest) - 1))


#: bit positions within a bitmask word
_BITS = torch.arange(32, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """Set to -inf, in place, the logits of the tokens ``bitmask`` does not allow, in ``rows``.

    Args:
        logits: float32 ``[B, V]`` (rows may be strided views; each row contiguous).
        bitmask: int32 ``[>= B, ceil(V / 32)]``; row i applies to logits row i.
        rows: the rows to mask (others are left as they are).

    Two ways, per row, by where its allowed tokens lie.  Most of a grammar's states allow a few
    tokens (a key, a number, an enum, punctuation): their bits sit in few of the row's words, and
    the row is filled with -inf and its allowed logits put back (a fill of V floats and a gather
    of the allowed ones).  A state that allows much (inside a string) goes to xgrammar's kernel
    (``apply_token_bitmask_inplace``), which writes only the masked tokens but pays for each
    (about 6 ns a token on a 2-core Xeon: 0.9 ms for a row of Qwen2.5's 151,936 with all but two
    masked, against 0.04 ms filled; ``perf/guided_step.py``).
    """
    if not rows:
        return
    vocab = logits.shape[1]
    n_words = (vocab + 31) // 32
    dense = []
    for r in rows:
        words = bitmask[r, :n_words]
        if 2 * int(torch.count_nonzero(words)) > n_words:  # allowed tokens in over half the words
            dense.append(r)
            continue
        nz = words.nonzero().view(-1)
        ids = (nz.unsqueeze(1) * 32 + _BITS)[((words[nz].unsqueeze(1) >> _BITS) & 1).bool()]
        ids = ids[ids < vocab].long()
        row = logits[r]
        kept = row[ids]
        row.fill_(float("-inf"))
        row[ids] = kept
    if dense:
        import xgrammar as xgr

        xgr.apply_token_bitmask_inplace(logits, bitmask[: logits.shape[0]], vocab_size=vocab, indices=dense)


class RequestGrammar:
    """One request's grammar state on one model: an xgrammar matcher over its output tokens.

    Args:
        compiled: the request's compiled grammar (:meth:`GrammarCompiler.compile`).
        start: index in the model's sequence of the first output token (the prompt's length).
    """

    def __init__(self, compiled: Any, start: int):
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)
        self.start = int(start)
        #: the output tokens the matcher has accepted, in order
        self.accepted: List[int] = []
        #: how many leading ``accepted`` tokens the caller of :meth:`sync` declared settled (they
        #: never leave the output): the next sync compares only the tokens after them
        self.settled = 0

    @property
    def terminated(self) -> bool:
        """The output is complete: a stop token was accepted after a full match."""
        return bool(self.matcher.is_terminated())

    def sync(self, tokens: Sequence[int], begin: int = 0, end: Optional[int] = None,
             tentative: Optional[int] = None) -> None:
        """Make the matcher's accepted tokens equal the output ``tokens[begin:end]`` (in order): roll
        back to the longest common prefix, then accept the rest.

        Args:
            tokens: a sequence holding the output at ``begin:end`` (not copied).
            begin, end: the output's bounds in ``tokens`` (``end`` None: its length).
            tentative: None (default): every accepted token may have changed; the common prefix
                is searched from the first token (O(output)).  An int: of the output after this
                call, all but the last ``tentative`` tokens are settled: they never leave it or
                change (the caller's promise: the subserver passes the request's own unconfirmed
                speculative drafts, the only tokens a sequence ever drops), so the next call
                compares only the tokens after them: a step's sync is O(new and tentative
                tokens), not O(output).

        Raises:
            ValueError: a token the grammar does not allow at its position (the message gives
                the output position); the matcher then holds the tokens before it.
        """
        end = len(tokens) if end is None else end
        acc = self.accepted
        n = min(len(acc), end - begin)
        keep = self.settled
        # the settled prefix is taken as it is (one token checked: a broken promise falls back
        # to the full comparison)
        if keep > n or (keep and acc[keep - 1] != tokens[begin + keep - 1]):
            keep = 0
        while keep < n and acc[keep] == tokens[begin + keep]:
            keep += 1
        self.settled = 0  # until this call succeeds
        if keep < len(acc):
            self.matcher.rollback(len(acc) - keep)
            del acc[keep:]
        for i in range(begin + keep, end):
            t = int(tokens[i])
            if not self.matcher.accept_token(t):
                raise ValueError(f"output token {i - begin} (id {t}) is not allowed by the request's grammar")
            acc.append(t)
        if tentative is not None:
            self.settled = max(0, len(acc) - int(tentative))

    def fill(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write the allowed next tokens into ``bitmask[row]``; False (row left as is) once terminated."""
        if self.matcher.is_terminated():
            return False
        self.matcher.fill_next_token_bitmask(bitmask, row)
        return True

    def fill_after(self, drafts: Sequence[int], bitmask: torch.Tensor) -> int:
        """Masks at each drafted position, for speculative verification: row j of ``bitmask`` gets
        the tokens allowed after the output and ``drafts[:j]`` (j = 0 .. len(drafts)).

        The drafts are accepted one by one and rolled back afterwards (the matcher ends as it began).

        Returns:
            rows filled: ``len(drafts) + 1``, or fewer when a draft is not allowed (the positions
            after it are left as they are: the verifier rejects that draft, as its masked
            probability is 0, and never reads them).
        """
        done = 0
        accepted = 0
        try:
            for j in range(len(drafts) + 1):
                if not self.fill(bitmask, j):
                    break
                done += 1
                if j == len(drafts) or not self.matcher.accept_token(int(drafts[j])):
                    break
                accepted += 1
        finally:
            if accepted:
                self.matcher.rollback(accepted)
        return done


def grammar_of(sampling: Dict[str, Any]) -> Optional[GuidedSpec]:
    """The :class:`GuidedSpec` a PeerReq's sampler dict carries (key ``guided``), or None.

    Raises:
        ValueError: a malformed ``guided`` value.
    """
    g = sampling.get("guided")
    return None if g is None else GuidedSpec.from_wire(g)

