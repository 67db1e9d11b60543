"""Structured output requests: ``response_format``, ``tools`` and ``tool_choice`` into guided decoding.

* ``response_format`` ``{"type": "json_object"}`` asks for any JSON object, ``{"type":
  "json_schema", "json_schema": {"name", "schema", "strict"}}`` for JSON valid against the schema
  (always enforced, strict or not): both become ``sampling_parameters.guided_decoding``, which
  both models obey across every handoff (:mod:`tokenrouter.engine.grammar`).
* ``tools`` are rendered by the chat template (Qwen2.5's lists them and asks for ``<tool_call>``
  blocks); ``tool_choice`` ``auto`` (the default with tools) leaves the model free and parses the
  blocks it writes, ``required`` forces one call of some tool and a named function one call of
  that function (an xgrammar structural tag: ``<tool_call>\\n``, a JSON object ``{"name",
  "arguments"}`` valid against the function's ``parameters``, ``\\n</tool_call>``), ``none``
  renders no tools and parses nothing.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from .errors import OpenAIError
from .tool_calls import TOOL_CALL_END, TOOL_CALL_START

__all__ = ["Structured", "structured_request", "guided_error_param"]

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass(frozen=True)
class Structured:
    """What a chat request's structured-output fields ask for.

    Attributes:
        guided: the ``guided_decoding`` object for ``sampling_parameters``, or None.
        tools: the function definitions for the chat template (``[{"type": "function",
            "function": {...}}]``), or None.
        parse_tools: parse ``<tool_call>`` blocks of the output into ``tool_calls``.
        field: the request field the guided decoding came from (``response_format`` or
            ``tool_choice``), named in a grammar error.
    """

    guided: Optional[Dict[str, Any]] = None
    tools: Optional[List[Dict[str, Any]]] = None
    parse_tools: bool = False
    field: Optional[str] = None


def _response_format(rf: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """``response_format`` as a ``guided_decoding`` object (None for text)."""
    if rf is None:
        return None
    kind = rf.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind != "json_schema":
        raise OpenAIError(400, f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                          param="response_format", code="invalid_value")
    js = rf.get("json_schema")
    if not isinstance(js, dict) or not isinstance(js.get("name"), str) or not _NAME.match(js["name"]):
        raise OpenAIError(400, "response_format.json_schema needs a name (letters, digits, _ and -, at most 64)",
                          param="response_format", code="invalid_value")
    schema = js.get("schema", {"type": "object"})
    if not isinstance(schema, (dict, bool)):
        raise OpenAIError(400, "response_format.json_schema.schema must be a JSON schema (an object)",
                          param="response_format", code="invalid_value")
    # as JSON text: sampling_parameters' depth limit is for its own keys, not the schema's
    return {"json": json.dumps(schema, ensure_ascii=False)}


def _functions(tools: Any) -> List[Dict[str, Any]]:
    """The ``function`` objects of ``tools``, checked."""
    if not isinstance(tools, list) or not tools:
        raise OpenAIError(400, "tools must be a non-empty list", param="tools", code="invalid_value")
    out = []
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not _NAME.match(f["name"]):
            raise OpenAIError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}} "
                              "with a name of letters, digits, _ and - (at most 64)", param=f"tools[{i}]",
                              code="invalid_value")
        params = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise OpenAIError(400, f"tools[{i}].function.parameters must be a JSON schema (an object)",
                              param=f"tools[{i}].function.parameters", code="invalid_value")
        out.append({**f, "parameters": params})
    names = [f["name"] for f in out]
    if len(set(names)) != len(names):
        raise OpenAIError(400, "tools has two functions of the same name", param="tools", code="invalid_value")
    return out


def _call_tag(functions: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The ``guided_decoding`` object forcing one ``<tool_call>`` block of one of ``functions``."""
    calls = [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
              "required": ["name", "arguments"], "additionalProperties": False} for f in functions]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    tag = {"type": "structural_tag", "format": {"type": "tag", "begin": TOOL_CALL_START + "\n",
                                                 "content": {"type": "json_schema", "json_schema": schema},
                                                 "end": "\n" + TOOL_CALL_END}}
    return {"structural_tag": json.dumps(tag, ensure_ascii=False)}


def structured_request(response_format: Optional[Dict[str, Any]], tools: Any, tool_choice: Any) -> Structured:
    """Check a chat request's ``response_format``, ``tools`` and ``tool_choice``.

    Returns:
        :class:`Structured`.

    Raises:
        OpenAIError: 400 naming the field: an unknown ``response_format`` type, a
            ``json_schema`` without name or with a schema that is not an object, malformed
            ``tools``, a ``tool_choice`` without ``tools`` or naming no function of them, or a
            forced tool call together with a JSON ``response_format``.
    """
    guided = _response_format(response_format)
    if not tools:
        if tool_choice not in (None, "none"):
            raise OpenAIError(400, "tool_choice is only allowed when tools are given", param="tool_choice",
                              code="invalid_value")
        return Structured(guided=guided, field="response_format" if guided else None)
    functions = _functions(tools)
    rendered = [{"type": "function", "function": f} for f in functions]
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return Structured(guided=guided, field="response_format" if guided else None)
    if choice == "auto":
        return Structured(guided=guided, tools=rendered, parse_tools=guided is None,
                          field="response_format" if guided else None)
    if choice == "required":
        forced = functions
    elif isinstance(choice, dict) and choice.get("type") == "function" and \
            isinstance(choice.get("function"), dict) and isinstance(choice["function"].get("name"), str):
        forced = [f for f in functions if f["name"] == choice["function"]["name"]]
        if not forced:
            raise OpenAIError(400, f"tool_choice names {choice['function']['name']!r}, which is not in tools",
                              param="tool_choice", code="invalid_value")
    else:
        raise OpenAIError(400, "tool_choice must be none, auto, required or {\"type\": \"function\", "
                          "\"function\": {\"name\": ...}}", param="tool_choice", code="invalid_value")
    if guided is not None:
        raise OpenAIError(400, "a JSON response_format cannot be combined with a forced tool call",
                          param="response_format", code="invalid_value")
    return Structured(guided=_call_tag(forced), tools=rendered, parse_tools=True, field="tool_choice")


def guided_error_param(message: str, structured: Structured) -> Optional[str]:
    """The request field to name in a 400 about the guided decoding (the router's message names
    ``guided_decoding``, the field this front end filled), or None when the message is not about it."""
    if "guided_decoding" not in message or structured.guided is None:
        return None
    if structured.field == "tool_choice":
        return "tools"
    return structured.field
