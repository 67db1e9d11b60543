"""Incremental detokenisation with stop strings.

Text is produced with ``tokenizers``' ``DecodeStream``, which buffers tokens
until they form complete UTF-8 characters, so a streamed chunk never splits a
character and never drops the space a byte-level BPE token carries.  With stop
strings, text that could still turn into a stop string is held back until it
cannot (the output is cut before the first stop string, as in vLLM).
"""

from __future__ import annotations

from typing import Sequence

from tokenizers.decoders import DecodeStream

__all__ = ["IncrementalDetokenizer"]


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas.

    Args:
        tokenizer: a Hugging Face fast tokenizer (its ``_tokenizer`` backend is used).
        stop: stop strings (may be empty).
        include_stop_str: keep the matched stop string at the end of the text (vLLM's
            ``include_stop_str_in_output``).
        skip_special_tokens: leave special tokens (EOS, chat markers) out of the text.

    Attributes:
        text: all text released so far (without the stop string).
        stopped: True once a stop string was seen.
    """

    def __init__(self, tokenizer, stop: Sequence[str] = (), include_stop_str: bool = False,
                 skip_special_tokens: bool = True):
        self._tk = tokenizer._tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._include_stop = include_stop_str
        self._stop = [s for s in stop if s]
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._pending = ""  # decoded but not yet released
        self.text = ""
        self.stopped = False

    def add(self, token_ids: Sequence[int]) -> str:
        """Feed tokens; return the text that can be released now (maybe "")."""
        if self.stopped:
            return ""
        for t in token_ids:
            piece = self._stream.step(self._tk, int(t))
            if piece:
                self._pending += piece
        if not self._stop:
            out, self._pending = self._pending, ""
            self.text += out
            return out
        hits = [(i, len(s)) for i, s in ((self._pending.find(s), s) for s in self._stop) if i >= 0]
        if hits:
            cut, n = min(hits)
            out = self._pending[:cut + n] if self._include_stop else self._pending[:cut]
            self._pending = ""
            self.stopped = True
            self.text += out
            return out
        keep = self._hold
        out = self._pending[:-keep] if keep and len(self._pending) > keep else ("" if keep else self._pending)
        self._pending = self._pending[len(out):]
        self.text += out
        return out

    def flush(self) -> str:
        """Release whatever is held back (end of generation)."""
        if self.stopped:
            return ""
        out, self._pending = self._pending, ""
        self.text += out
        return out
