"""The pieces llmd.bench.kv_disk_bench drives: a daemon process of its own, one answer
timed as its client sees it, the working set's texts, and a reader of the tier's file headers."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from llmd.bench.bench_editor import start_daemon
from llmd.clients.client import Client
from llmd.protocol import Done, Token
from llmd.runtime.kv_disk import HEADER
from llmd.training.corpus import list_sources, split

class Daemon:
    """`python -m llmd.daemon serve` on a socket of its own in ``work``; ``with`` starts it (waiting
    until it is ready) and stops it with SIGTERM, as systemd does."""

    def __init__(self, model: str, work: Path, name: str, threads: int, *flags: str):
        self.dir = work / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.socket = str(self.dir / "llmd.sock")
        self.model, self.threads, self.flags = model, threads, list(flags)
        self.proc: Optional[subprocess.Popen] = None

    def __enter__(self) -> "Daemon":
        self.proc = start_daemon(self.model, self.socket, self.threads, self.flags)
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def client(self) -> Client:
        return Client(self.socket, timeout=600)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(120)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(60)


@dataclass
class Answer:
    tokens: list
    usage: dict
    timings: dict
    e2e_ms: float
    ttft_ms: Optional[float]

    @property
    def computed(self) -> int:
        return (self.usage.get("prompt_tokens") or 0) - (self.usage.get("cached_tokens") or 0)

    @property
    def decode_tps(self) -> Optional[float]:
        n = len(self.tokens)
        if self.ttft_ms is None or n < 2 or self.e2e_ms <= self.ttft_ms:
            return None
        return (n - 1) / ((self.e2e_ms - self.ttft_ms) / 1000)


def consume(stream, start: float) -> Answer:
    tokens, first = [], None
    for ev in stream:
        if isinstance(ev, Token):
            first = first or time.perf_counter()
            tokens += ev.token_ids
    end = time.perf_counter()
    if not isinstance(stream.final, Done):
        raise SystemExit(f"the daemon refused a request: {stream.final}")
    return Answer(tokens, stream.final.usage, stream.final.timings, 1000 * (end - start),
                  None if first is None else 1000 * (first - start))


def ask(c: Client, kind: str, *args, **kw) -> Answer:
    """One greedy request, timed from its sending to its ``done``."""
    start = time.perf_counter()
    return consume(getattr(c, kind)(*args, **kw), start)


def texts(n: int, min_chars: int) -> list[str]:
    """``n`` stdlib sources of at least ``min_chars`` characters, held-out ones (which the bundled
    models never trained on) first."""
    held, train = split(list_sources())[1], split(list_sources())[0]
    out = []
    for f in held + train:
        text = f.path.read_text(encoding="utf-8", errors="replace")
        if len(text) >= min_chars and text not in out:
            out.append(text)
        if len(out) == n:
            return out
    raise SystemExit(f"found only {len(out)} sources of {min_chars} characters or more")


def headers(tier: Path) -> dict[str, tuple[int, int]]:
    """File name -> (key, parent key) of each block file in the tier."""
    out = {}
    for f in sorted(tier.glob("*.kv")):
        with open(f, "rb") as fh:
            raw = fh.read(HEADER.size)
        if len(raw) == HEADER.size:
            _, _, key, parent, _, _ = HEADER.unpack(raw)
            out[f.name] = (int.from_bytes(key, "little"), int.from_bytes(parent, "little"))
    return out


def tier_bytes(tier: Path) -> int:
    """Bytes of every file in the tier, those being written included."""
    total = 0
    for entry in os.scandir(tier):
        try:
            total += entry.stat(follow_symlinks=False).st_size
        except FileNotFoundError:
            pass                                  # renamed or deleted meanwhile
    return total


def median(xs: list) -> Optional[float]:
    xs = sorted(x for x in xs if x is not None)
    return None if not xs else xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2
