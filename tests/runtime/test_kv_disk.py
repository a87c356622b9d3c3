"""The prefix cache's tier on disk (llmd.runtime.kv_disk, kv_tier) on the bundled coder: blocks outlive
restarts and evictions, bad files are dropped and recomputed, and greedy output never changes."""
import logging
import os
import stat
import struct
import threading
import zlib
from pathlib import Path

import pytest

from llmd import LLM
from llmd.runtime import kv_disk
from llmd.runtime.block_manager import ROOT_KEY, BlockManager, block_key
from llmd.runtime.kv_tier import prompt_blocks
from llmd.runtime.request import Request, SamplingParams

TARGET = Path(__file__).resolve().parents[2] / "models" / "code-target"
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
BS = 16
CODE = ("def merge(a, b):\n    out = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n"
        "        if a[i] < b[j]:\n            out.append(a[i])\n            i += 1\n")
PROMPTS = [f"# file {n}\n" + CODE * 2 + f"def f{n}(x):\n    return x * {n}\n" for n in range(4)]


@pytest.fixture(scope="module")
def reference():
    """Greedy tokens of each prompt, recomputed without any cache."""
    llm = LLM(str(TARGET), kv_memory="8MiB", prefix_cache=False)
    return {p: llm.generate(p, GREEDY)[0].token_ids for p in PROMPTS}


def tiered(directory, **kw) -> LLM:
    return LLM(str(TARGET), **{"kv_memory": "8MiB", "block_size": BS, "kv_disk": str(directory), **kw})


def settle(llm: LLM) -> None:
    """Queue what is cached and wait for the tier's writes."""
    llm.engine.tier.flush()
    assert llm.engine.tier.disk.drain()


def disk(llm: LLM) -> dict:
    return {k: v for k, v in llm.stats().items() if k.startswith("kv_disk")}


def block_file(llm: LLM, prompt: str, index: int) -> Path:
    """The file of the prompt's full block ``index``."""
    ids, parent = llm.tokenizer.encode(prompt), ROOT_KEY
    for i in range(index + 1):
        parent = block_key(parent, tuple(ids[i * BS:(i + 1) * BS]), None)
    tier = llm.engine.tier.disk
    return tier.dir / f"{tier._name(parent)}.kv"


def test_a_restart_reads_the_blocks_back(tmp_path, reference):
    first = tiered(tmp_path / "kv")
    assert first.generate(PROMPTS[0], GREEDY)[0].token_ids == reference[PROMPTS[0]]
    first.engine.close()
    written = disk(first)["kv_disk_blocks_written"]
    assert written == first.stats()["kv_blocks_cached"] > 0
    del first
    again = tiered(tmp_path / "kv")
    out = again.generate(PROMPTS[0], GREEDY)[0]
    assert out.token_ids == reference[PROMPTS[0]]
    d = disk(again)
    assert d["kv_disk_hits"] == 1 and d["kv_disk_blocks_read"] == d["kv_disk_blocks_restored"] > 0
    assert d["kv_disk_bytes_read"] > 0 and d["kv_disk_read_s"] > 0
    n_prompt = len(again.tokenizer.encode(PROMPTS[0]))
    assert out.metrics["cached_tokens"] == min(written, (n_prompt - 1) // BS) * BS
    assert stat.S_IMODE(os.stat(tmp_path / "kv").st_mode) == 0o700
    assert {stat.S_IMODE(f.stat().st_mode) for f in (tmp_path / "kv").iterdir()} == {0o600}


def test_a_pool_smaller_than_the_working_set_is_served_from_the_tier(tmp_path, reference):
    llm = tiered(tmp_path / "kv", kv_memory="1280KiB")           # 13 blocks; each prompt needs 7 or 8
    assert llm.stats()["kv_blocks_total"] < 2 * 7
    for _ in range(2):
        for p in PROMPTS:
            assert llm.generate(p, GREEDY)[0].token_ids == reference[p]
    d = disk(llm)
    assert d["kv_disk_blocks_written"] > 0 and d["kv_disk_blocks_restored"] >= 3 * 4
    assert llm.stats()["prefix_tokens_hit"] >= d["kv_disk_blocks_restored"] * BS
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"], "blocks leaked"


def test_bad_files_are_dropped_and_recomputed(tmp_path, reference):
    other = tiered(tmp_path / "other", kv_dtype="bfloat16")       # another dtype's file for the same block
    other.generate(PROMPTS[1], GREEDY)
    settle(other)
    foreign_dtype = block_file(other, PROMPTS[1], 2).read_bytes()
    llm = tiered(tmp_path / "kv")
    prompt = PROMPTS[1]
    llm.generate(prompt, GREEDY)
    settle(llm)

    def flip(data):
        data[len(data) // 2] ^= 0x40
        return data

    def other_model(data):                # another fingerprint in a file otherwise whole
        data[8:24] = bytes(16)
        data[-4:] = struct.pack("<I", zlib.crc32(bytes(data[:-4])))
        return data

    damages = [flip, lambda d: d[:len(d) // 3], other_model, lambda d: bytearray(foreign_dtype)]
    for bad, damage in enumerate(damages, start=1):
        path = block_file(llm, prompt, 2)
        good = path.read_bytes()
        path.write_bytes(damage(bytearray(good)))
        llm.engine.block_manager.reset_prefix_cache()             # memory forgets: the tier must serve
        before = disk(llm)["kv_disk_blocks_restored"]
        out = llm.generate(prompt, GREEDY)[0]
        assert out.token_ids == reference[prompt]
        d = disk(llm)
        assert d["kv_disk_blocks_bad"] == bad
        assert d["kv_disk_blocks_restored"] - before == 2          # the blocks before the bad one
        assert out.metrics["cached_tokens"] == 2 * BS
        settle(llm)                     # the bad file was deleted, and the recomputed block written again
        assert path.read_bytes() == good


def test_the_budget_is_never_exceeded(tmp_path, reference):
    probe = tiered(tmp_path / "probe")
    file_bytes = probe.engine.tier.disk.file_bytes
    budget = 5 * file_bytes + file_bytes // 2
    llm = tiered(tmp_path / "kv", kv_disk_size=budget, kv_memory="1280KiB")
    for p in PROMPTS:
        assert llm.generate(p, GREEDY)[0].token_ids == reference[p]
        settle(llm)
        files = list((tmp_path / "kv").iterdir())
        assert sum(f.stat().st_size for f in files) <= budget and len(files) == 5
    assert disk(llm)["kv_disk_bytes"] <= budget
    written = disk(llm)["kv_disk_blocks_written"]
    settle(llm)
    assert disk(llm)["kv_disk_blocks_written"] == written, "idle moments rewrite nothing memory still holds"
    # a restart with a smaller budget deletes the least recently used files first
    del llm
    smaller = tiered(tmp_path / "kv", kv_disk_size=2 * file_bytes)
    assert len(list((tmp_path / "kv").iterdir())) == 2 and disk(smaller)["kv_disk_bytes"] == 2 * file_bytes


class ReadOnlyOS:
    """``os`` as kv_disk sees it on a read-only file system."""

    def __getattr__(self, name):
        return getattr(os, name)

    @staticmethod
    def open(path, *args, **kwargs):
        raise OSError(30, "Read-only file system", str(path))


def test_a_read_only_disk_warns_once_and_serving_goes_on(tmp_path, reference, monkeypatch, caplog):
    llm = tiered(tmp_path / "kv")
    monkeypatch.setattr(kv_disk, "os", ReadOnlyOS())
    with caplog.at_level(logging.WARNING, logger="llmd.kv_disk"):
        for p in PROMPTS[:3]:
            assert llm.generate(p, GREEDY)[0].token_ids == reference[p]
            llm.engine.tier.disk.drain()
    assert len([r for r in caplog.records if "KV tier on disk" in r.message]) == 1
    assert disk(llm)["kv_disk_on"] is False and list((tmp_path / "kv").iterdir()) == []


def test_a_directory_that_cannot_be_made_turns_the_tier_off(tmp_path, reference, caplog):
    (tmp_path / "file").write_text("")
    with caplog.at_level(logging.WARNING, logger="llmd.kv_disk"):
        llm = tiered(tmp_path / "file" / "kv")
    assert len([r for r in caplog.records if "KV tier on disk" in r.message]) == 1
    assert llm.generate(PROMPTS[0], GREEDY)[0].token_ids == reference[PROMPTS[0]]
    assert disk(llm)["kv_disk_on"] is False


def tier_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name == "llmd-kv-disk")


def test_with_the_tier_off_nothing_changes(tmp_path, reference):
    threads = tier_threads()
    llm = LLM(str(TARGET), kv_memory="8MiB")
    no_cache = LLM(str(TARGET), kv_memory="8MiB", prefix_cache=False, kv_disk=str(tmp_path / "kv"))
    assert llm.engine.tier is None and no_cache.engine.tier is None
    assert llm.generate(PROMPTS[0], GREEDY)[0].token_ids == reference[PROMPTS[0]]
    assert not any(k.startswith("kv_disk") for k in llm.stats())
    assert tier_threads() == threads
    assert not (tmp_path / "kv").exists()


def test_a_request_aborted_while_its_blocks_are_read(tmp_path, reference):
    first = tiered(tmp_path / "kv")
    first.generate(PROMPTS[2], GREEDY)
    first.engine.close()
    llm = tiered(tmp_path / "kv")
    engine = llm.engine
    engine.add_request("a", PROMPTS[2], GREEDY)
    assert "a" in engine.tier.parked and engine.has_unfinished()
    assert engine.abort("a")
    outs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("a", "abort")]
    while engine.has_unfinished():
        engine.step()
    assert llm.generate(PROMPTS[2], GREEDY)[0].token_ids == reference[PROMPTS[2]]


# ---- the block manager's side, exactly ---------------------------------------------------------
def req(rid, tokens):
    return Request(rid, list(tokens), SamplingParams())


def admit(bm, r):
    hit = bm.lookup_prefix(r)
    bm.allocate(r, hit, r.num_tokens)
    r.num_computed_tokens = r.num_tokens
    bm.cache_full_blocks(r, r.num_tokens)
    return hit


def test_evicted_full_blocks_are_recorded_and_restored_blocks_are_found():
    bm = BlockManager(4, 4)
    bm.spill = True
    a = req("a", range(9))                      # blocks 0, 1 full, 2 partial
    admit(bm, a)
    bm.free_request(a)
    b = req("b", range(100, 116))               # takes every block: 2 (unkeyed) first, then 3, 1, 0
    admit(bm, b)
    evicted = bm.take_evicted()
    assert [(i, r.tokens) for i, r in evicted] == [(1, (4, 5, 6, 7)), (0, (0, 1, 2, 3))]
    assert bm.take_evicted() == []
    bm.free_request(b)
    again = req("c", range(9))
    chain = [rec for rec, block_id in prompt_blocks(bm, again, lambda key: True) if block_id is None]
    assert [r.tokens for r in chain] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert chain[0].parent_key == ROOT_KEY and chain[1].parent_key == chain[0].key
    ids = bm.restore(chain, None, [])           # b's blocks went back tail first: its tail is evicted first
    assert ids == [0, 1] and bm.lookup_prefix(again).block_ids == (0, 1)
    assert [(i, r.tokens) for i, r in bm.take_evicted()] == [(0, tuple(range(112, 116))), (1, tuple(range(108, 112)))]
    assert bm.num_free_blocks == 4 and bm.pool.free_order()[-2:] == [0, 1]
    assert bm.restore(chain, None, []) == [None, None]          # memory has them: nothing to do
    assert list(prompt_blocks(bm, again, lambda key: False)) == [(chain[0], 0), (chain[1], 1)]


def test_a_dropped_engine_ends_its_thread(tmp_path):
    import gc
    before = {t for t in threading.enumerate() if t.name == "llmd-kv-disk"}   # other tests' engines may end meanwhile
    llm = tiered(tmp_path / "kv")
    (mine,) = {t for t in threading.enumerate() if t.name == "llmd-kv-disk"} - before
    llm.generate(PROMPTS[0], GREEDY)
    del llm
    gc.collect()
    mine.join(timeout=2.0)
    assert not mine.is_alive()
    assert len(list((tmp_path / "kv").iterdir())) > 0       # its queued writes landed first


@pytest.mark.heavy
def test_kill_9_during_writes_then_a_restart_gives_the_same_output(tmp_path):
    from daemon_fixtures import daemon_process, daemon_settings, wait_ready, wait_until
    from llmd.clients.client import Client
    from llmd.protocol import Token

    prompts = [f"# file {n}\n" + CODE * 2 + f"def g{n}(y):\n    return y - {n}\n" for n in range(8)]
    recompute = LLM(str(TARGET), kv_memory="8MiB", prefix_cache=False)
    want = {p: recompute.generate(p, GREEDY)[0].token_ids for p in prompts}
    settings = daemon_settings(TARGET, tmp_path, kv_memory="1280KiB")   # a small pool: evictions write
    kv = tmp_path / "kv"

    def answer(c, prompt):
        return [t for ev in c.generate(prompt, max_tokens=8, ignore_eos=True) if isinstance(ev, Token)
                for t in ev.token_ids]

    def tier(c):
        return c.stats()["engine"]

    proc = daemon_process(settings, "--kv-disk", str(kv))
    try:
        wait_ready(lambda: Client(settings.socket, connect_timeout=0.5))
        with Client(settings.socket) as c:
            assert [answer(c, p) for p in prompts[:4]] == [want[p] for p in prompts[:4]]
            assert wait_until(lambda: tier(c)["kv_disk_blocks_written"] > 0 and not tier(c)["kv_disk_queued"], 10)
            streams = [c.generate(p, max_tokens=8, ignore_eos=True) for p in prompts[4:]]
            next(iter(streams[0]))
            proc.kill()                                 # kill -9 while the second batch computes and spills
    finally:
        proc.kill()
        proc.wait()
    again = daemon_process(settings, "--kv-disk", str(kv))
    try:
        wait_ready(lambda: Client(settings.socket, connect_timeout=0.5))
        with Client(settings.socket) as c:
            assert [answer(c, p) for p in prompts] == [want[p] for p in prompts]
            assert tier(c)["kv_disk_blocks_read"] > 0
    finally:
        again.terminate()
        again.wait(15)


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "int8"])
def test_other_kv_dtypes_restart_with_the_same_output(tmp_path, kv_dtype):
    first = tiered(tmp_path / "kv", kv_dtype=kv_dtype)
    want = first.generate(PROMPTS[3], GREEDY)[0].token_ids        # computed: nothing was cached
    first.engine.close()
    again = tiered(tmp_path / "kv", kv_dtype=kv_dtype)
    assert again.generate(PROMPTS[3], GREEDY)[0].token_ids == want
    assert disk(again)["kv_disk_blocks_restored"] > 0


def test_other_requests_step_while_a_prompt_is_read(tmp_path, reference, monkeypatch):
    first = tiered(tmp_path / "kv")
    first.generate(PROMPTS[0], GREEDY)
    first.engine.close()
    llm = tiered(tmp_path / "kv")
    engine = llm.engine
    gate = threading.Event()
    read = engine.tier.disk._read
    monkeypatch.setattr(engine.tier.disk, "_read", lambda record: gate.wait(30) and read(record))
    engine.add_request("cold", PROMPTS[1], GREEDY)
    engine.add_request("warm", PROMPTS[0], GREEDY)
    assert list(engine.tier.parked) == ["warm"]
    got = {"cold": [], "warm": []}
    while "cold" in engine.scheduler.requests:                    # the cold request runs to its end meanwhile
        for o in engine.step():
            got[o.request_id] += o.new_token_ids
    assert got["cold"] == reference[PROMPTS[1]] and "warm" in engine.tier.parked
    gate.set()
    while engine.has_unfinished():
        for o in engine.step():
            got[o.request_id] += o.new_token_ids
    assert got["warm"] == reference[PROMPTS[0]] and disk(llm)["kv_disk_blocks_restored"] > 0


def test_a_prompt_only_prefetch_lands_in_the_tier(tmp_path, reference):
    first = tiered(tmp_path / "kv")
    assert first.generate(PROMPTS[1], SamplingParams(prompt_only=True))[0].token_ids == []
    first.engine.close()
    again = tiered(tmp_path / "kv")
    assert again.generate(PROMPTS[1], GREEDY)[0].token_ids == reference[PROMPTS[1]]
    assert disk(again)["kv_disk_blocks_restored"] == len(again.tokenizer.encode(PROMPTS[1])) // BS


def test_a_failing_read_strands_no_request(tmp_path, reference, monkeypatch, caplog):
    first = tiered(tmp_path / "kv")
    first.generate(PROMPTS[2], GREEDY)
    first.engine.close()
    llm = tiered(tmp_path / "kv")

    def broken(record):
        raise RuntimeError("a bug in the tier")
    monkeypatch.setattr(llm.engine.tier.disk, "_read", broken)
    with caplog.at_level(logging.WARNING, logger="llmd.kv_disk"):
        assert llm.generate(PROMPTS[2], GREEDY)[0].token_ids == reference[PROMPTS[2]]
    assert disk(llm)["kv_disk_on"] is False and disk(llm)["kv_disk_blocks_restored"] == 0
    assert llm.generate(PROMPTS[0], GREEDY)[0].token_ids == reference[PROMPTS[0]]


def test_leftovers_of_a_killed_writer_are_deleted_once_old(tmp_path):
    (tmp_path / "kv").mkdir(mode=0o755)
    old, fresh = tmp_path / "kv" / ".a.1.tmp", tmp_path / "kv" / ".b.2.tmp"
    old.write_bytes(b"torn")
    fresh.write_bytes(b"being written by another process")
    os.utime(old, (1, 1))
    d = kv_disk.KVDisk(str(tmp_path / "kv"), 1 << 20, bytes(16), 64, 4)
    try:
        assert not old.exists() and fresh.exists() and d.stats()["kv_disk_files"] == 0
        assert stat.S_IMODE(os.stat(tmp_path / "kv").st_mode) == 0o700
    finally:
        d.close()
