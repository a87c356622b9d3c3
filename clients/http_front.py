"""``llmd http``: OpenAI's, llama.cpp's and Ollama's HTTP APIs in front of the daemon's ZeroMQ socket.

A separate process (alone, or the child of ``llmd serve --http``): aiohttp serves HTTP/1.1, each
request is parsed at the edge (``http_api``; ``/completion`` and ``/tokenize`` in ``http_llamacpp``,
Ollama's ``/api/*`` in ``http_ollama``, ``/metrics`` in ``http_metrics``) and sent over one ZeroMQ
connection, and the daemon's events come back as JSON, server-sent events or (Ollama's) JSON lines. A
client that goes away cancels its request: aiohttp cancels the handler; leaving the stream, ``cancel``.

Safe by default: a unix socket or 127.0.0.1 only; another address needs ``--allow-remote`` and
``--api-key-file``. Bounded: body, header lines and count, open connections, the time a request's
head and body may take (``http_guard``), fields as on the ZeroMQ edge. No CORS unless asked.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import ipaddress
from dataclasses import dataclass
from typing import Optional

from aiohttp import web

from .client import AsyncClient, ClientError, RequestTooLarge
from llmd.protocol import Error, Token
from .http_api import (ChatBody, CompletionBody, HttpError, InfillBody, Shaper, Work, chat_logprobs, chat_work,
                       completion_logprobs, completion_work, daemon_error, infill_reply, infill_work, merge_logprobs,
                       parse)
from .http_llamacpp import LlamaCppRoutes
from .http_metrics import FrontMetrics
from .http_ollama import OllamaRoutes
from .http_stream import (collect, events, finish_reason, finished, first_event, predict_limited,
                          raise_error, send_event)
from .http_tools import ToolStream, parse_calls


@dataclass(frozen=True)
class FrontConfig:
    socket: Optional[str] = None               # the daemon's ZeroMQ address
    host: str = "127.0.0.1"
    port: int = 8080
    unix: Optional[str] = None                 # listen on this unix socket instead of TCP
    api_key: Optional[str] = None
    allow_remote: bool = False
    cors_origins: tuple[str, ...] = ()
    max_body_bytes: int = 2 << 20
    max_header_bytes: int = 8190               # one header line
    max_headers: int = 64
    max_connections: int = 64
    head_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keepalive_s: float = 15.0

    def check(self) -> None:
        """Refuse a configuration that would expose the daemon: raises ValueError saying what to do."""
        if self.unix is None and not is_loopback(self.host):
            if not self.allow_remote:
                raise ValueError(f"refusing to listen on {self.host}: only 127.0.0.1, ::1 or a unix socket by "
                                 "default; pass --allow-remote with --api-key-file to serve other machines")
            if not self.api_key:
                raise ValueError(f"refusing to listen on {self.host} without a key: pass --api-key-file FILE "
                                 "(clients then send 'Authorization: Bearer <key>')")
        for name in ("max_body_bytes", "max_header_bytes", "max_headers", "max_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if min(self.head_timeout_s, self.body_timeout_s, self.keepalive_s) <= 0:
            raise ValueError("timeouts must be positive")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Front:
    """The HTTP application: routes, auth, CORS and the translation of one request at a time."""

    def __init__(self, config: FrontConfig, client: Optional[AsyncClient] = None):
        self.config = config
        self.client = client or AsyncClient(config.socket, timeout=600.0)
        self.model: Optional[str] = None          # the daemon's, asked once
        self.metrics = FrontMetrics(self.client)
        self.app = web.Application(client_max_size=config.max_body_bytes, middlewares=(self.metrics.count, self._edge))
        r = self.app.router
        for path in ("", "/v1"):
            r.add_get(path + "/health", self.health)
            r.add_get(path + "/models", self.models)
            r.add_post(path + "/completions", self.completions)
            r.add_post(path + "/chat/completions", self.chat)
            r.add_post(path + "/infill", self.infill)
        LlamaCppRoutes(self).add_to(r)
        self.metrics.add_to(r)
        OllamaRoutes(self).add_to(r)

    # edge: errors, auth, CORS ------------------------------------------------------------------

    @web.middleware
    async def _edge(self, request: web.Request, handler):
        origin = request.headers.get("Origin")
        cors = origin if origin and origin in self.config.cors_origins or "*" in self.config.cors_origins else None
        try:
            if request.method == "OPTIONS" and cors:
                response = web.Response(status=204)
            else:
                self._authorize(request)
                response = await handler(request)
        except HttpError as e:
            response = web.json_response(_error_body(request, e), status=e.status)
            if e.status in (408, 413):          # the body was not read whole: the connection is out of step
                response.force_close()
        except web.HTTPException as e:          # aiohttp's own: 404, 405, 413 ...
            if e.status < 400:
                raise
            error = HttpError(e.status, e.reason, "invalid_request_error", code=e.reason.lower().replace(" ", "_"))
            response = web.json_response(_error_body(request, error), status=e.status)
        if cors and not response.prepared:
            response.headers["Access-Control-Allow-Origin"] = cors
            response.headers["Access-Control-Allow-Headers"] = "Authorization, Content-Type"
            response.headers["Access-Control-Allow-Methods"] = "GET, POST, OPTIONS"
            response.headers["Vary"] = "Origin"
        return response

    def _authorize(self, request: web.Request) -> None:
        key = self.config.api_key
        if not key or request.path in ("/health", "/v1/health"):
            return
        given = request.headers.get("Authorization", "")
        token = given[7:] if given[:7].lower() == "bearer " else ""
        if not hmac.compare_digest(token.encode(), key.encode()):
            raise HttpError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                            "invalid_request_error", code="invalid_api_key")

    async def read_body(self, request: web.Request) -> bytes:
        try:
            async with asyncio.timeout(self.config.body_timeout_s):
                return await request.read()
        except TimeoutError:
            raise HttpError(408, f"the request body did not arrive within {self.config.body_timeout_s:g} s",
                            code="request_timeout") from None
        except web.HTTPRequestEntityTooLarge:
            raise HttpError(413, f"the body is over {self.config.max_body_bytes:,} bytes",
                            code="body_too_large") from None

    # routes ------------------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        try:
            h = await self.client.health()
        except ClientError as e:
            raise HttpError(503, f"the daemon is unavailable: {e}", "server_error", code="unavailable") from None
        if h.get("state") != "ready":
            raise HttpError(503, f"the daemon is {h.get('state')}: {h.get('status') or ''}".strip(),
                            "server_error", code=h.get("state"))
        return web.json_response({"status": "ok", "in_flight": h.get("in_flight")})

    async def models(self, request: web.Request) -> web.Response:
        models = await self.daemon_models()
        data = [{"id": m["name"], "object": "model", "created": 0, "owned_by": "llmd",
                 "max_model_len": m.get("context_length"),
                 "meta": {k: m.get(k) for k in ("context_length", "vocab_size", "chat", "infill", "state")}}
                for m in models]
        return web.json_response({"object": "list", "data": data})

    async def daemon_models(self) -> list[dict]:
        try:
            models = await self.client.models()
        except ClientError as e:
            raise HttpError(503, f"the daemon is unavailable: {e}", "server_error", code="unavailable") from None
        if models:
            self.model = models[0]["name"]
        return models

    async def completions(self, request: web.Request) -> web.StreamResponse:
        work = completion_work(parse(CompletionBody, await self.read_body(request)))
        return await self._openai(request, work, "text_completion", "cmpl")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        work = chat_work(parse(ChatBody, await self.read_body(request)))
        return await self._openai(request, work, "chat.completion", "chatcmpl")

    async def infill(self, request: web.Request) -> web.StreamResponse:
        work = infill_work(parse(InfillBody, await self.read_body(request)))
        if work.extra["n_predict"] == 0:           # llama.vim's context warm-up: nothing to predict
            return web.json_response(infill_reply("", None))
        replace = "http:" + hashlib.sha256(_client_key(request).encode()).hexdigest()[:32]
        stream = await self.start(dataclasses.replace(work, fields={**work.fields, "replace": replace}),
                                   priority="interactive")
        limit_ms = work.extra["t_max_predict_ms"]
        async with stream:
            first = await first_event(stream)
            produced = predict_limited(events(first, stream), limit_ms)
            if not work.stream:
                text, final = await collect(produced)
                return finished(web.json_response(infill_reply(text, final)), final)
            response = await self.sse(request)
            final = None
            async for event in produced:
                if isinstance(event, Token):
                    await send_event(response, {"content": event.text, "stop": False})
                else:
                    final = event
            await send_event(response, {**infill_reply("", final), "stop": True})
            await response.write_eof()
            return response

    async def _openai(self, request: web.Request, work: Work, kind: str, prefix: str) -> web.StreamResponse:
        if self.model is None:
            await self.daemon_models()
        # whole answers come in one event, but logprobs name each token's own text, which needs its event
        stream = await self.start(work, whole=not work.stream and work.logprobs is None)
        shaper = Shaper(kind, self.model or "llmd", f"{prefix}-{stream.id}")
        lp = chat_logprobs if shaper.chat else completion_logprobs
        async with stream:
            first = await first_event(stream)
            if not work.stream:
                parts, logprobs, final = [], None, None
                async for event in events(first, stream):
                    if isinstance(event, Token):
                        parts.append(event.text)
                        logprobs = merge_logprobs(logprobs, lp(event.logprobs, event.text) if event.logprobs else None)
                    else:
                        final = event
                raise_error(final)
                if work.logprobs is not None and logprobs is None:
                    logprobs = lp([], "")
                text, calls = parse_calls("".join(parts), work.extra.get("tool_names") or set(),
                                          work.extra.get("max_calls"))
                return finished(web.json_response(shaper.whole(text, logprobs, finish_reason(final), final.usage,
                                                               [c.openai() for c in calls])), final)
            response = await self.sse(request)
            if shaper.chat:
                await send_event(response, shaper.chunk("", None, first=True))
            final, calls = None, 0
            tools = ToolStream(work.extra.get("tool_names") or set(), work.extra.get("max_calls"))
            async for event in events(first, stream):
                if isinstance(event, Token):
                    calls += await self._send_text(response, shaper, tools.feed(event.text), calls,
                                                   lp(event.logprobs, event.text) if event.logprobs else None)
                else:
                    final = event
            calls += await self._send_text(response, shaper, tools.finish(), calls, None)
            if isinstance(final, Error):
                await send_event(response, daemon_error(final.code, final.message).body())
            else:
                await send_event(response, shaper.chunk("", None, "tool_calls" if calls else finish_reason(final)))
                if work.include_usage:
                    await send_event(response, shaper.usage_chunk(final.usage))
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response

    @staticmethod
    async def _send_text(response, shaper: Shaper, released: tuple, first_index: int, logprobs) -> int:
        """Send what a ToolStream released: its text (with the event's logprobs) and each call as a
        ``tool_calls`` delta; returns how many calls went out."""
        text, calls = released
        if text or (logprobs and not calls):
            await send_event(response, shaper.chunk(text, logprobs))
        for i, call in enumerate(calls):
            await send_event(response, shaper.chunk("", None, tool_calls=[call.openai(first_index + i)]))
        return len(calls)

    async def start(self, work: Work, priority: Optional[str] = None, whole: bool = False):
        """The daemon stream of ``work``; ``whole``: the daemon sends the output in one event at the end
        (a non-streamed answer needs no event per token)."""
        start = {"generate": self.client.generate, "chat": self.client.chat, "infill": self.client.infill}[work.kind]
        fields = dict(work.fields)
        if work.kind == "chat":
            args = (fields.pop("messages"),)
        elif work.kind == "infill":
            files = fields.pop("files", None)
            fields["files"] = [(f["path"], f["text"]) for f in files] if files else None
            args = (fields.pop("prefix"), fields.pop("suffix", ""))
        else:
            args = (fields.pop("prompt", None),)
        try:
            stream = await start(*args, priority=priority, **fields, **work.sampling, stream=not whole)
            return self.metrics.watch(stream)
        except RequestTooLarge as e:
            raise HttpError(413, str(e), code="too_large") from None
        except ClientError as e:
            raise HttpError(503, f"the daemon is unavailable: {e}", "server_error", code="unavailable") from None

    async def sse(self, request: web.Request, content_type: str = "text/event-stream") -> web.StreamResponse:
        """A prepared streamed answer (server-sent events, or ``content_type``), with CORS when asked."""
        response = web.StreamResponse(headers={"Content-Type": content_type, "Cache-Control": "no-cache",
                                               "X-Accel-Buffering": "no"})
        origin = request.headers.get("Origin")
        if origin and (origin in self.config.cors_origins or "*" in self.config.cors_origins):
            response.headers["Access-Control-Allow-Origin"] = origin
        await response.prepare(request)
        return response

    async def aclose(self) -> None:
        await self.client.aclose()


def _error_body(request: web.Request, error: HttpError) -> dict:
    """OpenAI's error shape, or Ollama's (``{"error": message}``) under ``/api/``."""
    return {"error": error.message} if request.path.startswith("/api/") else error.body()


def _client_key(request: web.Request) -> str:
    """Who "one client" is for ``/infill`` replacement: an ``X-Llmd-Client`` header when given, else
    the caller's address and key (a unix socket's callers share one)."""
    named = request.headers.get("X-Llmd-Client")
    if named:
        return "named:" + named[:128]
    peer = request.transport.get_extra_info("peername") if request.transport else None
    host = peer[0] if isinstance(peer, tuple) and peer else "unix"
    return f"{host}|{request.headers.get('Authorization', '')}"
