"""Reading one daemon stream for an HTTP answer, whatever the dialect: the first event (an error
before any token is the answer itself), the events after it, the whole text, finish reasons, and
llama.cpp's ``t_max_predict_ms``. Shared by the OpenAI, llama.cpp and Ollama routes of ``llmd http``."""
from __future__ import annotations

import json
import time
from typing import Optional

from aiohttp import web

from llmd.protocol import Done, Error, Token

from .http_api import FINISH, HttpError, daemon_error


async def first_event(stream):
    """The stream's first event; an error before any token is the HTTP answer itself."""
    async for event in stream:
        if isinstance(event, Error):
            raise daemon_error(event.code, event.message)
        return event
    raise HttpError(502, "the daemon ended the request without an answer", "server_error")


async def events(first, stream):
    """``first``, then the rest of the stream (nothing more when ``first`` already ended it)."""
    yield first
    if isinstance(first, Token):
        async for event in stream:
            yield event


async def predict_limited(events, limit_ms: Optional[int]):
    """llama.cpp's ``t_max_predict_ms``: once a newline has been generated, the answer ends when the
    time since its first token passes ``limit_ms`` (finish reason ``deadline``; the caller leaving
    the stream cancels the rest)."""
    first, newline, count = None, False, 0
    async for event in events:
        yield event
        if not limit_ms or not isinstance(event, Token):
            continue
        now = time.monotonic()
        first, count = first or now, count + len(event.token_ids)
        newline = newline or "\n" in event.text
        if newline and (now - first) * 1000 > limit_ms:
            yield Done(event.id, "deadline", {"completion_tokens": count}, {"decode_ms": (now - first) * 1000})
            return


async def collect(events) -> tuple[str, object]:
    """The whole text and the final event; a daemon error becomes the HTTP error."""
    parts, final = [], None
    async for event in events:
        if isinstance(event, Token):
            parts.append(event.text)
        else:
            final = event
    raise_error(final)
    return "".join(parts), final


def raise_error(final) -> None:
    if isinstance(final, Error):
        raise daemon_error(final.code, final.message)
    if not isinstance(final, Done):
        raise HttpError(502, "the daemon ended the request without an answer", "server_error")


def finish_reason(final) -> str:
    """OpenAI's finish reason (stop or length) for llmd's."""
    return FINISH.get(getattr(final, "finish_reason", "stop"), "stop")


def finished(response: web.Response, final) -> web.Response:
    response.headers["X-Llmd-Finish-Reason"] = getattr(final, "finish_reason", "") or ""
    return response


async def send_event(response: web.StreamResponse, obj: dict) -> None:
    """One server-sent event."""
    await response.write(b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n")
