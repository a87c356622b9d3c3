"""``llmd voice``: a Wyoming "handle" service that answers transcripts through the daemon.

Events, per connection::

    describe   → info (one handle program, streaming)
    transcript → handled-start, handled-chunk (one per sentence, as each completes),
                 handled (the whole answer), handled-stop

A chunk after the first starts with a space, so the chunks joined are the whole answer. History
is kept per conversation id (``context.conversation_id`` of the transcript, else the satellite)
as chat messages. Barge-in: a new transcript from the same satellite (``context.satellite_id``,
else the connection) cancels the answer in progress at once; that answer ends with
handled-stop and no handled, keeping what was already said in the history.

``sentences``/``iter_sentences`` are the helper for other voice stacks: complete sentences of a
stream as they arrive, cut by llmd.sentences.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import json
import logging
import sys
from dataclasses import dataclass, field
from functools import partial
from typing import AsyncIterator, Iterator, Optional

from wyoming.asr import Transcript
from wyoming.event import Event
from wyoming.handle import Handled, HandledChunk, HandledStart, HandledStop, NotHandled
from wyoming.info import Attribution, Describe, HandleModel, HandleProgram, Info
from wyoming.server import AsyncEventHandler, AsyncServer

from llmd import __version__
from llmd.protocol import Error, Token
from llmd.sentences import SentenceSplitter

from .backend import async_client, backend_of
from .client import AsyncClient, ClientError, RequestError

log = logging.getLogger("llmd.voice")
_ATTRIBUTION = Attribution(name="llmd", url="")


async def sentences(stream) -> AsyncIterator[str]:
    """Complete sentences of an AsyncStream as they arrive; the unfinished rest at the end.
    Raises RequestError if the stream ends in an error. Leaving early cancels the request."""
    splitter = SentenceSplitter()
    try:
        async for event in stream:
            if isinstance(event, Token):
                for sentence in splitter.feed(event.text):
                    yield sentence
    finally:
        await stream.aclose()
    if isinstance(stream.final, Error):
        raise RequestError(stream.final)
    rest = splitter.flush()
    if rest:
        yield rest


def iter_sentences(stream) -> Iterator[str]:
    """Blocking form of ``sentences`` for a Client's Stream."""
    splitter = SentenceSplitter()
    with stream:
        for event in stream:
            if isinstance(event, Token):
                yield from splitter.feed(event.text)
    if isinstance(stream.final, Error):
        raise RequestError(stream.final)
    rest = splitter.flush()
    if rest:
        yield rest


@dataclass(frozen=True)
class VoiceConfig:
    socket: Optional[str] = None
    system_prompt: str = ("You are a helpful voice assistant. Answer briefly, in plain spoken sentences "
                          "without lists or markup.")
    max_tokens: int = 256
    temperature: float = 0.0
    sampling: dict = field(default_factory=dict)   # other sampling keys, e.g. {"top_p": 0.9}
    history_turns: int = 8
    max_conversations: int = 256
    language: str = "en"

    def __post_init__(self):
        if self.history_turns < 0 or self.max_conversations < 1 or self.max_tokens < 1:
            raise ValueError("history_turns must be >= 0, max_conversations and max_tokens >= 1 "
                             f"(got {self.history_turns}, {self.max_conversations}, {self.max_tokens})")


MAX_TRANSCRIPT_CHARS = 8192     # a spoken request; longer is refused (NotHandled), not sent
MAX_EVENT_DATA = 64 << 10       # bytes of an event's JSON data; a handle service gets no audio,
MAX_EVENT_PAYLOAD = 1 << 20     # so a larger frame closes the connection instead of being buffered


async def read_event_bounded(reader: asyncio.StreamReader) -> Optional[Event]:
    """One Wyoming event, or None at the end of the stream or for a frame over the limits (the header
    line is bounded by the reader's own line limit). The library's reader trusts the lengths it is sent."""
    try:
        line = await reader.readline()
        if not line:
            return None
        header = json.loads(line)
        if not isinstance(header, dict) or not isinstance(header.get("type"), str):
            return None
        data_len, payload_len = header.get("data_length") or 0, header.get("payload_length") or 0
        if (not isinstance(data_len, int) or not isinstance(payload_len, int) or not 0 <= data_len <= MAX_EVENT_DATA
                or not 0 <= payload_len <= MAX_EVENT_PAYLOAD):
            log.warning("closing a connection that sent a frame over the size limits")
            return None
        data = header.get("data") or {}
        if data_len:
            extra = json.loads(await reader.readexactly(data_len))
            if not isinstance(data, dict) or not isinstance(extra, dict):
                return None
            data = {**data, **extra}
        payload = await reader.readexactly(payload_len) if payload_len else None
        return Event(type=header["type"], data=data if isinstance(data, dict) else {}, payload=payload)
    except (ValueError, asyncio.IncompleteReadError):
        return None


class Conversations:
    """Chat history per conversation id, the last ``turns`` exchanges each, least recently used dropped."""

    def __init__(self, turns: int, capacity: int):
        self.turns, self.capacity = turns, capacity
        self._history: collections.OrderedDict[str, collections.deque] = collections.OrderedDict()

    def messages(self, cid: str, system: str, user_text: str) -> list[dict]:
        past = list(self._history.get(cid, ()))
        return ([{"role": "system", "content": system}] if system else []) + past + \
            [{"role": "user", "content": user_text}]

    def forget_oldest(self, cid: str) -> bool:
        """Drop the conversation's oldest exchange (to fit the model's context); False when none is left."""
        turns = self._history.get(cid)
        if not turns:
            return False
        turns.popleft()
        if turns:
            turns.popleft()
        return True

    def add(self, cid: str, user_text: str, answer: str) -> None:
        turns = self._history.pop(cid, None) or collections.deque(maxlen=2 * self.turns)
        turns.append({"role": "user", "content": user_text})
        turns.append({"role": "assistant", "content": answer})
        self._history[cid] = turns
        while len(self._history) > self.capacity:
            self._history.popitem(last=False)


class VoiceBridge:
    """What all connections share: the daemon client, the histories and the answer in progress per
    satellite. ``_answers`` is written only by ``answer``."""

    def __init__(self, config: VoiceConfig, client: Optional[AsyncClient] = None):
        self.config = config
        self.client = client or async_client(config.socket, timeout=60.0)
        self.conversations = Conversations(config.history_turns, config.max_conversations)
        self._answers: dict[str, asyncio.Task] = {}

    def info(self, model: str = "llmd") -> Info:
        handle_model = HandleModel(name=model, attribution=_ATTRIBUTION, installed=True, description="llmd chat model",
                                   version=__version__, languages=[self.config.language])
        program = HandleProgram(name="llmd", attribution=_ATTRIBUTION, installed=True, version=__version__,
                                description="answers through a local llmd daemon", models=[handle_model],
                                supports_handled_streaming=True)
        return Info(handle=[program])

    async def answer(self, satellite: str, cid: str, text: str, write) -> asyncio.Task:
        """Stop the satellite's answer in progress (barge-in), then start answering ``text``."""
        old = self._answers.get(satellite)
        if old is not None and not old.done():
            old.cancel()
            await asyncio.gather(old, return_exceptions=True)
        task = asyncio.create_task(self._answer(cid, text, write))
        self._answers[satellite] = task
        task.add_done_callback(lambda t: self._answers.pop(satellite, None) if self._answers.get(satellite) is t
                               else None)
        return task

    async def _answer(self, cid: str, text: str, write) -> None:
        c = self.config
        context = {"conversation_id": cid}
        spoken: list[str] = []
        await write(HandledStart(context=context).event())
        try:
            while True:
                try:
                    stream = await self.client.chat(self.conversations.messages(cid, c.system_prompt, text),
                                                    max_tokens=c.max_tokens, priority="interactive",
                                                    temperature=c.temperature, **c.sampling)
                    async for sentence in sentences(stream):
                        await write(HandledChunk(text=(" " if spoken else "") + sentence).event())
                        spoken.append(sentence)
                    break
                except RequestError as e:
                    # a history grown past the model's context: drop the oldest exchange and ask again
                    if (spoken or e.code != "invalid_request" or "context window" not in e.event.message
                            or not self.conversations.forget_oldest(cid)):
                        raise
                    log.info("conversation %s outgrew the context window: dropped its oldest exchange", cid)
        except asyncio.CancelledError:
            log.info("barge-in: stopped an answer after %d sentence(s)", len(spoken))
            self.conversations.add(cid, text, " ".join(spoken))
            await write(HandledStop().event())
            raise
        except ClientError as e:
            log.warning("answer failed: %s", e)
            await write(NotHandled(text=f"llmd: {e}", context=context).event())
            await write(HandledStop().event())
            return
        answer = " ".join(spoken)
        self.conversations.add(cid, text, answer)
        await write(Handled(text=answer, context=context).event())
        await write(HandledStop().event())

    async def aclose(self) -> None:
        for task in list(self._answers.values()):
            task.cancel()
        await asyncio.gather(*self._answers.values(), return_exceptions=True)
        await self.client.aclose()


_connections = itertools.count()


class VoiceHandler(AsyncEventHandler):
    """One Wyoming connection. Answers run as tasks so that a new transcript can interrupt them."""

    def __init__(self, bridge: VoiceBridge, reader, writer):
        super().__init__(reader, writer)
        self.bridge = bridge
        self.name = f"conn-{next(_connections)}"
        self._tasks: set[asyncio.Task] = set()

    async def run(self) -> None:
        """The library's loop, reading frames with size limits (``read_event_bounded``)."""
        self._is_running = True
        try:
            while self._is_running:
                event = await read_event_bounded(self.reader)
                if event is None or not await self.handle_event(event):
                    break
        finally:
            await self.disconnect()
            self.writer.close()

    async def handle_event(self, event: Event) -> bool:
        if Describe.is_type(event.type):
            await self.write_event(self.bridge.info(self.bridge.client.server_info.get("model") or "llmd").event())
        elif Transcript.is_type(event.type):
            data = event.data if isinstance(event.data, dict) else {}
            text, ctx = data.get("text"), data.get("context") or {}
            if not isinstance(text, str) or not isinstance(ctx, dict) or len(text) > MAX_TRANSCRIPT_CHARS:
                why = (f"a transcript of at most {MAX_TRANSCRIPT_CHARS} characters" if isinstance(text, str)
                       else "a transcript with a text")
                log.warning("refused a malformed transcript from %s", self.name)
                await self.write_event(NotHandled(text=f"llmd: expected {why}").event())
                return True
            satellite = str(ctx.get("satellite_id") or self.name)
            cid = str(ctx.get("conversation_id") or satellite)
            task = await self.bridge.answer(satellite, cid, text, self.write_event)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return True

    async def disconnect(self) -> None:
        for task in list(self._tasks):
            task.cancel()


async def serve_voice(uri: str, config: VoiceConfig, started: Optional[asyncio.Event] = None) -> None:
    """Serve Wyoming on ``uri`` (tcp://HOST:PORT or unix://PATH) until cancelled."""
    bridge = VoiceBridge(config)
    server = AsyncServer.from_uri(uri)
    try:
        await server.start(partial(VoiceHandler, bridge))
        if started is not None:
            started.set()
        await asyncio.Event().wait()
    finally:
        await server.stop()
        await bridge.aclose()


def run_voice(args) -> int:
    logging.basicConfig(level="INFO", format="llmd voice: %(levelname)s %(message)s")
    try:
        config = VoiceConfig(socket=backend_of(args), system_prompt=args.system_prompt or VoiceConfig.system_prompt,
                             max_tokens=args.max_tokens, temperature=args.temperature,
                             history_turns=args.history_turns, language=args.language)
        asyncio.run(serve_voice(args.uri, config))
    except KeyboardInterrupt:
        pass
    except ValueError as e:
        print(f"llmd voice: {e}", file=sys.stderr)
        return 2
    return 0

