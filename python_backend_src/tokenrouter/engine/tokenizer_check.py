"""Whether two models can be routed between: the same token ids must mean the same text.

Token-level routing hands token ids from one model to the other (a PeerReq carries ids, not
text), so every model of a deployment must share one tokenizer.
"""

from __future__ import annotations

import os
from typing import Optional

__all__ = ["tokenizer_difference"]


def tokenizer_difference(a: "str | os.PathLike", b: "str | os.PathLike") -> Optional[str]:
    """How the tokenizers of checkpoint folders ``a`` and ``b`` differ, or None when they are the same.

    Token routing hands token ids from one model to the other, so both must map every id to the
    same text: compared are the vocabularies (every token and its id, added tokens included)
    and the end-of-sequence token. The first difference found is named.

    Args:
        a, b: checkpoint folders holding a Hugging Face tokenizer.

    Returns:
        None when the tokenizers agree, else one sentence naming the first difference
        (the sizes of the vocabularies, a token whose id differs, or the end-of-sequence tokens).

    Raises:
        OSError: a folder holds no loadable tokenizer.
    """
    from transformers import AutoTokenizer

    na, nb = os.path.basename(os.fspath(a).rstrip("/")), os.path.basename(os.fspath(b).rstrip("/"))
    ta, tb = AutoTokenizer.from_pretrained(os.fspath(a)), AutoTokenizer.from_pretrained(os.fspath(b))
    va, vb = ta.get_vocab(), tb.get_vocab()
    if len(va) != len(vb):
        return f"vocabulary sizes differ: {na} has {len(va)} tokens, {nb} {len(vb)}"
    for token, i in va.items():
        if vb.get(token) != i:
            return f"token {token!r} is id {i} in {na} but {vb.get(token)} in {nb}"
    if ta.eos_token != tb.eos_token:
        return f"end-of-sequence tokens differ: {ta.eos_token!r} in {na}, {tb.eos_token!r} in {nb}"
    return None
