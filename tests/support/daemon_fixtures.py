"""Helpers for the daemon tests: a real Server on a real ipc:// socket, with the real engine.

The daemon runs in-process on a thread (its run() is the same code `llmd serve` runs); tests
that need signals or a separate process start `python -m llmd.daemon serve` instead.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from llmd.daemon.serve import engine_factory
from llmd.daemon.server import Server
from llmd.daemon.settings import Settings

REPO = Path(__file__).resolve().parents[2]
ENGINE_OPTIONS = dict(dtype="float32", kv_memory="64MiB", block_size=16, max_batch_tokens=256)
# Every engine step of a test daemon lasts at least this long. Tests that interrupt a long answer
# (cancel, barge-in, drain, deadline) ask for several hundred tokens; the tiny model can produce them
# in well under a second on a fast machine, so without a floor the answer could finish first.
MIN_STEP_S = 0.003


def daemon_settings(model_dir, socket_dir, **overrides) -> Settings:
    base = dict(model=str(model_dir), socket=str(Path(socket_dir) / "llmd" / "llmd.sock"), keepalive_s=0.1,
                drain_grace_s=2.0, heartbeat_ivl_ms=200, heartbeat_timeout_ms=600, **ENGINE_OPTIONS)
    return Settings(**{**base, **overrides})


def make_engine_factory(model_dir, wrap=None):
    """The engine as the daemon builds it; ``wrap(engine)`` may inject a fault for a test."""
    def make(progress=None):
        from llmd.runtime.config import EngineConfig
        from llmd.runtime.engine import Engine
        engine = Engine(EngineConfig(model=str(model_dir), **ENGINE_OPTIONS), progress=progress)
        if wrap is not None:
            wrap(engine)
        return engine
    return make


def paced(make_engine, min_step_s: float = MIN_STEP_S):
    """Wrap an engine factory so that each step of the engine it builds lasts at least min_step_s."""
    def make(progress=None):
        engine = make_engine(progress=progress)
        step = engine.step

        def slow_step(*args, **kwargs):
            t0 = time.monotonic()
            out = step(*args, **kwargs)
            rest = min_step_s - (time.monotonic() - t0)
            if rest > 0:
                time.sleep(rest)
            return out
        engine.step = slow_step
        return engine
    return make


@contextlib.contextmanager
def running_daemon(settings: Settings, make_engine=None, notifier=None, ready_timeout: float = 60.0):
    """Start a Server on a thread, wait until it is ready, stop it (draining) on exit."""
    server = Server(settings, paced(make_engine or engine_factory(settings)), notifier=notifier)
    ready = threading.Event()
    server.ready_event = ready
    result: dict = {}

    def body():
        try:
            result["code"] = server.run()
        except BaseException as e:    # surfaced to the test below
            result["error"] = e

    thread = threading.Thread(target=body, name="llmd-test-daemon", daemon=True)
    thread.start()
    deadline = time.monotonic() + ready_timeout
    while not ready.wait(0.05):
        if "error" in result or not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"daemon did not become ready: {result}")
    try:
        yield server
    finally:
        server.request_stop()
        thread.join(15)
        assert not thread.is_alive(), "daemon thread did not stop"
        assert result.get("code") == 0, result


def offline_greedy(engine, prompts, max_tokens: int) -> dict:
    """Run prompts through an Engine directly (no daemon); returns {prompt: (token_ids, text)}, a token-id
    prompt keyed as a tuple."""
    from llmd.runtime.request import SamplingParams
    out = {}
    for i, p in enumerate(prompts):
        rid = f"offline-{i}"
        engine.add_request(rid, p, SamplingParams(max_tokens=max_tokens))
        ids, text = [], ""
        while engine.has_unfinished():
            for o in engine.step():
                ids += o.new_token_ids
                text += o.text_delta
        out[tuple(p) if isinstance(p, list) else p] = (ids, text)
    return out


def daemon_process(settings: Settings, *extra: str, env=None) -> subprocess.Popen:
    """`python -m llmd.daemon serve` as a separate process with these settings."""
    cmd = [sys.executable, "-m", "llmd.daemon", "serve", "--model", settings.model, "--socket", settings.socket,
           "--kv-memory", settings.kv_memory, "--max-batch-tokens", str(settings.max_batch_tokens),
           "--drain-grace-s", str(settings.drain_grace_s), "--threads", "1", *extra]
    full_env = {**os.environ, "PYTHONPATH": str(REPO / "tests" / "support"),
                "XDG_CONFIG_HOME": str(Path(settings.socket).parent), **(env or {})}
    return subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_ready(client_factory, timeout: float = 60.0) -> None:
    from llmd.clients.client import ClientError
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with client_factory() as c:
                if c.health()["state"] == "ready":
                    return
        except ClientError:
            pass
        time.sleep(0.1)
    raise TimeoutError("daemon not ready")


def wait_until(predicate, timeout: float, interval: float = 0.01):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)
