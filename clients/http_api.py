"""The HTTP dialects `llmd http` speaks, parsed at the edge into llmd's own work messages.

OpenAI's ``/v1/completions`` and ``/v1/chat/completions`` and llama.cpp's ``/infill`` arrive as
JSON; each is validated here (known fields typed strictly and bounded as on the ZeroMQ edge,
unknown fields ignored as those servers do) and becomes a ``Work``: the llmd request type, its
fields and its sampling map. Replies are shaped here too, so the server module only moves bytes.
Pure Python: no torch, no aiohttp.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from llmd import sampling_fields
from llmd.protocol import MAX_FILES, MAX_MESSAGES, MAX_STOP, MAX_TEXT_LEN, MAX_TOKENS, sampling_type

from .http_knobs import chained, knob_model, knobs
from .http_tools import ToolError, call_grammar, format_grammar, one_grammar, wire_calls, wire_tools

DEFAULT_MAX_TOKENS = 256            # when a request names none
INFILL_DEFAULT_TOKENS = 64

Text = Annotated[str, Field(max_length=MAX_TEXT_LEN)]
StopText = Annotated[str, Field(min_length=1, max_length=sampling_fields.BY_NAME["stop"].item_len)]
Finite = Annotated[float, Field(allow_inf_nan=False)]


class HttpError(Exception):
    """A request refused at the HTTP edge: ``status`` and an OpenAI-shaped body."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


# daemon error code -> HTTP status and OpenAI error type
DAEMON_ERRORS = {"invalid_request": (400, "invalid_request_error"), "capacity": (400, "invalid_request_error"),
                 "busy": (503, "server_error"), "draining": (503, "server_error"),
                 "duplicate_id": (409, "invalid_request_error"), "internal": (500, "server_error")}


def daemon_error(code: str, message: str) -> HttpError:
    status, kind = DAEMON_ERRORS.get(code, (502, "server_error"))
    return HttpError(status, message, kind, code=code)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)


class _Sampled(knob_model("_Knobs", sampling_fields.OPENAI, _Body)):
    """The sampling fields both OpenAI bodies share: the knobs sampling_fields gives the OpenAI front
    (temperature, top_p, and as vLLM's and llama.cpp's servers also take them, top_k, min_p,
    typical_p, the penalties), and these."""

    model: Optional[Annotated[str, Field(max_length=256)]] = None
    max_tokens: Optional[Annotated[int, Field(ge=1, le=MAX_TOKENS)]] = None
    seed: sampling_type(sampling_fields.BY_NAME["seed"]) = None
    stop: Optional[Union[StopText, Annotated[list[StopText], Field(max_length=MAX_STOP)]]] = None
    n: Annotated[int, Field(ge=1, le=1)] = 1
    stream: bool = False
    stream_options: Optional[dict] = None
    logit_bias: Optional[Annotated[dict, Field(max_length=0)]] = None
    user: Optional[Annotated[str, Field(max_length=256)]] = None
    ignore_eos: Optional[bool] = None                 # an extension vLLM and llama.cpp share
    response_format: Optional[dict] = None            # text, json_object or json_schema (http_tools)

    def sampling(self, max_tokens: Optional[int], logprobs: Optional[int]) -> dict:
        s = {"max_tokens": max_tokens or self.max_tokens or DEFAULT_MAX_TOKENS, **knobs(self, sampling_fields.OPENAI),
             "seed": self.seed, "stop": [self.stop] if isinstance(self.stop, str) else self.stop, "logprobs": logprobs,
             "ignore_eos": self.ignore_eos or None}
        return {k: v for k, v in s.items() if v is not None and v != []}

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage") is True)


class CompletionBody(_Sampled):
    prompt: Union[Text, Annotated[list[Text], Field(min_length=1, max_length=1)],
                  Annotated[list[Annotated[int, Field(ge=0, lt=1 << 31)]], Field(min_length=1, max_length=1 << 17)]]
    suffix: Optional[Text] = None
    echo: Literal[False] = False
    best_of: Optional[Annotated[int, Field(ge=1, le=1)]] = None
    logprobs: Optional[Annotated[int, Field(ge=0, le=20)]] = None


class Part(_Body):
    type: Literal["text"]
    text: Text


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[Text, Annotated[list[Part], Field(max_length=64)], None] = None
    tool_calls: Optional[Annotated[list[dict], Field(max_length=64)]] = None
    tool_call_id: Optional[Annotated[str, Field(max_length=128)]] = None
    name: Optional[Annotated[str, Field(max_length=256)]] = None


class ChatBody(_Sampled):
    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: Optional[Annotated[int, Field(ge=1, le=MAX_TOKENS)]] = None
    logprobs: bool = False
    top_logprobs: Optional[Annotated[int, Field(ge=0, le=20)]] = None
    tools: Optional[Annotated[list[dict], Field(max_length=128)]] = None
    tool_choice: Optional[Union[Annotated[str, Field(max_length=16)], dict]] = None
    parallel_tool_calls: Optional[bool] = None


class ExtraChunk(_Body):
    text: Text
    filename: Annotated[str, Field(max_length=4096)] = ""


class InfillBody(knob_model("_InfillKnobs", sampling_fields.LLAMA, _Body, penalties=False)):
    """llama.cpp's ``/infill`` fields that llmd acts on: temperature and the filters in llama.cpp's
    spelling (sampling_fields), and these; the rest (``n_indent``, ``response_fields``,
    ``t_max_prompt_ms`` ..., the penalties) are read as llama.cpp does, or ignored."""

    input_prefix: Text = ""
    input_suffix: Text = ""
    input_extra: Annotated[list[ExtraChunk], Field(max_length=MAX_FILES)] = []
    prompt: Text = ""
    n_predict: Annotated[int, Field(ge=-1, le=MAX_TOKENS)] = -1
    t_max_predict_ms: Optional[Annotated[int, Field(ge=0, le=86_400_000)]] = None
    t_max_prompt_ms: Optional[Annotated[int, Field(ge=-1, le=86_400_000)]] = None
    cache_prompt: bool = True
    stream: bool = False
    samplers: Annotated[list[Annotated[str, Field(max_length=32)]], Field(max_length=16)] = []
    seed: Optional[Annotated[int, Field(ge=-1, lt=1 << 63)]] = None
    stop: Annotated[list[StopText], Field(max_length=MAX_STOP)] = []
    n_indent: Optional[Annotated[int, Field(ge=0, le=4096)]] = None
    ignore_eos: bool = False


@dataclass(frozen=True)
class Work:
    """One request for the daemon: ``kind`` is generate | chat | infill."""

    kind: str
    fields: dict
    sampling: dict
    stream: bool
    include_usage: bool = False
    logprobs: Optional[int] = None
    extra: dict = field(default_factory=dict)


def parse(model: type[BaseModel], raw: bytes) -> Any:
    """The body as ``model``; HttpError 400 naming the first problems."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise HttpError(400, f"the body is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(data, dict):
        raise HttpError(400, "the body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(p)[:64] for p in first["loc"])
        more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
        msg = "not a field llmd can honour here: refused, not ignored" if first["type"] == "extra_forbidden" \
            else first["msg"]
        raise HttpError(400, f"{loc or 'body'}: {msg}{more}", param=loc or None) from None


def refused(e: ToolError) -> HttpError:
    return HttpError(400, str(e), param=e.param)


def completion_work(body: CompletionBody) -> Work:
    sampling = body.sampling(None, body.logprobs)
    try:
        grammar = format_grammar(body.response_format, "response_format")
    except ToolError as e:
        raise refused(e) from None
    if grammar is not None:
        if body.suffix is not None:
            raise HttpError(400, "a response_format cannot constrain a fill-in-the-middle answer", param="suffix")
        sampling["grammar"] = grammar
    prompt = body.prompt[0] if isinstance(body.prompt, list) and isinstance(body.prompt[0], str) else body.prompt
    if body.suffix is not None:
        if not isinstance(prompt, str):
            raise HttpError(400, "suffix needs a text prompt", param="suffix")
        return Work("infill", {"prefix": prompt, "suffix": body.suffix}, sampling, body.stream, body.include_usage(),
                    body.logprobs)
    fields = {"prompt": prompt} if isinstance(prompt, str) else {"token_ids": prompt}
    return Work("generate", fields, sampling, body.stream, body.include_usage(), body.logprobs)


def chat_work(body: ChatBody) -> Work:
    try:
        return _chat_work(body)
    except ToolError as e:
        raise refused(e) from None


def _chat_work(body: ChatBody) -> Work:
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    messages = []
    for i, m in enumerate(body.messages):
        content = m.content if isinstance(m.content, str) else "".join(p.text for p in (m.content or []))
        msg = {"role": "system" if m.role == "developer" else m.role, "content": content}
        if m.tool_calls:
            msg["tool_calls"] = wire_calls(m.tool_calls, f"messages.{i}.tool_calls")
        msg.update({k: v for k, v in (("tool_call_id", m.tool_call_id), ("name", m.name)) if v})
        messages.append(msg)
    tools = wire_tools(body.tools)
    forced, offered = call_grammar(tools, body.tool_choice)
    sampling = body.sampling(body.max_completion_tokens, logprobs)
    grammar = one_grammar(forced, format_grammar(body.response_format, "response_format"))
    if grammar is not None:
        sampling["grammar"] = grammar
    fields = {"messages": messages, "tools": tools if offered else None}
    return Work("chat", fields, sampling, body.stream, body.include_usage(), logprobs,
                extra={"tool_names": {t["name"] for t in tools} if offered else set(),
                       "max_calls": 1 if body.parallel_tool_calls is False else None})


def infill_work(body: InfillBody) -> Work:
    """llama.cpp's FIM request as an llmd infill. ``prompt`` joins the prefix, where llama.cpp's
    server puts it; ``n_predict`` -1 takes the default; ``t_max_predict_ms`` is kept by the server
    (``predict_limited``);
    a sampler chain without ``temperature`` samples greedily unless ``temperature`` is given."""
    n = body.n_predict if body.n_predict > 0 else INFILL_DEFAULT_TOKENS
    sampling = {"max_tokens": n, "stop": body.stop or None,
                "seed": body.seed if body.seed is not None and body.seed >= 0 else None,
                "ignore_eos": body.ignore_eos or None}
    sampling = {k: v for k, v in sampling.items() if v is not None}
    sampling.update(chained(knobs(body, sampling_fields.LLAMA, penalties=False), body.samplers))
    if sampling.get("temperature", 0) == 0:      # greedy: the filters change nothing
        sampling = {k: v for k, v in sampling.items() if sampling_fields.BY_NAME[k].stage != sampling_fields.FILTER}
    files = [{"path": c.filename or f"chunk-{i}", "text": c.text} for i, c in enumerate(body.input_extra)]
    return Work("infill", {"prefix": body.input_prefix + body.prompt, "suffix": body.input_suffix,
                           "files": files or None}, sampling, body.stream,
                extra={"n_predict": body.n_predict, "t_max_predict_ms": body.t_max_predict_ms})


# -- replies ---------------------------------------------------------------------------------------

FINISH = {"stop": "stop", "length": "length", "cancelled": "stop", "deadline": "length", "shutdown": "stop"}


def usage(done_usage: dict) -> dict:
    p, c = done_usage.get("prompt_tokens") or 0, done_usage.get("completion_tokens") or 0
    out = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
    if done_usage.get("cached_tokens") is not None:
        out["prompt_tokens_details"] = {"cached_tokens": done_usage["cached_tokens"]}
    return out


def token_label(token_id: int) -> str:
    """How a token the front cannot spell is named in logprobs (it holds no tokenizer)."""
    return f"<|token:{token_id}|>"


def completion_logprobs(entries: list, text: str) -> dict:
    """OpenAI completions ``logprobs`` for one event's tokens: the event's text goes with its first token."""
    tokens = [text] + [""] * (len(entries) - 1)
    return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{token_label(i): lp for i, lp in e.get("top") or []} for e in entries],
            "text_offset": [0] * len(entries)}


def chat_logprobs(entries: list, text: str) -> dict:
    tokens = [text] + [""] * (len(entries) - 1)
    return {"content": [{"token": t, "logprob": e["logprob"], "bytes": list(t.encode()),
                         "top_logprobs": [{"token": token_label(i), "logprob": lp, "bytes": None}
                                          for i, lp in e.get("top") or []]}
                        for t, e in zip(tokens, entries)]}


@dataclass
class Shaper:
    """Builds the response objects of one request (ids and timestamps fixed at its start)."""

    kind: str                # "text_completion" or "chat.completion"
    model: str
    rid: str
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def chat(self) -> bool:
        return self.kind == "chat.completion"

    def chunk(self, text: str, logprobs: Optional[dict], finish: Optional[str] = None, first: bool = False,
              tool_calls: Optional[list] = None) -> dict:
        if self.chat:
            delta = ({"role": "assistant", "content": text} if first else {"content": text}) if text or first else {}
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            return {"id": self.rid, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                    "choices": [choice]}
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return {"id": self.rid, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [choice]}

    def usage_chunk(self, done_usage: dict) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model, "choices": [],
                "usage": usage(done_usage)}

    def whole(self, text: str, logprobs: Optional[dict], finish: str, done_usage: dict,
              tool_calls: Optional[list] = None) -> dict:
        if self.chat:
            message = {"role": "assistant", "content": text or None if tool_calls else text}
            if tool_calls:
                message["tool_calls"], finish = tool_calls, "tool_calls"
            choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return {"id": self.rid, "object": self.kind, "created": self.created, "model": self.model,
                "choices": [choice], "usage": usage(done_usage)}


def merge_logprobs(acc: Optional[dict], part: Optional[dict]) -> Optional[dict]:
    if part is None:
        return acc
    if acc is None:
        return {k: list(v) for k, v in part.items()}
    for k, v in part.items():
        acc[k].extend(v)
    return acc


def infill_reply(text: str, done) -> dict:
    """llama.cpp's ``/infill`` answer: ``content`` plus the timing fields editors show."""
    u, t = getattr(done, "usage", {}) or {}, getattr(done, "timings", {}) or {}
    prompt_n, predicted_n = u.get("prompt_tokens") or 0, u.get("completion_tokens") or 0
    prompt_ms, predicted_ms = t.get("prompt_ms") or 0.0, t.get("decode_ms") or 0.0
    return {"content": text, "stop": True, "stop_type": _stop_type(done), "tokens_cached": u.get("cached_tokens") or 0,
            "truncated": False, "tokens_predicted": predicted_n, "tokens_evaluated": prompt_n,
            "timings": {"prompt_n": prompt_n, "prompt_ms": prompt_ms,
                        "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
                        "prompt_per_second": 1000 * prompt_n / prompt_ms if prompt_ms else 0.0,
                        "predicted_n": predicted_n, "predicted_ms": predicted_ms,
                        "predicted_per_token_ms": predicted_ms / predicted_n if predicted_n else 0.0,
                        "predicted_per_second": 1000 * predicted_n / predicted_ms if predicted_ms else 0.0}}


def _stop_type(done) -> str:
    reason = getattr(done, "finish_reason", "stop")
    return {"stop": "eos", "length": "limit", "deadline": "limit"}.get(reason, "none")
