"""The engine thread: the only thread that touches the Engine.

It blocks on its inbox while idle and drains the inbox without blocking while busy, so a new
request joins the very next step. Everything it produces goes to the outbox, followed by a
wake-up byte on an inproc PAIR that the socket thread polls; it never touches the ROUTER.
The watchdog is pinged from this loop, so a stalled step stops the pings.

    socket thread --Submit/Abort/Call/Stop--> inbox (SimpleQueue) --> engine thread
    socket thread <--outputs, Failed, Result-- outbox + wake (inproc PAIR) <-- engine thread
"""
from __future__ import annotations

import logging
import queue
import threading
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import zmq

from llmd.runtime.request import SamplingParams

log = logging.getLogger("llmd.daemon")


@dataclass(frozen=True)
class Submit:
    engine_id: str
    kind: str                      # "generate" | "infill" | "chat"
    params: Any                    # runtime SamplingParams, built and validated by the socket thread
    priority: Any                  # runtime Priority
    prompt: Any = None             # str or list[int] (generate)
    prefix: str = ""               # infill
    suffix: str = ""
    middle: str = ""               # infill: the start of the middle, already written
    files: tuple = ()              # infill: ((path, text), ...)
    layout: str = "psm"            # infill: "psm" | "spm"
    messages: tuple = ()           # chat: ({"role", "content"}, ...)
    tools: tuple = ()              # chat: ({"name", "description", "parameters"}, ...)
    cache_salt: Optional[str] = None
    reuse_key: Optional[str] = None  # shifted reuse among the requests under this key (infill)


@dataclass(frozen=True)
class Abort:
    engine_id: str


@dataclass(frozen=True)
class Call:
    """Run ``fn(engine)`` between steps; its value (or error) comes back as a Result with ``token``."""

    token: int
    fn: Callable[[Any], Any]


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class Failed:
    engine_id: str
    code: str
    message: str


@dataclass(frozen=True)
class Result:
    token: int
    value: Any = None
    error: Optional[str] = None


@dataclass(frozen=True)
class Progress:
    fraction: float
    text: str


@dataclass(frozen=True)
class Loaded:
    info: dict = field(default_factory=dict)


@dataclass(frozen=True)
class LoadFailed:
    message: str


@dataclass(frozen=True)
class Died:
    """The engine loop itself failed (outside a step, which fails only its requests): the daemon must
    exit so that its supervisor restarts it."""
    message: str


class EngineThread(threading.Thread):
    """Owns the Engine built by ``make_engine(progress=fn(done, total))``; talks to the socket
    thread only by queues."""

    def __init__(self, make_engine: Callable[..., Any], wake_endpoint: str, context: zmq.Context,
                 notifier=None, warmup: bool = True, idle_wait_s: float = 0.5):
        super().__init__(name="llmd-engine", daemon=True)
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._make_engine = make_engine
        self._wake_endpoint = wake_endpoint
        self._context = context
        self._notifier = notifier
        self._warmup = warmup
        self._idle_wait_s = idle_wait_s
        self._wake: Optional[zmq.Socket] = None
        self.engine = None           # set once loaded; used by this thread only

    def submit(self, command) -> None:
        """Called by the socket thread; never blocks."""
        self.inbox.put(command)

    # -- thread body ---------------------------------------------------------------------------

    def run(self) -> None:
        self._wake = self._context.socket(zmq.PAIR)
        self._wake.setsockopt(zmq.LINGER, 0)
        self._wake.connect(self._wake_endpoint)
        try:
            if self._load():
                self._loop()
        except Exception as e:
            log.error("the engine loop failed: %s\n%s", e, traceback.format_exc())
            self._emit([Died(f"{type(e).__name__}: {e}")])
        finally:
            self._wake.close()

    def _emit(self, items: list) -> None:
        for item in items:
            self.outbox.put(item)
        try:
            self._wake.send(b"", zmq.NOBLOCK)
        except zmq.Again:
            pass                     # a wake-up is already pending

    def _load(self) -> bool:
        self._emit([Progress(0.0, "loading model")])
        try:
            self.engine = self._make_engine(progress=self._load_progress)
            if self._warmup:
                self._emit([Progress(0.8, "warming up")])
                self._warm_up()
        except Exception as e:
            log.error("model load failed: %s", e)
            self._emit([LoadFailed(f"{type(e).__name__}: {e}")])
            return False
        self._emit([Loaded(self._info())])
        return True

    def _load_progress(self, done: int, total: int) -> None:
        """Called by the loader per tensor; reported in steps of 5% (loading is 0.05 .. 0.8)."""
        fraction = 0.05 + 0.75 * done / max(total, 1)
        if fraction - getattr(self, "_reported", 0.0) >= 0.05 or done == total:
            self._reported = fraction
            self._emit([Progress(fraction, f"loading model: {done}/{total} tensors")])

    def _warm_up(self) -> None:
        self.engine.add_request("__warmup__", self.engine.tokenizer.encode("Hello, world."),
                                SamplingParams(max_tokens=4, ignore_eos=True))
        while self.engine.has_unfinished():
            self.engine.step()

    def _info(self) -> dict:
        mc, tok = self.engine.model_config, self.engine.tokenizer
        return {
            "context_length": mc.max_position_embeddings,
            "vocab_size": mc.vocab_size,
            "chat": tok.has_chat_template,
            "infill": tok.can_infill,
        }

    def _loop(self) -> None:
        while True:
            busy = self.engine.has_unfinished()
            wait = self.engine.deferred_s() if busy else 0.0
            # idle, or holding batch prompts back for a quiet moment: wait for new work meanwhile
            commands = self._drain(block=not busy or wait > 0, timeout=wait or None)
            if any(isinstance(c, Stop) for c in commands):
                return
            out: list = []
            for c in commands:
                self._handle(c, out)
            if self.engine.has_unfinished():
                out.extend(self._step())
            if out:
                self._emit(out)
            if self._notifier is not None:
                self._notifier.watchdog()

    def _drain(self, block: bool, timeout: float | None = None) -> list:
        commands = []
        if block:
            try:
                commands.append(self.inbox.get(timeout=timeout or self._idle_wait_s))
            except queue.Empty:
                return commands
        while True:
            try:
                commands.append(self.inbox.get_nowait())
            except queue.Empty:
                return commands

    def _step(self) -> list:
        try:
            return self.engine.step()
        except Exception as e:
            # The engine isolates per-request failures itself; a whole step failing means its
            # state is suspect, so every unfinished request fails rather than hanging.
            log.error("engine step failed: %s\n%s", e, traceback.format_exc())
            return [Failed("*", "internal", f"engine step failed: {type(e).__name__}: {e}")]

    def _handle(self, command, out: list) -> None:
        if isinstance(command, Submit):
            self._add(command, out)
        elif isinstance(command, Abort):
            try:
                self.engine.abort(command.engine_id)
            except Exception as e:
                log.error("abort %s failed: %s", command.engine_id, e)
        elif isinstance(command, Call):
            try:
                out.append(Result(command.token, command.fn(self.engine)))
            except Exception as e:
                out.append(Result(command.token, None, f"{type(e).__name__}: {e}"))

    def _add(self, s: Submit, out: list) -> None:
        try:
            prompt = self._prompt(s)
            self.engine.add_request(s.engine_id, prompt, s.params, priority=s.priority, cache_salt=s.cache_salt,
                                    reuse_key=s.reuse_key)
        except Exception as e:
            code = getattr(e, "code", None)
            if not isinstance(code, str) or isinstance(e, (AttributeError, TypeError, KeyError)):
                code = "internal"
                log.error("request %s failed: %s\n%s", s.engine_id, e, traceback.format_exc())
            out.append(Failed(s.engine_id, code, str(e) or type(e).__name__))

    def _prompt(self, s: Submit):
        tok = self.engine.tokenizer
        if s.kind == "chat":
            return tok.encode_chat([dict(m) for m in s.messages], tools=list(s.tools) or None)
        if s.kind == "infill":
            return tok.build_infill(s.prefix, s.suffix, list(s.files), s.layout, s.middle)
        if isinstance(s.prompt, str):
            # an editor's completion prompt in the model's FIM format: its markers become FIM tokens
            return tok.encode_fim_markers(s.prompt) or s.prompt
        return s.prompt
