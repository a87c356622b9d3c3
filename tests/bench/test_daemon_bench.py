"""Benchmarks (slow): the IPC overhead of a one-token generate, and a bounded soak of 1,000
mixed requests. Run with `pytest -m slow tests/bench/test_daemon_bench.py -s`."""
from __future__ import annotations

import random
import statistics
import threading
import time

import pytest
import zmq

from daemon_fixtures import ENGINE_OPTIONS, daemon_settings, running_daemon, wait_until
from llmd.clients.client import Client
from llmd.protocol import Done, Token
from llmd import codec

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def daemon(tiny_model_dir, tmp_path_factory):
    with running_daemon(daemon_settings(tiny_model_dir, tmp_path_factory.mktemp("b"), max_queue=256)) as server:
        yield server


def test_ipc_overhead_of_a_one_token_generate(daemon, tiny_model_dir):
    from llmd.runtime.config import EngineConfig
    from llmd.runtime.engine import Engine
    from llmd.runtime.request import SamplingParams
    engine = Engine(EngineConfig(model=str(tiny_model_dir), **ENGINE_OPTIONS))
    ids = engine.tokenizer.encode("hello")

    def offline_once():
        t = time.perf_counter()
        engine.add_request("o", ids, SamplingParams(max_tokens=1))
        while engine.has_unfinished():
            engine.step()
        return time.perf_counter() - t

    with Client(daemon.settings.socket) as c:
        def daemon_once():
            t = time.perf_counter()
            events = list(c.generate(token_ids=ids, max_tokens=1))
            assert isinstance(events[-1], Done)
            return time.perf_counter() - t

        for _ in range(20):
            offline_once(), daemon_once()
        offline, online = [], []
        for _ in range(200):                   # interleaved so machine load hits both alike
            offline.append(offline_once())
            online.append(daemon_once())
    p50_off, p50_on = statistics.median(offline) * 1e3, statistics.median(online) * 1e3
    overhead = p50_on - p50_off
    print(f"\none-token generate p50: offline {p50_off:.3f} ms, daemon {p50_on:.3f} ms, IPC overhead {overhead:.3f} ms")
    assert overhead <= 1.0


def test_soak_1000_mixed_requests_nothing_lost_no_leaked_blocks(daemon):
    before = Client(daemon.settings.socket).stats()
    total, workers = 1000, 4
    counts = {"done": 0, "cancelled": 0, "vanished": 0}
    errors: list = []
    lock = threading.Lock()

    def work(n: int, seed: int):
        rnd = random.Random(seed)
        ctx = zmq.Context.instance()
        with Client(daemon.settings.socket, timeout=60) as c:
            for i in range(n):
                kind = rnd.random()
                try:
                    if kind < 0.1:                 # a client that vanishes with its request in flight
                        s = ctx.socket(zmq.DEALER)
                        s.connect(daemon.settings.endpoint)
                        s.send(codec.pack({"type": "generate", "id": "v", "prompt": f"vanish {i}",
                                           "params": {"max_tokens": 50, "ignore_eos": True}}))
                        time.sleep(0.002)
                        s.close(linger=1000)           # the request is sent first, then the client is gone
                        key = "vanished"
                    elif kind < 0.3:               # cancelled after its first token
                        s = c.generate(f"cancel {i}", max_tokens=50, ignore_eos=True)
                        assert isinstance(next(s), Token)
                        c.cancel(s.id)
                        assert list(s)[-1].finish_reason == "cancelled"
                        key = "cancelled"
                    else:
                        n_tok = rnd.randint(1, 6)
                        events = list(c.generate(f"soak {i}", max_tokens=n_tok, ignore_eos=True))
                        tokens = [e for e in events if isinstance(e, Token)]
                        assert isinstance(events[-1], Done) and events[-1].usage["completion_tokens"] == n_tok
                        assert [t.seq for t in tokens] == list(range(len(tokens)))
                        key = "done"
                    with lock:
                        counts[key] += 1
                except Exception as e:
                    errors.append(e)

    t0 = time.monotonic()
    threads = [threading.Thread(target=work, args=(total // workers, k)) for k in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    elapsed = time.monotonic() - t0
    assert not errors, errors[:3]
    assert sum(counts.values()) == total
    with Client(daemon.settings.socket) as c:
        assert wait_until(lambda: (lambda e: e["running"] + e["waiting"] + e["kv_blocks_used"] == 0)(
            c.stats()["engine"]), 5.0), c.stats()["engine"]
        after = c.stats()
    ended = sum(after["finished"].values()) - sum(before["finished"].values())
    print(f"\nsoak: {total} requests in {elapsed:.1f}s {counts}; daemon saw {after['finished']}, "
          f"dropped clients {after['dropped_clients']}")
    assert ended == total                         # every request reached an end, none lost
