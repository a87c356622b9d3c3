"""llmd's clients over any OpenAI-compatible server: vLLM, SGLang, llama.cpp's server, Ollama, `llmd http`.

``HttpBackend`` has the calls and events of ``AsyncClient`` (generate, infill, chat, models,
health; streams of Token then one Done or Error), so ``llmd lsp``, ``voice``, ``batch`` and ``run``
move by changing one URL. What such a server lacks is done here where it can be and said where
not; ``features`` names each one and how it is served:

* ``replace``: emulated: a new infill with the same key closes the previous one's connection (the
  server stops it when it notices).
* ``sentences``: emulated: split here from the streamed text.
* ``priority``: off: every request is served at the server's one priority.
* fill-in-the-middle: llama.cpp's ``/infill`` where the server has it, else ``/v1/completions``
  with the model's FIM tokens written out (``FIM_TEMPLATES``, by model name, or ``fim_template``).
"""
from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
from typing import Any, Optional

import aiohttp

from .client import AsyncStream, ClientError, DaemonUnavailable, Timeout
from llmd.protocol import Done, Error, Sentence, Token
from llmd.sentences import SentenceSplitter

log = logging.getLogger("llmd.client.http")

# (substring of the model name, template); the first match wins, the last is the default.
FIM_TEMPLATES = (
    ("deepseek", "<｜fim▁begin｜>{prefix}<｜fim▁hole｜>{suffix}<｜fim▁end｜>"),
    ("codellama", "<PRE> {prefix} <SUF>{suffix} <MID>"),
    ("starcoder", "<fim_prefix>{prefix}<fim_suffix>{suffix}<fim_middle>"),
    ("codestral", "[SUFFIX]{suffix}[PREFIX]{prefix}"),
    ("", "{files}<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>"),
)
FILE_TEMPLATE = "<|file_sep|>{path}\n{text}"
HTTP_ERRORS = {400: "invalid_request", 404: "invalid_request", 413: "invalid_request", 422: "invalid_request",
               409: "duplicate_id", 429: "busy", 503: "busy"}
FEATURES = {"replace": "emulated (the previous request's connection is closed)",
            "sentences": "emulated (split by the client)", "priority": "off (the server's own order)",
            "middle": "off (an infill's middle joins its prefix: llama.cpp's /infill puts its prompt there)"}


def fim_template(model: str, override: Optional[str] = None) -> str:
    if override:
        return override
    name = model.lower()
    return next(t for key, t in FIM_TEMPLATES if key in name)


class HttpStream:
    """One request's events, read from the server's server-sent events; ``aclose()`` drops the
    connection, which is how an HTTP server learns to stop."""

    def __init__(self, backend: "HttpBackend", rid: str, response: aiohttp.ClientResponse, dialect: str,
                 sentences: bool):
        self.id = rid
        self.final: Optional[Any] = None
        self._backend, self._response, self._dialect = backend, response, dialect
        self._seq, self._sentence_seq = itertools.count(), itertools.count()
        self._splitter = SentenceSplitter() if sentences else None
        self._pending: list = []
        self._usage: dict = {}
        self._timings: dict = {}
        self._prompt_n: Optional[int] = None      # prompt tokens the server computed (its timings)
        self._finish = "stop"
        self._lines = self._read_lines()

    def __aiter__(self):
        return self

    async def __anext__(self):
        while not self._pending:
            if self.final is not None:
                raise StopAsyncIteration
            await self._pull()
        event = self._pending.pop(0)
        if isinstance(event, (Done, Error)):
            self.final = event
            self._release()
        return event

    async def _read_lines(self):
        buf = b""
        async for chunk in self._response.content.iter_any():
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                yield line.rstrip(b"\r")
        if buf:
            yield buf

    async def _pull(self) -> None:
        try:
            async with asyncio.timeout(self._backend.timeout):
                line = await anext(self._lines, None)
        except TimeoutError:
            await self.aclose()
            raise Timeout(f"no event for request {self.id} within {self._backend.timeout}s") from None
        except aiohttp.ClientError as e:
            self._release()
            raise DaemonUnavailable(f"the connection to {self._backend.url} broke: {e}") from None
        if line is None:
            self._end()
            return
        if not line.startswith(b"data:"):
            return
        data = line[5:].strip()
        if data == b"[DONE]":
            self._end()
            return
        try:
            obj = json.loads(data)
        except ValueError:
            return
        self._take(obj)

    def _take(self, obj: dict) -> None:
        if "error" in obj:
            err = obj["error"] if isinstance(obj["error"], dict) else {"message": str(obj["error"])}
            self._pending.append(Error(self.id, str(err.get("code") or "internal"), str(err.get("message"))))
            return
        t = obj.get("timings")
        if isinstance(t, dict):       # llama.cpp's server (and llmd's front) time the prompt and the decode
            self._timings = {"prompt_ms": t.get("prompt_ms"), "decode_ms": t.get("predicted_ms")}
            self._prompt_n = t.get("prompt_n")
        if self._dialect == "infill":
            text, finish = obj.get("content") or "", None
            if obj.get("stop"):
                finish = "length" if obj.get("stop_type") == "limit" else "stop"
                # tokens_cached counts the slot's whole cache after the request: the prompt tokens
                # served from the cache are those it did not compute (prompt_n)
                n, computed = obj.get("tokens_evaluated"), self._prompt_n
                self._usage = {"prompt_tokens": n, "completion_tokens": obj.get("tokens_predicted"),
                               "cached_tokens": max(0, n - computed) if isinstance(n, int) and
                               isinstance(computed, int) else None}
        else:
            if obj.get("usage"):
                u = obj["usage"]
                self._usage = {"prompt_tokens": u.get("prompt_tokens"), "completion_tokens": u.get("completion_tokens"),
                               "cached_tokens": (u.get("prompt_tokens_details") or {}).get("cached_tokens")}
            choice = (obj.get("choices") or [{}])[0]
            text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
            text = text or ""
            finish = choice.get("finish_reason")
        if text:
            self._pending.append(Token(self.id, next(self._seq), text, []))
            if self._splitter is not None:
                self._pending += [Sentence(self.id, next(self._sentence_seq), s) for s in self._splitter.feed(text)]
        if finish:
            self._finish = "length" if finish == "length" else "stop"

    def _end(self) -> None:
        if self._splitter is not None:
            rest = self._splitter.flush()
            if rest:
                self._pending.append(Sentence(self.id, next(self._sentence_seq), rest))
        self._pending.append(Done(self.id, self._finish, self._usage, self._timings))

    def _release(self) -> None:
        self._response.release()
        self._backend._replacing = {k: v for k, v in self._backend._replacing.items() if v is not self}

    text = AsyncStream.text

    async def aclose(self) -> None:
        if self.final is None:
            self.final = Done(self.id, "cancelled", {"completion_tokens": None}, {})
            self._response.close()
            self._release()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.aclose()


class HttpBackend:
    """An ``AsyncClient`` look-alike over an OpenAI-compatible server at ``url``."""

    features = FEATURES

    def __init__(self, url: str, timeout: float = 30.0, api_key: Optional[str] = None, model: Optional[str] = None,
                 fim: str = "auto", fim_template: Optional[str] = None, connect_timeout: float = 5.0):
        if fim not in ("auto", "infill", "completions"):
            raise ValueError("fim must be auto, infill or completions")
        self.url = url.rstrip("/")
        self.base = self.url[:-3] if self.url.endswith("/v1") else self.url
        self.address = self.url
        self.timeout, self.connect_timeout = timeout, connect_timeout
        self.api_key = api_key if api_key is not None else (os.environ.get("LLMD_API_KEY")
                                                            or os.environ.get("OPENAI_API_KEY"))
        self.model, self.fim, self._fim_template = model, fim, fim_template
        self.server_info: dict = {}
        self._session: Optional[aiohttp.ClientSession] = None
        self._ids = itertools.count()
        self._replacing: dict[str, HttpStream] = {}
        self._models: Optional[list[dict]] = None

    # connection --------------------------------------------------------------------------------

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            self._session = aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(
                total=None, connect=self.connect_timeout, sock_connect=self.connect_timeout))
        return self._session

    async def _post(self, path: str, body: dict) -> aiohttp.ClientResponse:
        try:
            return await self._http().post(self.base + path, json=body)
        except aiohttp.ClientError as e:
            raise DaemonUnavailable(f"no server at {self.url} ({e})") from None

    async def _get(self, path: str) -> Any:
        try:
            async with asyncio.timeout(self.timeout):
                async with self._http().get(self.base + path) as r:
                    if r.status >= 400:
                        raise ClientError(f"{self.url}{path} answered {r.status}: {(await r.text())[:200]}")
                    return await r.json(content_type=None)
        except aiohttp.ClientError as e:
            raise DaemonUnavailable(f"no server at {self.url} ({e})") from None
        except TimeoutError:
            raise Timeout(f"no answer from {self.url}{path} within {self.timeout}s") from None

    async def hello(self) -> dict:
        models = await self.models()
        self.server_info = {"server": self.url, "model": models[0]["name"] if models else None, "state": "ready",
                            "features": dict(self.features)}
        return self.server_info

    async def models(self) -> list[dict]:
        if self._models is None:
            data = (await self._get("/v1/models")).get("data") or []
            self._models = [{"name": m.get("id"), "state": "ready",
                             "context_length": m.get("max_model_len") or (m.get("meta") or {}).get("n_ctx_train")
                             or (m.get("meta") or {}).get("context_length")} for m in data]
            if self.model is None and self._models:
                self.model = self._models[0]["name"]
        return self._models

    async def health(self) -> dict:
        try:
            await self._get("/health")
        except ClientError as e:
            if isinstance(e, DaemonUnavailable):
                raise
            return {"state": "failed", "status": str(e)}
        return {"state": "ready"}

    # requests ----------------------------------------------------------------------------------

    def _next_id(self) -> str:
        return f"h{os.getpid()}-{next(self._ids)}"

    @staticmethod
    def _sampling(max_tokens: int, sampling: dict) -> dict:
        """The request's sampling keys, with llmd's defaults where the servers' differ (greedy). ``stream``
        is the daemon's (whole answers in one event); over HTTP the client always streams."""
        body = {"max_tokens": max_tokens, "temperature": 0.0}
        for k, v in sampling.items():
            if v is None or k == "stream" or (k == "stop" and not v) or (k == "ignore_eos" and not v):
                continue
            body[k] = list(v) if isinstance(v, tuple) else v
        return body

    async def _start(self, path: str, body: dict, rid: str, dialect: str, sentences: bool = False) -> HttpStream:
        response = await self._post(path, {**body, "stream": True})
        if response.status >= 400:
            text = await response.text()
            response.release()
            try:
                err = json.loads(text).get("error") or {}
                message = err.get("message") if isinstance(err, dict) else str(err)
            except (ValueError, AttributeError):
                message = text[:500]
            stream = HttpStream(self, rid, response, dialect, False)
            code = HTTP_ERRORS.get(response.status, "internal")
            stream._pending.append(Error(rid, code, f"{response.status}: {message or text[:200]}"))
            return stream
        return HttpStream(self, rid, response, dialect, sentences)

    async def generate(self, prompt: Optional[str] = None, *, token_ids: Optional[list[int]] = None,
                       max_tokens: int = 64, priority: Optional[str] = None, deadline: Optional[float] = None,
                       sentences: bool = False, request_id: Optional[str] = None, **sampling) -> HttpStream:
        await self.models()
        body = {"model": self.model, "prompt": prompt if prompt is not None else list(token_ids or []),
                **self._sampling(max_tokens, sampling), "stream_options": {"include_usage": True}}
        return await self._start("/v1/completions", body, request_id or self._next_id(), "openai", sentences)

    async def chat(self, messages: list[dict], *, max_tokens: int = 256, priority: Optional[str] = None,
                   deadline: Optional[float] = None, sentences: bool = False, request_id: Optional[str] = None,
                   **sampling) -> HttpStream:
        await self.models()
        body = {"model": self.model, "messages": list(messages), **self._sampling(max_tokens, sampling),
                "stream_options": {"include_usage": True}}
        return await self._start("/v1/chat/completions", body, request_id or self._next_id(), "openai", sentences)

    async def infill(self, prefix: str, suffix: str = "", *, files: Optional[list[tuple[str, str]]] = None,
                     replace: Optional[str] = None, max_tokens: int = 64, priority: Optional[str] = None,
                     deadline: Optional[float] = None, request_id: Optional[str] = None,
                     layout: Optional[str] = None, shift_reuse: Optional[bool] = None,
                     middle: Optional[str] = None, **sampling) -> HttpStream:
        """``layout`` is not sent: on llama.cpp's ``/infill`` the server's ``--spm-infill`` decides the
        order, and over ``/v1/completions`` the FIM template does. ``shift_reuse`` is llmd's own: an
        HTTP server reuses its cache as it is configured to. ``middle`` joins the prefix (llama.cpp's
        ``/infill`` puts its ``prompt`` at the prefix's end, before the suffix)."""
        await self.models()
        if replace is not None and replace in self._replacing:
            await self._replacing.pop(replace).aclose()
        rid = request_id or self._next_id()
        stream = None
        if self.fim in ("auto", "infill"):
            stream = await self._infill_native(prefix + (middle or ""), suffix, files, max_tokens, rid, sampling)
            if stream is None and self.fim == "infill":
                raise ClientError(f"{self.url} has no /infill endpoint")
        if stream is None:
            template = fim_template(self.model or "", self._fim_template)
            extra = "".join(FILE_TEMPLATE.format(path=p, text=t if t.endswith("\n") or not t else t + "\n")
                            for p, t in files or ())
            prompt = template.format(prefix=prefix + (middle or ""), suffix=suffix, files=extra)
            stream = await self._start("/v1/completions", {"model": self.model, "prompt": prompt,
                                                           **self._sampling(max_tokens, sampling)}, rid, "openai")
        if replace is not None:
            self._replacing[replace] = stream
        return stream

    async def _infill_native(self, prefix, suffix, files, max_tokens, rid, sampling) -> Optional[HttpStream]:
        body = {"input_prefix": prefix, "input_suffix": suffix, "n_predict": max_tokens, "cache_prompt": True,
                "input_extra": [{"filename": p, "text": t} for p, t in files or ()]}
        s = self._sampling(max_tokens, sampling)
        s.pop("max_tokens")
        temperature = s.get("temperature") or 0.0
        if temperature == 0.0:          # llama.cpp samples unless the chain is greedy
            s["samplers"], s["top_k"] = ["top_k"], 1
        body.update(s)
        stream = await self._start("/infill", body, rid, "infill")
        first = stream._pending[0] if stream._pending else None
        if isinstance(first, Error) and first.message.startswith(("404", "405", "501")):
            if self.fim == "auto":
                self.fim = "completions"
                log.info("%s has no /infill: filling in the middle over /v1/completions", self.url)
            return None
        if self.fim == "auto":
            self.fim = "infill"
        return stream

    async def cancel(self, request_id: str) -> bool:
        return False

    async def stats(self) -> dict:
        return {"server": self.url, "features": dict(self.features)}

    async def aclose(self) -> None:
        for stream in list(self._replacing.values()):
            await stream.aclose()
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.aclose()


def is_http(url: Optional[str]) -> bool:
    return bool(url) and url.startswith(("http://", "https://"))
