"""systemd integration without a dependency: sd_notify, the watchdog interval, socket activation.

sd_notify is one datagram of newline-separated assignments to the AF_UNIX socket named in
$NOTIFY_SOCKET (a path, or an abstract name starting with '@'). Socket activation passes
listening sockets as fds 3.. with $LISTEN_FDS, meant for us only when $LISTEN_PID is our pid.
"""
from __future__ import annotations

import os
import socket
import threading
import time

SD_LISTEN_FDS_START = 3


class Notifier:
    """Sends notifications to the service manager; a no-op when not run under systemd.

    Safe to call from any thread (one datagram per call). ``watchdog()`` is rate-limited to
    half the interval systemd asked for, so the engine loop can call it every iteration.
    """

    def __init__(self, notify_socket: str | None = None, watchdog_usec: int | None = None):
        env = os.environ
        self.address = notify_socket if notify_socket is not None else env.get("NOTIFY_SOCKET") or None
        if watchdog_usec is None:
            watchdog_usec = watchdog_usec_from_env(env)
        self.watchdog_interval_s = watchdog_usec / 1e6 if watchdog_usec else None
        self._last_ping = 0.0
        self._lock = threading.Lock()
        self._sock = None
        if self.address:
            # Non-blocking: a full receive queue drops a status line instead of stalling the daemon.
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def notify(self, **fields) -> bool:
        """notify(READY=1, STATUS="...") sends one datagram; returns whether it was sent (never blocks)."""
        if self._sock is None:
            return False
        text = "\n".join(f"{k}={v}" for k, v in fields.items())
        addr = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        try:
            with self._lock:
                self._sock.sendto(text.encode(), addr)
            return True
        except OSError:
            return False

    def ready(self, status: str = "ready") -> bool:
        return self.notify(READY=1, STATUS=status)

    def status(self, text: str) -> bool:
        return self.notify(STATUS=text)

    def stopping(self, status: str = "draining") -> bool:
        return self.notify(STOPPING=1, STATUS=status)

    def watchdog(self) -> bool:
        """Ping the watchdog if half its interval has passed since the last ping."""
        if self._sock is None or not self.watchdog_interval_s:
            return False
        now = time.monotonic()
        if now - self._last_ping < self.watchdog_interval_s / 2:
            return False
        self._last_ping = now
        return self.notify(WATCHDOG=1)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def watchdog_usec_from_env(env) -> int | None:
    usec = env.get("WATCHDOG_USEC")
    pid = env.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        value = int(usec)
    except ValueError:
        return None
    return value if value > 0 else None


def listen_fds(env=None, unset: bool = True) -> list[int]:
    """The fds systemd passed us (socket activation), or []. Unsets the variables by default
    so child processes do not believe the sockets are theirs."""
    env = os.environ if env is None else env
    pid, count = env.get("LISTEN_PID"), env.get("LISTEN_FDS")
    if not pid or not count or pid != str(os.getpid()):
        return []
    try:
        n = int(count)
    except ValueError:
        return []
    if unset:
        for key in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
            env.pop(key, None)
    fds = list(range(SD_LISTEN_FDS_START, SD_LISTEN_FDS_START + max(n, 0)))
    for fd in fds:
        os.set_inheritable(fd, False)
    return fds


def unix_socket_path(fd: int) -> str | None:
    """The filesystem path an inherited AF_UNIX listening socket is bound to, if any."""
    s = socket.socket(fileno=os.dup(fd))
    try:
        if s.family != socket.AF_UNIX:
            return None
        name = s.getsockname()
        return name if isinstance(name, str) and name else None
    finally:
        s.close()
