"""`llmd http` for tests: the real server (aiohttp, the guard, one ZeroMQ client) on a thread with its
own event loop, on a free 127.0.0.1 port; and raw-socket helpers for the hostile tests."""
from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time

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
