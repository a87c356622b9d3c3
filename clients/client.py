"""Python clients for the llmd daemon: ``Client`` (blocking) and ``AsyncClient`` (asyncio).

    with Client() as c:
        for ev in c.generate("def fib(n):", max_tokens=32):
            if isinstance(ev, Token): print(ev.text, end="")

``generate``, ``infill`` and ``chat`` return a stream of typed events (Token, Sentence, then one
Done or Error). Leaving the stream early (``close()``, the end of a ``with`` block, or dropping
it) cancels the request in the daemon. A client talks over one DEALER socket, is used from one
thread (or one event loop), and reconnects on the next call after the daemon restarts.
Imports no torch.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import os
import time
import weakref
from pathlib import Path
from typing import Any, Optional

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from llmd import codec, sampling_fields
from llmd.protocol import TERMINAL, Ack, Done, Error, Keepalive, Sentence, Token, default_socket_path, from_wire

__all__ = ["Client", "AsyncClient", "Stream", "AsyncStream", "ClientError", "DaemonUnavailable",
           "ConnectionLost", "Timeout", "RequestError", "RequestTooLarge", "Token", "Sentence", "Done", "Error"]

log = logging.getLogger("llmd.client")

PROTOCOL_VERSIONS = [1]
SAMPLING_KEYS = tuple(p.name for p in sampling_fields.WIRE)      # the keywords that go into ``params``


class ClientError(Exception):
    code = "client"


class DaemonUnavailable(ClientError):
    code = "unavailable"


class ConnectionLost(DaemonUnavailable):
    code = "connection_lost"


class Timeout(ClientError, TimeoutError):
    code = "timeout"


class RequestTooLarge(ClientError, ValueError):
    """The encoded request is over the daemon's ``max_message_bytes``: it was not sent (the daemon
    would drop the whole connection for it)."""
    code = "too_large"


class RequestError(ClientError):
    """The daemon answered with an ``error`` event; ``code`` is the wire code."""

    def __init__(self, event: Error):
        super().__init__(f"{event.code}: {event.message}")
        self.code = event.code
        self.event = event


def resolve_address(address: Optional[str]) -> str:
    address = address or os.environ.get("LLMD_SOCKET") or str(default_socket_path())
    return address if "://" in address else f"ipc://{address}"


def work_message(kind: str, rid: str, sampling: dict, priority: Optional[str], deadline: Optional[float],
                 sentences: bool, **fields) -> dict:
    unknown = set(sampling) - set(SAMPLING_KEYS)
    if unknown:
        raise TypeError(f"unknown sampling parameter(s): {', '.join(sorted(unknown))}")
    msg = {"type": kind, "id": rid, "params": {k: (list(v) if isinstance(v, tuple) else v)
                                               for k, v in sampling.items() if v is not None}}
    if priority is not None:
        msg["priority"] = priority
    if deadline is not None:
        msg["deadline_ms"] = max(1, int(deadline * 1000))
    if sentences:
        msg["sentences"] = True
    msg.update({k: v for k, v in fields.items() if v is not None})
    return msg


class _Base:
    def __init__(self, address: Optional[str], timeout: float, connect_timeout: float):
        self.address = resolve_address(address)
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self._ids = itertools.count()
        self._prefix = f"c{os.getpid()}-{id(self) & 0xffff:x}"
        self.heard = time.monotonic()       # the daemon's last message, keepalives included
        self.server_info: dict = {}

    def _next_id(self) -> str:
        return f"{self._prefix}-{next(self._ids)}"

    def _route_frame(self, frame: bytes) -> None:
        """Decode one received message and hand it to ``_route``; one that cannot be read (a newer or
        broken peer) is logged and skipped, so the streams around it go on."""
        self.heard = time.monotonic()
        try:
            event = from_wire(codec.unpack(frame, codec.MAX_MESSAGE_BYTES * 4))
        except (codec.CodecError, ValueError, KeyError, TypeError, AttributeError) as e:
            log.warning("ignoring a message from %s that cannot be read: %s", self.address, e)
            return
        self._route(event)

    def _frame(self, message: dict) -> bytes:
        """The encoded message, refused here when the daemon would not take it (CodecError for a value
        msgpack cannot hold, RequestTooLarge over its message size)."""
        frame = codec.pack(message)
        limit = self.server_info.get("max_message_bytes") or codec.MAX_MESSAGE_BYTES
        if len(frame) > limit:
            raise RequestTooLarge(f"the request is {len(frame):,} bytes; the daemon takes at most {limit:,} "
                                  "a message (max_message_bytes)")
        return frame

    def _unavailable(self, why: str) -> DaemonUnavailable:
        return DaemonUnavailable(f"no llmd daemon at {self.address} ({why}): start one with `llmd serve`")

    def _check_path(self) -> None:
        if self.address.startswith("ipc://") and not Path(self.address[6:]).exists():
            raise self._unavailable("no socket file")

    def _configure(self, sock) -> None:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3000)
        sock.setsockopt(zmq.MAXMSGSIZE, codec.MAX_MESSAGE_BYTES * 4)

    @staticmethod
    def _work(kind, rid, max_tokens, priority, deadline, sentences, sampling, **fields):
        """``stream=False`` among the keyword arguments asks for the whole output as one token event
        just before ``done`` (no event per token); the rest are sampling parameters."""
        if not sampling.pop("stream", True):
            fields["stream"] = False
        return work_message(kind, rid, {"max_tokens": max_tokens, **sampling}, priority, deadline, sentences, **fields)


# -- blocking ----------------------------------------------------------------------------------


def _waited_from(stream, start: float) -> float:
    """When a stream's wait for its next event began, as its client's timeout counts it: the call's
    start, or for a request with stream false, which has no event until its output is done, the
    daemon's latest message of any kind (its keepalives show it is still there). A stalled engine
    under a live daemon is then the systemd watchdog's to catch, not the client's."""
    return max(start, stream._client.heard) if stream.whole else start


class Stream:
    """The events of one request. Iterate it; ``close()`` (or leaving ``with``) cancels it."""

    def __init__(self, client: "Client", rid: str, whole: bool = False):
        self.id = rid
        self._client = client
        self.whole = whole                    # stream false: no event until the output is done
        self._events: collections.deque = collections.deque()
        self._failure: Optional[Exception] = None
        self._closed = False
        self.final: Optional[Any] = None      # the Done or Error event once received

    def __iter__(self):
        return self

    def __next__(self):
        if self.final is not None and not self._events:
            raise StopIteration
        start = time.monotonic()
        while not self._events:
            if self._failure is not None:
                raise self._failure
            remaining = _waited_from(self, start) + self._client.timeout - time.monotonic()
            if remaining <= 0:
                self.close()
                raise Timeout(f"no event for request {self.id} within {self._client.timeout}s")
            self._client._pump(remaining)
        event = self._events.popleft()
        if isinstance(event, TERMINAL):
            self.final = event
            self._client._streams.pop(self.id, None)
        return event

    def text(self) -> str:
        """Consume the stream and return its text; raises RequestError if it ends in an error."""
        parts = [ev.text for ev in self if isinstance(ev, Token)]
        if isinstance(self.final, Error):
            raise RequestError(self.final)
        return "".join(parts)

    def close(self) -> None:
        if self.final is None and not self._closed:
            self._closed = True
            self._client._streams.pop(self.id, None)
            if self._failure is None:
                self._client._send_quiet({"type": "cancel", "id": self._client._next_id(), "target": self.id})

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class Client(_Base):
    """Blocking client. Not thread-safe: use one per thread."""

    def __init__(self, address: Optional[str] = None, timeout: float = 30.0, connect_timeout: float = 2.0):
        super().__init__(address, timeout, connect_timeout)
        self._ctx = zmq.Context.instance()
        self._sock = None
        self._monitor = None
        # Weak: a stream the caller dropped is collected, and its __del__ cancels the request.
        self._streams: "weakref.WeakValueDictionary[str, Stream]" = weakref.WeakValueDictionary()
        self._replies: dict[str, Any] = {}
        self._waiting: set[str] = set()

    # connection ---------------------------------------------------------------------------------

    def _connect(self) -> None:
        if self._sock is not None:
            return
        self._check_path()
        sock = self._ctx.socket(zmq.DEALER)
        self._configure(sock)
        self._monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sock.connect(self.address)
        self._sock = sock
        rid = self._next_id()
        try:
            reply = self._call({"type": "hello", "id": rid, "versions": PROTOCOL_VERSIONS, "client": "llmd.clients"},
                               self.connect_timeout)
        except Timeout:
            self._reset(None)
            raise self._unavailable(f"nothing answered within {self.connect_timeout}s") from None
        self.server_info = reply.body

    def _reset(self, failure: Optional[Exception]) -> None:
        if self._sock is None:
            return
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)
        self._sock = self._monitor = None
        for stream in list(self._streams.values()):
            stream._failure = failure or ConnectionLost(f"connection to {self.address} lost")
        self._streams.clear()

    def close(self) -> None:
        for stream in list(self._streams.values()):
            stream.close()
        self._reset(None)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # I/O ----------------------------------------------------------------------------------------

    def _send(self, message: dict) -> None:
        self._connect()
        self._sock.send(self._frame(message))

    def _send_quiet(self, message: dict) -> None:
        if self._sock is not None:
            try:
                self._sock.send(codec.pack(message), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    def _pump(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for messages and route them to their streams."""
        if self._sock is None:
            raise ConnectionLost(f"connection to {self.address} lost")
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        ready = dict(poller.poll(max(0, int(timeout * 1000))))
        if self._monitor in ready:
            event = parse_monitor_message(self._monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                # what the daemon sent before it went away (a stream's last events, its Done at a
                # shutdown) is still queued here: route it first, so only unfinished streams fail
                self._drain()
                self._reset(ConnectionLost(f"the daemon at {self.address} went away"))
                return
        if self._sock in ready:
            self._drain()

    def _drain(self) -> None:
        """Route every message already received, without waiting."""
        while True:
            try:
                frame = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            self._route_frame(frame)

    def _route(self, event) -> None:
        if isinstance(event, Keepalive):
            return
        stream = self._streams.get(event.id)
        if stream is not None:
            stream._events.append(event)
        elif event.id in self._waiting:
            self._replies[event.id] = event

    def _call(self, message: dict, timeout: Optional[float] = None):
        """Send a unary request and wait for its reply (Reply or Ack); raise on Error."""
        rid = message["id"]
        self._waiting.add(rid)
        try:
            self._send(message)
            deadline = time.monotonic() + (timeout or self.timeout)
            while rid not in self._replies:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise Timeout(f"no answer to {message['type']} within {timeout or self.timeout}s")
                self._pump(remaining)
            reply = self._replies.pop(rid)
        finally:
            self._waiting.discard(rid)
        if isinstance(reply, Error):
            raise RequestError(reply)
        return reply

    def _start(self, message: dict) -> Stream:
        if message["id"] in self._streams:
            raise ClientError(f"request id {message['id']!r} is already in use by an open stream of this client")
        stream = Stream(self, message["id"], whole=message.get("stream") is False)
        self._connect()
        self._streams[stream.id] = stream
        try:
            self._send(message)
        except Exception:
            self._streams.pop(stream.id, None)
            raise
        return stream

    # API ----------------------------------------------------------------------------------------

    def generate(self, prompt: Optional[str] = None, *, token_ids: Optional[list[int]] = None, max_tokens: int = 64,
                 priority: Optional[str] = None, deadline: Optional[float] = None, sentences: bool = False,
                 request_id: Optional[str] = None, **sampling) -> Stream:
        """Complete ``prompt`` (text) or ``token_ids``. ``deadline`` is in seconds from now."""
        return self._start(self._work("generate", request_id or self._next_id(), max_tokens, priority, deadline,
                                      sentences, sampling, prompt=prompt,
                                      token_ids=list(token_ids) if token_ids is not None else None))

    def infill(self, prefix: str, suffix: str = "", *, files: Optional[list[tuple[str, str]]] = None,
               replace: Optional[str] = None, max_tokens: int = 64, priority: Optional[str] = None,
               deadline: Optional[float] = None, request_id: Optional[str] = None, layout: Optional[str] = None,
               shift_reuse: Optional[bool] = None, middle: Optional[str] = None, **sampling) -> Stream:
        """Fill in the middle. A new infill with the same ``replace`` key cancels the previous one.
        ``middle``: the start of the middle, already written (the model continues it).
        ``layout``: the prompt's order, "psm" (the default) or "spm" (suffix first, prefix last).
        ``shift_reuse``: let the daemon move keys and values computed for this ``replace`` key's earlier
        infills to their new positions after an edit (approximate; fewer tokens computed)."""
        return self._start(self._work("infill", request_id or self._next_id(), max_tokens, priority, deadline,
                                      False, sampling, prefix=prefix, suffix=suffix, replace=replace, layout=layout,
                                      shift_reuse=shift_reuse, middle=middle or None,
                                      files=[{"path": p, "text": t} for p, t in files] if files else None))

    def chat(self, messages: list[dict], *, max_tokens: int = 256, priority: Optional[str] = None,
             deadline: Optional[float] = None, sentences: bool = False, request_id: Optional[str] = None,
             tools: Optional[list[dict]] = None, **sampling) -> Stream:
        """Messages ({"role", "content"}, with ``tool_calls`` or a tool's answer) rendered through the
        model's chat template; ``tools``: functions ({"name", "description", "parameters"}) it may call.
        ``grammar={"kind": "json_schema", "text": schema}`` (or ``"json_object"``) constrains the output."""
        return self._start(self._work("chat", request_id or self._next_id(), max_tokens, priority, deadline,
                                      sentences, sampling, messages=list(messages), tools=tools or None))

    def cancel(self, request_id: str) -> bool:
        """Cancel a request; returns whether it was still in flight. No event for it follows the ack
        except its final ``done`` (finish_reason "cancelled"), which comes before the ack."""
        ack: Ack = self._call({"type": "cancel", "id": self._next_id(), "target": request_id})
        return ack.found

    def hello(self) -> dict:
        """Connect if needed; the daemon's answer to ``hello`` (version, model, state, limits)."""
        self._connect()
        return self.server_info

    def health(self) -> dict:
        return self._call({"type": "health", "id": self._next_id()}).body

    def stats(self) -> dict:
        return self._call({"type": "stats", "id": self._next_id()}).body

    def models(self) -> list[dict]:
        return self._call({"type": "models", "id": self._next_id()}).body["models"]


# -- asyncio -----------------------------------------------------------------------------------


class AsyncStream:
    """Async iterator of one request's events; ``aclose()`` or leaving ``async with`` cancels it."""

    def __init__(self, client: "AsyncClient", rid: str, whole: bool = False):
        self.id = rid
        self._client = client
        self.whole = whole                    # stream false: no event until the output is done
        self._queue: asyncio.Queue = asyncio.Queue()
        self.final: Optional[Any] = None

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.final is not None:
            raise StopAsyncIteration
        start, wait = time.monotonic(), self._client.timeout
        while True:
            try:
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for returns the event and drops a cancel
                # that lands as the event arrives, so a barge-in or aclose() mid-stream was lost
                async with asyncio.timeout(wait):
                    event = await self._queue.get()
                break
            except TimeoutError:
                wait = _waited_from(self, start) + self._client.timeout - time.monotonic()
                if wait <= 0:
                    await self.aclose()
                    raise Timeout(f"no event for request {self.id} within {self._client.timeout}s") from None
        if isinstance(event, Exception):
            raise event
        if isinstance(event, TERMINAL):
            self.final = event
            self._client._streams.pop(self.id, None)
        return event

    async def text(self) -> str:
        parts = [ev.text async for ev in self if isinstance(ev, Token)]
        if isinstance(self.final, Error):
            raise RequestError(self.final)
        return "".join(parts)

    async def aclose(self) -> None:
        if self.final is None and self._client._streams.pop(self.id, None) is not None:
            await self._client._send({"type": "cancel", "id": self._client._next_id(), "target": self.id})

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.aclose()


class AsyncClient(_Base):
    """asyncio client over zmq.asyncio; one background task reads and routes events."""

    def __init__(self, address: Optional[str] = None, timeout: float = 30.0, connect_timeout: float = 2.0):
        super().__init__(address, timeout, connect_timeout)
        self._ctx = zmq.asyncio.Context.instance()
        self._sock = None
        self._reader: Optional[asyncio.Task] = None
        self._streams: dict[str, AsyncStream] = {}
        self._replies: dict[str, asyncio.Future] = {}

    async def _connect(self) -> None:
        if self._sock is not None:
            return
        self._check_path()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._configure(self._sock)
        monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._sock.connect(self.address)
        self._reader = asyncio.get_running_loop().create_task(self._read(self._sock, monitor))
        try:
            reply = await self._call({"type": "hello", "id": self._next_id(), "versions": PROTOCOL_VERSIONS,
                                      "client": "llmd.clients.async"}, self.connect_timeout)
        except Timeout:
            await self.aclose()
            raise self._unavailable(f"nothing answered within {self.connect_timeout}s") from None
        self.server_info = reply.body

    async def _read(self, sock, monitor) -> None:
        poller = zmq.asyncio.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            while True:
                ready = dict(await poller.poll())
                if monitor in ready:
                    event = parse_monitor_message(await monitor.recv_multipart())
                    if event["event"] == zmq.EVENT_DISCONNECTED:
                        while True:           # messages sent before the daemon went away still count
                            try:
                                frame = await sock.recv(zmq.NOBLOCK)
                            except zmq.Again:
                                break
                            self._route_frame(frame)
                        self._fail_all(ConnectionLost(f"the daemon at {self.address} went away"))
                        return
                if sock in ready:
                    self._route_frame(await sock.recv())
        except asyncio.CancelledError:
            raise
        except Exception as e:        # never end silently: every waiting stream and call hears of it
            self._fail_all(ConnectionLost(f"reading from the daemon at {self.address} failed: {e}"))
        finally:
            sock.disable_monitor()
            monitor.close(linger=0)

    def _fail_all(self, error: Exception) -> None:
        for stream in self._streams.values():
            stream._queue.put_nowait(error)
        for fut in self._replies.values():
            if not fut.done():
                fut.set_exception(error)
        self._streams.clear()
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def _route(self, event) -> None:
        if isinstance(event, Keepalive):
            return
        stream = self._streams.get(event.id)
        if stream is not None:
            stream._queue.put_nowait(event)
            return
        fut = self._replies.get(event.id)
        if fut is not None and not fut.done():
            fut.set_result(event)

    async def _send(self, message: dict) -> None:
        await self._connect()
        await self._sock.send(self._frame(message))

    async def _call(self, message: dict, timeout: Optional[float] = None):
        fut = asyncio.get_running_loop().create_future()
        self._replies[message["id"]] = fut
        try:
            await self._send(message)
            async with asyncio.timeout(timeout or self.timeout):     # keeps a cancel (see AsyncStream)
                reply = await fut
        except TimeoutError:
            raise Timeout(f"no answer to {message['type']} within {timeout or self.timeout}s") from None
        finally:
            self._replies.pop(message["id"], None)
        if isinstance(reply, Error):
            raise RequestError(reply)
        return reply

    async def _start(self, message: dict) -> AsyncStream:
        await self._connect()
        stream = AsyncStream(self, message["id"], whole=message.get("stream") is False)
        self._streams[stream.id] = stream
        await self._send(message)
        return stream

    async def generate(self, prompt: Optional[str] = None, *, token_ids: Optional[list[int]] = None,
                       max_tokens: int = 64, priority: Optional[str] = None, deadline: Optional[float] = None,
                       sentences: bool = False, request_id: Optional[str] = None, **sampling) -> AsyncStream:
        return await self._start(self._work("generate", request_id or self._next_id(), max_tokens, priority,
                                            deadline, sentences, sampling, prompt=prompt,
                                            token_ids=list(token_ids) if token_ids is not None else None))

    async def infill(self, prefix: str, suffix: str = "", *, files: Optional[list[tuple[str, str]]] = None,
                     replace: Optional[str] = None, max_tokens: int = 64, priority: Optional[str] = None,
                     deadline: Optional[float] = None, request_id: Optional[str] = None,
                     layout: Optional[str] = None, shift_reuse: Optional[bool] = None,
                     middle: Optional[str] = None, **sampling) -> AsyncStream:
        return await self._start(self._work("infill", request_id or self._next_id(), max_tokens, priority,
                                            deadline, False, sampling, prefix=prefix, suffix=suffix, replace=replace,
                                            layout=layout, shift_reuse=shift_reuse, middle=middle or None,
                                            files=[{"path": p, "text": t} for p, t in files] if files else None))

    async def chat(self, messages: list[dict], *, max_tokens: int = 256, priority: Optional[str] = None,
                   deadline: Optional[float] = None, sentences: bool = False, request_id: Optional[str] = None,
                   tools: Optional[list[dict]] = None, **sampling) -> AsyncStream:
        return await self._start(self._work("chat", request_id or self._next_id(), max_tokens, priority,
                                            deadline, sentences, sampling, messages=list(messages),
                                            tools=tools or None))

    async def cancel(self, request_id: str) -> bool:
        return (await self._call({"type": "cancel", "id": self._next_id(), "target": request_id})).found

    async def hello(self) -> dict:
        await self._connect()
        return self.server_info

    async def health(self) -> dict:
        return (await self._call({"type": "health", "id": self._next_id()})).body

    async def stats(self) -> dict:
        return (await self._call({"type": "stats", "id": self._next_id()})).body

    async def models(self) -> list[dict]:
        return (await self._call({"type": "models", "id": self._next_id()})).body["models"]

    async def aclose(self) -> None:
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.cancel()
            # let the reader's cleanup (monitor off) run before the socket closes under it
            await asyncio.gather(reader, return_exceptions=True)
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.aclose()
