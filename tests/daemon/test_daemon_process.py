"""The daemon as a separate process (`python -m llmd.daemon serve`): SIGTERM drains and exits 0."""
from __future__ import annotations

import pytest
import signal
import socket
import subprocess
import sys
import threading
import time

from daemon_fixtures import REPO, daemon_process, daemon_settings, wait_ready
from llmd.clients.client import Client
from llmd.protocol import Done, Token

pytestmark = pytest.mark.heavy          # daemon subprocesses


def collect_notifications(sock, messages: list, stop: threading.Event) -> None:
    """Read the fake NOTIFY_SOCKET continuously (a full queue would drop the daemon's datagrams)."""
    while True:
        try:
            messages.append(sock.recv(4096).decode())
        except (TimeoutError, socket.timeout):
            if stop.is_set():
                return


def test_sigterm_mid_stream_delivers_a_terminal_event_and_exits_0(model_factory, tmp_path):
    # A long-context model and a long answer: the drain, not the length, must end it on any machine.
    settings = daemon_settings(model_factory("sigterm-long", max_pos=8192), tmp_path, drain_grace_s=0.3)
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify"))
    notify.settimeout(0.05)
    messages: list[str] = []
    collecting = threading.Event()
    reader = threading.Thread(target=collect_notifications, args=(notify, messages, collecting), daemon=True)
    reader.start()
    proc = daemon_process(settings, env={"NOTIFY_SOCKET": str(tmp_path / "notify")})
    try:
        wait_ready(lambda: Client(settings.socket, connect_timeout=0.5))
        with Client(settings.socket) as c:
            stream = c.generate("a very long answer", max_tokens=6000, ignore_eos=True)
            assert isinstance(next(stream), Token)
            proc.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            events = list(stream)
            assert isinstance(events[-1], Done) and events[-1].finish_reason == "shutdown"
        assert proc.wait(timeout=10) == 0
        assert time.monotonic() - t0 < settings.drain_grace_s + 3.0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    collecting.set()
    reader.join(5)
    ready = next(i for i, m in enumerate(messages) if "READY=1" in m)
    stopping = next(i for i, m in enumerate(messages) if "STOPPING=1" in m)
    assert any("warming up" in m for m in messages[:ready])
    assert ready < stopping
    assert not (settings.socket_path).exists()          # removed on a clean exit


def test_print_config_shows_values_and_their_sources(tiny_model_dir, tmp_path):
    (tmp_path / "llmd").mkdir()
    (tmp_path / "llmd" / "llmd.toml").write_text("max_queue = 7\nkv_memory = \"32MiB\"\n")
    env = {"XDG_CONFIG_HOME": str(tmp_path), "LLMD_KV_MEMORY": "48MiB", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "llmd.daemon", "serve", "--print-config", "--model", "m",
                          "--drain-grace", "3"], cwd=REPO, env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    lines = {line.split()[0]: line for line in out.stdout.splitlines()}
    assert "7" in lines["max_queue"] and str(tmp_path / "llmd" / "llmd.toml") in lines["max_queue"]
    assert "48MiB" in lines["kv_memory"] and lines["kv_memory"].endswith("environment")
    assert "3.0" in lines["drain_grace_s"] and lines["drain_grace_s"].endswith("command line")
    assert lines["block_size"].endswith("default")
