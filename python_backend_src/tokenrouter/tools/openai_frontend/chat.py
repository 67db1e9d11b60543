"""Chat messages into prompt text: the checkpoint's tokenizer and its chat template."""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

from .errors import OpenAIError

__all__ = ["load_tokenizer", "render_chat"]

#: OpenAI roles -> the role the chat template gets
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def load_tokenizer(path: str):
    """A Hugging Face tokenizer from a checkpoint folder (for its chat template).

    Uses ``PreTrainedTokenizerFast`` when the folder has ``tokenizer.json`` (no
    torch import), else ``AutoTokenizer``.

    Raises:
        OSError / ValueError: the folder holds no loadable tokenizer.
    """
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(path)
    from ...engine.cpu import install

    install()  # transformers' model imports load torchvision (a CUDA build here)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _content(where: str, content: Any) -> str:
    """A message's ``content``: a string, or a list of text parts joined.

    Raises:
        OpenAIError: 400 for a non-text part or any other type.
    """
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise OpenAIError(400, f"{where}.content[{j}]: only text parts are supported",
                                  param=f"{where}.content")
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise OpenAIError(400, f"{where}.content must be a string or a list of text parts",
                          param=f"{where}.content")
    return content


def _conversation(messages: Any) -> List[Dict[str, str]]:
    """OpenAI chat ``messages`` as the chat template's ``[{"role", "content"}]`` (content a string).

    Raises:
        OpenAIError: 400 for a malformed message, an unsupported role, tool calls or a non-text part.
    """
    if not isinstance(messages, list) or not messages:
        raise OpenAIError(400, "messages must be a non-empty list", param="messages")
    conv = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise OpenAIError(400, f"{where} must be an object", param=where)
        role = m.get("role")
        if role not in _ROLES:
            raise OpenAIError(400, f"{where}.role {role!r} is not supported (system, developer, user, "
                              "assistant; tools are not supported)", param=f"{where}.role")
        if m.get("tool_calls") or m.get("function_call"):
            raise OpenAIError(400, f"{where}: tool calls are not supported", param=f"{where}.tool_calls")
        conv.append({"role": _ROLES[role], "content": _content(where, m.get("content"))})
    return conv


def render_chat(tokenizer, messages: Any, template_kwargs: Optional[Dict[str, Any]] = None) -> str:
    """Render OpenAI chat ``messages`` into the prompt text with the tokenizer's chat template.

    Args:
        tokenizer: a Hugging Face tokenizer with a ``chat_template``.
        messages: list of ``{"role", "content"}``; roles ``system``, ``developer``
            (rendered as ``system``), ``user``, ``assistant``; content a string or a
            list of ``{"type": "text", "text": …}`` parts (joined).
        template_kwargs: extra variables for the template (e.g. ``enable_thinking``).

    Returns:
        The prompt text ending with the generation prompt (the assistant turn's
        header). When the tokenizer adds a BOS token itself on encoding, a BOS
        the template wrote is removed so the router does not get two.

    Raises:
        OpenAIError: 400 for a malformed message, an unsupported role or content
            part, a tokenizer without a chat template, or a template error.
    """
    conv = _conversation(messages)
    if not getattr(tokenizer, "chat_template", None):
        raise OpenAIError(400, "the model's tokenizer has no chat template; use /v1/completions",
                          param="messages")
    try:
        text = tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=False,
                                             **(template_kwargs or {}))
    except Exception as e:  # noqa: BLE001 - jinja2 TemplateError, raise_exception() in templates
        raise OpenAIError(400, f"chat template: {e}", param="messages") from None
    bos = getattr(tokenizer, "bos_token", None)
    if bos and text.startswith(bos):
        ids = tokenizer.encode("a")
        if ids and ids[0] == tokenizer.bos_token_id:
            text = text[len(bos):]
    return text
