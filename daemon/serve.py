"""`llmd serve`: build the engine factory from settings, take over systemd's socket if any, run."""
from __future__ import annotations

import dataclasses
import gc
import logging
import signal
import sys

import zmq

from llmd import systemd
from .http_child import HttpChild
from .paths import AlreadyRunning
from .server import Server
from .settings import Settings, SettingsError


def engine_factory(settings: Settings, freeze: bool = False):
    """A function the engine thread calls to build the Engine (so torch loads there, after bind).
    ``freeze``: for a process that keeps this engine until it exits (`llmd serve`), take everything
    alive then out of the garbage collector's view (a process that builds engines again and again,
    as the tests do, must not: a frozen cycle is never freed)."""
    config = settings.engine_config()

    def make(progress=None):
        from llmd.runtime.engine import Engine      # torch loads here, on the engine thread, after bind
        engine = Engine(config, progress=progress)
        if freeze:
            # The engine's objects (modules, tensors, tables) left in the collector's generations would
            # be walked by every full collection, which holds the GIL for longer than a decode step at
            # moments no request chooses; frozen, they are never walked.
            gc.collect()
            gc.freeze()
        return engine
    return make


def activated_socket(settings: Settings) -> tuple[Settings, int | None]:
    """The listening socket systemd passed us, and settings pointing at its path."""
    fds = systemd.listen_fds()
    if not fds:
        return settings, None
    path = systemd.unix_socket_path(fds[0])
    if path is None:
        raise SettingsError("socket activation passed a socket that is not a unix socket with a path")
    return dataclasses.replace(settings, socket=path), fds[0]


def serve(settings: Settings, notifier: systemd.Notifier | None = None) -> int:
    logging.basicConfig(level=settings.log_level.upper(), format="llmd: %(levelname)s %(message)s")
    if not settings.model:
        print("llmd serve: no model given (--model, LLMD_MODEL or `model` in llmd.toml)", file=sys.stderr)
        return 2
    try:
        settings, fd = activated_socket(settings)
        server = Server(settings, engine_factory(settings, freeze=True), notifier or systemd.Notifier(), listen_fd=fd)
    except SettingsError as e:          # a bad warm file, or socket: said before the model loads
        print(f"llmd serve: {e}", file=sys.stderr)
        return 2
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: server.request_stop())
    front = HttpChild(settings, on_exit=server.request_stop) if settings.http else None
    try:
        if front is not None:
            front.start()
        code = server.run()
        logging.getLogger("llmd.daemon").info("stopped")
        return code or (front.exit_code if front is not None and front.exit_code else 0)
    except AlreadyRunning as e:
        print(f"llmd serve: {e}", file=sys.stderr)
        return 1
    except (OSError, zmq.ZMQError) as e:
        print(f"llmd serve: cannot listen on {settings.endpoint}"
              f"{' or ' + settings.tcp if settings.tcp else ''}: {e}", file=sys.stderr)
        return 2
    finally:
        if front is not None:
            front.stop()       # after the drain: the front's answers in flight have ended
