"""Chat messages into prompt text: the checkpoint's tokenizer and its chat template."""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional

from ...engine.detok import load_tokenizer
from .errors import OpenAIError

__all__ = ["load_tokenizer", "render_chat"]

#: OpenAI roles -> the role the chat template gets
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


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


def _tool_calls(where: str, calls: Any) -> List[Dict[str, Any]]:
    """An assistant message's ``tool_calls`` for the chat template: ``arguments`` as an object
    (Qwen2.5's template writes them with ``tojson``), as vLLM passes them.

    Raises:
        OpenAIError: 400 for a call that is not ``{"function": {"name", "arguments": JSON text}}``.
    """
    if not isinstance(calls, list):
        raise OpenAIError(400, f"{where}.tool_calls must be a list", param=f"{where}.tool_calls")
    out = []
    for j, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise OpenAIError(400, f"{where}.tool_calls[{j}] needs function.name", param=f"{where}.tool_calls")
        args = f.get("arguments", "{}")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError as e:
            raise OpenAIError(400, f"{where}.tool_calls[{j}].function.arguments is not JSON: {e}",
                              param=f"{where}.tool_calls") from None
        out.append({"id": c.get("id"), "type": "function", "function": {"name": f["name"], "arguments": args}})
    return out


def _conversation(messages: Any) -> List[Dict[str, Any]]:
    """OpenAI chat ``messages`` as the chat template's ``[{"role", "content"}]`` (content a string;
    an assistant turn's ``tool_calls`` and a tool result's ``tool_call_id`` kept).

    Raises:
        OpenAIError: 400 for a malformed message, an unsupported role, a legacy ``function_call``
            or a non-text part.
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
                              "assistant, tool)", param=f"{where}.role")
        if m.get("function_call"):
            raise OpenAIError(400, f"{where}: function_call is not supported (use tool_calls)",
                              param=f"{where}.function_call")
        content = m.get("content")
        entry: Dict[str, Any] = {"role": _ROLES[role]}
        if role == "assistant" and m.get("tool_calls"):
            entry["content"] = "" if content is None else _content(where, content)
            entry["tool_calls"] = _tool_calls(where, m["tool_calls"])
        else:
            entry["content"] = _content(where, content)
        if role == "tool" and m.get("tool_call_id") is not None:
            entry["tool_call_id"] = str(m["tool_call_id"])
        conv.append(entry)
    return conv


def render_chat(tokenizer, messages: Any, template_kwargs: Optional[Dict[str, Any]] = None,
                tools: Optional[List[Dict[str, Any]]] = None) -> str:
    """Render OpenAI chat ``messages`` into the prompt text with the tokenizer's chat template.

    Args:
        tokenizer: a Hugging Face tokenizer with a ``chat_template``.
        messages: list of ``{"role", "content"}``; roles ``system``, ``developer``
            (rendered as ``system``), ``user``, ``assistant``; content a string or a
            list of ``{"type": "text", "text": …}`` parts (joined).
        template_kwargs: extra variables for the template (e.g. ``enable_thinking``).
        tools: function definitions the template lists (``[{"type": "function", "function":
            {...}}]``; Qwen2.5's asks for ``<tool_call>`` blocks), or None.

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
                                             **({"tools": tools} if tools else {}), **(template_kwargs or {}))
    except Exception as e:  # noqa: BLE001 - jinja2 TemplateError, raise_exception() in templates
        raise OpenAIError(400, f"chat template: {e}", param="messages") from None
    bos = getattr(tokenizer, "bos_token", None)
    if bos and text.startswith(bos):
        ids = tokenizer.encode("a")
        if ids and ids[0] == tokenizer.bos_token_id:
            text = text[len(bos):]
    return text
