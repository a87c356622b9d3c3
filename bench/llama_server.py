"""llama.cpp's ``llama-server`` as a peer for benchmarks and tests: started on a free port of
127.0.0.1 only, waited for until ``/health`` answers, stopped after.

    server = LlamaServer()
    url = server.start(binary(), "model.gguf", threads=2, extra_args=["--cache-reuse", "256"])
    ...                                   # http://127.0.0.1:PORT
    server.stop()

or ``with LlamaServer() as server: url = server.start(...)``. The binary is the one
``bench/build_llama_server.sh`` built and cached (``binary()`` finds it, building it only when asked).
"""
from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
# where bench/build_llama_server.sh builds llama.cpp's programs: its own LLMD_LLAMA_SERVER_DIR, else the
# source checkout's .cache
CACHE = Path(os.environ.get("LLMD_LLAMA_SERVER_DIR") or REPO / ".cache" / "llama-server")



def file_tail(log, chars: int = 2000) -> str:
    """The last ``chars`` characters written to a server's log file (an open, readable temp file)."""
    log.flush()
    log.seek(0)
    return log.read()[-chars:]

class LlamaServerError(RuntimeError):
    """llama-server is missing, exited, or did not become ready."""


def binary(build: bool = False) -> Path:
    """The cached llama-server binary; with ``build``, ``bench/build_llama_server.sh`` builds it first
    when it is missing (several minutes)."""
    cached = CACHE / "bin" / "llama-server"
    if cached.exists():
        return cached
    if not build:
        raise LlamaServerError(f"no llama-server at {cached}: run bench/build_llama_server.sh first")
    out = subprocess.run(["bash", str(REPO / "bench" / "build_llama_server.sh")], capture_output=True, text=True)
    if out.returncode != 0:
        raise LlamaServerError(f"bench/build_llama_server.sh failed: {out.stderr[-2000:]}")
    return Path(out.stdout.strip().splitlines()[-1])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """One llama-server process. ``start`` returns its base URL; ``stop`` ends it (idempotent)."""

    def __init__(self, ready_timeout_s: float = 300.0):
        self.ready_timeout_s = ready_timeout_s
        self.proc: Optional[subprocess.Popen] = None
        self.url: Optional[str] = None
        self._log = None

    def start(self, binary: str | Path, gguf: str | Path, threads: int, extra_args: Sequence[str] = ()) -> str:
        if self.proc is not None:
            raise LlamaServerError("this llama-server is already started")
        port = free_port()
        self._log = tempfile.TemporaryFile(mode="w+")
        cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
               "-tb", str(threads), "--no-webui", *map(str, extra_args)]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{port}"
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self.url

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise LlamaServerError(f"llama-server exited ({self.proc.returncode}): {self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise LlamaServerError(f"llama-server was not ready within {self.ready_timeout_s:.0f} s: {self.log_tail()}")

    def log_tail(self, chars: int = 2000) -> str:
        return "" if self._log is None else file_tail(self._log, chars)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> "LlamaServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
