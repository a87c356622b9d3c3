"""`llmd http` for tests: the real server (aiohttp, the guard, one ZeroMQ client) on a thread with its
own event loop, on a free 127.0.0.1 port; a daemon with it; raw-socket helpers for the hostile tests, and
wrong bodies for the fuzz tests."""
from __future__ import annotations

import asyncio
import contextlib
import json
import random
import socket
import threading
import time

import pytest

from llmd.clients.http_front import FrontConfig
from llmd.clients.http_serve import serve


@contextlib.contextmanager
def running_front(config: FrontConfig, listen_fd=None):
    """Serve ``config`` (port 0: a free one) until the block ends; yields the base URL (the unix
    socket's path for one). ``listen_fd`` stands for a socket systemd passed."""
    loop = asyncio.new_event_loop()
    started = threading.Event()
    box: dict = {}

    async def main():
        box["stop"] = asyncio.Event()
        await serve(config, lambda address: (box.__setitem__("address", address), started.set()), box["stop"],
                    listen_fd=listen_fd)

    def body():
        try:
            loop.run_until_complete(main())
        except BaseException as e:        # surfaced below
            box["error"] = e
            started.set()

    thread = threading.Thread(target=body, name="llmd-http-test", daemon=True)
    thread.start()
    if not started.wait(30) or "error" in box:
        raise RuntimeError(f"llmd http did not start: {box.get('error')}")
    address = box["address"]
    try:
        yield address if isinstance(address, str) else f"http://{address[0]}:{address[1]}"
    finally:
        loop.call_soon_threadsafe(box["stop"].set)
        thread.join(15)
        loop.close()


def raw_exchange(url: str, data: bytes, timeout: float = 10.0, trickle_s: float = 0.0) -> bytes:
    """Send ``data`` over a fresh connection (a byte per ``trickle_s`` when given) and read the reply
    until the server closes or ``timeout``."""
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=timeout)
    deadline = time.monotonic() + timeout
    try:
        if trickle_s:
            s.setblocking(False)
            for b in data:
                try:
                    s.send(bytes([b]))
                except OSError:
                    break
                time.sleep(trickle_s)
                with contextlib.suppress(BlockingIOError):
                    if s.recv(1, socket.MSG_PEEK):
                        break             # the server answered already
                if time.monotonic() > deadline:
                    break
            s.setblocking(True)
            s.settimeout(max(0.1, deadline - time.monotonic()))
        else:
            s.sendall(data)
        out = b""
        with contextlib.suppress(OSError):
            while chunk := s.recv(65536):
                out += chunk
        return out
    finally:
        s.close()


def status_of(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1]) if reply.startswith(b"HTTP/1.") else 0


@contextlib.contextmanager
def daemon_and_front(model_dir, socket_dir, **front):
    """A real daemon serving ``model_dir`` and `llmd http` in front of it; yields (daemon, base URL)."""
    from daemon_fixtures import daemon_settings, running_daemon
    with running_daemon(daemon_settings(model_dir, socket_dir)) as daemon:
        config = FrontConfig(socket=daemon.settings.socket, port=0, max_body_bytes=256 << 10, **front)
        with running_front(config) as url:
            yield daemon, url


def call(url: str, body=None, method: str = "POST", timeout: float = 30) -> tuple[int, dict, bytes]:
    """One HTTP exchange: (status, headers, raw body); ``body`` is JSON-encoded unless bytes."""
    import urllib.error
    import urllib.request
    data = None if body is None else body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


# wrong values for a field of each kind (strict types: "1" is no number, 1 no bool, 1.5 no count)
WRONG = {
    "str": [1, 2.5, True, [], {}, ["a"]],
    "int": ["1", 1.5, True, [], {}, 1 << 70, -5],
    "float": ["0.5", True, [], {}, 1e300, -50],
    "bool": ["true", 1, [], {}, "yes"],
    "list": ["a", 1, {}, True, [[[]]]],
    "text_or_ids": [1, 2.5, True, {}, [], [[1]], ["a", 1], [-1], ["a", "b"]],
}


def fuzz_bodies(fields: dict, rng: random.Random, n: int, base: dict) -> list[bytes]:
    """``n`` request bodies that are each wrong: ``base`` with one to three of ``fields`` (name ->
    kind; a dotted name goes one object down) given a wrong value, an unknown key, or junk JSON."""
    out = []
    for i in range(n):
        if i % 7 == 6:
            out.append(rng.choice([b"[]", b"null", b"\"x\"", b"{" * 50, b"[" * 5000, b"{\"a\": 1e999999}",
                                   json.dumps({"x": "y" * 300_000}).encode()]))
            continue
        body = json.loads(json.dumps(base))
        for name in rng.sample(sorted(fields), rng.randint(1, min(3, len(fields)))):
            value = rng.choice(WRONG[fields[name]])
            outer, _, inner = name.partition(".")
            if inner:
                body.setdefault(outer, {})[inner] = value
            else:
                body[outer] = value
        if rng.random() < 0.3:
            body[f"unknown_{rng.randint(0, 99)}"] = rng.choice([0, "x", None, [1]])
        out.append(json.dumps(body).encode())
    return out


def front_fixtures(name: str):
    """``served, url = front_fixtures(name)`` in a test module: its module's daemon and HTTP front
    (``served``: the pair) and the front's base URL (``url``)."""
    @pytest.fixture(scope="module")
    def served(tiny_model_dir, tmp_path_factory):
        with daemon_and_front(tiny_model_dir, tmp_path_factory.mktemp(name)) as pair:
            yield pair

    @pytest.fixture
    def url(served):
        return served[1]
    return served, url
