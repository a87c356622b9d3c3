"""The socket thread: owns the ROUTER socket, the flight table and the daemon's state.

It never waits on a model step. Requests are validated here and handed to the engine thread;
the engine's outputs come back through the outbox and leave here as events. Every send is
non-blocking with ROUTER_MANDATORY set, so a client that vanished (EHOSTUNREACH) or stopped
reading (its queue full, EAGAIN) is dropped at once and its requests aborted. Clients with
work in flight but no recent output get a keepalive, which is how a vanished client is found
while its request is still in the prompt.

States: loading -> ready -> draining -> stopped (or loading -> failed).
"""
from __future__ import annotations

import errno
import itertools
import logging
import os
import time
from pathlib import Path
from typing import Callable, Optional

import zmq
from zmq.utils.monitor import parse_monitor_message

from llmd import codec, protocol
from llmd.protocol import Ack, Done, Error, Keepalive, Reply, Sentence, Token
from llmd.runtime.request import Priority, SamplingParams  # the runtime validates semantics
from llmd.sentences import SentenceSplitter

from . import paths
from .engine_thread import Abort, Call, Died, EngineThread, Failed, Loaded, LoadFailed, Progress, Result, Stop, Submit
from .flights import Flight, FlightTable
from .settings import Settings
from .stats import ServerStats, plain
from .warm import Warmer, WarmFileError, read_warm_file

log = logging.getLogger("llmd.daemon")
_ids = itertools.count()
HELD_TOKENS = 1024       # most tokens in one token event of a non-streamed request (stream false)


MAX_STATS_WAITERS = 256       # stats requests waiting for the engine's one answer


class Server:
    """The daemon. ``run()`` blocks in the calling thread until stopped and returns an exit code."""

    def __init__(self, settings: Settings, make_engine: Callable[[], object], notifier=None,
                 listen_fd: Optional[int] = None, model_name: Optional[str] = None):
        self.settings = settings
        self.notifier = notifier
        self._make_engine = make_engine
        self._listen_fd = listen_fd
        self.model_name = model_name or (Path(settings.model).name if settings.model else "")
        self.state = "loading"
        self.progress = 0.0
        self.status_text = "starting"
        self.started = time.monotonic()
        self.info: dict = {}
        self.flights = FlightTable()
        self.stats = ServerStats()
        # stats asked while the engine computes them wait for that one answer: one call in flight at most
        self._stats_waiters: list[tuple[bytes, str]] = []
        self._stats_token: Optional[int] = None
        self._tokens = itertools.count(1)
        self._stop_r, self._stop_w = os.pipe()
        os.set_blocking(self._stop_w, False)
        self._drain_until: Optional[float] = None
        self._next_keepalive = 0.0
        self._exit_code = 0
        self._lock = paths.PidLock(settings.socket_path)
        self.ready_event = None        # optional threading.Event set when ready (tests, embedding)
        self.engine: Optional[EngineThread] = None
        self.ctx = self.router = self.monitor = self.wake = None     # set by _open
        self.warmer = self._warmer()      # a bad warm file stops the start here, before the model loads

    # -- lifecycle -----------------------------------------------------------------------------

    def request_stop(self) -> None:
        """Begin draining. Safe from any thread and from a signal handler."""
        try:
            os.write(self._stop_w, b"x")
        except (BlockingIOError, OSError):
            pass

    def run(self) -> int:
        if self._listen_fd is None:
            paths.prepare_dir(self.settings.socket_path, self.settings.group)
        self._lock.acquire()          # raises AlreadyRunning before touching the socket
        try:
            try:
                self._open()
                self._loop()
            finally:
                self._close()
        finally:
            self._lock.release()
            os.close(self._stop_r)
            os.close(self._stop_w)
        return self._exit_code

    def _open(self) -> None:
        s = self.settings
        self.ctx = zmq.Context()
        r = self.router = self.ctx.socket(zmq.ROUTER)
        r.setsockopt(zmq.ROUTER_MANDATORY, 1)
        r.setsockopt(zmq.MAXMSGSIZE, s.max_message_bytes)
        r.setsockopt(zmq.SNDHWM, s.send_hwm)
        r.setsockopt(zmq.RCVHWM, s.send_hwm)
        if s.send_buffer_bytes:
            r.setsockopt(zmq.SNDBUF, s.send_buffer_bytes)
        r.setsockopt(zmq.HEARTBEAT_IVL, s.heartbeat_ivl_ms)
        r.setsockopt(zmq.HEARTBEAT_TTL, s.heartbeat_timeout_ms)
        r.setsockopt(zmq.HEARTBEAT_TIMEOUT, s.heartbeat_timeout_ms)
        r.setsockopt(zmq.LINGER, 500)
        self.monitor = r.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        if self._listen_fd is not None:
            r.setsockopt(zmq.USE_FD, self._listen_fd)
        umask = os.umask(0o077)       # the socket file is owner-only from its creation
        try:
            r.bind(s.endpoint)
        finally:
            os.umask(umask)
        if self._listen_fd is None:
            paths.secure_socket(s.socket_path, s.group)
        if s.tcp:
            r.bind(s.tcp)
        self.wake = self.ctx.socket(zmq.PAIR)
        wake_endpoint = f"inproc://llmd-wake-{id(self)}"
        self.wake.bind(wake_endpoint)
        self.poller = zmq.Poller()
        for sock in (r, self.wake, self.monitor):
            self.poller.register(sock, zmq.POLLIN)
        self.poller.register(self._stop_r, zmq.POLLIN)
        idle = 0.5
        if self.notifier is not None and self.notifier.watchdog_interval_s:
            idle = min(idle, self.notifier.watchdog_interval_s / 4)
        self.engine = EngineThread(self._make_engine, wake_endpoint, self.ctx, self.notifier,
                                   warmup=s.warmup, idle_wait_s=idle)
        self.engine.start()
        self._status("loading model")
        log.info("listening on %s", s.endpoint)

    def _close(self) -> None:
        """Also after a start that failed part way: closes what _open got to."""
        if self.engine is not None:
            self.engine.submit(Stop())
            self.engine.join(timeout=5.0)
            self._close_engine()
        if self.monitor is not None:
            self.router.disable_monitor()
        for sock in (self.monitor, self.wake):
            if sock is not None:
                sock.close(linger=0)
        if self.router is not None:
            self.router.close()
        if self.ctx is not None:
            self.ctx.term()
        if self._listen_fd is None:
            try:
                os.unlink(self.settings.socket_path)
            except FileNotFoundError:
                pass
        if self.notifier is not None:
            self.notifier.status("stopped")

    def _close_engine(self) -> None:
        """Once the engine thread has ended, the engine is no one's: close it, so the disk tier writes
        what it lacks before the process exits (`llmd serve` ends with os._exit, which runs no atexit)."""
        engine = self.engine.engine
        if engine is None or self.engine.is_alive():
            return
        try:
            engine.close()
        except Exception as e:
            log.warning("closing the engine failed: %s", e)

    def _warmer(self) -> Optional[Warmer]:
        s = self.settings
        if not s.warm:
            return None
        if not s.prefix_cache:
            raise WarmFileError("warm computes prompts into the prefix cache, which is off: set prefix_cache "
                                "(--prefix-cache) or leave warm unset")
        return Warmer(s.warm, read_warm_file(s.warm), self._submit_warm, lambda eid: self.engine.submit(Abort(eid)))

    def _submit_warm(self, req) -> str:
        submit = self._submission(req)
        self.engine.submit(submit)
        return submit.engine_id

    def _warm_status(self) -> None:
        if self.state == "ready":
            self._status(f"ready, {self.warmer.status()}")

    def _status(self, text: str) -> None:
        self.status_text = text
        if self.notifier is not None:
            self.notifier.status(text)

    # -- the loop ------------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            now = time.monotonic()
            if self.state in ("failed", "stopped"):
                return
            if self._drain_until is not None and (not self.flights or now >= self._drain_until):
                self._finish_all("shutdown")
                self.state = "stopped"
                return
            for sock, _ in self.poller.poll(self._poll_ms(now)):
                if sock is self.router:
                    self._read_requests()
                elif sock is self.wake:
                    self._read_outbox()
                elif sock is self.monitor:
                    self._read_monitor()
                elif sock == self._stop_r:
                    os.read(self._stop_r, 64)
                    self._begin_drain()
            self._check_deadlines()
            self._keepalive()

    def _poll_ms(self, now: float) -> int:
        t = 100.0
        if self.flights:
            t = min(t, self.settings.keepalive_s * 1000)
        if self._drain_until is not None:
            t = min(t, max(0.0, (self._drain_until - now) * 1000))
        return max(1, int(t))

    def _begin_drain(self) -> None:
        if self._drain_until is None:
            self.state = "draining"
            self._drain_until = time.monotonic() + self.settings.drain_grace_s
            if self.warmer is not None:
                self.warmer.stop()
            if self.notifier is not None:
                self.notifier.stopping(f"draining {len(self.flights)} request(s)")
            log.info("draining %d request(s), grace %.1fs", len(self.flights), self.settings.drain_grace_s)

    # -- incoming ------------------------------------------------------------------------------

    def _read_requests(self) -> None:
        for _ in range(256):          # bounded so outputs are never starved
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            ident, body = frames[0], frames[1:]
            try:
                if len(body) != 1:
                    raise protocol.ProtocolError(protocol.BAD_MESSAGE, f"expected 1 body frame, got {len(body)}")
                message = codec.unpack(body[0], self.settings.max_message_bytes)
                self._dispatch(ident, protocol.parse_request(message))
            except codec.CodecError as e:
                self._send(ident, Error("", protocol.BAD_MESSAGE, str(e)).to_wire())
            except protocol.ProtocolError as e:
                self._send(ident, Error(e.request_id, e.code, e.message).to_wire())

    def _dispatch(self, ident: bytes, req) -> None:
        if isinstance(req, protocol.WORK_TYPES):
            self._accept_work(ident, req)
        elif isinstance(req, protocol.Cancel):
            f = self.flights.by_client(ident, req.target)
            if f is not None:
                self._finish(f, "cancelled")
            self._send(ident, Ack(req.id, req.target, f is not None).to_wire())
        elif isinstance(req, protocol.Hello):
            version = protocol.negotiate(req)
            self._reply(ident, req.id, "hello", version=version, server="llmd", state=self.state,
                        model=self.model_name, max_message_bytes=self.settings.max_message_bytes,
                        max_queue=self.settings.max_queue, heartbeat_ivl_ms=self.settings.heartbeat_ivl_ms)
        elif isinstance(req, protocol.Health):
            self._reply(ident, req.id, "health", **self._health())
        elif isinstance(req, protocol.Models):
            model = {"name": self.model_name, "path": self.settings.model or "", "state": self.state, **self.info}
            self._reply(ident, req.id, "models", models=[model])
        elif isinstance(req, protocol.Stats):
            self._ask_stats(ident, req.id)

    def _health(self) -> dict:
        return {"state": self.state, "progress": round(self.progress, 3), "status": self.status_text,
                "uptime_s": round(time.monotonic() - self.started, 3), "in_flight": len(self.flights)}

    def _accept_work(self, ident: bytes, req) -> None:
        if self.state in ("draining", "stopped", "failed"):
            raise protocol.ProtocolError(protocol.DRAINING, f"the daemon is {self.state}; not accepting work", req.id)
        if self.flights.by_client(ident, req.id) is not None:
            raise protocol.ProtocolError(protocol.DUPLICATE_ID, f"request {req.id!r} is already in flight", req.id)
        submit = self._submission(req, ident)   # a bad request is refused before it replaces anything
        replace_key = getattr(req, "replace", None)
        old = self.flights.by_replace(ident, replace_key) if replace_key is not None else None
        in_flight = len(self.flights) - (old is not None)
        if in_flight >= self.settings.max_queue:
            self.stats.busy += 1
            raise protocol.ProtocolError(protocol.BUSY, f"{in_flight} requests in flight; retry later", req.id)
        if old is not None:
            self._finish(old, "cancelled")
        now = time.monotonic()
        f = Flight(ident, req.id, submit.engine_id, req.type, arrival=now,
                   deadline=now + req.deadline_ms / 1000 if req.deadline_ms else None,
                   replace_key=replace_key, splitter=SentenceSplitter() if req.sentences else None,
                   stream=req.stream)
        self.flights.add(f)
        self.engine.submit(submit)

    def _submission(self, req, ident: bytes = b"") -> Submit:
        try:
            params = SamplingParams(**req.params.model_dump())      # fields: llmd.sampling_fields
            priority = Priority.parse(req.priority)
        except ValueError as e:
            raise protocol.ProtocolError(protocol.INVALID_REQUEST, str(e), req.id) from None
        common = dict(engine_id=f"r{next(_ids)}", kind=req.type, params=params, priority=priority,
                      cache_salt=req.cache_salt)
        if isinstance(req, protocol.Generate):
            return Submit(prompt=req.prompt if req.prompt is not None else list(req.token_ids), **common)
        if isinstance(req, protocol.Infill):
            # a document's reuse key is its client's replace key: one client's text never meets another's
            reuse = f"{ident.hex()}:{req.replace}" if req.shift_reuse and req.replace is not None else None
            return Submit(prefix=req.prefix, suffix=req.suffix, middle=req.middle, layout=req.layout, reuse_key=reuse,
                          files=tuple((f.path, f.text) for f in req.files), **common)
        return Submit(messages=tuple(m.to_template() for m in req.messages),
                      tools=tuple(t.model_dump() for t in req.tools), **common)

    def _ask_stats(self, ident: bytes, rid: str) -> None:
        if self.state not in ("ready", "draining"):
            self._reply(ident, rid, "stats", **self._server_stats(None))
            return
        if len(self._stats_waiters) >= MAX_STATS_WAITERS:
            self.stats.busy += 1
            raise protocol.ProtocolError(protocol.BUSY, f"{len(self._stats_waiters)} stats requests waiting; "
                                         "retry later", rid)
        self._stats_waiters.append((ident, rid))
        if self._stats_token is None:
            self._stats_token = next(self._tokens)
            self.engine.submit(Call(self._stats_token, lambda engine: engine.stats()))

    def _server_stats(self, engine_stats: Optional[dict]) -> dict:
        warm = {"warm": self.warmer.snapshot()} if self.warmer is not None else {}
        return {**self._health(), "model": self.model_name, **self.stats.snapshot(), **warm,
                "engine": plain(engine_stats)}

    def _read_monitor(self) -> None:
        while True:
            try:
                event = parse_monitor_message(self.monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self._next_keepalive = 0.0     # probe every client with work at once

    # -- outgoing ------------------------------------------------------------------------------

    def _send(self, ident: bytes, message: dict) -> bool:
        """Non-blocking send; a client that is gone or not reading is dropped with its requests. A message
        that cannot be encoded (a bug) fails its own request instead of the loop."""
        try:
            frame = codec.pack(message)
        except codec.CodecError as e:
            log.error("cannot encode a %r message: %s", message.get("type"), e)
            f = self.flights.by_client(ident, message.get("id", ""))
            if f is not None:
                self._fail(f, protocol.INTERNAL, "the daemon could not encode a reply for this request")
            return False
        try:
            self.router.send_multipart([ident, frame], zmq.NOBLOCK)
            return True
        except zmq.Again:
            reason = "not reading"
        except zmq.ZMQError as e:
            if e.errno != errno.EHOSTUNREACH:
                raise
            reason = "gone"
        self._drop_client(ident, reason)
        return False

    def _reply(self, ident: bytes, rid: str, kind: str, **body) -> None:
        self._send(ident, Reply(rid, kind, body).to_wire())

    def _drop_client(self, ident: bytes, reason: str) -> None:
        flights = self.flights.of_ident(ident)
        if flights:
            log.info("client %s %s: aborting %d request(s)", ident.hex(), reason, len(flights))
            self.stats.dropped_clients += 1
        for f in flights:
            self.flights.remove(f)
            self.engine.submit(Abort(f.engine_id))
            self.stats.record_end(f, "vanished")

    def _finish(self, f: Flight, reason: str) -> None:
        """End a flight from the daemon's side (cancel, replace, deadline, shutdown)."""
        self.flights.remove(f)
        self.engine.submit(Abort(f.engine_id))
        self._flush_sentences(f)
        now = time.monotonic()
        usage = {"prompt_tokens": None, "completion_tokens": f.tokens, "cached_tokens": None}
        timings = {"queued_ms": None, "prompt_ms": None, "decode_ms": None,
                   "total_ms": round((now - f.arrival) * 1000, 3)}
        self.stats.record_end(f, reason)
        self._send_held(f)               # a non-streamed request's output so far: nothing is lost
        self._send(f.ident, Done(f.client_id, reason, usage, timings).to_wire())

    def _fail(self, f: Flight, code: str, message: str) -> None:
        self.flights.remove(f)
        self.stats.record_end(f, "error")
        self._send_held(f)
        self._send(f.ident, Error(f.client_id, code, message).to_wire())

    def _finish_all(self, reason: str) -> None:
        for f in self.flights:
            self._finish(f, reason)

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        for f in self.flights:
            if f.deadline is not None and now >= f.deadline:
                self._finish(f, "deadline")

    def _keepalive(self) -> None:
        now = time.monotonic()
        if now < self._next_keepalive or not self.flights:
            return
        force = self._next_keepalive == 0.0
        self._next_keepalive = now + self.settings.keepalive_s
        stale = {f.ident for f in self.flights if force or now - f.last_sent >= self.settings.keepalive_s}
        for ident in stale:
            if self._send(ident, Keepalive().to_wire()):
                for f in self.flights.of_ident(ident):
                    f.last_sent = now

    # -- from the engine thread ----------------------------------------------------------------

    def _read_outbox(self) -> None:
        while True:
            try:
                self.wake.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
        while True:
            try:
                item = self.engine.outbox.get_nowait()
            except Exception:
                return
            self._on_engine(item)

    def _on_engine(self, item) -> None:
        if isinstance(item, Failed):
            self._warm_failed(item)
            targets = list(self.flights) if item.engine_id == "*" else [self.flights.by_engine(item.engine_id)]
            for f in targets:
                if f is not None:
                    if item.engine_id == "*":
                        self.engine.submit(Abort(f.engine_id))
                    self._fail(f, item.code, item.message)
        elif isinstance(item, Result):
            if item.token == self._stats_token:
                waiters, self._stats_waiters, self._stats_token = self._stats_waiters, [], None
                body = self._server_stats(item.value or {"error": item.error})
                for ident, rid in waiters:
                    self._reply(ident, rid, "stats", **body)
        elif isinstance(item, Progress):
            self.progress = item.fraction
            self._status(item.text)
        elif isinstance(item, Loaded):
            self._on_loaded(item.info)
        elif isinstance(item, (LoadFailed, Died)):
            what = "model load failed" if isinstance(item, LoadFailed) else "the engine stopped"
            self.state, self._exit_code = "failed", 1
            self._status(f"{what}: {item.message}")
            log.error("%s: %s; exiting with status 1", what, item.message)
            for f in self.flights:
                self._fail(f, protocol.INTERNAL, f"{what}: {item.message}")
        else:
            self._on_output(item)

    def _on_loaded(self, info: dict) -> None:
        self.info = info
        self.progress = 1.0
        if self.state == "loading":
            self.state = "ready"
        self._status("ready")
        if self.notifier is not None:
            self.notifier.ready(f"ready: {self.model_name}")
        if self.warmer is not None and self.state == "ready":
            self.warmer.begin(memory_only=not self.settings.kv_disk)
            self._warm_status()
        if self.ready_event is not None:
            self.ready_event.set()

    def _warm_failed(self, item: Failed) -> None:
        w = self.warmer
        if w is None or w.current is None or item.engine_id not in ("*", w.current):
            return
        if item.engine_id == "*":
            self.engine.submit(Abort(w.current))
        w.failed(f"{item.code}: {item.message}")
        self._warm_status()

    def _warm_output(self, out) -> None:
        """An output of the warm prompt in flight (a prompt-only request ends with its first output)."""
        if not out.finished:
            return
        if out.finish_reason in ("stop", "length"):
            self.warmer.finished(out.metrics)
        else:
            self.warmer.failed(out.error or f"the engine ended it ({out.finish_reason})")
        self._warm_status()

    def _on_output(self, out) -> None:
        f = self.flights.by_engine(out.request_id)
        if f is None:
            if self.warmer is not None and out.request_id == self.warmer.current:
                self._warm_output(out)
            return                    # cancelled, replaced, timed out or its client vanished
        now = time.monotonic()
        if out.new_token_ids or out.text_delta:
            if f.first_token_at is None:
                f.first_token_at = now
            f.tokens += len(out.new_token_ids)
            if not f.stream:
                f.held.append((out.text_delta, list(out.new_token_ids), plain(out.logprobs)))
            elif not self._send(f.ident, Token(f.client_id, f.seq, out.text_delta, list(out.new_token_ids),
                                               plain(out.logprobs)).to_wire()):
                return
            else:
                f.seq += 1
                f.last_sent = now        # a held output sends nothing: keepalives go on meanwhile
            if f.splitter is not None:
                for text in f.splitter.feed(out.text_delta):
                    self._send_sentence(f, text)
        if out.finished:
            self._on_finished(f, out)

    def _send_held(self, f: Flight) -> bool:
        """A non-streamed request's output, held until now, as token events of at most HELD_TOKENS
        tokens each (one, but for long outputs: each message stays well under a client's size limit).
        False where the client is gone (it is dropped with its requests)."""
        held, f.held = f.held, []
        at = 0
        while at < len(held):
            text, ids, logprobs = [], [], None
            while at < len(held) and (not ids or len(ids) + len(held[at][1]) <= HELD_TOKENS):
                step_text, step_ids, step_logprobs = held[at]
                text.append(step_text)
                ids.extend(step_ids)
                if step_logprobs is not None:
                    logprobs = (logprobs or [])
                    logprobs.extend(step_logprobs)
                at += 1
            if not self._send(f.ident, Token(f.client_id, f.seq, "".join(text), ids, logprobs).to_wire()):
                return False
            f.seq += 1
        return True

    def _on_finished(self, f: Flight, out) -> None:
        if out.finish_reason in ("stop", "length"):
            if not self._send_held(f):
                return                   # the client is gone: dropped with its requests
            self.flights.remove(f)
            self._flush_sentences(f)
            self.stats.record_end(f, out.finish_reason, out.metrics)
            self._send(f.ident, Done(f.client_id, out.finish_reason, *_usage_timings(out.metrics)).to_wire())
        elif out.finish_reason == "error":
            self._fail(f, protocol.INTERNAL, out.error or "the request failed inside the engine")
        else:
            self._fail(f, protocol.INTERNAL, f"the engine ended the request ({out.finish_reason})")

    def _send_sentence(self, f: Flight, text: str) -> None:
        if self._send(f.ident, Sentence(f.client_id, f.sentence_seq, text).to_wire()):
            f.sentence_seq += 1

    def _flush_sentences(self, f: Flight) -> None:
        if f.splitter is not None:
            rest = f.splitter.flush()
            if rest:
                self._send_sentence(f, rest)


def _ms(seconds) -> Optional[float]:
    return None if seconds is None else round(float(seconds) * 1000, 3)


def _usage_timings(m: Optional[dict]) -> tuple[dict, dict, dict]:
    m = m or {}
    usage = {"prompt_tokens": m.get("prompt_tokens"), "completion_tokens": m.get("output_tokens"),
             "cached_tokens": m.get("cached_tokens"), "shifted_tokens": m.get("shifted_tokens")}
    ttft, queued = m.get("ttft_s"), m.get("queued_s")
    timings = {"queued_ms": _ms(queued), "prompt_ms": _ms(ttft - (queued or 0.0)) if ttft is not None else None,
               "decode_ms": _ms(m.get("decode_s")), "total_ms": _ms(m.get("e2e_s"))}
    spec = {"proposed": m.get("spec_proposed"), "accepted": m.get("spec_accepted"),
            "acceptance": m.get("spec_acceptance")}
    return plain(usage), plain(timings), plain(spec)
