"""Where the daemon's socket lives, its permissions, and the lock that keeps one daemon per socket.

ZeroMQ unlinks an existing ipc:// path when it binds, so a second daemon would silently take
the endpoint over. The lock file beside the socket (flock, holding the pid) prevents that: the
second daemon fails with "already running (pid N)" before it touches the socket.

Permissions: without a ``group`` the socket is the owner's alone (0600 in a 0700 directory); with
one, its members connect too (0660 in a 0750 directory, both owned by that group). A directory
that already exists (it may be shared, like /tmp) is left as it is: only the socket is set.
"""
from __future__ import annotations

import fcntl
import grp
import os
from pathlib import Path

OWNER_MODES = (0o700, 0o600)      # (directory, socket) without a group
GROUP_MODES = (0o750, 0o660)      # with a group: its members may connect


class AlreadyRunning(RuntimeError):
    code = "already_running"


def modes(group: str | None) -> tuple[int, int]:
    return GROUP_MODES if group else OWNER_MODES


def prepare_dir(socket_path: Path, group: str | None = None) -> None:
    """Create the socket's directory, 0700 (0750 and the group's, given a group); an existing one is
    left alone."""
    d = Path(socket_path).parent
    d.parent.mkdir(parents=True, exist_ok=True)
    try:
        d.mkdir(mode=0o700)
    except FileExistsError:
        return
    os.chmod(d, modes(group)[0])
    if group:
        os.chown(d, -1, grp.getgrnam(group).gr_gid)


def secure_socket(socket_path: Path, group: str | None = None) -> None:
    """Give the bound socket file mode 0600 (0660 and the group's, given a group)."""
    os.chmod(socket_path, modes(group)[1])
    if group:
        os.chown(socket_path, -1, grp.getgrnam(group).gr_gid)


class PidLock:
    """An exclusive flock on ``<socket>.lock`` holding the owner's pid, held for the daemon's life.

    The file is never unlinked: removing it would let a late opener lock an orphaned inode while
    a third process locks a fresh one.
    """

    def __init__(self, socket_path: Path):
        self.path = Path(str(socket_path) + ".lock")
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise AlreadyRunning(f"llmd is already running (pid {pid}) on {self.path.with_suffix('')}") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            os.close(self._fd)
            self._fd = None

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()
