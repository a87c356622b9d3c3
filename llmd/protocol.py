"""Wire protocol v1, shared by the daemon and the clients: where the daemon listens, the requests a
client may send (validated at the edge), and the events the daemon sends back.

Every request is a msgpack map with a ``type`` and a client-chosen ``id``. Unknown keys, wrong
types and out-of-range sizes are refused (pydantic, strict, extra="forbid") with a typed error;
nothing past this module sees an unvalidated value. Events are frozen dataclasses, one per wire
``type``: ``to_wire`` gives the map, ``from_wire`` reads one back, and readers ignore keys they do
not know (the daemon may add fields within protocol v1). Bytes exist only in llmd.codec.
docs/protocol.md is the contract.

This module imports neither torch, the runtime nor ZeroMQ.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, create_model, model_validator

from llmd import sampling_fields
from llmd.sampling_fields import Param

SYSTEM_SOCKET = Path("/run/llmd/llmd.sock")


def default_socket_path(env: dict | None = None) -> Path:
    """$XDG_RUNTIME_DIR/llmd/llmd.sock for a user, /run/llmd/llmd.sock for the system service."""
    env = os.environ if env is None else env
    if env.get("LLMD_SYSTEM") == "1" or not env.get("XDG_RUNTIME_DIR"):
        return SYSTEM_SOCKET
    return Path(env["XDG_RUNTIME_DIR"]) / "llmd" / "llmd.sock"


def endpoint(path: Path | str) -> str:
    return f"ipc://{Path(path)}"


PROTOCOL_VERSION = 1
SUPPORTED_VERSIONS = (1,)

MAX_ID_LEN = 128
MAX_TEXT_LEN = 1 << 20
MAX_PROMPT_TOKENS = 1 << 17
MAX_MESSAGES = 256
MAX_FILES = 32
MAX_DEADLINE_MS = 24 * 3600 * 1000
MAX_GRAMMAR_LEN = 1 << 16
MAX_STOP = sampling_fields.BY_NAME["stop"].items
MAX_TOKENS = sampling_fields.MAX_TOKENS
MAX_TOOLS = 128
MAX_TOOL_CALLS = 64


class ProtocolError(ValueError):
    """A message the daemon refuses. ``code`` goes on the wire; ``id`` echoes the request id if known."""

    def __init__(self, code: str, message: str, request_id: str = ""):
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id


# Error codes that appear in ``error`` events (see docs/protocol.md).
BAD_MESSAGE = "bad_message"          # not a msgpack map within limits, or wrong frame count
UNKNOWN_TYPE = "unknown_type"        # ``type`` missing or not a request type
INVALID_REQUEST = "invalid_request"  # wrong field, type or value
UNSUPPORTED_VERSION = "unsupported_version"
DUPLICATE_ID = "duplicate_id"        # the same client already has a request with this id in flight
BUSY = "busy"                        # the queue is full; retry later
DRAINING = "draining"                # the daemon is shutting down
CAPACITY = "capacity"                # the request can never fit
INTERNAL = "internal"                # failed inside the engine; other requests go on

Id = Annotated[str, Field(min_length=1, max_length=MAX_ID_LEN)]
Text = Annotated[str, Field(max_length=MAX_TEXT_LEN)]
Int64 = Annotated[int, Field(ge=-(1 << 63), le=(1 << 63) - 1)]
TokenId = Annotated[int, Field(ge=0, lt=1 << 31)]


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class Grammar(_Message):
    """A constraint on the output: any JSON object, or the JSON schema in ``text``."""

    kind: Literal["json_object", "json_schema"]
    text: Annotated[str, Field(max_length=MAX_GRAMMAR_LEN)] = ""


def sampling_type(p: Param, high: Optional[float] = None) -> Any:
    """The strict, bounded pydantic type of a parameter's wire value (``high``: a front's wider
    upper bound, see sampling_fields.Spelling)."""
    if p.kind == "grammar":
        t = Grammar
    elif p.kind == "bool":
        t = bool
    elif p.kind == "texts":
        t = Annotated[list[Annotated[str, Field(min_length=1, max_length=p.item_len)]], Field(max_length=p.items)]
    elif p.kind == "token_ids":
        t = Annotated[list[TokenId], Field(max_length=p.items)]
    else:
        bounds = {"gt" if p.open_low else "ge": p.low, "lt" if p.open_high and high is None else "le": high or p.high}
        extra = {"allow_inf_nan": False} if p.kind == "float" else {}
        t = Annotated[int if p.kind == "int" else float, Field(**bounds, **extra, description=p.help)]
    return Optional[t] if p.optional else t


Sampling = create_model(
    "Sampling", __base__=_Message, __module__=__name__,
    __doc__="Sampling parameters, as llmd.sampling_fields declares them; the runtime's SamplingParams checks "
            "them again.",
    **{p.name: (sampling_type(p), list(p.default) if isinstance(p.default, tuple) else p.default)
       for p in sampling_fields.WIRE})


Priority = Literal["interactive", "normal", "batch"]


class _Work(_Message):
    """Fields shared by the requests that produce tokens."""

    id: Id
    params: Sampling = Sampling()
    priority: Priority = "normal"
    deadline_ms: Optional[Annotated[int, Field(ge=1, le=MAX_DEADLINE_MS)]] = None
    sentences: bool = False
    cache_salt: Optional[Id] = None
    # False: no token event while the request runs; one with the whole output just before ``done``
    # (whole answers: batch jobs, non-streamed HTTP), which spares a message per token on both sides
    stream: bool = True

    @model_validator(mode="after")
    def _sentences_stream(self):
        if self.sentences and not self.stream:
            raise ValueError("sentences come while the output streams: they need stream true")
        return self


class Generate(_Work):
    type: Literal["generate"]
    prompt: Optional[Text] = None
    token_ids: Optional[Annotated[list[TokenId], Field(min_length=1, max_length=MAX_PROMPT_TOKENS)]] = None

    @model_validator(mode="after")
    def _one_prompt(self):
        if (self.prompt is None) == (self.token_ids is None):
            raise ValueError("give exactly one of prompt or token_ids")
        return self


class File(_Message):
    path: Annotated[str, Field(max_length=4096)]
    text: Text


class Infill(_Work):
    type: Literal["infill"]
    prefix: Text
    suffix: Text = ""
    middle: Text = ""      # the start of the middle, already written: the model continues it
    files: Annotated[list[File], Field(max_length=MAX_FILES)] = []
    replace: Optional[Id] = None
    priority: Priority = "interactive"
    layout: Literal["psm", "spm"] = "psm"     # prefix-suffix-middle, or suffix-prefix-middle
    # take this document's keys and values computed by its earlier infills (same ``replace`` key) at
    # their new positions after an edit before them: approximate, see the daemon's shift_max_stale
    shift_reuse: bool = False


Name = Annotated[str, Field(min_length=1, max_length=256)]
# a JSON object given as its text, so that the message keeps its typed, bounded shape
JsonText = Annotated[str, Field(min_length=2, max_length=MAX_GRAMMAR_LEN)]


class ToolCall(_Message):
    """A call an assistant message made: the function's name and its arguments (a JSON object's text)."""

    id: Optional[Annotated[str, Field(max_length=MAX_ID_LEN)]] = None
    name: Name
    arguments: JsonText = "{}"


class Tool(_Message):
    """A function the model may call: ``parameters`` is its JSON schema's text."""

    name: Name
    description: Annotated[str, Field(max_length=1 << 14)] = ""
    parameters: JsonText = '{"type": "object", "properties": {}}'


class ChatMessage(_Message):
    role: Literal["system", "user", "assistant", "tool"]
    content: Text
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOL_CALLS)] = []
    tool_call_id: Optional[Annotated[str, Field(max_length=MAX_ID_LEN)]] = None    # role tool: the call answered
    name: Optional[Name] = None                                                     # role tool: the function

    def to_template(self) -> dict:
        """The message as the runtime's chat template takes it (runtime.chat_template)."""
        out: dict = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump(exclude_none=True) for c in self.tool_calls]
        out.update({k: v for k, v in (("tool_call_id", self.tool_call_id), ("name", self.name)) if v is not None})
        return out


class Chat(_Work):
    type: Literal["chat"]
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] = []


class Cancel(_Message):
    type: Literal["cancel"]
    id: Id
    target: Id


class Hello(_Message):
    type: Literal["hello"]
    id: Id
    versions: Annotated[list[Annotated[int, Field(ge=0, le=1 << 16)]], Field(min_length=1, max_length=16)]
    client: Optional[Annotated[str, Field(max_length=MAX_ID_LEN)]] = None


class Health(_Message):
    type: Literal["health"]
    id: Id


class Stats(_Message):
    type: Literal["stats"]
    id: Id


class Models(_Message):
    type: Literal["models"]
    id: Id


Request = Annotated[Union[Generate, Infill, Chat, Cancel, Hello, Health, Stats, Models], Field(discriminator="type")]
WORK_TYPES = (Generate, Infill, Chat)
REQUEST_TYPES = ("generate", "infill", "chat", "cancel", "hello", "health", "stats", "models")
_adapter = TypeAdapter(Request)


def _summary(err: ValidationError) -> str:
    parts = []
    for e in err.errors()[:3]:
        loc = ".".join(_short(p) for p in e["loc"][1:]) or "message"
        parts.append(f"{loc}: {e['msg']}")
    more = err.error_count() - len(parts)
    return "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")


def _short(part, limit: int = 64) -> str:
    """A field path element as shown in an error: a client's unknown key is echoed, but never at length."""
    text = str(part)
    return text if len(text) <= limit else text[:limit] + "..."


def parse_request(message: dict) -> Union[Generate, Infill, Chat, Cancel, Hello, Health, Stats, Models]:
    """Validate one decoded map. Raises ProtocolError with a wire code and the request id if any."""
    rid = message.get("id")
    rid = rid if isinstance(rid, str) and 0 < len(rid) <= MAX_ID_LEN else ""
    kind = message.get("type")
    if kind not in REQUEST_TYPES:
        raise ProtocolError(UNKNOWN_TYPE, f"unknown message type {kind!r}; expected one of {', '.join(REQUEST_TYPES)}"
                            if isinstance(kind, str) and len(kind) < 64 else "message has no valid 'type'", rid)
    try:
        return _adapter.validate_python(message)
    except ValidationError as e:
        raise ProtocolError(INVALID_REQUEST, f"{kind}: {_summary(e)}", rid) from None


def negotiate(hello: Hello) -> int:
    """The highest version both sides speak, or ProtocolError."""
    common = sorted(set(hello.versions) & set(SUPPORTED_VERSIONS))
    if not common:
        raise ProtocolError(UNSUPPORTED_VERSION,
                            f"client speaks {sorted(set(hello.versions))}, daemon speaks {list(SUPPORTED_VERSIONS)}",
                            hello.id)
    return common[-1]


# ---- events: what the daemon sends -----------------------------------------------------------

# Finish reasons in ``done``. The engine's own: stop, length. The daemon's: cancelled (by the
# client, a replacing infill, or the client vanishing), deadline, shutdown (drained at exit).
FINISH_REASONS = ("stop", "length", "cancelled", "deadline", "shutdown")


@dataclass(frozen=True)
class Token:
    """New text for request ``id``. ``seq`` counts token events from 0 with no gaps."""

    id: str
    seq: int
    text: str
    token_ids: list[int]
    logprobs: Optional[list] = None
    type: str = field(default="token", init=False)


@dataclass(frozen=True)
class Sentence:
    """A finished sentence or line of the output so far (for speech); ``seq`` counts from 0."""

    id: str
    seq: int
    text: str
    type: str = field(default="sentence", init=False)


@dataclass(frozen=True)
class Done:
    """The last event of a request that was not refused. Timings are in milliseconds."""

    id: str
    finish_reason: str
    usage: dict            # prompt_tokens, completion_tokens, cached_tokens, shifted_tokens
    timings: dict          # queued_ms, prompt_ms, decode_ms, total_ms
    speculative: dict = field(default_factory=dict)   # proposed, accepted, acceptance
    type: str = field(default="done", init=False)


@dataclass(frozen=True)
class Error:
    """The last event of a request that failed or was refused; ``code`` is stable, see the docs."""

    id: str
    code: str
    message: str
    type: str = field(default="error", init=False)


@dataclass(frozen=True)
class Ack:
    """Answer to ``cancel``: ``found`` tells whether ``target`` was still in flight."""

    id: str
    target: str
    found: bool
    type: str = field(default="ack", init=False)


@dataclass(frozen=True)
class Reply:
    """Answer to hello, health, stats or models: ``type`` echoes the request, ``body`` holds the rest."""

    id: str
    type: str
    body: dict

    def to_wire(self) -> dict:
        return {**self.body, "type": self.type, "id": self.id}


@dataclass(frozen=True)
class Keepalive:
    """Sent by the daemon to check that a client with work in flight is still there; ignore it."""

    id: str = ""
    type: str = field(default="keepalive", init=False)


EVENT_TYPES = {cls.__dataclass_fields__["type"].default: cls for cls in (Token, Sentence, Done, Error, Ack, Keepalive)}
REPLY_TYPES = ("hello", "health", "stats", "models")
TERMINAL = (Done, Error)


def _to_wire(self) -> dict:
    return asdict(self)


for _cls in EVENT_TYPES.values():
    _cls.to_wire = _to_wire


def from_wire(message: dict) -> Any:
    """Build the typed event for a decoded map. Raises ValueError for an unknown or malformed one."""
    kind = message.get("type")
    if kind in REPLY_TYPES:
        body = {k: v for k, v in message.items() if k not in ("type", "id")}
        return Reply(id=str(message.get("id", "")), type=kind, body=body)
    cls = EVENT_TYPES.get(kind)
    if cls is None:
        raise ValueError(f"unknown event type {kind!r}")
    names = {f.name for f in fields(cls) if f.init}
    try:
        return cls(**{k: v for k, v in message.items() if k in names})
    except TypeError as e:
        raise ValueError(f"malformed {kind} event: {e}") from None
