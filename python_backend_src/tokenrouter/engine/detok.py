"""Incremental detokenisation with stop strings.

Text is produced with ``tokenizers``' ``DecodeStream``, which buffers tokens
until they form complete UTF-8 characters, so a streamed chunk never splits a
character and never drops the space a byte-level BPE token carries.  With stop
strings, text that could still turn into a stop string is held back until it
cannot (the output is cut before the first stop string, as in vLLM).
"""

from __future__ import annotations

import functools
import os
import re
from typing import Dict, List, Optional, Sequence

from tokenizers.decoders import DecodeStream

__all__ = ["IncrementalDetokenizer", "TokenStrings", "stop_token_ids", "load_tokenizer"]


def load_tokenizer(path: str):
    """A Hugging Face tokenizer from a checkpoint folder (its chat template, a grammar's vocabulary).

    Uses ``PreTrainedTokenizerFast`` when the folder has ``tokenizer.json``, else ``AutoTokenizer``.
    The first imports a small part of transformers (about 1 s against AutoTokenizer's 4 s after
    torch: the model-side modules, torch._dynamo among them, stay out); on SmolLM2's and
    Qwen2.5-Coder's folders it encodes, decodes, renders the chat template (tools included) and
    names special tokens exactly as AutoTokenizer does (tests/test_engine.py).

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


@functools.lru_cache(maxsize=1)
def _byte_level_table() -> Dict[str, int]:
    """Byte-level BPE's alphabet: the character that stands for each byte (GPT-2's ``bytes_to_unicode``),
    inverted: character -> byte value."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + \
        list(range(ord("\xae"), ord("\xff") + 1))
    cs = list(bs)
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenStrings:
    """Each token id's own text and bytes: the ``decoded_token`` of vllm_backend's ``logprobs``
    output, the ``token`` and ``bytes`` of OpenAI's logprobs.

    Args:
        tokenizer: a Hugging Face tokenizer.
        cache_size: token ids whose strings are kept (an LRU cache per method).

    ``text(id)`` is the token decoded alone (``tokenizer.decode([id])``, special tokens kept), as vLLM
    reports it: a token that holds part of a UTF-8 character shows as U+FFFD there.  ``bytes(id)`` is
    the token's exact bytes (a tuple of ints in 0 … 255), so that a client can join a character split
    over tokens: byte-level
    BPE tokenizers (GPT-2's scheme: Qwen2.5, SmolLM2, Llama 3) map the token's string back through
    their byte alphabet; added (special) tokens give their content's UTF-8; other tokenizers the
    UTF-8 of ``text(id)`` (a SentencePiece byte token ``<0xNN>`` its byte).  An id the tokenizer
    does not know (a padded vocabulary row) is ``""`` and ``[]``.
    """

    def __init__(self, tokenizer, cache_size: int = 65536):
        self._tok = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None)
        self._byte_level = type(decoder).__name__ == "ByteLevel"
        self._added = {int(i): t.content for i, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()}
        self.text = functools.lru_cache(maxsize=cache_size)(self._text)
        self.bytes = functools.lru_cache(maxsize=cache_size)(self._bytes)

    def _piece(self, token_id: int) -> Optional[str]:
        try:
            return self._tok.convert_ids_to_tokens(int(token_id))
        except (IndexError, OverflowError, TypeError, ValueError):
            return None

    def _text(self, token_id: int) -> str:
        if self._piece(token_id) is None:
            return ""
        return self._tok.decode([int(token_id)], skip_special_tokens=False)

    def _bytes(self, token_id: int) -> tuple:
        token_id = int(token_id)
        if token_id in self._added:
            return tuple(self._added[token_id].encode("utf-8"))
        piece = self._piece(token_id)
        if piece is None:
            return ()
        if self._byte_level:
            table = _byte_level_table()
            if all(c in table for c in piece):
                return tuple(table[c] for c in piece)
        m = _BYTE_TOKEN.fullmatch(piece)
        if m:
            return (int(m.group(1), 16),)
        return tuple(self._text(token_id).encode("utf-8"))
