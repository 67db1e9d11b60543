"""Incremental detokenisation with stop strings.

Text is produced with ``tokenizers``' ``DecodeStream``, which buffers tokens
until they form complete UTF-8 characters, so a streamed chunk never splits a
character and never drops the space a byte-level BPE token carries.  With stop
strings, text that could still turn into a stop string is held back until it
cannot (the output is cut before the first stop string, as in vLLM).
"""

from __future__ import annotations

import os
from typing import List, Sequence

from tokenizers.decoders import DecodeStream

__all__ = ["IncrementalDetokenizer", "stop_token_ids", "load_tokenizer"]


def load_tokenizer(path: str):
    """A Hugging Face tokenizer from a checkpoint folder (its chat template, a grammar's vocabulary).

    Uses ``PreTrainedTokenizerFast`` when the folder has ``tokenizer.json`` (no
    torch import), else ``AutoTokenizer``.

    Raises:
        OSError / ValueError: the folder holds no loadable tokenizer.
    """
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(path)
    from .cpu import install

    install()  # transformers' model imports load torchvision (a CUDA build here)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def stop_token_ids(tokenizer) -> List[int]:
    """EOS and chat end-of-turn token ids of ``tokenizer`` (they end a request)."""
    ids = {tokenizer.eos_token_id}
    for tok in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<|end|>"):
        tid = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id:
            ids.add(tid)
    return sorted(i for i in ids if i is not None)


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
