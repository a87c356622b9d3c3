"""A model's chat template: messages validated and rendered in the bounded sandbox
(``template_sandbox``), and split into pieces that are message content and pieces that are the
template's own text (so that only the latter may spell control tokens)."""
from __future__ import annotations

import json
import secrets
import time
from pathlib import Path
from typing import Any, Optional

import jinja2.ext
from jinja2.exceptions import SecurityError, TemplateError

from .chat_tools import bounded_str, tool_calls, tools_in_text, validate_tools
from .errors import InvalidRequest
from .template_sandbox import RENDER_MAX_CHARS, RenderLimit, Sandbox, check_deadline, render_deadline

MAX_MESSAGES = 1024
MAX_MESSAGE_CHARS = 1 << 20
MAX_TEXT_CHARS = 1 << 23      # the most text one request may carry (a prompt, or all its messages)
assert RENDER_MAX_CHARS >= 2 * MAX_TEXT_CHARS   # a template that wraps the messages always fits

# Used when the model has no chat template. ChatML when the vocabulary has its control tokens,
# otherwise "role: content" paragraphs ending with "assistant:".
_FALLBACK_CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_FALLBACK_PLAIN = (
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}")


def _raise_exception(message: str):
    raise TemplateError(str(message))



class ChatTemplate:
    """A compiled chat template. Rendering errors and refusals raise InvalidRequest."""

    def __init__(self, source: Optional[str], model_dir: Path, bos_token: str, eos_token: str,
                 special_tokens: list[str], chatml: bool):
        self.source = source
        self._specials = [t for t in special_tokens if t]
        env = Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.globals.update(raise_exception=_raise_exception, bos_token=bos_token, eos_token=eos_token,
                           strftime_now=lambda fmt: time.strftime(fmt))
        self._compile_error: Optional[str] = None
        try:
            self._template = env.from_string(source or (_FALLBACK_CHATML if chatml else _FALLBACK_PLAIN))
        except TemplateError as e:
            # A broken template fails chat requests, not the whole model: completions still work.
            self._template = None
            self._compile_error = f"the chat template in {model_dir} does not compile: {e}"

    @property
    def has_tools(self) -> bool:
        """The template places ``tools`` itself; otherwise llmd describes them in a system message."""
        return self.source is not None and "tools" in self.source

    def render(self, messages: list[dict], add_generation_prompt: bool, tools: Optional[list[dict]] = None) -> str:
        msgs, tools = self._prepare(messages, tools)
        return self._render(msgs, add_generation_prompt, tools)

    def _prepare(self, messages: list[dict], tools: Optional[list[dict]]) -> tuple[list[dict], Optional[list[dict]]]:
        msgs, tools = _validate_messages(messages), validate_tools(tools)
        spelled = [t for t in self._specials for x in (tools, [m.get("tool_calls") for m in msgs])
                   if x and t in json.dumps(x, ensure_ascii=False)]
        if spelled:
            raise InvalidRequest(f"a tool or tool call contains the special token {spelled[0]!r}, which this "
                                 "chat template would turn into a control token")
        if not self.has_tools and (tools or any("tool_calls" in m for m in msgs)):
            return tools_in_text(msgs, tools), None
        return msgs, tools

    def render_pieces(self, messages: list[dict], add_generation_prompt: bool,
                      tools: Optional[list[dict]] = None) -> list[tuple[str, bool]]:
        """The rendering as (text, is_message_content) pieces.

        Renders twice: with the real contents and with a unique marker in place of each content. When
        putting the contents (as they are, or stripped) back at the markers reproduces the real
        rendering exactly, the pieces are known. Otherwise the template transforms contents; then contents that spell a special
        token are refused, since they could not be kept as text.
        """
        msgs, tools = self._prepare(messages, tools)
        nonce = secrets.token_hex(8)
        # empty contents stay empty: templates test them ("if message.content")
        marks = [f"[[llmd-{nonce}-{i}]]" if m["content"] else "" for i, m in enumerate(msgs)]   # survives strip()
        with render_deadline():
            real = self._render(msgs, add_generation_prompt, tools)
            marked = self._render([{**m, "content": k} for m, k in zip(msgs, marks)], add_generation_prompt, tools)
        marked_msgs = [m for m, k in zip(msgs, marks) if k]
        for transform in (str, str.strip):     # templates commonly strip message contents
            pieces = _split_at_marks(marked, [k for k in marks if k], [transform(m["content"]) for m in marked_msgs])
            if pieces is not None and "".join(t for t, _ in pieces) == real:
                return pieces
        bad = [t for t in self._specials for m in msgs if t in m["content"]]
        if bad:
            raise InvalidRequest(f"message content contains the special token {bad[0]!r}, which this chat "
                                 "template would turn into a control token")
        return [(real, False)]

    def _render(self, messages: list[dict], add_generation_prompt: bool, tools: Optional[list[dict]] = None) -> str:
        if self._template is None:
            raise InvalidRequest(self._compile_error)
        try:
            with render_deadline():
                out = self._bounded(messages, bool(add_generation_prompt), tools)
        except RenderLimit as e:
            raise InvalidRequest(str(e)) from None
        except SecurityError as e:
            raise InvalidRequest(f"the chat template did something unsafe and was stopped: {e}") from None
        except TemplateError as e:
            raise InvalidRequest(f"the chat template rejected the messages: {e}") from None
        except Exception as e:  # template code can raise anything (TypeError on bad data ...)
            raise InvalidRequest(f"the chat template failed: {type(e).__name__}: {e}") from None
        return out

    def _bounded(self, messages: list, add_generation_prompt: bool, tools: Optional[list[dict]]) -> str:
        """The rendering, stopped once it runs past RENDER_MAX_CHARS characters or the deadline."""
        parts, size = [], 0
        extra = {"tools": tools} if tools else {}
        for chunk in self._template.generate(messages=messages, add_generation_prompt=add_generation_prompt, **extra):
            size += len(chunk)
            if size > RENDER_MAX_CHARS:
                raise RenderLimit("the rendered chat is too long")
            check_deadline()
            parts.append(chunk)
        return "".join(parts)


def _split_at_marks(marked: str, marks: list[str], contents: list[str]) -> Optional[list[tuple[str, bool]]]:
    """Split ``marked`` at each mark (each must appear exactly once, in order), contents in between."""
    pieces: list[tuple[str, bool]] = []
    pos = 0
    for mark, content in zip(marks, contents):
        at = marked.find(mark, pos)
        if at < 0 or marked.count(mark) != 1:
            return None
        pieces += [(marked[pos:at], False), (content, True)]
        pos = at + len(mark)
    pieces.append((marked[pos:], False))
    return [p for p in pieces if p[0]]


def _validate_messages(messages: Any) -> list[dict]:
    """Messages as fresh {"role", "content"} dicts of bounded strings, with an assistant's
    ``tool_calls`` and a tool answer's ``tool_call_id`` and ``name`` where given (runtime.chat_tools)."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list")
    if len(messages) > MAX_MESSAGES:
        raise InvalidRequest(f"at most {MAX_MESSAGES} messages")
    out, total = [], 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidRequest(f"messages[{i}] must be an object with role and content")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not 0 < len(role) <= 64:
            raise InvalidRequest(f"messages[{i}].role must be a non-empty string of at most 64 characters")
        if not isinstance(content, str) or len(content) > MAX_MESSAGE_CHARS:
            raise InvalidRequest(f"messages[{i}].content must be a string of at most {MAX_MESSAGE_CHARS} characters")
        total += len(content)
        msg = {"role": role, "content": content}
        for key in ("tool_call_id", "name"):
            if m.get(key) is not None:
                msg[key] = bounded_str(m[key], f"messages[{i}].{key}")
        if m.get("tool_calls"):
            msg["tool_calls"] = tool_calls(m["tool_calls"], i)
            total += len(json.dumps(msg["tool_calls"]))
        out.append(msg)
    if total > MAX_TEXT_CHARS:
        raise InvalidRequest(f"messages hold more than {MAX_TEXT_CHARS} characters in all")
    return out
