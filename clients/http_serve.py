"""Running ``llmd http``: the listener (TCP on loopback, a unix socket, or systemd's socket), the
connection guard around aiohttp's protocol, signals, and the command's flags."""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
from typing import Optional

from aiohttp import web

from llmd import systemd

from .http_front import Front, FrontConfig
from .http_guard import Guard

log = logging.getLogger("llmd.http")


async def serve(config: FrontConfig, ready=None, stop: Optional[asyncio.Event] = None,
                listen_fd: Optional[int] = None) -> None:
    """Serve until ``stop`` is set (or SIGTERM/SIGINT when it is None). ``ready(address)`` is called
    once listening."""
    config.check()
    front = Front(config)
    runner = web.AppRunner(front.app, handler_cancellation=True, access_log=None,
                           keepalive_timeout=config.keepalive_s, max_line_size=config.max_header_bytes,
                           max_field_size=config.max_header_bytes, max_headers=config.max_headers,
                           lingering_time=0)
    await runner.setup()
    guard = Guard(config.max_connections, config.head_timeout_s)
    loop = asyncio.get_running_loop()
    factory = guard.factory(runner.server)
    if listen_fd is not None:
        sock = socket.socket(fileno=listen_fd)
        server = await (loop.create_unix_server(factory, sock=sock) if sock.family == socket.AF_UNIX
                        else loop.create_server(factory, sock=sock))
    elif config.unix:
        old = os.umask(0o177)
        try:
            server = await loop.create_unix_server(factory, config.unix)
        finally:
            os.umask(old)
    else:
        server = await loop.create_server(factory, config.host, config.port, reuse_address=True)
    guard.start()
    if stop is None:
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    address = server.sockets[0].getsockname()
    if ready is not None:
        ready(address)
    try:
        await stop.wait()
    finally:
        server.close()
        await guard.stop()
        await runner.cleanup()
        await front.aclose()


def config_from_args(args) -> FrontConfig:
    key = None
    if args.api_key_file:
        with open(args.api_key_file, encoding="utf-8") as f:
            key = f.read().strip()
        if not key:
            raise ValueError(f"{args.api_key_file} is empty")
    return FrontConfig(socket=args.socket, host=args.host, port=args.port, unix=args.unix, api_key=key,
                       allow_remote=args.allow_remote, cors_origins=tuple(args.cors_origin or ()),
                       max_body_bytes=args.max_body_bytes, max_connections=args.max_connections,
                       head_timeout_s=args.head_timeout, body_timeout_s=args.body_timeout,
                       keepalive_s=args.keepalive)


def run_http(args) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = config_from_args(args)
        config.check()
    except (OSError, ValueError) as e:
        print(f"llmd http: {e}", file=sys.stderr)
        return 2
    fds = systemd.listen_fds()

    def ready(address) -> None:
        where = address if isinstance(address, str) else f"http://{address[0]}:{address[1]}"
        log.info("serving OpenAI- and llama.cpp-compatible HTTP on %s for the daemon at %s", where,
                 config.socket or "the default socket")
        systemd.Notifier().ready()

    try:
        asyncio.run(serve(config, ready, listen_fd=fds[0] if fds else None))
    except OSError as e:
        print(f"llmd http: cannot listen: {e}", file=sys.stderr)
        return 2
    return 0
