"""systemd integration: sd_notify against a fake NOTIFY_SOCKET, the watchdog fed by the engine
loop, socket activation through ZMQ_USE_FD, and the unit files checked by systemd-analyze."""
from __future__ import annotations

import os
import socket
import struct
import threading
import time
from pathlib import Path

import pytest

from daemon_fixtures import REPO, daemon_settings, running_daemon, wait_until
from systemd_units import SYSTEMD_ANALYZE, check_units
from llmd.clients.client import Client
from llmd.protocol import Done
from llmd import systemd
from llmd.daemon.engine_thread import Call
from llmd.daemon.serve import engine_factory


SO_TIMESTAMPNS = 35         # Linux: the kernel stamps each datagram as it is queued (not exposed by Python)


class FakeManager:
    """A NOTIFY_SOCKET that records each datagram with its arrival time: the kernel's stamp, taken as the
    datagram is queued, so a reader thread that a busy machine schedules late does not move it."""

    def __init__(self, path: Path):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        self.sock.bind(str(path))
        self.sock.settimeout(0.05)
        self.path = str(path)
        self.messages: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self):
        while not self._stop.is_set():
            try:
                data, ancillary, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(16))
            except (TimeoutError, socket.timeout):
                continue
            now = time.monotonic()
            for level, kind, stamp in ancillary:
                if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
                    sec, nsec = struct.unpack("qq", stamp[:16])
                    now -= max(0.0, time.time() - (sec + nsec / 1e9))      # the stamp, on the monotonic clock
            self.messages.append((now, data.decode()))

    def close(self):
        self._stop.set()
        self._thread.join(2)
        self.sock.close()

    def index(self, text: str, wait: float = 5.0) -> int:
        """Position of the first datagram containing ``text``; waits for the reader thread to see it
        (a datagram already sent may not be read yet on a busy machine)."""
        deadline = time.monotonic() + wait
        while True:
            found = next((i for i, (_, m) in enumerate(self.messages) if text in m), None)
            if found is not None or time.monotonic() > deadline:
                if found is None:
                    raise AssertionError(f"no {text!r} among {[m for _, m in self.messages]}")
                return found
            time.sleep(0.01)

    def pings(self) -> list[float]:
        return [t for t, m in self.messages if m == "WATCHDOG=1"]


def test_notify_sends_datagrams_and_is_a_noop_without_a_socket(tmp_path):
    fake = FakeManager(tmp_path / "n")
    try:
        n = systemd.Notifier(notify_socket=fake.path, watchdog_usec=0)
        assert n.ready("up") and n.status("x")
        assert systemd.Notifier(notify_socket="", watchdog_usec=0).notify(READY=1) is False
        assert fake.index("STATUS=x") == 1          # waits for the reader thread to see both
        assert [m for _, m in fake.messages] == ["READY=1\nSTATUS=up", "STATUS=x"]
    finally:
        fake.close()


def test_abstract_namespace_and_a_full_queue_never_block():
    name = f"@llmd-test-{os.getpid()}"
    recv = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    recv.bind("\0" + name[1:])
    n = systemd.Notifier(notify_socket=name, watchdog_usec=0)
    assert n.status("one")
    assert recv.recv(100) == b"STATUS=one"
    t0 = time.monotonic()
    results = [n.status("flood") for _ in range(5000)]      # nobody reads: the queue fills up
    assert time.monotonic() - t0 < 2.0 and not all(results)
    recv.close()


def test_watchdog_is_rate_limited_to_half_the_interval(tmp_path):
    fake = FakeManager(tmp_path / "n")
    try:
        n = systemd.Notifier(notify_socket=fake.path, watchdog_usec=200_000)
        sent = sum(n.watchdog() for _ in range(1000))
        assert sent == 1
        time.sleep(0.11)
        assert n.watchdog()
    finally:
        fake.close()


def test_environment_parsing():
    me = str(os.getpid())
    assert systemd.watchdog_usec_from_env({"WATCHDOG_USEC": "5000000", "WATCHDOG_PID": me}) == 5_000_000
    assert systemd.watchdog_usec_from_env({"WATCHDOG_USEC": "5000000", "WATCHDOG_PID": "1"}) is None
    assert systemd.listen_fds({"LISTEN_PID": "1", "LISTEN_FDS": "1"}) == []
    env = {"LISTEN_PID": me, "LISTEN_FDS": "2", "LISTEN_FDNAMES": "a:b"}
    r, w = os.pipe(), os.pipe()           # make sure fds 3 and 4 exist for the inheritable flag
    try:
        assert systemd.listen_fds(env) == [3, 4] and env == {}
    finally:
        for fd in (*r, *w):
            os.close(fd)


@pytest.mark.heavy
def test_ready_only_after_warm_up_and_pings_stop_when_the_loop_stalls(tiny_model_dir, tmp_path):
    fake = FakeManager(tmp_path / "notify")
    notifier = systemd.Notifier(notify_socket=fake.path, watchdog_usec=200_000)
    settings = daemon_settings(tiny_model_dir, tmp_path)
    warmed = {}

    def make(progress=None):
        engine = engine_factory(settings)(progress)
        real_step = engine.step

        def step():                       # records when warm-up steps ran, to order against READY
            warmed.setdefault("last", time.monotonic())
            warmed["last"] = time.monotonic()
            return real_step()
        engine.step = step
        return engine

    try:
        with running_daemon(settings, make, notifier=notifier) as server:
            ready_at = fake.messages[fake.index("READY=1")][0]
            assert fake.index("warming up") < fake.index("READY=1")
            assert warmed["last"] < ready_at
            assert wait_until(lambda: len([t for t in fake.pings() if t > ready_at]) >= 3, 5.0)
            stall = {}

            def stall_for_a_second(engine):          # the engine loop stalls; times taken inside it
                stall["start"] = time.monotonic()
                time.sleep(1.0)
                stall["end"] = time.monotonic()
            server.engine.submit(Call(0, stall_for_a_second))
            assert wait_until(lambda: "end" in stall, 10.0)
            assert wait_until(lambda: len([t for t in fake.pings() if t > stall["end"]]) >= 2, 5.0)
            # Times are the kernel's stamps of each ping (a ping read late, as on a loaded machine, keeps its
            # time; one read 0.5 s late failed a clean run). A live loop pings every 0.1 s, four times or more
            # in the window checked here.
            during = [t for t in fake.pings() if stall["start"] + 0.5 < t < stall["end"] - 0.05]
            assert during == []
        assert fake.index("READY=1") < fake.index("STOPPING=1")
    finally:
        fake.close()


@pytest.mark.heavy
def test_socket_activation_accepts_clients_while_the_model_loads(tiny_model_dir, tmp_path):
    settings = daemon_settings(tiny_model_dir, tmp_path)
    settings.socket_path.parent.mkdir(parents=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(settings.socket)
    listener.listen(16)

    def slow(progress=None):
        time.sleep(1.0)
        return engine_factory(settings)(progress)

    from llmd.daemon.server import Server
    server = Server(settings, slow, listen_fd=listener.detach())     # ZeroMQ owns (and closes) the fd
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        with Client(settings.socket, connect_timeout=5) as c:
            assert c.health()["state"] == "loading"
            events = list(c.generate("queued while loading", max_tokens=3))
            assert isinstance(events[-1], Done)
            assert c.health()["state"] == "ready"
    finally:
        server.request_stop()
        thread.join(10)
    assert not thread.is_alive()


@pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed")
def test_unit_files_verify_and_are_hardened(tmp_path):
    check_units(tmp_path, "llmd.socket", "llmd.service")
    service = (REPO / "systemd" / "llmd.service").read_text()
    for setting in ("Type=notify", "PrivateNetwork=yes", "RestrictAddressFamilies=AF_UNIX", "ProtectSystem=strict",
                    "ProtectHome=yes", "NoNewPrivileges=yes", "MemoryMax=", "WatchdogSec=", "User=llmd"):
        assert setting in service
