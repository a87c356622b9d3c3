"""Where the daemon's socket lives, its permissions, and the lock that keeps one daemon per socket.

ZeroMQ unlinks an existing ipc:// path when it binds, so a second daemon would silently take
the endpoint over. The lock file beside the socket (flock, holding the pid) prevents that: the
second daemon fails with "already running (pid N)" before it touches the socket.
"""
from __future__ import annotations

import fcntl
import grp
import os
from pathlib import Path

SYSTEM_SOCKET = Path("/run/llmd/llmd.sock")
DIR_MODE = 0o750
SOCKET_MODE = 0o660


class AlreadyRunning(RuntimeError):
    code = "already_running"


def default_socket_path(env: dict | None = None) -> Path:
    """$XDG_RUNTIME_DIR/llmd/llmd.sock for a user, /run/llmd/llmd.sock for the system service."""
    env = os.environ if env is None else env
    if env.get("LLMD_SYSTEM") == "1" or not env.get("XDG_RUNTIME_DIR"):
        return SYSTEM_SOCKET
    return Path(env["XDG_RUNTIME_DIR"]) / "llmd" / "llmd.sock"


def endpoint(path: Path | str) -> str:
    return f"ipc://{Path(path)}"


def prepare_dir(socket_path: Path, group: str | None = None) -> None:
    """Create the socket's directory with mode 0750 (and the group, if given)."""
    d = Path(socket_path).parent
    d.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
    os.chmod(d, DIR_MODE)
    if group:
        os.chown(d, -1, grp.getgrnam(group).gr_gid)


def secure_socket(socket_path: Path, group: str | None = None) -> None:
    """Give the bound socket file mode 0660 (and the group, if given)."""
    os.chmod(socket_path, SOCKET_MODE)
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
