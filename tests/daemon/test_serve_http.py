"""`llmd serve --http HOST:PORT`: one command serves the ZeroMQ socket and the HTTP front (its child
process, `llmd http`), with `llmd http`'s safe defaults; stopping the daemon stops the front."""
from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys

import pytest
from prometheus_client.parser import text_string_to_metric_families

from daemon_fixtures import REPO, daemon_process, daemon_settings, wait_until
from http_fixtures import call
from systemd_units import SYSTEMD_ANALYZE, check_units
from llmd.clients.client import Client


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(url: str) -> bool:
    try:
        return call(url + "/health", method="GET", timeout=2)[0] == 200
    except OSError:
        return False


def ttft_count(url: str) -> float:
    status, _, body = call(url + "/metrics", method="GET")
    assert status == 200
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            if s.name == "llmd_time_to_first_token_seconds_count":
                return s.value
    raise AssertionError("no llmd_time_to_first_token_seconds in /metrics")


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    """`python -m llmd.daemon serve --http 127.0.0.1:PORT`; yields (settings, base URL, process)."""
    settings = daemon_settings(tiny_model_dir, tmp_path_factory.mktemp("serve-http"))
    url = f"http://127.0.0.1:{free_port()}"
    proc = daemon_process(settings, "--http", url.removeprefix("http://"))
    try:
        if not wait_until(lambda: healthy(url) or proc.poll() is not None, timeout=90, interval=0.1) \
                or proc.poll() is not None:
            proc.kill()
            raise RuntimeError(f"llmd serve --http did not start: {proc.communicate(timeout=10)}")
        yield settings, url, proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.mark.heavy
def test_one_command_answers_zeromq_openai_ollama_and_metrics(served):
    settings, url, _ = served
    with Client(settings.socket, timeout=30) as c:
        assert c.health()["state"] == "ready"
    before = ttft_count(url)
    status, _, body = call(url + "/v1/completions", {"prompt": "def add(a, b):", "max_tokens": 4})
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 4
    status, _, body = call(url + "/api/generate", {"model": "m", "prompt": "def add(a, b):", "stream": False,
                                                   "options": {"num_predict": 3}})
    assert status == 200 and json.loads(body)["done"] is True
    assert ttft_count(url) - before == 2


@pytest.mark.heavy
def test_stopping_the_daemon_stops_the_front(served):
    _, url, proc = served
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0, proc.communicate()
    assert not healthy(url)
    with socket.socket() as s:          # nothing listens there any more: no front was left behind
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)      # past the closed connections' TIME_WAIT
        s.bind(("127.0.0.1", int(url.rsplit(":", 1)[1])))


@pytest.mark.parametrize("extra, message", [
    (("--http", "0.0.0.0:8080"), "refusing to listen on 0.0.0.0"),
    (("--http", "192.168.7.9:8080", "--http-allow-remote"), "without a key"),
    (("--http", "localhost"), "HOST:PORT"),
])
@pytest.mark.heavy
def test_a_non_loopback_address_is_refused_without_the_opt_in(tmp_path, extra, message):
    out = subprocess.run([sys.executable, "-m", "llmd.daemon", "serve", "--model", str(tmp_path / "none"),
                          "--socket", str(tmp_path / "d.sock"), *extra], capture_output=True, text=True,
                         timeout=60, cwd=REPO, env={"XDG_CONFIG_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 2 and message in out.stderr, out.stderr


@pytest.mark.heavy
def test_a_taken_port_ends_the_daemon(tiny_model_dir, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        settings = daemon_settings(tiny_model_dir, tmp_path)
        proc = daemon_process(settings, "--http", f"127.0.0.1:{taken.getsockname()[1]}")
        try:
            code = proc.wait(90)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert code == 2, proc.communicate()


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.heavy
def test_a_killed_daemon_takes_its_front_along(tiny_model_dir, tmp_path):
    port = free_port()
    proc = daemon_process(daemon_settings(tiny_model_dir, tmp_path), "--http", f"127.0.0.1:{port}")
    try:
        assert wait_until(lambda: listening(port) or proc.poll() is not None, timeout=90, interval=0.1)
        assert proc.poll() is None, proc.communicate()
        proc.kill()
        proc.wait(10)
        assert wait_until(lambda: not listening(port), timeout=20, interval=0.1)
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed")
def test_the_http_drop_in_verifies_and_keeps_the_service_on_loopback(tmp_path):
    (tmp_path / "llmd.service.d").mkdir()
    conf = (REPO / "systemd" / "llmd.service.d" / "http.conf").read_text()
    (tmp_path / "llmd.service.d" / "http.conf").write_text(conf)
    check_units(tmp_path, "llmd.socket", "llmd.service")     # verified and rated with the drop-in beside it
    for setting in ("Environment=LLMD_HTTP=127.0.0.1:", "IPAddressDeny=any", "IPAddressAllow=localhost"):
        assert setting in conf
