"""`llmd serve --warm FILE` (llmd.daemon.warm) on the bundled coder, through a real daemon on a real
socket: the file's checks, prompts cached in memory and on disk, read back after a restart, the same
output as recomputing, and clients served before any warm prompt."""
import json
import logging
from pathlib import Path

import pytest

from daemon_fixtures import daemon_settings, running_daemon, wait_until
from llmd import LLM
from llmd.clients.client import Client
from llmd.daemon.serve import engine_factory, serve
from llmd.daemon.warm import MAX_WARM_BYTES, MAX_WARM_PROMPTS, WarmFileError, read_warm_file
from llmd.protocol import Done, Token
from llmd.runtime.request import Priority, SamplingParams

TARGET = Path(__file__).resolve().parents[2] / "models" / "code-target"
BS = 16                                     # daemon_fixtures' block size
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
SYSTEM = ("You answer questions about Python code. Keep answers short: one sentence, then the code. "
          "Prefer the standard library. Never invent a module. Say so when you do not know.")
CODE = ("import os\n\n\ndef walk(top):\n    for root, dirs, files in os.walk(top):\n"
        "        for name in files:\n            yield os.path.join(root, name)\n")
QUESTION = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "How do I list a directory?"}]


def write(tmp_path: Path, lines: list, name: str = "warm.jsonl") -> str:
    path = tmp_path / name
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return str(path)


# ---- the file ----------------------------------------------------------------------------------
@pytest.mark.parametrize("lines, says", [
    (['{"prompt": "a"}', "prompt: b"], "line 2: not JSON"),
    (['{"prompt": "a", "messages": []}'], "line 1: give an object with exactly one of"),
    (['["a"]'], "line 1: give an object with exactly one of"),
    (['{"prompt": "a", "max_tokens": 3}'], "line 1: unknown key.*'max_tokens'"),
    (['{"prompt": 5}'], "line 1: generate: prompt"),
    (['{"messages": [{"role": "wizard", "content": "x"}]}'], "line 1: chat: messages"),
    (['{"messages": []}'], "line 1: chat: messages"),
    (['{"prompt": "a", "cache_salt": ""}'], "line 1: generate: cache_salt"),
    (["", "  "], "lists no prompt"),
    (['{"prompt": "a"}'] * (MAX_WARM_PROMPTS + 1), f"more than {MAX_WARM_PROMPTS} prompts"),
])
def test_a_bad_warm_file_is_refused_with_its_line(tmp_path, lines, says):
    with pytest.raises(WarmFileError, match=says):
        read_warm_file(write(tmp_path, lines))


def test_a_warm_file_too_large_unreadable_or_not_text_is_refused(tmp_path):
    big = tmp_path / "big.jsonl"
    big.write_text(json.dumps({"prompt": "x" * (MAX_WARM_BYTES + 1)}))
    with pytest.raises(WarmFileError, match="larger than 8 MiB"):
        read_warm_file(str(big))
    with pytest.raises(WarmFileError, match="cannot read"):
        read_warm_file(str(tmp_path / "missing.jsonl"))
    binary = tmp_path / "bin.jsonl"
    binary.write_bytes(b'{"prompt": "\xff"}\n')
    with pytest.raises(WarmFileError, match="not UTF-8"):
        read_warm_file(str(binary))


def test_a_warm_file_reads_as_prompt_only_batch_requests(tmp_path):
    path = write(tmp_path, [{"prompt": CODE}, "", {"messages": QUESTION[:1], "cache_salt": "voice"}])
    gen, chat = read_warm_file(path)
    assert (gen.type, gen.prompt, gen.cache_salt) == ("generate", CODE, None)
    assert (chat.type, [m.content for m in chat.messages], chat.cache_salt) == ("chat", [SYSTEM], "voice")
    assert {r.priority for r in (gen, chat)} == {"batch"}
    assert all(r.params.prompt_only and r.params.max_tokens == 1 for r in (gen, chat))


def test_serve_refuses_a_bad_warm_file_before_the_model_loads(tmp_path, capsys):
    settings = daemon_settings(TARGET, tmp_path, warm=write(tmp_path, ['{"prompt": "a"}', "{"]))
    assert serve(settings) == 2
    err = capsys.readouterr().err
    assert "llmd serve: warm:" in err and "line 2: not JSON" in err
    assert not Path(settings.socket).exists()
    no_cache = daemon_settings(TARGET, tmp_path, prefix_cache=False, warm=write(tmp_path, [{"prompt": "a"}]))
    assert serve(no_cache) == 2
    assert "prefix_cache" in capsys.readouterr().err


# ---- through the daemon ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def recompute():
    """Greedy tokens without any cache: what every cached answer must equal."""
    llm = LLM(str(TARGET), kv_memory="8MiB", prefix_cache=False)
    chat_ids = llm.tokenizer.encode_chat(QUESTION)
    return {"chat": llm.generate(chat_ids, GREEDY)[0].token_ids, "code": llm.generate(CODE, GREEDY)[0].token_ids,
            "warm_chat": llm.tokenizer.encode_chat(QUESTION[:1]), "question": chat_ids,
            "code_ids": llm.tokenizer.encode(CODE)}


def answer(stream) -> tuple[list, dict]:
    tokens = [t for ev in stream if isinstance(ev, Token) for t in ev.token_ids]
    assert isinstance(stream.final, Done), stream.final
    return tokens, stream.final.usage


def warmed(c: Client) -> dict:
    assert wait_until(lambda: c.stats()["warm"]["state"] == "done", 60), c.stats()["warm"]
    return c.stats()


def full_blocks(n_tokens: int) -> int:
    """Tokens of a prompt's full blocks before its last token: what the tier can serve."""
    return (n_tokens - 1) // BS * BS


@pytest.mark.heavy
def test_warm_prompts_reach_the_tier_and_are_read_back_after_a_restart(tmp_path, recompute):
    warm = write(tmp_path, [{"messages": QUESTION[:1]}, {"prompt": CODE}])
    settings = daemon_settings(TARGET, tmp_path, kv_disk=str(tmp_path / "kv"), warm=warm)
    with running_daemon(settings), Client(settings.socket) as c:
        s = warmed(c)
        assert {k: s["warm"][k] for k in ("prompts", "done", "failed", "cached_tokens")} == \
            {"prompts": 2, "done": 2, "failed": 0, "cached_tokens": 0}
        assert s["warm"]["prompt_tokens"] == len(recompute["warm_chat"]) + len(recompute["code_ids"])
        assert c.health()["status"] == "ready, warmed 2/2 prompts"
        tokens, usage = answer(c.chat(QUESTION, max_tokens=8, ignore_eos=True))
        assert tokens == recompute["chat"] and usage["cached_tokens"] >= BS
        assert wait_until(lambda: c.stats()["engine"]["kv_disk_blocks_written"] > 0, 10)
    with running_daemon(settings), Client(settings.socket) as c:
        s = warmed(c)
        # every full block of both prompts came from the tier: none was computed again
        assert s["warm"]["cached_tokens"] == full_blocks(len(recompute["warm_chat"])) + \
            full_blocks(len(recompute["code_ids"]))
        assert s["engine"]["kv_disk_blocks_read"] * BS == s["warm"]["cached_tokens"]
        tokens, usage = answer(c.generate(CODE, max_tokens=8, ignore_eos=True))
        assert tokens == recompute["code"] and usage["cached_tokens"] >= full_blocks(len(recompute["code_ids"]))
        tokens, _ = answer(c.chat(QUESTION, max_tokens=8, ignore_eos=True))
        assert tokens == recompute["chat"]


@pytest.mark.heavy
def test_without_a_tier_warm_fills_the_memory_cache_and_a_failed_prompt_is_counted(tmp_path, recompute, caplog):
    too_long = {"prompt": "def f():\n    return 1\n" * 4000}          # past the context window
    settings = daemon_settings(TARGET, tmp_path, warm=write(tmp_path, [too_long, {"prompt": CODE}]))
    with caplog.at_level(logging.INFO, logger="llmd.daemon"):
        with running_daemon(settings), Client(settings.socket) as c:
            s = warmed(c)
            assert (s["warm"]["done"], s["warm"]["failed"]) == (1, 1)
            assert c.health()["status"] == "ready, warmed 1/2 prompts, 1 failed"
            tokens, usage = answer(c.generate(CODE, max_tokens=8, ignore_eos=True))
            assert tokens == recompute["code"] and usage["cached_tokens"] >= full_blocks(len(recompute["code_ids"]))
    said = [r.getMessage() for r in caplog.records]
    assert any("into the prefix cache in memory" in m for m in said)
    assert any(m.startswith("warm 1/2 failed") and "context" in m for m in said)


def clients_first(make_engine, order: list):
    """The engine, its steps held while only warm prompts (batch) wait, until a client's request
    arrives; ``order`` gets the request ids as they finish, the warm ones as 'warm'."""
    def make(progress=None):
        engine = make_engine(progress=progress)
        add, step = engine.add_request, engine.step
        kinds, seen = {}, {"start": False, "warm": False, "client": False}

        def add_request(rid, prompt, params, priority=Priority.NORMAL, **kw):
            batch = Priority.parse(priority) is Priority.BATCH
            kinds[rid] = kind = "warm" if batch else "client" if seen["warm"] else "start"   # the start's warm-up
            seen[kind] = True
            add(rid, prompt, params, priority, **kw)

        def held_step():
            if seen["warm"] and not seen["client"]:
                return []
            outs = step()
            order.extend(kinds.get(o.request_id) for o in outs if o.finished)
            return outs
        engine.add_request, engine.step = add_request, held_step
        return engine
    return make


@pytest.mark.heavy
def test_a_client_is_served_before_the_warm_prompts_and_a_drain_stops_them(tmp_path, recompute):
    settings = daemon_settings(TARGET, tmp_path, warm=write(tmp_path, [{"prompt": CODE + str(n)} for n in range(3)]))
    order: list = []
    with running_daemon(settings, clients_first(engine_factory(settings), order)) as server, \
            Client(settings.socket) as c:
        tokens, _ = answer(c.generate(CODE, max_tokens=8, ignore_eos=True))
        assert tokens == recompute["code"]
        assert "client" in order and "warm" not in order[:order.index("client")]
        warmer = server.warmer
    assert warmer.stopped and warmer.current is None        # the drain withdrew the prompt in flight
