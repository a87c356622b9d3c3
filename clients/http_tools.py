"""Tool calling and structured output at the HTTP edge, for the OpenAI and Ollama dialects alike.

In: the tools a request offers and the calls earlier answers made become the wire's ``tools`` and
messages (llmd.protocol); ``tool_choice`` "required" or a named function, ``response_format`` and
Ollama's ``format`` become a grammar that the daemon's sampler enforces token by token.

Out: calls are read from the model's text, in either of the two forms chat models write them:
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes-style, Qwen2.5), or the
whole answer as one JSON object ``{"name": ..., "parameters": {...}}`` (Llama 3.x). Only calls to
offered functions count; anything else stays text. ``ToolStream`` does the same while streaming,
holding back only text that may still turn out to be a call. Pure Python, no torch.
"""
from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any, Optional

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class Call:
    name: str
    arguments: dict
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))

    def openai(self, index: Optional[int] = None) -> dict:
        out = {"id": self.id, "type": "function",
               "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)}}
        return out if index is None else {"index": index, **out}

    def ollama(self) -> dict:
        return {"function": {"name": self.name, "arguments": self.arguments}}


class ToolError(ValueError):
    """A tool, call, tool_choice or format llmd refuses (the edges answer 400 naming ``param``)."""

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.param = param


# -- in --------------------------------------------------------------------------------------------

def wire_tools(tools: Optional[list], param: str = "tools") -> list[dict]:
    """OpenAI's and Ollama's ``[{"type": "function", "function": {...}}]`` as the wire's tools."""
    out = []
    for i, t in enumerate(tools or []):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(f, dict):
            raise ToolError(f"{param}.{i}: a tool must be {{\"type\": \"function\", \"function\": {{...}}}}",
                            param=f"{param}.{i}")
        name, params = f.get("name"), f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(name, str) or not 0 < len(name) <= 256:
            raise ToolError(f"{param}.{i}.function.name must be a string of 1 to 256 characters",
                            param=f"{param}.{i}.function.name")
        if not isinstance(params, dict):
            raise ToolError(f"{param}.{i}.function.parameters must be a JSON schema object",
                            param=f"{param}.{i}.function.parameters")
        desc = f.get("description") or ""
        if not isinstance(desc, str):
            raise ToolError(f"{param}.{i}.function.description must be a string", param=f"{param}.{i}")
        out.append({"name": name, "description": desc, "parameters": json.dumps(params)})
    return out


def wire_calls(calls: Optional[list], where: str) -> list[dict]:
    """An assistant message's calls (OpenAI's arguments are JSON text, Ollama's an object) for the wire."""
    out = []
    for j, c in enumerate(calls or []):
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise ToolError(f"{where}.{j}: a call must be {{\"function\": {{\"name\", \"arguments\"}}}}",
                            param=f"{where}.{j}")
        args = f.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args or "{}")
            except ValueError:
                raise ToolError(f"{where}.{j}.function.arguments is not valid JSON", param=where) from None
        if not isinstance(args, dict):
            raise ToolError(f"{where}.{j}.function.arguments must be a JSON object", param=where)
        call = {"name": f["name"], "arguments": json.dumps(args, ensure_ascii=False)}
        if isinstance(c.get("id"), str) and c["id"]:
            call["id"] = c["id"][:128]
        out.append(call)
    return out


def call_grammar(tools: list[dict], choice: Any) -> tuple[Optional[dict], bool]:
    """For ``tool_choice``: (the grammar that forces a valid call, or None; whether the tools are
    offered at all). "auto" (the default) offers them, "none" does not, "required" forces a call to
    one of them, ``{"type": "function", "function": {"name": ...}}`` a call to that one."""
    if choice in (None, "auto"):
        return None, bool(tools)
    if choice == "none":
        return None, False
    if not tools:
        raise ToolError("tool_choice needs tools to choose from", param="tool_choice")
    if choice == "required":
        chosen = tools
    elif isinstance(choice, dict) and choice.get("type", "function") == "function" \
            and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        chosen = [t for t in tools if t["name"] == name]
        if not chosen:
            raise ToolError(f"tool_choice names {str(name)[:64]!r}, which is not among the tools",
                            param="tool_choice")
    else:
        raise ToolError("tool_choice must be \"none\", \"auto\", \"required\" or "
                        "{\"type\": \"function\", \"function\": {\"name\": ...}}", param="tool_choice")
    shapes = [{"type": "object", "properties": {"name": {"const": t["name"]},
                                                "arguments": json.loads(t["parameters"])},
               "required": ["name", "arguments"], "additionalProperties": False} for t in chosen]
    schema = shapes[0] if len(shapes) == 1 else {"anyOf": shapes}
    return {"kind": "json_schema", "text": json.dumps(schema)}, True


def format_grammar(fmt: Any, param: str) -> Optional[dict]:
    """A grammar for OpenAI's ``response_format`` or Ollama's ``format``; None for plain text."""
    if fmt is None or fmt == "" or fmt == {"type": "text"}:
        return None
    if fmt == "json" or fmt == {"type": "json_object"}:
        return {"kind": "json_object", "text": ""}
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":           # OpenAI's response_format
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ToolError(f"{param}.json_schema.schema must be a JSON schema object", param=param)
        return {"kind": "json_schema", "text": json.dumps(schema)}
    if isinstance(fmt, dict) and param == "format":                            # Ollama's: the schema itself
        return {"kind": "json_schema", "text": json.dumps(fmt)}
    raise ToolError(f"{param} must be " + ('"json" or a JSON schema' if param == "format" else
                    '{"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": {...}}'),
                    param=param)


def one_grammar(*grammars: Optional[dict]) -> Optional[dict]:
    given = [g for g in grammars if g is not None]
    if len(given) > 1:
        raise ToolError("a forced tool call and a response format cannot both constrain one answer",
                        param="tool_choice")
    return given[0] if given else None


# -- out -------------------------------------------------------------------------------------------

def parse_calls(text: str, names: set[str], limit: Optional[int] = None) -> tuple[str, list[Call]]:
    """The text without its calls, and the calls to functions in ``names`` (the first ``limit`` of
    them: ``parallel_tool_calls: false`` asks for one; the blocks of later ones are left out too)."""
    whole = _as_call(text.strip(), names)
    if whole is not None:
        return "", [whole]
    content, calls, pos = [], [], 0
    while (at := text.find(OPEN, pos)) >= 0:
        end = text.find(CLOSE, at)
        body = text[at + len(OPEN):end if end >= 0 else len(text)]
        call = _as_call(body.strip(), names)
        if call is None:
            break
        content.append(text[pos:at])
        calls.append(call)
        pos = end + len(CLOSE) if end >= 0 else len(text)
    content.append(text[pos:])
    return "".join(content).strip() if calls else text, calls[:limit]


def _as_call(body: str, names: set[str]) -> Optional[Call]:
    if not body.startswith("{"):
        return None
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return Call(obj["name"], args) if isinstance(args, dict) else None


class ToolStream:
    """Streamed text in, (content, calls) out as soon as each is certain. An answer that starts
    with ``{`` may be a whole call and is held to the end; elsewhere only a ``<tool_call>`` block (or
    the start of its tag) is held."""

    def __init__(self, names: set[str], limit: Optional[int] = None):
        self.names, self.limit = names, limit
        self._sent = 0             # calls released so far
        self._held = ""
        self._started = False      # some content went out, so the answer is not one JSON object
        self._whole = False        # the answer may be one JSON call: held to the end

    def feed(self, text: str) -> tuple[str, list[Call]]:
        self._held += text
        if not self._started and not self._whole:
            head = self._held.lstrip()
            if not head:
                return "", []
            self._whole = head.startswith("{")
        if self._whole:
            return "", []
        return self._release(final=False)

    def finish(self) -> tuple[str, list[Call]]:
        if self._whole:
            content, calls = parse_calls(self._held, self.names)
            self._held = ""
            return content, self._limited(calls)
        return self._release(final=True)

    def _limited(self, calls: list[Call]) -> list[Call]:
        room = len(calls) if self.limit is None else max(0, self.limit - self._sent)
        self._sent += min(room, len(calls))
        return calls[:room]

    def _release(self, final: bool) -> tuple[str, list[Call]]:
        out, calls = [], []
        while True:
            at = self._held.find(OPEN)
            if at < 0:
                keep = 0 if final else _partial_tag(self._held)
                out.append(self._held[:len(self._held) - keep])
                self._held = self._held[len(self._held) - keep:]
                break
            end = self._held.find(CLOSE, at)
            if end < 0 and not final:
                out.append(self._held[:at])
                self._held = self._held[at:]
                break
            stop = end + len(CLOSE) if end >= 0 else len(self._held)
            content, found = parse_calls(self._held[at:stop], self.names)
            out.append(self._held[:at] + content)
            calls += found
            self._held = self._held[stop:]
        text = "".join(out)
        self._started = self._started or bool(text)
        return text, self._limited(calls)


def _partial_tag(text: str) -> int:
    """How many characters at the end of ``text`` may begin ``<tool_call>``."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0
