"""The Python clients against the real daemon: errors when it is absent, reconnection after a
restart, timeouts, and the asyncio client."""
from __future__ import annotations

import asyncio
import socket
import time

import pytest

from daemon_fixtures import daemon_settings, running_daemon, wait_until
from llmd.clients.client import (AsyncClient, AsyncStream, Client, ConnectionLost, DaemonUnavailable, RequestError, Timeout)
from llmd.protocol import Done, Token
from llmd.daemon.engine_thread import Call


def test_absent_daemon_is_a_clear_error(tmp_path):
    with pytest.raises(DaemonUnavailable, match=r"no llmd daemon at ipc://.*start one with `llmd serve`"):
        Client(str(tmp_path / "none.sock")).health()


def test_stale_socket_file_times_out_as_unavailable(tmp_path):
    path = tmp_path / "stale.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))                    # exists, but nobody listens
    t0 = time.monotonic()
    with pytest.raises(DaemonUnavailable, match="nothing answered"):
        Client(str(path), connect_timeout=0.3).health()
    assert time.monotonic() - t0 < 2
    s.close()


@pytest.mark.heavy
def test_reconnects_after_a_daemon_restart_and_fails_streams_cut_off(tiny_model_dir, tmp_path):
    settings = daemon_settings(tiny_model_dir, tmp_path, drain_grace_s=0.0)
    c = Client(settings.socket, timeout=10)
    with running_daemon(settings):
        first = c.generate("before restart", max_tokens=5).text()
        cut = c.generate("cut off", max_tokens=900, ignore_eos=True)
        next(cut)
    try:
        events = list(cut)               # the drain ends it with `shutdown`, or the connection drops
        assert isinstance(events[-1], Done) and events[-1].finish_reason == "shutdown"
    except ConnectionLost:
        pass
    with pytest.raises(DaemonUnavailable):
        c.health()
    with running_daemon(settings):
        assert c.generate("before restart", max_tokens=5).text() == first
    c.close()


@pytest.fixture(scope="module")
def daemon(tiny_model_dir, tmp_path_factory):
    with running_daemon(daemon_settings(tiny_model_dir, tmp_path_factory.mktemp("c"))) as server:
        yield server


@pytest.mark.heavy
def test_timeout_when_no_event_arrives(daemon):
    with Client(daemon.settings.socket, timeout=0.2) as c:
        daemon.engine.submit(Call(0, lambda engine: time.sleep(0.6)))     # the engine is busy elsewhere
        with pytest.raises(Timeout):
            list(c.generate("slow", max_tokens=3))
        time.sleep(0.6)
        assert wait_until(lambda: c.stats()["engine"]["running"] == 0, 2.0)


@pytest.mark.heavy
def test_request_error_from_text(daemon):
    with Client(daemon.settings.socket) as c:
        with pytest.raises(RequestError) as e:
            c.generate("x", top_p=0.0).text()
        assert e.value.code == "invalid_request"
        with pytest.raises(TypeError, match="unknown sampling"):
            c.generate("x", temprature=1.0)


@pytest.mark.heavy
def test_async_client_streams_and_cancels(daemon):
    async def main():
        async with AsyncClient(daemon.settings.socket) as c:
            assert (await c.health())["state"] == "ready"
            streams = [await c.generate(f"async {i}", max_tokens=6) for i in range(4)]
            texts = await asyncio.gather(*(s.text() for s in streams))
            async with await c.generate("leave early", max_tokens=500, ignore_eos=True) as s:
                first = await s.__anext__()
            assert isinstance(first, Token)
            for _ in range(100):
                if (await c.stats())["engine"]["running"] == 0:
                    break
                await asyncio.sleep(0.01)
            assert (await c.stats())["engine"]["running"] == 0
            return texts

    texts = asyncio.run(main())
    with Client(daemon.settings.socket) as c:
        assert texts == [c.generate(f"async {i}", max_tokens=6).text() for i in range(4)]


def test_a_cancel_that_lands_as_an_event_arrives_is_not_lost(tmp_path):
    """A barge-in cancels the task reading an answer; tokens arrive every few milliseconds, so the cancel
    often lands just as one is routed to the stream. It must still end the task: a lost cancel let the
    whole interrupted answer run on (seen as a voice bridge test failing under load)."""
    async def main():
        client = AsyncClient(str(tmp_path / "unused.sock"))
        lost = 0
        for attempt in range(50):
            rid = f"r{attempt}"
            stream = client._streams[rid] = AsyncStream(client, rid)

            async def read_all():
                return [event async for event in stream]

            reader = asyncio.create_task(read_all())
            await asyncio.sleep(0)                           # the reader waits for an event
            client._route(Token(id=rid, seq=0, text="a", token_ids=[1]))
            for _ in range(attempt % 3):
                await asyncio.sleep(0)
            reader.cancel()
            client._route(Done(id=rid, finish_reason="length", usage={}, timings={}))
            try:
                await reader
                lost += 1
            except asyncio.CancelledError:
                pass
        return lost

    assert asyncio.run(main()) == 0


def test_a_message_the_client_cannot_read_is_skipped_and_the_rest_still_arrive(tmp_path):
    """The real daemon never sends such frames, so a raw ROUTER peer plays a broken or newer one: before
    each reply it sends bytes that are not msgpack, a msgpack list, and an event type it does not know."""
    import threading

    import zmq

    from llmd.protocol import Reply
    from llmd import codec
    path = tmp_path / "peer.sock"
    ctx = zmq.Context.instance()
    peer = ctx.socket(zmq.ROUTER)
    peer.setsockopt(zmq.RCVTIMEO, 200)
    peer.bind(f"ipc://{path}")
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                ident, frame = peer.recv_multipart()
            except zmq.Again:
                continue
            msg = codec.unpack(frame)
            for junk in (b"\xc1", codec.pack([1, 2]), codec.pack({"type": "from_the_future", "id": msg["id"]})):
                peer.send_multipart([ident, junk])
            body = {"version": 1} if msg["type"] == "hello" else {"state": "ready"}
            peer.send_multipart([ident, codec.pack(Reply(msg["id"], msg["type"], body).to_wire())])

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        with Client(str(path), timeout=5, connect_timeout=5) as c:
            assert c.health()["state"] == "ready"

        async def run():
            async with AsyncClient(str(path), timeout=5, connect_timeout=5) as a:
                return await a.health()
        assert asyncio.run(run())["state"] == "ready"
    finally:
        stop.set()
        t.join(2)
        peer.close(linger=0)
