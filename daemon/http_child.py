"""`llmd serve --http HOST:PORT`: the HTTP front (`llmd http`) as a child of the daemon.

The front runs as its own process, started by the daemon and stopped with it, talking to the
daemon's own ZeroMQ socket: one command and one service, and one code path for HTTP (the same
`llmd http`, with its guards and defaults). A process, not a thread: the daemon and the clients
never import each other (docs/architecture.md, Layers), and the front's JSON and streaming work never
holds the daemon's GIL between engine steps.

The child ends after the daemon has drained (its in-flight answers finish first). If it exits on its
own (its port is taken, say), the daemon drains and exits too, with the child's status, so a
service manager restarts both.
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
from typing import Callable, Optional

from .settings import Settings, http_address

log = logging.getLogger("llmd.daemon")
# the service manager's variables are the daemon's: the child must not notify or take sockets
PARENT_ONLY = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")
STOP_TIMEOUT_S = 10.0


def http_command(settings: Settings) -> list[str]:
    """The `llmd http` command line for the daemon's settings."""
    host, port = http_address(settings.http)
    cmd = [sys.executable, "-m", "llmd.cli", "http", "--socket", str(settings.socket_path), "--host", host,
           "--port", str(port), "--log-level", settings.log_level]
    if settings.http_allow_remote:
        cmd.append("--allow-remote")
    if settings.http_api_key_file:
        cmd += ["--api-key-file", settings.http_api_key_file]
    return cmd


class HttpChild:
    """The front's process; ``on_exit()`` is called (from a watcher thread) when it ends unasked."""

    def __init__(self, settings: Settings, on_exit: Callable[[], None]):
        self.command = http_command(settings)
        self.on_exit = on_exit
        self.process: Optional[subprocess.Popen] = None
        self.exit_code: Optional[int] = None      # set when the child ended before it was stopped
        self._stopping = False

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if k not in PARENT_ONLY}
        self.process = subprocess.Popen(self.command, env=env, stdin=subprocess.DEVNULL,
                                        preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        threading.Thread(target=self._watch, name="llmd-http-child", daemon=True).start()
        log.info("HTTP front started (pid %d): %s", self.process.pid, " ".join(self.command[3:]))

    def _watch(self) -> None:
        code = self.process.wait()
        if not self._stopping:
            self.exit_code = code or 1
            log.error("the HTTP front exited with status %d; stopping the daemon", code)
            self.on_exit()

    def stop(self) -> None:
        """SIGTERM (the front closes its listener and connections), then SIGKILL after a while."""
        self._stopping = True
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _die_with_parent() -> None:
    """In the child, before exec (the daemon has no other thread yet): SIGTERM when the daemon dies,
    even by SIGKILL, so no front outlives it where no service manager cleans up."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
