"""Connection limits for `llmd http`, below the HTTP server: how many connections, and how long a
request's head may take to arrive.

Each accepted connection's protocol is wrapped in a ``Guarded`` proxy that counts it and watches
the bytes before a request head ends (the blank line after the headers). A connection over the
limit is answered 503 and closed; one whose head is still incomplete ``head_timeout_s`` after its
first byte (or after it connected, for the first request) is answered 408 and closed: a client
trickling headers a byte at a time (slowloris) holds a slot for that long at most. Request bodies
have their own time limit in the handler; an idle keep-alive connection is closed by the server.

Head tracking, per connection::

    HEAD --blank line--> BODY (Content-Length bytes) --> WAIT --first byte--> HEAD ...
                     \\-- Transfer-Encoding: chunked --> UNTRACKED (the body limit still holds)
"""
from __future__ import annotations

import asyncio
import json
import time
from typing import Callable, Optional

HEAD, BODY, WAIT, UNTRACKED = "head", "body", "wait", "untracked"
MAX_HEAD_SCAN = 64 * 1024


def canned(status: int, reason: str, message: str, code: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "server_error" if status >= 500
                                 else "invalid_request_error", "param": None, "code": code}}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"Connection: close\r\n\r\n").encode() + body


class Guard:
    """Owns the live connections; ``factory(inner)`` is the protocol factory for the event loop."""

    def __init__(self, max_connections: int, head_timeout_s: float):
        self.max_connections = max_connections
        self.head_timeout_s = head_timeout_s
        self.live: set["Guarded"] = set()
        self.refused = 0
        self.timed_out = 0
        self._task: Optional[asyncio.Task] = None

    def factory(self, inner: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        return lambda: Guarded(self, inner)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._watch())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _watch(self) -> None:
        tick = min(0.25, self.head_timeout_s / 4)
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            for conn in [c for c in self.live if c.overdue(now)]:
                self.timed_out += 1
                conn.abort(408, "Request Timeout", f"the request head did not arrive within "
                           f"{self.head_timeout_s:g} s", "request_timeout")


class Guarded(asyncio.Protocol):
    """A proxy for the server's protocol of one connection; see the module docstring."""

    def __init__(self, guard: Guard, inner: Callable[[], asyncio.Protocol]):
        self.guard = guard
        self._make_inner = inner
        self.inner: Optional[asyncio.Protocol] = None
        self.transport = None
        self.state = HEAD
        self.head_since = time.monotonic()
        self.requests = 0
        self._head = bytearray()
        self._body_left = 0

    # the event loop's calls --------------------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport
        if len(self.guard.live) >= self.guard.max_connections:
            self.guard.refused += 1
            transport.write(canned(503, "Service Unavailable", f"more than {self.guard.max_connections} "
                                   "connections are open; retry later", "too_many_connections"))
            transport.close()
            return
        self.guard.live.add(self)
        self.inner = self._make_inner()
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.inner is None:
            return
        self._track(data)
        self.inner.data_received(data)

    def eof_received(self):
        return self.inner.eof_received() if self.inner is not None else None

    def connection_lost(self, exc) -> None:
        self.guard.live.discard(self)
        if self.inner is not None:
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    # head tracking -----------------------------------------------------------------------------

    def _track(self, data: bytes) -> None:
        view = memoryview(data)
        while view and self.state != UNTRACKED:
            if self.state == WAIT:
                self.state, self.head_since = HEAD, time.monotonic()
            if self.state == BODY:
                take = min(self._body_left, len(view))
                self._body_left -= take
                view = view[take:]
                if self._body_left == 0:
                    self.state = WAIT
                continue
            view = self._scan_head(view)

    def _scan_head(self, view: memoryview) -> memoryview:
        prior = len(self._head)
        self._head += view[:MAX_HEAD_SCAN + 4 - prior]
        end = self._head.find(b"\r\n\r\n", max(0, prior - 3))
        if end < 0:
            if len(self._head) > MAX_HEAD_SCAN:          # the server refuses such a head itself
                self.state = UNTRACKED
            return view[len(view):]
        head, self._head = bytes(self._head[:end]).lower(), bytearray()
        self.requests += 1
        if b"transfer-encoding:" in head:
            self.state = UNTRACKED
        else:
            self._body_left = _content_length(head)
            self.state = BODY if self._body_left else WAIT
        return view[end + 4 - prior:]

    def overdue(self, now: float) -> bool:
        return self.state == HEAD and now - self.head_since > self.guard.head_timeout_s

    def abort(self, status: int, reason: str, message: str, code: str) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        if self.requests == 0:          # nothing was answered on it yet, so a reply cannot interleave
            self.transport.write(canned(status, reason, message, code))
        self.state = UNTRACKED
        self.transport.close()


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip() == b"content-length":
            try:
                return max(0, int(value.strip()))
            except ValueError:
                return 0
    return 0
