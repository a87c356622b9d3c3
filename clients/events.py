"""The events the daemon sends, as typed values shared by the daemon and the Python client.

One class per wire ``type``; ``to_wire`` gives the msgpack map, ``from_wire`` reads one back.
Readers ignore keys they do not know (the daemon may add fields within protocol v1); the daemon
itself refuses unknown keys in requests. Pure Python: no torch, no zmq.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Optional

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
    usage: dict            # prompt_tokens, completion_tokens, cached_tokens
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
