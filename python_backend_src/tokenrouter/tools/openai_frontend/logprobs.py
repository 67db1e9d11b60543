"""Logprobs in OpenAI's shapes: the request fields checked, and the router's per-token logprobs
(vllm_backend's ``logprobs`` output) turned into a choice's ``logprobs`` object.

* Chat completions: ``logprobs: true`` with ``top_logprobs`` N in 0 … 20 gives ``choices[].logprobs =
  {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ...]}],
  "refusal": null}``: one entry per output token, its ``top_logprobs`` exactly the N most likely
  tokens, most likely first.
* Completions (legacy): ``logprobs`` N in 0 … 5 gives ``choices[].logprobs = {"tokens",
  "token_logprobs", "top_logprobs", "text_offset"}``: per output token its text, its logprob, a
  dict ``{token text: logprob}`` of the token and the N most likely (N or N + 1 entries, as
  OpenAI documents), and the offset of its text in the completion (characters).

Every value comes from the router: natural-log probabilities under the raw distribution of the
model that wrote each token (``docs/api.md``).  A streamed response carries the logprobs of the
tokens that reached the router since the previous one, so each chunk has those of its tokens
(text held back for a stop string or a split character comes with a later chunk).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from tokenizers.decoders import DecodeStream

from ...engine.detok import TokenStrings
from ...protocol import MAX_TOP_LOGPROBS as _ROUTER_MAX
from .errors import OpenAIError

__all__ = ["MAX_TOP_LOGPROBS", "MAX_COMPLETION_LOGPROBS", "chat_top_logprobs", "completion_logprobs",
           "RouterTokenLogprob", "parse_router_logprobs", "LogprobsFormatter"]

#: the most ``top_logprobs`` of a chat completion (OpenAI's bound; the router's own)
MAX_TOP_LOGPROBS = _ROUTER_MAX
#: the most ``logprobs`` of a legacy completion (OpenAI's bound)
MAX_COMPLETION_LOGPROBS = 5
#: OpenAI's stand-in for a logprob of -inf (JSON has no infinity), as vLLM sends it
_FLOOR = -9999.0


def _count(value: Any, field_name: str, hi: int) -> int:
    """``value`` as an integer in [0, ``hi``] (booleans refused); 400 naming ``field_name``."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= hi:
        raise OpenAIError(400, f"{field_name} must be an integer between 0 and {hi}, got {value!r}",
                          param=field_name, code="invalid_value")
    return value


def chat_top_logprobs(logprobs: Any, top_logprobs: Any) -> Optional[int]:
    """A chat request's ``logprobs`` / ``top_logprobs``: the N alternatives per token, or None (off).

    Raises:
        OpenAIError: 400 naming ``logprobs`` (not a boolean) or ``top_logprobs`` (not an integer in
            0 … 20, or > 0 without ``logprobs: true``, as vLLM refuses it).
    """
    if logprobs is not None and not isinstance(logprobs, bool):
        raise OpenAIError(400, f"logprobs must be a boolean, got {logprobs!r}", param="logprobs",
                          code="invalid_value")
    n = None if top_logprobs is None else _count(top_logprobs, "top_logprobs", MAX_TOP_LOGPROBS)
    if not logprobs:
        if n:
            raise OpenAIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs",
                              code="invalid_value")
        return None
    return n or 0


def completion_logprobs(logprobs: Any) -> Optional[int]:
    """A legacy completion's ``logprobs``: N in 0 … 5, or None (off).

    Raises:
        OpenAIError: 400 naming ``logprobs``.
    """
    return None if logprobs is None else _count(logprobs, "logprobs", MAX_COMPLETION_LOGPROBS)


@dataclass(frozen=True)
class RouterTokenLogprob:
    """One output token's logprobs as the router sends them.

    Attributes:
        token_id: the token.
        logprob: its logprob (natural log).
        alternatives: ``(id, logprob)`` of the token and its top N in the router's order (the token
            first, then the top N most likely first, the token not repeated).
    """

    token_id: int
    logprob: float
    alternatives: Tuple[Tuple[int, float], ...]

    def top(self, n: int) -> List[Tuple[int, float]]:
        """The ``n`` most likely tokens, most likely first (``(id, logprob)``)."""
        return sorted(self.alternatives, key=lambda a: -a[1])[:n]


def parse_router_logprobs(entries: Optional[List[Any]]) -> List[Optional[RouterTokenLogprob]]:
    """The router's ``logprobs`` output (decoded JSON: per token ``{"<id>": {"logprob", "rank",
    "decoded_token"}, ...}``, its first key the token itself) as :class:`RouterTokenLogprob`s; a
    ``null`` entry stays None."""
    out: List[Optional[RouterTokenLogprob]] = []
    for d in entries or []:
        if not d:
            out.append(None)
            continue
        alts = tuple((int(k), float(v["logprob"])) for k, v in d.items())
        out.append(RouterTokenLogprob(alts[0][0], alts[0][1], alts))
    return out


@dataclass
class LogprobsFormatter:
    """Turns one request's router logprobs into its choice's ``logprobs`` object, chunk by chunk.

    Args:
        chat: a chat completion (``content`` entries) or a legacy completion (``tokens`` ...).
        n: the alternatives asked for (``top_logprobs`` / ``logprobs``).
        tokenizer: the model's tokenizer (token text, bytes, and text offsets).

    One formatter per request: a legacy completion's ``text_offset`` runs on across the chunks
    of a stream.
    """

    chat: bool
    n: int
    tokenizer: Any
    _strings: Optional[TokenStrings] = field(default=None, init=False, repr=False)
    _stream: Optional[DecodeStream] = field(default=None, init=False, repr=False)
    _offset: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self._strings = TokenStrings(self.tokenizer)
        self._stream = DecodeStream(skip_special_tokens=True)  # as the router's text

    def _token(self, tid: int) -> str:
        return self._strings.text(tid)

    def _bytes(self, tid: int) -> List[int]:
        return list(self._strings.bytes(tid))

    def format(self, entries: List[Optional[RouterTokenLogprob]]) -> Optional[Dict[str, Any]]:
        """The ``logprobs`` object of these tokens (the next ones of the request's output), or None
        when there are none."""
        if not entries:
            return None
        return self._chat(entries) if self.chat else self._completion(entries)

    def format_empty(self) -> Dict[str, Any]:
        """The ``logprobs`` object of no tokens (a whole response whose router sent none)."""
        return self._chat([]) if self.chat else self._completion([])

    def _chat(self, entries: List[Optional[RouterTokenLogprob]]) -> Dict[str, Any]:
        content = []
        for e in entries:
            if e is None:
                continue
            content.append({"token": self._token(e.token_id), "logprob": max(e.logprob, _FLOOR),
                            "bytes": self._bytes(e.token_id),
                            "top_logprobs": [{"token": self._token(i), "logprob": max(v, _FLOOR),
                                              "bytes": self._bytes(i)} for i, v in e.top(self.n)]})
        return {"content": content, "refusal": None}

    def _completion(self, entries: List[Optional[RouterTokenLogprob]]) -> Dict[str, Any]:
        tokens: List[str] = []
        token_logprobs: List[Optional[float]] = []
        top: List[Optional[Dict[str, float]]] = []
        offsets: List[int] = []
        tk = self.tokenizer._tokenizer
        for e in entries:
            if e is None:
                continue
            offsets.append(self._offset)
            piece = self._stream.step(tk, e.token_id)
            self._offset += len(piece or "")
            tokens.append(self._token(e.token_id))
            token_logprobs.append(max(e.logprob, _FLOOR))
            # the token and its top N, as OpenAI's legacy API (up to N + 1 entries)
            d: Dict[str, float] = {}
            for i, v in [(e.token_id, e.logprob)] + e.top(self.n):
                d.setdefault(self._token(i), max(v, _FLOOR))  # two ids of one text: the first
            top.append(d)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}
