"""Tools and tool calls in a chat: validated into the shape chat templates read, and, for a template
without a tool section, written into the messages as text.

A template reads ``tools`` as ``[{"type": "function", "function": {"name", "description",
"parameters"}}]`` and an assistant's calls as ``message.tool_calls = [{"id", "type": "function",
"function": {"name", "arguments"}}]``, arguments and parameters as JSON objects (not their text).
"""
from __future__ import annotations

import json
from typing import Any, Optional

from .errors import InvalidRequest

MAX_TOOLS = 128
MAX_TOOL_CALLS = 64
MAX_NAME_CHARS = 256
MAX_JSON_CHARS = 1 << 16

TOOLS_PREAMBLE = ("You may call functions to answer. To call one, answer with its name and arguments as JSON "
                  "inside tags:\n<tool_call>\n{\"name\": \"...\", \"arguments\": {...}}\n</tool_call>\n"
                  "The functions, with the JSON schemas of their arguments:\n<tools>\n")


def validate_tools(tools: Any) -> Optional[list[dict]]:
    """``tools`` in the template's shape; each given as ``{"name", "description", "parameters"}`` (the
    wire's, parameters as a JSON text or object) or as OpenAI's ``{"type": "function", "function": {...}}``."""
    if tools is None or tools == [] or tools == ():
        return None
    if not isinstance(tools, (list, tuple)) or len(tools) > MAX_TOOLS:
        raise InvalidRequest(f"tools must be a list of at most {MAX_TOOLS} functions")
    out = []
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) and "function" in t else t
        if not isinstance(f, dict):
            raise InvalidRequest(f"tools[{i}] must be an object with a name")
        params = _json_object(f.get("parameters", {"type": "object", "properties": {}}), f"tools[{i}].parameters")
        desc = f.get("description") or ""
        entry = {"name": bounded_str(f.get("name"), f"tools[{i}].name"),
                 "description": bounded_str(desc, f"tools[{i}].description", MAX_JSON_CHARS, empty=True),
                 "parameters": params}
        out.append({"type": "function", "function": entry})
    return out


def tool_calls(calls: Any, i: int) -> list[dict]:
    """An assistant message's calls in the template's shape (messages[i])."""
    if not isinstance(calls, (list, tuple)) or len(calls) > MAX_TOOL_CALLS:
        raise InvalidRequest(f"messages[{i}].tool_calls must be a list of at most {MAX_TOOL_CALLS} calls")
    out = []
    for j, c in enumerate(calls):
        where = f"messages[{i}].tool_calls[{j}]"
        f = c.get("function") if isinstance(c, dict) and "function" in c else c
        if not isinstance(f, dict):
            raise InvalidRequest(f"{where} must be an object with a name and arguments")
        call = {"type": "function", "function": {"name": bounded_str(f.get("name"), f"{where}.name"),
                                                 "arguments": _json_object(f.get("arguments", {}), f"{where}.arguments")}}
        if isinstance(c, dict) and c.get("id") is not None:
            call["id"] = bounded_str(c["id"], f"{where}.id")
        out.append(call)
    return out


def tools_in_text(messages: list[dict], tools: Optional[list[dict]]) -> list[dict]:
    """The messages for a template without a tool section: the tools described in the system message
    (added first when there is none), each call written as ``<tool_call>`` JSON after its message's
    content. Everything the tools add is message content, so it stays text."""
    out = []
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None)
        if calls:
            written = "\n".join(_call_text(c["function"]) for c in calls)
            m["content"] = f"{m['content']}\n{written}" if m["content"] else written
        out.append(m)
    if tools:
        described = TOOLS_PREAMBLE + "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools) + "\n</tools>"
        if out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{described}" if out[0]["content"] else described}
        else:
            out.insert(0, {"role": "system", "content": described})
    return out


def _call_text(function: dict) -> str:
    body = json.dumps({"name": function["name"], "arguments": function["arguments"]}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def _json_object(value: Any, where: str) -> dict:
    """A JSON object given as one or as its text."""
    if isinstance(value, str):
        if len(value) > MAX_JSON_CHARS:
            raise InvalidRequest(f"{where} is longer than {MAX_JSON_CHARS} characters")
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            raise InvalidRequest(f"{where} must be a JSON object (or its text)") from None
    if not isinstance(value, dict):
        raise InvalidRequest(f"{where} must be a JSON object")
    return value


def bounded_str(value: Any, where: str, limit: int = MAX_NAME_CHARS, empty: bool = False) -> str:
    if not isinstance(value, str) or len(value) > limit or (not value and not empty):
        raise InvalidRequest(f"{where} must be a {'' if empty else 'non-empty '}string of at most {limit} characters")
    return value
