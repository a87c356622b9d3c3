"""The disk tier behind a real daemon: the editor's prefetch of an opened file lands in it and serves
the file's first completion after a restart, and a daemon that stops writes every cached block."""
import pytest
import asyncio
from pathlib import Path

from daemon_fixtures import daemon_settings, running_daemon, wait_until
from llmd.clients.client import Client
from llmd.clients.lsp_probe import LspProbe
from llmd.daemon.serve import engine_factory

TARGET = Path(__file__).resolve().parents[2] / "models" / "code-target"
BS = 16                                     # daemon_fixtures' block size
DOC = "".join(f"def scale_{i}(values, k):\n    return [v * k + {i} for v in values]\n\n" for i in range(8)) + \
    "def total(values):\n    return \n"
URI = "file:///work/scale.py"
CURSOR = (DOC.count("\n") - 1, len("    return "))


def engine(c: Client) -> dict:
    return c.stats()["engine"]


def on_disk(c: Client) -> bool:
    """Every cached block is written (the tier's idle flush) and nothing waits in its queue."""
    e = engine(c)
    return e["kv_blocks_cached"] > 0 and e["kv_disk_blocks_written"] >= e["kv_blocks_cached"] and not e["kv_disk_queued"]


def complete_once(settings, tmp_path, name: str) -> tuple[str, dict]:
    """A fresh language server without prefetch asks one completion of DOC; its suggestion and the
    daemon's engine stats after it."""
    async def session():
        args = ["--socket", settings.socket, "--log-file", str(tmp_path / f"{name}.log"), "--no-prefill"]
        async with LspProbe(args) as lsp:
            lsp.open(URI, DOC)
            return await lsp.inline(URI, *CURSOR)

    with Client(settings.socket) as c:
        before = engine(c)
        text = asyncio.run(session())
        after = engine(c)
    return text, {k: after[k] - before.get(k, 0) for k in ("prefix_tokens_hit", "prefix_tokens_queried",
                                                            "kv_disk_blocks_read", "kv_disk_blocks_restored")}


@pytest.mark.heavy
def test_a_file_the_editor_opened_before_a_restart_is_read_from_disk_after_it(tmp_path):
    warm = daemon_settings(TARGET, tmp_path / "a", kv_disk=str(tmp_path / "kv"))
    with running_daemon(warm), Client(warm.socket) as c:
        async def prefetch():
            args = ["--socket", warm.socket, "--log-file", str(tmp_path / "open.log")]
            async with LspProbe(args) as lsp:
                lsp.open(URI, DOC)                                   # the language server's warm-up, batch
                for _ in range(600):
                    if (await lsp.stats())["prefilled"]:
                        return
                    await asyncio.sleep(0.05)
                raise AssertionError("the opened file was never prefetched")
        asyncio.run(prefetch())
        assert wait_until(lambda: on_disk(c), 30), engine(c)     # while the daemon runs, once idle
        assert engine(c)["kv_blocks_cached"] * BS >= 150
    restarted = daemon_settings(TARGET, tmp_path / "b", kv_disk=str(tmp_path / "kv"))
    with running_daemon(restarted):
        warm_text, warm_counts = complete_once(restarted, tmp_path, "restarted")
    cold = daemon_settings(TARGET, tmp_path / "c", kv_disk=str(tmp_path / "empty"))
    with running_daemon(cold):
        cold_text, cold_counts = complete_once(cold, tmp_path, "cold")
    assert warm_text == cold_text and warm_text
    assert cold_counts["prefix_tokens_hit"] == 0 and cold_counts["kv_disk_blocks_read"] == 0
    assert warm_counts["prefix_tokens_queried"] == cold_counts["prefix_tokens_queried"]
    # the completion's prompt shares the file's head with the prefetch: those blocks came from disk
    assert warm_counts["kv_disk_blocks_restored"] == warm_counts["kv_disk_blocks_read"] >= 100 // BS
    assert warm_counts["prefix_tokens_hit"] >= warm_counts["kv_disk_blocks_restored"] * BS


def small_queue(make_engine):
    """The daemon's engine with a tier whose write queue holds four blocks."""
    def make(progress=None):
        engine = make_engine(progress=progress)
        engine.tier.disk.queue_blocks = 4
        return engine
    return make


@pytest.mark.heavy
def test_a_stopping_daemon_writes_every_cached_block(tmp_path):
    settings = daemon_settings(TARGET, tmp_path, kv_disk=str(tmp_path / "kv"))
    with running_daemon(settings, small_queue(engine_factory(settings))), Client(settings.socket) as c:
        done = list(c.generate(DOC, max_tokens=1, prompt_only=True))
        assert done and wait_until(lambda: engine(c)["kv_disk_blocks_written"] and not engine(c)["kv_disk_queued"], 10)
        e = engine(c)
        cached = e["kv_blocks_cached"]
        # idle moments queue a queueful each (how many pass while this polls depends on the load): some
        # blocks are still unwritten, and the stop writes them
        assert cached > e["kv_disk_blocks_written"]
    assert len(list((tmp_path / "kv").glob("*.kv"))) == cached
