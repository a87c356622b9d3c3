"""Black-box tests of the real daemon (server code, real engine, tiny random model) on ipc://."""
from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import zmq

from daemon_fixtures import (REPO, daemon_settings, make_engine_factory, offline_greedy, running_daemon,
                             wait_until)
from llmd.clients.client import Client
from llmd.protocol import Done, Error, Sentence, Token
from llmd import codec
from llmd.daemon.paths import AlreadyRunning
from llmd.daemon.server import Server

PROMPTS = [f"def f{i}(x): return x * {i} +" for i in range(8)]


@pytest.fixture(scope="module")
def daemon(tiny_model_dir, tmp_path_factory):
    # no speculation: n-gram lookup on the random model's repetitive answers accepts ~8 tokens a step,
    # which ends the long answers the cancel and vanished-client tests interrupt in well under a second
    settings = daemon_settings(tiny_model_dir, tmp_path_factory.mktemp("d"), draft="none")
    with running_daemon(settings) as server:
        yield server


@pytest.fixture(scope="module")
def offline(tiny_model_dir):
    from llmd.runtime.config import EngineConfig
    from llmd.runtime.engine import Engine
    from daemon_fixtures import ENGINE_OPTIONS
    return Engine(EngineConfig(model=str(tiny_model_dir), **ENGINE_OPTIONS))


def client(server, **kw) -> Client:
    return Client(server.settings.socket, **kw)


def daemon_stats(server) -> dict:
    with client(server) as c:
        return c.stats()


def engine_stats(server) -> dict:
    return daemon_stats(server)["engine"]


def collect(stream):
    events = list(stream)
    tokens = [e for e in events if isinstance(e, Token)]
    return events, [t for e in tokens for t in e.token_ids], "".join(e.text for e in tokens)


@pytest.mark.heavy
def test_eight_concurrent_clients_match_the_offline_engine(daemon, offline):
    expected = offline_greedy(offline, PROMPTS, max_tokens=12)
    results, errors = {}, []

    def run(prompt):
        try:
            with client(daemon) as c:
                results[prompt] = collect(c.generate(prompt, max_tokens=12))
        except Exception as e:  # reported below, a thread cannot fail the test itself
            errors.append(e)

    threads = [threading.Thread(target=run, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    for p in PROMPTS:
        events, ids, text = results[p]
        assert (ids, text) == expected[p]
        assert [e.seq for e in events if isinstance(e, Token)] == list(range(len(events) - 1))
        done = events[-1]
        assert isinstance(done, Done) and done.finish_reason in ("length", "stop")
        assert done.usage["completion_tokens"] == len(ids)
        assert done.timings["total_ms"] > 0


@pytest.mark.heavy
def test_a_non_streamed_request_gets_its_whole_output_in_one_event_before_done(daemon, offline):
    """``stream=False``: one token event (seq 0) with every token and the whole text, the same as the
    streamed request's, then done; a deadline that ends it early still delivers what was made; and
    asking for sentences without streaming is refused alone, with a typed error."""
    expected = offline_greedy(offline, PROMPTS[:3], max_tokens=12)
    with client(daemon) as c:
        for p in PROMPTS[:3]:
            events, ids, text = collect(c.generate(p, max_tokens=12, stream=False))
            assert (ids, text) == expected[p]
            assert [type(e) for e in events] == [Token, Done] and events[0].seq == 0
            assert events[1].usage["completion_tokens"] == len(ids)
        events, ids, _ = collect(c.generate("a long story begins", max_tokens=100000, ignore_eos=True,
                                            stream=False, deadline=0.5))
        assert isinstance(events[-1], Done) and events[-1].finish_reason == "deadline"
        assert [type(e) for e in events] == [Token, Done] and len(ids) == events[-1].usage["completion_tokens"] > 0
        refused = list(c.generate("x", max_tokens=4, stream=False, sentences=True))
        assert [type(e) for e in refused] == [Error]
        assert refused[0].code == "invalid_request" and "stream" in refused[0].message
        assert collect(c.generate(PROMPTS[0], max_tokens=12))[1:] == expected[PROMPTS[0]]


@pytest.mark.heavy
def test_a_long_non_streamed_request_outlasts_the_clients_timeout_and_comes_in_bounded_events(daemon, offline,
                                                                                              monkeypatch):
    """While a non-streamed request runs the daemon's keepalives extend the client's wait (its timeout
    is per silence, not per request), and a long output comes in token events of at most HELD_TOKENS
    tokens each, seq counting up, together the streamed output."""
    from llmd.daemon import server as server_module
    from llmd.clients.client import AsyncClient
    import asyncio
    monkeypatch.setattr(server_module, "HELD_TOKENS", 5)
    expected = offline_greedy(offline, PROMPTS[:1], max_tokens=12)[PROMPTS[0]]
    with Client(daemon.settings.socket, timeout=0.3) as c:
        events, ids, text = collect(c.generate(PROMPTS[0], max_tokens=12, stream=False))
        assert (ids, text) == expected
        tokens = [e for e in events if isinstance(e, Token)]
        assert [e.seq for e in tokens] == list(range(len(tokens))) and all(len(e.token_ids) <= 5 for e in tokens)
        started = time.monotonic()
        events, ids, _ = collect(c.generate("a long story begins", max_tokens=100000, ignore_eos=True,
                                            stream=False, deadline=1.2))
        assert time.monotonic() - started > 1.0 and events[-1].finish_reason == "deadline" and ids

    async def run_async():
        async with AsyncClient(daemon.settings.socket, timeout=0.3) as ac:
            stream = await ac.generate("a long story begins", max_tokens=100000, ignore_eos=True, stream=False,
                                       deadline=1.2)
            return [e async for e in stream]
    events = asyncio.run(run_async())
    assert isinstance(events[-1], Done) and events[-1].finish_reason == "deadline"


@pytest.mark.heavy
def test_one_client_interleaves_many_streams(daemon, offline):
    expected = offline_greedy(offline, PROMPTS[:4], max_tokens=6)
    with client(daemon) as c:
        streams = [c.generate(p, max_tokens=6) for p in PROMPTS[:4]]
        for p, s in zip(PROMPTS[:4], streams):
            assert collect(s)[1:] == expected[p]


@pytest.mark.heavy
def test_cancel_during_decoding_stops_tokens_frees_blocks_and_spares_others(daemon, offline):
    others = PROMPTS[4:7]
    expected = offline_greedy(offline, others, max_tokens=40)
    with client(daemon) as c:
        keep = [c.generate(p, max_tokens=40) for p in others]
        victim = c.generate("a long story begins", max_tokens=1000, ignore_eos=True)
        seen = [next(victim) for _ in range(3)]
        assert all(isinstance(e, Token) for e in seen)
        assert c.cancel(victim.id) is True
        rest = list(victim)
        # Tokens already on the wire when the cancel arrived may still come, then the final done
        # (sent before the ack), then nothing: the stream ends at the done.
        assert isinstance(rest[-1], Done) and rest[-1].finish_reason == "cancelled"
        assert all(isinstance(e, Token) for e in rest[:-1])
        assert [e.seq for e in seen + rest[:-1]] == list(range(len(seen) + len(rest) - 1))
        assert rest[-1].usage["completion_tokens"] >= sum(len(e.token_ids) for e in seen + rest[:-1])
        for p, s in zip(others, keep):
            assert collect(s)[1:] == expected[p]
    stats = engine_stats(daemon)
    assert stats["running"] == 0 and stats["waiting"] == 0 and stats["kv_blocks_used"] == 0


@pytest.mark.heavy
def test_cancel_during_the_prompt(daemon, offline):
    long_prompt = [5 + i % 400 for i in range(900)]    # several prefill chunks of 256 tokens
    expected = offline_greedy(offline, [PROMPTS[0]], max_tokens=20)
    with client(daemon) as c:
        other = c.generate(PROMPTS[0], max_tokens=20)
        victim = c.generate(token_ids=long_prompt, max_tokens=50)
        assert c.cancel(victim.id) is True
        events = list(victim)
        assert [type(e) for e in events] == [Done] and events[0].finish_reason == "cancelled"
        assert events[0].usage["completion_tokens"] == 0
        assert collect(other)[1:] == expected[PROMPTS[0]]
        stats = c.stats()["engine"]
    assert stats["running"] == 0 and stats["kv_blocks_used"] == 0
    with client(daemon) as c:
        assert c.cancel("no-such-request") is False


@pytest.mark.heavy
def test_leaving_a_stream_early_cancels_it(daemon):
    with client(daemon) as c:
        def cancelled():
            return c.stats()["finished"].get("cancelled", 0)
        before = cancelled()
        with c.generate("x", max_tokens=900, ignore_eos=True) as s:
            next(s)
        assert wait_until(lambda: cancelled() == before + 1, 2.0)
        for event in c.generate("y", max_tokens=900, ignore_eos=True):
            break                                  # the dropped stream is collected and cancelled
        assert isinstance(event, Token)
        assert wait_until(lambda: cancelled() == before + 2, 2.0)
        assert c.stats()["engine"]["running"] == 0


@pytest.mark.heavy
def test_socket_and_directory_permissions(daemon):
    path = daemon.settings.socket_path             # no group: the owner's alone
    assert oct(path.stat().st_mode & 0o777) == oct(0o600)
    assert oct(path.parent.stat().st_mode & 0o777) == oct(0o700)
    assert (path.parent / "llmd.sock.lock").read_text().strip() == str(os.getpid())


@pytest.mark.heavy
def test_a_group_opens_the_socket_to_its_members_and_an_existing_directory_is_left_alone(tiny_model_dir, tmp_path):
    import grp
    group = grp.getgrgid(os.getgid()).gr_name
    with running_daemon(daemon_settings(tiny_model_dir, tmp_path / "g", group=group)) as server:
        path = server.settings.socket_path
        assert oct(path.stat().st_mode & 0o777) == oct(0o660) and path.stat().st_gid == os.getgid()
        assert oct(path.parent.stat().st_mode & 0o777) == oct(0o750) and path.parent.stat().st_gid == os.getgid()
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o1777)                       # like /tmp
    settings = daemon_settings(tiny_model_dir, tmp_path, socket=str(shared / "llmd.sock"))
    with running_daemon(settings) as server:
        assert oct(server.settings.socket_path.stat().st_mode & 0o777) == oct(0o600)
        assert oct(shared.stat().st_mode & 0o7777) == oct(0o1777)


@pytest.mark.heavy
def test_bad_socket_settings_are_refused_with_a_message(tiny_model_dir, tmp_path):
    from llmd.daemon.settings import SettingsError
    with pytest.raises(SettingsError, match="group 'no-such-group-llmd' does not exist"):
        daemon_settings(tiny_model_dir, tmp_path, group="no-such-group-llmd")
    proc = subprocess.run([sys.executable, "-m", "llmd.daemon", "serve", "--model", str(tiny_model_dir),
                           "--socket", str(tmp_path / "s" / "llmd.sock"), "--tcp", "tcp://no-such-host.invalid:1"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "cannot listen on" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "s" / "llmd.sock").exists()


@pytest.mark.heavy
def test_replace_burst_only_the_last_infill_completes(daemon):
    with client(daemon) as c:
        streams = [c.infill(f"def g{i}(", "):\n    pass\n", replace="buffer-1", max_tokens=8) for i in range(20)]
        finals = [list(s)[-1] for s in streams]
    assert [f.finish_reason for f in finals[:19]] == ["cancelled"] * 19
    assert isinstance(finals[19], Done) and finals[19].finish_reason in ("length", "stop")
    assert engine_stats(daemon)["kv_blocks_used"] == 0


@pytest.mark.heavy
def test_chat_infill_and_sentences(daemon, offline):
    with client(daemon) as c:
        events = list(c.chat([{"role": "user", "content": "Hi there."}], max_tokens=24, sentences=True))
        text = "".join(e.text for e in events if isinstance(e, Token))
        sentences = [e for e in events if isinstance(e, Sentence)]
        assert isinstance(events[-1], Done)
        # The sentences cover the whole text, in order, with nothing lost (whitespace aside).
        assert "".join(s.text for s in sentences).replace(" ", "").replace("\n", "") == \
            text.replace(" ", "").replace("\n", "")
        assert sentences and [s.seq for s in sentences] == list(range(len(sentences)))
        events, ids, _ = collect(c.infill("x = ", "\n", files=[("a.py", "y = 1\n")], max_tokens=4))
    assert isinstance(events[-1], Done)
    tok = offline.tokenizer
    prompt = tok.build_infill("x = ", "\n", [("a.py", "y = 1\n")])
    assert ids == offline_greedy(offline, [prompt], max_tokens=4)[tuple(prompt)][0]


@pytest.mark.heavy
def test_infill_in_suffix_prefix_middle_order(daemon, offline):
    with client(daemon) as c:
        _, spm, _ = collect(c.infill("def add(a, b):\n    return ", "\n\nprint(add(1, 2))\n", max_tokens=6,
                                     layout="spm"))
        bad = list(c.infill("x", "y", max_tokens=2, layout="msp"))
        assert isinstance(bad[-1], Error) and bad[-1].code == "invalid_request" and "layout" in bad[-1].message
    prompt = offline.tokenizer.build_infill("def add(a, b):\n    return ", "\n\nprint(add(1, 2))\n", layout="spm")
    assert spm == offline_greedy(offline, [prompt], max_tokens=6)[tuple(prompt)][0]


@pytest.mark.heavy
def test_health_models_hello_and_stats(daemon):
    with client(daemon) as c:
        assert list(c.generate("x", max_tokens=2, ignore_eos=True))[-1].finish_reason == "length"
        info = c.hello()
        assert info["version"] == 1 and info["state"] == "ready" and info["max_queue"] == 64
        h = c.health()
        assert h["state"] == "ready" and h["progress"] == 1.0 and h["uptime_s"] > 0
        (m,) = c.models()
        assert m["vocab_size"] > 0 and m["infill"] is True and m["chat"] is True
        s = c.stats()
        assert s["engine"]["kv_blocks_total"] > 0 and "p50" in s["latency_ms"]["ttft"]
        assert s["finished"].get("length", 0) >= 1


@pytest.mark.heavy
def test_typed_errors_for_bad_requests(daemon):
    with client(daemon) as c:
        err = list(c.generate("x", temperature=500.0))[-1]
        assert isinstance(err, Error) and err.code == "invalid_request" and "temperature" in err.message
        err = list(c.generate(token_ids=[10 ** 9]))[-1]
        assert isinstance(err, Error) and err.code == "invalid_request"
    # A second request with an id still in flight from the same client: sent raw, since the Client
    # refuses to reuse an id itself.
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVTIMEO, 10000)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(daemon.settings.endpoint)
    try:
        gen = {"type": "generate", "id": "same", "prompt": "x", "params": {"max_tokens": 300, "ignore_eos": True}}
        sock.send(codec.pack(gen))
        sock.send(codec.pack({**gen, "prompt": "y"}))
        while True:
            ev = codec.unpack(sock.recv())
            if ev["type"] == "error":
                assert ev["id"] == "same" and ev["code"] == "duplicate_id"
                break
            assert ev["type"] in ("token", "keepalive")
        sock.send(codec.pack({"type": "cancel", "id": "c1", "target": "same"}))
    finally:
        sock.close()


@pytest.mark.heavy
def test_a_bad_replacement_is_refused_without_cancelling_the_request_it_names(daemon):
    with client(daemon) as c:
        good = c.infill("def g(", "):\n    pass\n", replace="buffer-9", max_tokens=200, ignore_eos=True)
        assert isinstance(next(good), Token)
        bad = list(c.infill("def h(", "):\n", replace="buffer-9", max_tokens=8, temperature=500.0))
        assert isinstance(bad[-1], Error) and bad[-1].code == "invalid_request"
        assert list(good)[-1].finish_reason == "length"


@pytest.mark.heavy
def test_an_unknown_key_is_named_briefly_in_the_error(daemon):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVTIMEO, 10000)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(daemon.settings.endpoint)
    try:
        sock.send(codec.pack({"type": "health", "id": "k", "x" * 100_000: 1}))
        ev = codec.unpack(sock.recv())
        assert ev["type"] == "error" and ev["code"] == "invalid_request" and len(ev["message"]) < 300
    finally:
        sock.close()


@pytest.mark.heavy
def test_deadline_ends_a_request(daemon):
    with client(daemon) as c:
        events = list(c.generate("x", max_tokens=800, ignore_eos=True, deadline=0.15))
    assert isinstance(events[-1], Done) and events[-1].finish_reason == "deadline"
    assert 150 <= events[-1].timings["total_ms"] < 1500


@pytest.mark.heavy
def test_pickle_payload_is_refused_and_never_unpickled(daemon, tmp_path):
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    payload = pickle.dumps(Exploit())
    ctx = zmq.Context.instance()
    with ctx.socket(zmq.DEALER) as s:
        s.setsockopt(zmq.RCVTIMEO, 5000)
        s.connect(daemon.settings.endpoint)
        s.send(payload)
        reply = codec.unpack(s.recv())
        assert reply["type"] == "error" and reply["code"] == "bad_message"
        s.send(codec.pack({"type": "generate", "id": "p", "prompt": payload}))
        reply = codec.unpack(s.recv())
        assert reply["type"] == "error" and reply["code"] == "invalid_request" and reply["id"] == "p"
    assert not marker.exists()


@pytest.mark.heavy
def test_a_second_daemon_on_the_same_socket_is_refused(daemon, tiny_model_dir):
    second = Server(daemon.settings, make_engine_factory(tiny_model_dir))
    with pytest.raises(AlreadyRunning, match=rf"already running \(pid {os.getpid()}\)"):
        second.run()
    proc = subprocess.run([sys.executable, "-m", "llmd.daemon", "serve", "--model", str(tiny_model_dir),
                           "--socket", daemon.settings.socket], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and f"already running (pid {os.getpid()})" in proc.stderr
    with client(daemon) as c:
        assert c.health()["state"] == "ready"
        assert isinstance(list(c.generate("still here", max_tokens=3))[-1], Done)


@pytest.mark.heavy
def test_killed_client_is_aborted_and_its_blocks_freed_within_a_second(daemon):
    script = textwrap.dedent(f"""
        from llmd.clients.client import Client
        c = Client({daemon.settings.socket!r})
        s = c.generate("the client will die", max_tokens=1000, ignore_eos=True)
        next(s); print("streaming", flush=True)
        import time; time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "streaming"
        assert engine_stats(daemon)["running"] == 1
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    killed = time.monotonic()
    freed = wait_until(lambda: (lambda s: s["running"] == 0 and s["kv_blocks_used"] == 0)(engine_stats(daemon)), 3.0)
    assert freed, f"still running {time.monotonic() - killed:.2f}s after the kill: {engine_stats(daemon)}"


@pytest.mark.heavy
def test_a_vanished_client_is_found_while_its_request_is_queued(tiny_model_dir, tmp_path):
    # Nothing is sent to a request in the prompt; the keepalive probe finds the client gone.
    settings = daemon_settings(tiny_model_dir, tmp_path, max_batch_tokens=1)
    with running_daemon(settings) as server:
        ctx = zmq.Context.instance()
        s = ctx.socket(zmq.DEALER)
        s.connect(settings.endpoint)
        s.send(codec.pack({"type": "generate", "id": "v", "token_ids": [5 + i % 400 for i in range(1000)], "params": {"max_tokens": 5}}))
        assert wait_until(lambda: engine_stats(server)["running"] + engine_stats(server)["waiting"] == 1, 2.0)
        s.close(linger=0)
        assert wait_until(lambda: (lambda st: st["running"] + st["waiting"] == 0 and st["kv_blocks_used"] == 0)(
            engine_stats(server)), 3.0)


@pytest.mark.heavy
def test_busy_and_a_failure_inside_the_engine_fails_alone(tiny_model_dir, tmp_path):
    def inject(engine):
        real = engine.tokenizer.build_infill

        def faulty(prefix, suffix, extra_files=(), layout="psm", middle=""):
            if prefix == "boom":
                raise RuntimeError("injected fault")
            return real(prefix, suffix, extra_files, layout, middle)
        engine.tokenizer.build_infill = faulty

    settings = daemon_settings(tiny_model_dir, tmp_path, max_queue=3)
    with running_daemon(settings, make_engine_factory(tiny_model_dir, inject)) as server:
        with client(server) as c:
            a = c.generate("first", max_tokens=30)
            boom = c.infill("boom", "", max_tokens=5)
            b = c.generate("second", max_tokens=30)
            failure = list(boom)
            assert failure == [Error(boom.id, "internal", "injected fault")]
            c3, c4 = c.generate("third", max_tokens=30), c.generate("fourth", max_tokens=30)
            t0 = time.monotonic()
            refused = list(c4)
            assert refused[0].code == "busy" and time.monotonic() - t0 < 2.0     # at once, not after the queue
            for s in (a, b, c3):
                assert isinstance(list(s)[-1], Done)


@pytest.mark.heavy
def test_llmd_status_prints_the_daemon_state(daemon):
    proc = subprocess.run([sys.executable, "-m", "llmd.clients.cli", "status", "--socket", daemon.settings.socket],
                          cwd=REPO, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    fields = dict(line.split(":", 1) for line in proc.stdout.splitlines())
    assert fields["state"].split()[0] == "ready" and "requests" in fields and "kv cache" in fields
    assert "p50" in fields["ttft ms"]
    absent = subprocess.run([sys.executable, "-m", "llmd.clients.cli", "status", "--socket", daemon.settings.socket + ".x"],
                            cwd=REPO, capture_output=True, text=True, timeout=30)
    assert absent.returncode == 1 and "start one with `llmd serve`" in absent.stderr


def test_llmd_status_shows_the_head_screen_where_the_engine_has_one():
    from llmd.clients.cli import format_status
    engine = {"head_screen_on": True, "head_screen_rows": 114, "head_screen_candidates_mean": 854.4,
              "head_screen_whole": 2}
    lines = dict(line.split(":", 1) for line in format_status({"engine": engine}).splitlines())
    assert lines["head screen"].split() == "on, 114 rows screened, 854.4 tokens scored exactly a row, 2 read whole".split()
    off = format_status({"engine": {**engine, "head_screen_on": False}})
    assert "off (no faster than the whole head)" in off
    assert "head screen" not in format_status({"engine": {"running": 0}})


def test_llmd_status_names_the_cpu_kernels_the_engine_runs(tiny_model_dir):
    from llmd.clients.cli import format_status
    from llmd.runtime import kernels
    from llmd.runtime.llm import LLM
    stats = LLM(str(tiny_model_dir), kv_memory="4MiB", draft="none").engine.stats()
    assert stats["cpu_kernels"] == (kernels.variant() if kernels.available() else "none")
    line = dict(x.split(":", 1) for x in format_status({"engine": stats}).splitlines())["cpu kernels"]
    assert {"avx512": "AVX-512", "avx2": "AVX2", "none": "torch's ops"}[stats["cpu_kernels"]] in line
    amx = kernels.lib().llmd_amx_min_rows(-1) if kernels.available() else 0
    assert stats["cpu_amx_rows"] == amx
    assert (f"AMX for int8 products of {amx} rows or more (int4: {2 * amx})" in line) == (amx > 0)
    from llmd.runtime.kernels import ops
    bf16 = ops.bf16_amx_rows() if kernels.available() else 0
    assert stats["cpu_amx_bf16"] == bf16
    assert (f"and for bfloat16 blocks of more than {bf16} rows" in line) == (bf16 > 0)
    older = {**stats, "cpu_kernels": "avx512", "cpu_amx_bf16": True}     # an earlier daemon's flag: 16 rows
    assert "and for bfloat16 blocks of more than 16 rows" in format_status({"engine": older})


@pytest.mark.heavy
def test_a_client_that_stops_reading_is_dropped(tiny_model_dir, tmp_path):
    settings = daemon_settings(tiny_model_dir, tmp_path, send_hwm=8, send_buffer_bytes=4096)
    with running_daemon(settings) as server:
        s = zmq.Context.instance().socket(zmq.DEALER)
        s.setsockopt(zmq.RCVHWM, 1)
        s.setsockopt(zmq.RCVBUF, 4096)
        s.connect(settings.endpoint)
        s.send(codec.pack({"type": "generate", "id": "stuck", "prompt": "never read",
                           "params": {"max_tokens": 1000, "ignore_eos": True}}))
        try:
            assert wait_until(lambda: (lambda st: st["dropped_clients"] == 1 and st["engine"]["running"] == 0)(
                daemon_stats(server)), 20.0)
            assert daemon_stats(server)["finished"].get("length", 0) == 0
        finally:
            s.close(linger=0)


@pytest.mark.heavy
def test_a_flood_of_stats_requests_shares_one_engine_answer(tiny_model_dir, tmp_path):
    calls = []

    def count_stats(engine):
        real = engine.stats
        engine.stats = lambda: calls.append(1) or real()

    settings = daemon_settings(tiny_model_dir, tmp_path)
    with running_daemon(settings, make_engine_factory(tiny_model_dir, count_stats)) as server:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.RCVTIMEO, 10000)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(settings.endpoint)
        try:
            with client(server) as c:
                busy_engine = c.generate("keep the engine stepping", max_tokens=200, ignore_eos=True)
                next(busy_engine)
                n = 600
                for i in range(n):
                    sock.send(codec.pack({"type": "stats", "id": f"s{i}"}))
                answers = [codec.unpack(sock.recv()) for _ in range(n)]
                busy_engine.close()
        finally:
            sock.close()
    kinds = [a["type"] if a["type"] == "stats" else a["code"] for a in answers]
    assert set(kinds) <= {"stats", "busy"} and kinds.count("stats") >= 256
    assert all("engine" in a and "kv_blocks_total" in a["engine"] for a in answers if a["type"] == "stats")
    assert len(calls) < kinds.count("stats") / 4, f"{len(calls)} engine stats calls for {kinds.count('stats')} answers"


@pytest.mark.heavy
def test_an_engine_loop_that_dies_fails_its_requests_and_the_daemon_exits_1(tiny_model_dir, tmp_path):
    """A failure outside a step (which would fail only its requests) leaves no engine to serve: the
    waiting client hears of it at once, and the daemon exits 1 for its supervisor to restart it."""
    broken = threading.Event()

    def breakable(engine):
        real = engine.has_unfinished

        def has_unfinished():
            if broken.is_set():
                raise RuntimeError("injected engine-loop fault")
            return real()
        engine.has_unfinished = has_unfinished

    settings = daemon_settings(tiny_model_dir, tmp_path)
    server = Server(settings, make_engine_factory(tiny_model_dir, breakable))
    ready = threading.Event()
    server.ready_event = ready
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("code", server.run()), daemon=True)
    thread.start()
    assert ready.wait(60)
    with client(server, timeout=10) as c:
        stream = c.generate("x", max_tokens=1000, ignore_eos=True)
        assert isinstance(next(stream), Token)
        broken.set()
        last = list(stream)[-1]
    assert isinstance(last, Error) and last.code == "internal" and "the engine stopped" in last.message
    thread.join(15)
    assert not thread.is_alive() and result["code"] == 1


def test_the_served_engine_is_frozen_out_of_the_collectors_view(tiny_model_dir, tmp_path):
    """`llmd serve` keeps its engine for its life: after it is built a full collection walks none of it
    (the tests' own daemons do not freeze: they build engines again and again)."""
    import gc
    from llmd.daemon.serve import engine_factory
    settings = daemon_settings(tiny_model_dir, tmp_path)
    before = gc.get_freeze_count()
    try:
        engine = engine_factory(settings, freeze=True)()
        tracked = {id(o) for o in gc.get_objects()}
        assert gc.get_freeze_count() > before
        assert id(engine) not in tracked and id(engine.scheduler) not in tracked
        assert id(engine_factory(settings)()) in {id(o) for o in gc.get_objects()}    # not frozen by default
    finally:
        gc.unfreeze()
