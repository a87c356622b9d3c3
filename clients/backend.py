"""Which server a client command talks to: ``--backend URL``.

``ipc://PATH`` (or a bare path, or nothing: the default socket) is the llmd daemon over ZeroMQ;
``http://`` or ``https://`` is any OpenAI-compatible server, through ``HttpBackend``. Both give
the same calls and events; ``features(client)`` says what the chosen one serves natively.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Optional

from .client import AsyncClient, Client
from .http_backend import HttpBackend, is_http

log = logging.getLogger("llmd.backend")

NATIVE = {"replace": "native", "sentences": "native", "priority": "native", "middle": "native"}


def async_client(backend: Optional[str], timeout: float = 30.0):
    """An AsyncClient for the daemon, or an HttpBackend for an HTTP URL (its degraded features logged)."""
    if not is_http(backend):
        return AsyncClient(backend, timeout=timeout)
    client = HttpBackend(backend, timeout=timeout)
    for line in degraded(client):
        log.warning("backend %s: %s", backend, line)
    return client


def blocking_client(backend: Optional[str], timeout: float = 30.0):
    return BlockingHttp(async_client(backend, timeout)) if is_http(backend) else Client(backend, timeout=timeout)


def features(client) -> dict:
    """How each protocol feature is served: ``native``, ``emulated (...)`` or ``off (...)``."""
    inner = getattr(client, "backend", client)
    return dict(getattr(inner, "features", NATIVE))


def degraded(client) -> list[str]:
    return [f"{k}: {v}" for k, v in features(client).items() if v != "native"]


class BlockingStream:
    """A blocking view of an HttpStream, run on its BlockingHttp's loop (what ``llmd run`` iterates)."""

    def __init__(self, owner: "BlockingHttp", stream):
        self._owner, self._stream = owner, stream
        self.id = stream.id

    @property
    def final(self):
        return self._stream.final

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return self._owner._run(self._stream.__anext__())
        except StopAsyncIteration:
            raise StopIteration from None

    def text(self) -> str:
        return self._owner._run(self._stream.text())

    def close(self) -> None:
        self._owner._run(self._stream.aclose())

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class BlockingHttp:
    """``Client``'s blocking calls over an HttpBackend, on a private event loop."""

    def __init__(self, backend: HttpBackend):
        self.backend = backend
        self._loop = asyncio.new_event_loop()

    def _run(self, coro):
        return self._loop.run_until_complete(coro)

    def chat(self, messages, **kw) -> BlockingStream:
        return BlockingStream(self, self._run(self.backend.chat(messages, **kw)))

    def generate(self, prompt=None, **kw) -> BlockingStream:
        return BlockingStream(self, self._run(self.backend.generate(prompt, **kw)))

    def infill(self, prefix, suffix="", **kw) -> BlockingStream:
        return BlockingStream(self, self._run(self.backend.infill(prefix, suffix, **kw)))

    def models(self) -> list[dict]:
        return self._run(self.backend.models())

    def health(self) -> dict:
        return self._run(self.backend.health())

    def hello(self) -> dict:
        return self._run(self.backend.hello())

    def close(self) -> None:
        if not self._loop.is_closed():
            self._run(self.backend.aclose())
            self._loop.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def backend_of(args):
    """The --backend URL, else the --socket path (None: the default daemon socket)."""
    return getattr(args, "backend", None) or getattr(args, "socket", None)
