"""Ollama's API on ``llmd http``: ``/api/generate``, ``/api/chat`` (JSON lines while streaming, the
default), ``/api/tags``, ``/api/show``, ``/api/ps`` and ``/api/version``. The bodies and answers are
in ``http_ollama_api``; errors have Ollama's shape, ``{"error": message}`` (the front's edge)."""
from __future__ import annotations

import json
from typing import Optional

from aiohttp import web

from llmd.protocol import Error, Token

from .http_api import HttpError, Work, parse
from .http_ollama_api import (API_VERSION, ChatBody, GenerateBody, Shaper, ShowBody, chat_work, generate_work,
                              model_entry, running_entry, show, tagged)
from .http_stream import collect, events, finished, first_event
from .http_tools import ToolStream, parse_calls


class OllamaRoutes:
    """The handlers; ``front`` reads bodies, asks the daemon and starts its streams."""

    def __init__(self, front):
        self.front = front
        self._model: Optional[dict] = None        # the daemon's model, asked once (again by tags, show, ps)

    def add_to(self, router: web.UrlDispatcher) -> None:
        router.add_post("/api/generate", self.generate)
        router.add_post("/api/chat", self.chat)
        router.add_get("/api/tags", self.tags)
        router.add_post("/api/show", self.show)
        router.add_get("/api/ps", self.ps)
        router.add_get("/api/version", self.version)

    async def _models(self) -> list[dict]:
        models = await self.front.daemon_models()
        if not models:
            raise HttpError(503, "the daemon serves no model yet", "server_error", code="unavailable")
        self._model = models[0]
        return models

    async def _served(self) -> dict:
        if self._model is None:
            await self._models()
        return self._model

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = parse(GenerateBody, await self.front.read_body(request))
        m = await self._served()
        work = generate_work(body, bool(m.get("chat")), m.get("context_length") or 0)
        return await self._answer(request, work, Shaper(body.model or tagged(m["name"]), chat=False))

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = parse(ChatBody, await self.front.read_body(request))
        m = await self._served()
        work = chat_work(body, m.get("context_length") or 0)
        return await self._answer(request, work, Shaper(body.model or tagged(m["name"]), chat=True))

    async def _answer(self, request: web.Request, work: Optional[Work], shaper: Shaper) -> web.StreamResponse:
        if work is None:
            return web.json_response(shaper.loaded())
        stream = await self.front.start(work, whole=not work.stream)
        names = work.extra.get("tool_names") or set()
        async with stream:
            first = await first_event(stream)
            if not work.stream:
                text, final = await collect(events(first, stream))
                text, calls = parse_calls(text, names)
                return finished(web.json_response(shaper.final(text, final, [c.ollama() for c in calls])), final)
            response = await self.front.sse(request, "application/x-ndjson")
            final, tools = None, ToolStream(names)
            async for event in events(first, stream):
                if not isinstance(event, Token):
                    final = event
                elif event.text:
                    await _released(response, shaper, tools.feed(event.text))
            await _released(response, shaper, tools.finish())
            await _line(response, {"error": final.message} if isinstance(final, Error) else shaper.final("", final))
            await response.write_eof()
            return response

    async def tags(self, request: web.Request) -> web.Response:
        return web.json_response({"models": [model_entry(m) for m in await self._models()]})

    async def ps(self, request: web.Request) -> web.Response:
        models = await self._models()
        return web.json_response({"models": [running_entry(m) for m in models if m.get("state") == "ready"]})

    async def show(self, request: web.Request) -> web.Response:
        parse(ShowBody, await self.front.read_body(request))
        models = await self._models()
        return web.json_response(show(models[0]))

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": API_VERSION})


async def _released(response: web.StreamResponse, shaper: Shaper, released: tuple) -> None:
    """What a ToolStream let go: text, and the calls in one chunk, as Ollama streams them."""
    text, calls = released
    if text or calls:
        await _line(response, shaper.chunk(text, [c.ollama() for c in calls]))


async def _line(response: web.StreamResponse, obj: dict) -> None:
    """One JSON line of a streamed answer."""
    await response.write(json.dumps(obj, ensure_ascii=False).encode() + b"\n")
