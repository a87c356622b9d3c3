"""Ollama's API at the edge of ``llmd http``: the bodies of ``/api/generate``, ``/api/chat`` and
``/api/show``, how each becomes llmd work, and the shape of the answers. Pure Python, no aiohttp.

``format`` ("json" or a JSON schema) constrains the output; ``tools`` are offered to the model
and its calls come back in ``message.tool_calls`` (``http_tools``). What llmd cannot honour is
refused with a 400 naming the field, never ignored: images, thinking, logprobs, a template or token context of the client's own, and (see
``http_options``) samplers llmd lacks. Fields that do not change the output are accepted:
``keep_alive`` (llmd keeps its one model loaded), the load-time options (``num_gpu``,
``num_thread``, ``use_mmap`` ...), ``num_keep`` (llmd never shifts the context), and ``num_ctx`` up
to the model's context window. Any model name is served by the daemon's one model.
"""
from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import Field

from llmd.protocol import MAX_MESSAGES, MAX_PROMPT_TOKENS

from .http_api import FINISH, MAX_TOKENS, Finite, Text, Work
from .http_options import LlamaSampling, Strict, predicted, refuse
from .http_tools import ToolError, format_grammar, wire_calls, wire_tools

API_VERSION = "0.6.0"        # the version of Ollama's API whose fields llmd serves
FOREVER = "2999-12-31T23:59:59Z"    # /api/ps: llmd never unloads its model
DURATION = r"^-?([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h)?)+$"

Name = Annotated[str, Field(max_length=256)]
KeepAlive = Union[Annotated[Finite, Field(ge=-1e9, le=1e9)], Annotated[str, Field(max_length=32, pattern=DURATION)]]
Small = Annotated[int, Field(ge=-1, le=1 << 20)]


class Options(LlamaSampling):
    num_predict: Optional[Annotated[int, Field(ge=-2, le=MAX_TOKENS)]] = None
    num_ctx: Optional[Annotated[int, Field(ge=1, le=MAX_TOKENS)]] = None
    num_keep: Optional[Small] = None
    penalize_newline: Optional[bool] = None
    # load-time settings: llmd's daemon chose its own; none changes the output
    numa: Optional[bool] = None
    num_batch: Optional[Small] = None
    num_gpu: Optional[Small] = None
    main_gpu: Optional[Small] = None
    low_vram: Optional[bool] = None
    f16_kv: Optional[bool] = None
    use_mmap: Optional[bool] = None
    use_mlock: Optional[bool] = None
    num_thread: Optional[Small] = None
    logits_all: Optional[bool] = None
    vocab_only: Optional[bool] = None
    embedding_only: Optional[bool] = None


class _Request(Strict):
    model: Optional[Name] = None
    options: Optional[Options] = None
    stream: bool = True                      # Ollama's default: JSON lines
    keep_alive: Optional[KeepAlive] = None
    format: Any = None
    think: Optional[Union[bool, Annotated[str, Field(max_length=16)]]] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[Annotated[int, Field(ge=0, le=20)]] = None


class GenerateBody(_Request):
    prompt: Text = ""
    suffix: Optional[Text] = None
    system: Optional[Text] = None
    template: Optional[Text] = None
    context: Optional[Annotated[list[Annotated[int, Field(ge=0, lt=1 << 31)]], Field(max_length=MAX_PROMPT_TOKENS)]] \
        = None
    raw: bool = False
    images: Optional[Annotated[list[Text], Field(max_length=16)]] = None
    width: Optional[Small] = None
    height: Optional[Small] = None
    steps: Optional[Small] = None


class Message(Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: Text = ""
    images: Optional[Annotated[list[Text], Field(max_length=16)]] = None
    tool_calls: Optional[Annotated[list[dict], Field(max_length=64)]] = None
    tool_name: Optional[Name] = None
    thinking: Optional[Text] = None


class ChatBody(_Request):
    messages: Annotated[list[Message], Field(max_length=MAX_MESSAGES)] = []
    tools: Optional[Annotated[list[dict], Field(max_length=128)]] = None


class ShowBody(Strict):
    model: Optional[Name] = None
    name: Optional[Name] = None             # older clients' spelling
    verbose: bool = False


# -- requests --------------------------------------------------------------------------------------

TEXT_ONLY = "llmd serves text models: send no images"


def _check_request(body: _Request, context_length: int) -> None:
    if body.think not in (None, False):
        refuse("think", "llmd serves no thinking models: only false is accepted")
    if body.logprobs:
        refuse("logprobs", "logprobs are not served on Ollama's API yet (the OpenAI endpoints have them)")
    o = body.options
    if o is None:
        return
    for name in ("penalize_newline", "logits_all", "vocab_only", "embedding_only"):
        if getattr(o, name):
            refuse(f"options.{name}", "llmd cannot honour it: only false is accepted")
    if o.num_ctx is not None and context_length and o.num_ctx > context_length:
        refuse("options.num_ctx", f"the model's context window is {context_length} tokens; ask for at most that")


def _sampling(body: _Request) -> dict:
    o = body.options or Options()
    sampling = {**predicted(o.num_predict, MAX_TOKENS), **o.sampling("options.")}
    try:
        grammar = format_grammar(body.format, "format")
    except ToolError as e:
        refuse("format", str(e))
    if grammar is not None:
        sampling["grammar"] = grammar
    return sampling


def generate_work(body: GenerateBody, chat_template: bool, context_length: int) -> Optional[Work]:
    """The work of one ``/api/generate``; None when there is nothing to generate (Ollama's load call)."""
    _check_request(body, context_length)
    for name, why in (("images", TEXT_ONLY),
                      ("template", "llmd renders with the model's own template: send none"),
                      ("context", "llmd takes no token context: send the text again (the prefix cache "
                                  "spares recomputing it)")):
        if getattr(body, name):
            refuse(name, why)
    for name in ("width", "height", "steps"):
        if getattr(body, name) is not None:
            refuse(name, "llmd generates no images")
    sampling = _sampling(body)
    if body.suffix and body.raw:
        refuse("suffix", "raw takes the prompt as written, so a suffix has nowhere to go: send raw false")
    if not body.prompt and not body.suffix and not body.system:
        return None
    if body.suffix is not None and not body.raw:      # even an empty one: the cursor is at the end
        if "grammar" in sampling:
            refuse("format", "a format cannot constrain a fill-in-the-middle answer: send no suffix or no format")
        if body.system:
            refuse("system", "filling in the middle has no place for a system prompt")
        return Work("infill", {"prefix": body.prompt, "suffix": body.suffix}, sampling, body.stream)
    if body.raw or not chat_template:
        if body.system:
            refuse("system", "raw takes the prompt as written: put the system text in it" if body.raw
                   else "the model has no chat template to place a system prompt in")
        return Work("generate", {"prompt": body.prompt}, sampling, body.stream)
    messages = ([{"role": "system", "content": body.system}] if body.system else []) + \
        [{"role": "user", "content": body.prompt}]
    return Work("chat", {"messages": messages}, sampling, body.stream)


def chat_work(body: ChatBody, context_length: int) -> Optional[Work]:
    """The work of one ``/api/chat``; None for no messages (Ollama's load call)."""
    _check_request(body, context_length)
    for i, m in enumerate(body.messages):
        for name, why in (("images", TEXT_ONLY), ("thinking", "llmd serves no thinking models")):
            if getattr(m, name):
                refuse(f"messages.{i}.{name}", why)
    if not body.messages:
        return None
    try:
        tools = wire_tools(body.tools)
        messages = [_message(m, i) for i, m in enumerate(body.messages)]
    except ToolError as e:
        refuse(e.param or "tools", str(e))
    return Work("chat", {"messages": messages, "tools": tools or None}, _sampling(body), body.stream,
                extra={"tool_names": {t["name"] for t in tools}})


def _message(m: Message, i: int) -> dict:
    out = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = wire_calls(m.tool_calls, f"messages.{i}.tool_calls")
    if m.tool_name:
        out["name"] = m.tool_name
    return out


# -- answers ---------------------------------------------------------------------------------------

def timestamp(t: Optional[float] = None) -> str:
    """RFC 3339 in UTC, as Ollama writes ``created_at``."""
    return datetime.fromtimestamp(time.time() if t is None else t, timezone.utc).isoformat().replace("+00:00", "Z")


@dataclass
class Shaper:
    """The objects of one answer: ``chat`` puts text in ``message``, else in ``response``."""

    model: str
    chat: bool
    started_ns: int = field(default_factory=time.monotonic_ns)

    def chunk(self, text: str, tool_calls: Optional[list] = None) -> dict:
        key, value = ("message", {"role": "assistant", "content": text}) if self.chat else ("response", text)
        if tool_calls:
            value["tool_calls"] = tool_calls
        return {"model": self.model, "created_at": timestamp(), key: value, "done": False}

    def final(self, text: str, done, tool_calls: Optional[list] = None) -> dict:
        u, t = getattr(done, "usage", {}) or {}, getattr(done, "timings", {}) or {}
        return {**self.chunk(text, tool_calls), "done": True,
                "done_reason": FINISH.get(getattr(done, "finish_reason", "stop"), "stop"),
                "total_duration": time.monotonic_ns() - self.started_ns, "load_duration": 0,
                "prompt_eval_count": u.get("prompt_tokens") or 0,
                "prompt_eval_duration": int((t.get("prompt_ms") or 0) * 1e6),
                "eval_count": u.get("completion_tokens") or 0, "eval_duration": int((t.get("decode_ms") or 0) * 1e6)}

    def loaded(self) -> dict:
        """The answer to a request with nothing to generate: the model is loaded (llmd's always is)."""
        return {**self.chunk(""), "done": True, "done_reason": "load"}


def tagged(name: str) -> str:
    """A model name as Ollama lists it, with a tag."""
    return name if ":" in name else f"{name}:latest"


def _details(m: dict) -> dict:
    one_file = os.path.isfile(str(m.get("path") or ""))        # a GGUF file, else a model directory
    return {"parent_model": "", "format": "gguf" if one_file else "safetensors", "family": "",
            "families": None, "parameter_size": "", "quantization_level": ""}


def _modified(m: dict) -> str:
    try:
        return timestamp(os.stat(m.get("path") or "").st_mtime)
    except (OSError, ValueError):
        return timestamp(0)


def model_entry(m: dict) -> dict:
    """One model of ``/api/tags``."""
    name = tagged(str(m.get("name") or "llmd"))
    return {"name": name, "model": name, "modified_at": _modified(m), "size": 0,
            "digest": hashlib.sha256(f"{name}|{m.get('path')}".encode()).hexdigest(), "details": _details(m)}


def running_entry(m: dict) -> dict:
    """One model of ``/api/ps``."""
    return {**model_entry(m), "expires_at": FOREVER, "size_vram": 0, "context_length": m.get("context_length") or 0}


def show(m: dict) -> dict:
    """``/api/show``: what a client reads of the model (context window, capabilities)."""
    infill = bool(m.get("infill"))
    template = "{{ if .Suffix }}{{ .Prompt }}<fill in the middle>{{ .Suffix }}{{ else }}{{ .Prompt }}{{ end }}" \
        if infill else "{{ .Prompt }}"
    parameters = f"num_ctx {m['context_length']}" if m.get("context_length") else ""
    return {"modelfile": "", "parameters": parameters, "template": template, "details": _details(m),
            "model_info": {"general.architecture": "llmd", "llmd.context_length": m.get("context_length") or 0,
                           "llmd.vocab_size": m.get("vocab_size") or 0},
            "capabilities": ["completion"] + (["insert"] if infill else []), "modified_at": _modified(m)}
