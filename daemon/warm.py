"""`llmd serve --warm FILE`: prompts computed into the prefix cache once the model is loaded.

The file is JSON Lines, one prompt a line (blank lines skipped):

    {"prompt": "You are a helpful voice assistant. ..."}
    {"messages": [{"role": "system", "content": "You are ..."}], "cache_salt": "voice"}

``prompt`` is text as `generate` takes it; ``messages`` go through the model's chat template as
`chat`'s do; ``cache_salt`` must be the salt the clients that reuse the prompt send. Nothing else is
allowed on a line. Every line is checked as the socket checks a request (llmd.protocol), before the
model loads: a bad file stops `llmd serve` with the line named.

Each prompt runs prompt-only at batch priority, one at a time, while the socket serves clients: the
scheduler runs a batch prompt only in chunks that never lengthen a more important request's step, so
warming delays no client, and a client that asks for the same prompt meanwhile finds its blocks
cached as they land. With ``kv_disk`` the blocks also reach the tier when the engine goes idle, and
after a restart the warm prompts are read back from it rather than computed; without it they fill
the prefix cache in memory only.

The Warmer lives on the socket thread and is the only writer of its counters.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from llmd import protocol

from .settings import SettingsError

log = logging.getLogger("llmd.daemon")

MAX_WARM_PROMPTS = 256
MAX_WARM_BYTES = 8 << 20
LINE_KEYS = {"prompt", "messages", "cache_salt"}


class WarmFileError(SettingsError):
    pass


def read_warm_file(path: str) -> list:
    """The file's prompts as validated `generate` and `chat` requests (prompt-only, batch priority);
    raises WarmFileError naming the file and the line."""
    try:
        with open(Path(path).expanduser(), "rb") as f:
            data = f.read(MAX_WARM_BYTES + 1)
    except OSError as e:
        raise WarmFileError(f"warm: cannot read {path}: {e.strerror or e}") from None
    if len(data) > MAX_WARM_BYTES:
        raise WarmFileError(f"warm: {path} is larger than {MAX_WARM_BYTES >> 20} MiB; list fewer or shorter prompts")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise WarmFileError(f"warm: {path} is not UTF-8 text (byte {e.start})") from None
    out = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            if len(out) == MAX_WARM_PROMPTS:
                raise WarmFileError(f"warm: {path} lists more than {MAX_WARM_PROMPTS} prompts")
            out.append(_request(line, f"warm: {path} line {number}", len(out)))
    if not out:
        raise WarmFileError(f"warm: {path} lists no prompt; write one JSON object a line, "
                            '{"prompt": "..."} or {"messages": [{"role": "system", "content": "..."}]}')
    return out


def _request(line: str, where: str, index: int):
    try:
        entry = json.loads(line)
    except json.JSONDecodeError as e:
        raise WarmFileError(f"{where}: not JSON ({e.msg} at column {e.colno}); write one object a line") from None
    if not isinstance(entry, dict) or ("prompt" in entry) == ("messages" in entry):
        raise WarmFileError(f'{where}: give an object with exactly one of "prompt" (text) or "messages" (a chat)')
    unknown = sorted(set(entry) - LINE_KEYS)
    if unknown:
        raise WarmFileError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; "
                            f"a line may have {', '.join(sorted(LINE_KEYS))}")
    message = {"type": "chat" if "messages" in entry else "generate", "id": f"warm-{index}", "priority": "batch",
               "params": {"max_tokens": 1, "prompt_only": True}, **entry}
    try:
        return protocol.parse_request(message)
    except protocol.ProtocolError as e:
        raise WarmFileError(f"{where}: {e.message}") from None


@dataclass
class WarmCounts:
    prompts: int
    done: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0         # found in memory or read from the disk tier, not computed


class Warmer:
    """Feeds the prompts to the engine one at a time: ``submit(request)`` hands one over and returns
    its engine id, ``abort(engine_id)`` withdraws it."""

    def __init__(self, path: str, requests: list, submit: Callable[[object], str], abort: Callable[[str], None]):
        self.path = path
        self.requests = requests
        self.counts = WarmCounts(len(requests))
        self.current: Optional[str] = None
        self.started = self.stopped = False
        self._submit, self._abort = submit, abort

    @property
    def busy(self) -> bool:
        return self.current is not None

    def begin(self, memory_only: bool) -> None:
        where = "the prefix cache in memory (no kv_disk: they last until evicted or a restart)" if memory_only \
            else "the prefix cache and its tier on disk"
        log.info("warming %d prompt(s) from %s into %s", len(self.requests), self.path, where)
        self.started = True
        self._next()

    def finished(self, metrics: Optional[dict]) -> None:
        """The current prompt is cached."""
        m = metrics or {}
        c = self.counts
        c.done += 1
        c.prompt_tokens += int(m.get("prompt_tokens") or 0)
        c.cached_tokens += int(m.get("cached_tokens") or 0)
        log.info("warm %d/%d: %s prompt tokens, %s of them already cached", c.done + c.failed, c.prompts,
                 m.get("prompt_tokens"), m.get("cached_tokens"))
        self._next()

    def failed(self, message: str) -> None:
        self.counts.failed += 1
        log.warning("warm %d/%d failed: %s", self.counts.done + self.counts.failed, self.counts.prompts, message)
        self._next()

    def stop(self) -> None:
        """Warm no more (the daemon drains); the prompt in flight is aborted."""
        self.stopped = True
        if self.current is not None:
            self._abort(self.current)
            self.current = None

    def _next(self) -> None:
        self.current = None
        if self.stopped:
            return
        c = self.counts
        if c.done + c.failed >= len(self.requests):
            log.info("warm: done, %d prompt(s) cached (%d tokens, %d of them found cached), %d failed",
                     c.done, c.prompt_tokens, c.cached_tokens, c.failed)
            return
        try:
            self.current = self._submit(self.requests[c.done + c.failed])
        except Exception as e:          # refused before it reached the engine: the next one goes
            self.failed(str(e))

    def status(self) -> str:
        """A phrase for the daemon's status line."""
        c = self.counts
        state = "warming" if self.busy else "warmed"
        failed = f", {c.failed} failed" if c.failed else ""
        return f"{state} {c.done}/{c.prompts} prompts{failed}"

    def snapshot(self) -> dict:
        c = self.counts
        state = "warming" if self.busy else "stopped" if self.stopped else "done" if self.started else "waiting"
        return {"file": self.path, "state": state,
                "prompts": c.prompts, "done": c.done, "failed": c.failed,
                "prompt_tokens": c.prompt_tokens, "cached_tokens": c.cached_tokens}
