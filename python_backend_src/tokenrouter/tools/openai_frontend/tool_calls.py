"""Tool calls in a completion's text: Qwen2.5's (Hermes) ``<tool_call>`` blocks into OpenAI ``tool_calls``.

The chat template tells the model to answer a tool call as::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

:func:`parse_tool_calls` splits a whole completion into its content (the text before the first
block) and its calls; :class:`ToolCallStream` does the same on streamed text deltas, the way
vLLM's Hermes parser streams them: content deltas until a ``<tool_call>`` tag, then per call
one delta with its ``index``, ``id``, ``type`` and ``function.name`` (``arguments`` empty),
then deltas of ``function.arguments`` text.  The arguments are the model's own JSON text (not
re-serialised), so streamed and whole answers carry the same string.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Dict, List, Optional, Tuple

__all__ = ["parse_tool_calls", "ToolCallStream", "TOOL_CALL_START", "TOOL_CALL_END"]

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
_BLOCK = re.compile(re.escape(TOOL_CALL_START) + r"(.*?)(?:" + re.escape(TOOL_CALL_END) + r"|$)", re.S)
_HEAD = re.compile(r'^\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*', re.S)


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _arguments_text(body: str, obj: Dict[str, Any]) -> str:
    """The ``arguments`` of one parsed call as the model wrote them (its JSON text), when the call
    is ``{"name": ..., "arguments": ...}`` in that order; else re-serialised."""
    m = _HEAD.match(body)
    if m:
        rest = body[m.end():].rstrip()
        if rest.endswith("}"):
            raw = rest[:-1].rstrip()
            try:
                if json.loads(raw) == obj.get("arguments"):
                    return raw
            except json.JSONDecodeError:
                pass
    return json.dumps(obj.get("arguments", obj.get("parameters", {})), ensure_ascii=False)


def parse_tool_calls(text: str) -> Tuple[Optional[str], List[Dict[str, Any]]]:
    """Split a completion into content and tool calls.

    Args:
        text: the whole completion.

    Returns:
        ``(content, calls)``: ``content`` is the text before the first ``<tool_call>`` (None
        when empty or blank); ``calls`` are OpenAI tool calls ``{"id", "type": "function",
        "function": {"name", "arguments"}}`` (``arguments`` a JSON string).  A block that is not
        a JSON object with a string ``name`` makes the whole text content and no call (the model
        did not call a tool properly).
    """
    start = text.find(TOOL_CALL_START)
    if start < 0:
        return (text if text.strip() else None), []
    calls = []
    for m in _BLOCK.finditer(text, start):
        body = m.group(1).strip()
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            return text, []
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return text, []
        calls.append({"id": _call_id(), "type": "function",
                      "function": {"name": obj["name"], "arguments": _arguments_text(body, obj)}})
    content = text[:start]
    return (content if content.strip() else None), calls


class ToolCallStream:
    """Streamed text deltas of a completion into OpenAI chat deltas (content or tool calls).

    :meth:`feed` takes each text delta and returns the deltas to send (each a dict for a chunk's
    ``delta``: ``{"content": ...}`` or ``{"tool_calls": [...]}``); :meth:`finish` flushes what
    was held back at the end.  :attr:`calls` counts the calls seen (``finish_reason`` is
    ``tool_calls`` when there were any).
    """

    def __init__(self):
        self._buf = ""  # text not yet sent
        self._in_call = False
        self._named = False  # the current call's name was sent
        self._args_sent = 0  # characters of the current call's arguments sent
        self.calls = 0
        self._args_start = 0

    def feed(self, text: str) -> List[Dict[str, Any]]:
        """Deltas for one more piece of text (possibly none: text that may be the start of a tag
        or of a call's end is held back)."""
        self._buf += text
        out: List[Dict[str, Any]] = []
        while True:
            if not self._in_call:
                i = self._buf.find(TOOL_CALL_START)
                if i < 0:
                    keep = _partial_suffix(self._buf, TOOL_CALL_START)
                    self._content(out, self._buf[:len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    return out
                self._content(out, self._buf[:i])
                self._buf = self._buf[i + len(TOOL_CALL_START):]
                self._in_call, self._named, self._args_sent = True, False, 0
                continue
            end = self._buf.find(TOOL_CALL_END)
            body = self._buf if end < 0 else self._buf[:end]
            if not self._named:
                m = _HEAD.match(body)
                if m is None:
                    if end < 0:
                        return out
                    self._whole_call(out, body)  # not the usual shape: parse it whole
                else:
                    name = json.loads(m.group(1))
                    out.append({"tool_calls": [{"index": self.calls, "id": _call_id(), "type": "function",
                                                "function": {"name": name, "arguments": ""}}]})
                    self._named = True
                    self._args_start = m.end()
            if self._named:
                args = body[self._args_start:].lstrip()
                if end < 0:  # hold back from the last "}" (maybe the call's own) and a partial end tag
                    cut = args.rfind("}")
                    safe = len(args) - _partial_suffix(args, TOOL_CALL_END)
                    if cut >= 0 and TOOL_CALL_END.startswith(args[cut + 1:].lstrip()):
                        safe = min(safe, cut)
                    final = args[:safe]
                else:
                    final = args.rstrip()
                    final = final[:-1].rstrip() if final.endswith("}") else final
                if len(final) > self._args_sent:
                    out.append({"tool_calls": [{"index": self.calls,
                                                "function": {"arguments": final[self._args_sent:]}}]})
                    self._args_sent = len(final)
            if end < 0:
                return out
            self._buf = self._buf[end + len(TOOL_CALL_END):]
            self._in_call = False
            self.calls += 1

    def finish(self) -> List[Dict[str, Any]]:
        """Deltas for what was held back when the text ends."""
        if self._in_call:
            out = self.feed(TOOL_CALL_END)  # an unclosed call (the budget ran out) ends with the text
            self._in_call = False
            return out
        out: List[Dict[str, Any]] = []
        if self.calls == 0:
            self._content(out, self._buf)
        self._buf = ""
        return out

    def _content(self, out: List[Dict[str, Any]], text: str) -> None:
        if text and self.calls == 0:
            out.append({"content": text})

    def _whole_call(self, out: List[Dict[str, Any]], body: str) -> None:
        """A complete call not in the ``{"name", "arguments"}`` order; dropped if it is no call."""
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            obj = None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            self.calls -= 1  # not a call: the caller's count goes back
            return
        out.append({"tool_calls": [{"index": self.calls, "id": _call_id(), "type": "function",
                                    "function": {"name": obj["name"], "arguments": _arguments_text(body, obj)}}]})
        self._named = False


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of ``tag`` (held back)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
