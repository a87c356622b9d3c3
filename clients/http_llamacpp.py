"""llama.cpp's ``/completion``, ``/tokenize`` and ``/detokenize`` on ``llmd http`` (its ``/infill``
is the front's own).

``/completion`` takes llama.cpp's body (``http_options`` for the sampling fields) and answers as
llama.cpp does: ``content``, ``stop``, ``timings`` ..., streamed as server-sent events whose last
one has ``stop`` true. Unknown fields are refused (400, naming them): one may change the output.
Fields of features llmd lacks are accepted only where they are off (``n_probs`` 0, an empty
``grammar`` ...); those that do not change the text are accepted (``cache_prompt``: llmd always
caches prefixes; ``id_slot``, ``n_keep``, ``t_max_prompt_ms``).
"""
from __future__ import annotations

import asyncio
from typing import Annotated, Any, Optional, Union

from aiohttp import web
from pydantic import Field

from llmd.protocol import MAX_PROMPT_TOKENS, Done, Error, Token

from .http_api import MAX_TOKENS, Finite, HttpError, Text, Work, daemon_error, infill_reply, parse
from .http_knobs import chained
from .http_options import LlamaSampling, Strict, predicted, refuse
from .http_stream import events, finished, first_event, predict_limited, raise_error, send_event
from .http_tokens import ModelTokenizer

TokenId = Annotated[int, Field(ge=0, lt=1 << 31)]
TokenIds = Annotated[list[TokenId], Field(min_length=1, max_length=MAX_PROMPT_TOKENS)]
Small = Annotated[int, Field(ge=-1, le=1 << 20)]
Knob = Optional[Annotated[Finite, Field(ge=-1000, le=1000)]]


class CompletionBody(LlamaSampling):
    prompt: Union[Text, TokenIds, Annotated[list[Text], Field(min_length=1, max_length=1)]]
    n_predict: Optional[Annotated[int, Field(ge=-2, le=MAX_TOKENS)]] = None
    penalty_last_n: Optional[Annotated[int, Field(ge=-1, le=MAX_TOKENS)]] = None
    stream: bool = False
    ignore_eos: bool = False
    samplers: Annotated[list[Annotated[str, Field(max_length=32)]], Field(max_length=16)] = []
    return_tokens: bool = False
    t_max_predict_ms: Optional[Annotated[int, Field(ge=0, le=86_400_000)]] = None
    # no effect on the text
    cache_prompt: bool = True
    id_slot: Optional[Small] = None
    n_keep: Optional[Small] = None
    t_max_prompt_ms: Optional[Annotated[int, Field(ge=-1, le=86_400_000)]] = None
    # features llmd lacks: accepted only where they are off
    n_probs: Optional[Annotated[int, Field(ge=0, le=1 << 20)]] = None
    post_sampling_probs: bool = False
    dynatemp_range: Knob = None
    dry_multiplier: Knob = None
    xtc_probability: Knob = None
    top_n_sigma: Knob = None
    n_indent: Optional[Small] = None
    grammar: Optional[Text] = None
    json_schema: Any = None
    logit_bias: Any = None
    image_data: Any = None
    lora: Any = None
    # settings of those features: no effect while they are off
    dynatemp_exponent: Knob = None
    dry_base: Knob = None
    dry_allowed_length: Optional[Small] = None
    dry_penalty_last_n: Optional[Small] = None
    dry_sequence_breakers: Optional[Annotated[list[Annotated[str, Field(max_length=64)]], Field(max_length=16)]] = None
    xtc_threshold: Knob = None
    min_keep: Optional[Small] = None

    def last_n(self) -> tuple[str, Optional[int]]:
        if self.penalty_last_n is not None:
            return "penalty_last_n", self.penalty_last_n
        return "repeat_last_n", self.repeat_last_n


OFF = {"n_probs": "token probabilities are not served on /completion (the OpenAI endpoints have logprobs)",
       "post_sampling_probs": "token probabilities are not served on /completion",
       "dynatemp_range": "llmd has no dynamic temperature", "dry_multiplier": "llmd has no DRY sampler",
       "xtc_probability": "llmd has no XTC sampler", "n_indent": "llmd has no indentation stop on /completion",
       "grammar": "grammars are not served by llmd yet", "json_schema": "structured output is not served by llmd yet",
       "logit_bias": "llmd has no logit bias", "image_data": "llmd serves text models",
       "lora": "llmd serves no adapters"}


class TokenizeBody(Strict):
    content: Text
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeBody(Strict):
    tokens: Annotated[list[TokenId], Field(max_length=MAX_PROMPT_TOKENS)]


def completion_work(body: CompletionBody) -> Work:
    """The llmd work of one ``/completion``: a text prompt or token ids. Given ``samplers``, the
    filters and temperature the chain leaves out are not applied (as on ``/infill``)."""
    for name, why in OFF.items():
        if getattr(body, name):
            refuse(name, f"{why}: only its off value is accepted")
    if body.top_n_sigma is not None and body.top_n_sigma > 0:
        refuse("top_n_sigma", "llmd has no top-n-sigma sampler: only -1 (off) is accepted")
    sampling = {**predicted(body.n_predict, MAX_TOKENS), **body.sampling()}
    if body.ignore_eos:
        sampling["ignore_eos"] = True
    sampling = chained(sampling, body.samplers)
    prompt = body.prompt[0] if isinstance(body.prompt, list) and isinstance(body.prompt[0], str) else body.prompt
    fields = {"prompt": prompt} if isinstance(prompt, str) else {"token_ids": prompt}
    return Work("generate", fields, sampling, body.stream,
                extra={"return_tokens": body.return_tokens, "t_max_predict_ms": body.t_max_predict_ms})


def completion_reply(text: str, ids: list[int], done, model: str, return_tokens: bool) -> dict:
    reply = {**infill_reply(text, done), "model": model}
    if return_tokens:
        reply["tokens"] = ids
    return reply


class LlamaCppRoutes:
    """The handlers; ``front`` reads bodies, asks the daemon and starts its streams."""

    def __init__(self, front):
        self.front = front
        self._tokenizers: dict[str, ModelTokenizer] = {}      # by model path

    def add_to(self, router: web.UrlDispatcher) -> None:
        router.add_post("/completion", self.completion)
        router.add_post("/tokenize", self.tokenize)
        router.add_post("/detokenize", self.detokenize)

    async def completion(self, request: web.Request) -> web.StreamResponse:
        body = parse(CompletionBody, await self.front.read_body(request))
        work = completion_work(body)
        if self.front.model is None:
            await self.front.daemon_models()
        model = self.front.model or "llmd"
        # whole answers come in one event unless the time limit needs to see each token
        stream = await self.front.start(work, whole=not work.stream and not body.t_max_predict_ms)
        async with stream:
            first = await first_event(stream)
            produced = predict_limited(events(first, stream), body.t_max_predict_ms)
            if not work.stream:
                text, ids, final = await _gather(produced)
                return finished(web.json_response(completion_reply(text, ids, final, model, body.return_tokens)), final)
            response = await self.front.sse(request)
            final = None
            async for event in produced:
                if not isinstance(event, Token):
                    final = event
                elif event.text or body.return_tokens:
                    chunk = {"content": event.text, "stop": False}
                    await send_event(response, {**chunk, "tokens": event.token_ids} if body.return_tokens else chunk)
            if isinstance(final, Done):
                await send_event(response, completion_reply("", [], final, model, False))
            else:
                error = daemon_error(final.code, final.message) if isinstance(final, Error) else \
                    HttpError(502, "the daemon ended the request without an answer", "server_error")
                await send_event(response, error.body())
            await response.write_eof()
            return response

    async def tokenize(self, request: web.Request) -> web.Response:
        body = parse(TokenizeBody, await self.front.read_body(request))
        tok = await self._tokenizer()
        ids = await asyncio.to_thread(tok.encode, body.content, body.add_special, body.parse_special)
        if not body.with_pieces:
            return web.json_response({"tokens": ids})
        pieces = await asyncio.to_thread(tok.pieces, ids)
        return web.json_response({"tokens": [{"id": i, "piece": p} for i, p in zip(ids, pieces)]})

    async def detokenize(self, request: web.Request) -> web.Response:
        body = parse(DetokenizeBody, await self.front.read_body(request))
        tok = await self._tokenizer()
        return web.json_response({"content": await asyncio.to_thread(tok.decode, body.tokens)})

    async def _tokenizer(self) -> ModelTokenizer:
        models = await self.front.daemon_models()
        if not models:
            raise HttpError(503, "the daemon serves no model yet", "server_error", code="unavailable")
        path = str(models[0].get("path") or "")
        if path not in self._tokenizers:
            self._tokenizers = {path: await asyncio.to_thread(ModelTokenizer.load, path)}
        return self._tokenizers[path]


async def _gather(produced) -> tuple[str, list[int], object]:
    parts, ids, final = [], [], None
    async for event in produced:
        if isinstance(event, Token):
            parts.append(event.text)
            ids += event.token_ids
        else:
            final = event
    raise_error(final)
    return "".join(parts), ids, final
