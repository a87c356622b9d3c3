"""The Wyoming voice bridge, driven by the `wyoming` package's client over a real unix socket, in
front of a real daemon with the tiny model. Expected answers come from the daemon directly."""
from __future__ import annotations

import asyncio
import contextlib

import pytest
from wyoming.asr import Transcript
from wyoming.client import AsyncClient as WyomingClient
from wyoming.handle import Handled, HandledChunk, HandledStart, HandledStop
from wyoming.info import Describe, Info

from daemon_fixtures import daemon_settings, running_daemon, wait_until
from llmd.clients.client import Client
from llmd.sentences import SentenceSplitter
from llmd.clients.voice import VoiceConfig, iter_sentences, serve_voice

SYSTEM = "You are a test assistant."


@pytest.fixture(scope="module")
def daemon(model_factory, tmp_path_factory):
    # a long context and no speculation, so that an answer told to run on is still running when the barge-in
    # arrives: 700 tokens of the 1,024-token tiny model were done before it on a fast machine, and n-gram
    # lookup on the repetitive random model's answer accepted ~8 tokens a step, ending 3,000 in about a second
    settings = daemon_settings(model_factory("voice-long", max_pos=8192), tmp_path_factory.mktemp("voice"), draft="none")
    with running_daemon(settings) as server:
        yield server


def split(text: str) -> list[str]:
    s = SentenceSplitter()
    out = s.feed(text)
    rest = s.flush()
    return out + ([rest] if rest else [])


def in_flight(server) -> int:
    with Client(server.settings.socket) as c:
        return c.health()["in_flight"]


def direct_answer(server, messages, **sampling) -> str:
    with Client(server.settings.socket) as c:
        return c.chat(messages, **sampling).text()


@pytest.fixture(scope="module")
def sampling(daemon):
    """Seeded sampling whose answer to the test question has several sentences (the tiny random
    model rarely ends one greedily), so that streaming by sentence is visible."""
    for seed in range(20):
        params = dict(max_tokens=160, temperature=1.0, seed=seed)
        text = direct_answer(daemon, [{"role": "system", "content": SYSTEM},
                                      {"role": "user", "content": "What time is it?"}], **params)
        if len(split(text)) >= 3:
            return params
    pytest.fail("no seed gives a multi-sentence answer")


@contextlib.asynccontextmanager
async def bridge(daemon, tmp_path, **config):
    path = tmp_path / "voice.sock"
    started = asyncio.Event()
    params = dict(config)
    cfg = VoiceConfig(socket=daemon.settings.socket, system_prompt=SYSTEM, max_tokens=params.pop("max_tokens"),
                      temperature=params.pop("temperature", 0.0), sampling=params)
    task = asyncio.create_task(serve_voice(f"unix://{path}", cfg, started))
    await asyncio.wait_for(started.wait(), 10)
    try:
        async with WyomingClient.from_uri(f"unix://{path}", read_timeout=30) as client:
            yield client
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def answer_events(client) -> list:
    """Events of one answer, from handled-start to handled-stop."""
    events = []
    while True:
        event = await client.read_event()
        events.append(event)
        if HandledStop.is_type(event.type):
            return events


@pytest.mark.heavy
def test_describe_answers_info_with_a_streaming_handle_program(daemon, tmp_path):
    async def session():
        async with bridge(daemon, tmp_path, max_tokens=8) as client:
            await client.write_event(Describe().event())
            return Info.from_event(await client.read_event())

    info = asyncio.run(session())
    assert [p.name for p in info.handle] == ["llmd"]
    assert info.handle[0].supports_handled_streaming and info.handle[0].models[0].languages == ["en"]


@pytest.mark.heavy
def test_a_transcript_streams_sentence_chunks_then_handled(daemon, tmp_path, sampling):
    question = "What time is it?"
    expected = split(direct_answer(daemon, [{"role": "system", "content": SYSTEM},
                                            {"role": "user", "content": question}], **sampling))

    async def session():
        async with bridge(daemon, tmp_path, **sampling) as client:
            await client.write_event(Transcript(text=question, context={"conversation_id": "c1"}).event())
            return await answer_events(client)

    events = asyncio.run(session())
    types = [e.type for e in events]
    assert types == ["handled-start"] + ["handled-chunk"] * len(expected) + ["handled", "handled-stop"]
    chunks = [HandledChunk.from_event(e).text for e in events[1:-2]]
    assert [c.strip() for c in chunks] == expected
    final = Handled.from_event(events[-2])
    assert final.text == "".join(chunks) and final.context == {"conversation_id": "c1"}
    assert HandledStart.from_event(events[0]).context == {"conversation_id": "c1"}


@pytest.mark.heavy
def test_history_is_kept_per_conversation_id(daemon, tmp_path, sampling):
    params = dict(sampling, max_tokens=24)
    sys_msg = {"role": "system", "content": SYSTEM}
    first = direct_answer(daemon, [sys_msg, {"role": "user", "content": "Hello."}], **params)
    with_history = direct_answer(daemon, [sys_msg, {"role": "user", "content": "Hello."},
                                          {"role": "assistant", "content": " ".join(split(first))},
                                          {"role": "user", "content": "And then?"}], **params)
    fresh = direct_answer(daemon, [sys_msg, {"role": "user", "content": "And then?"}], **params)
    assert with_history != fresh, "the test needs history to change the answer"

    async def ask(client, text, cid):
        await client.write_event(Transcript(text=text, context={"conversation_id": cid}).event())
        return Handled.from_event([e for e in await answer_events(client) if e.type == "handled"][0]).text

    async def session():
        async with bridge(daemon, tmp_path, **params) as client:
            return [await ask(client, "Hello.", "a"), await ask(client, "And then?", "a"),
                    await ask(client, "And then?", "b")]

    got = asyncio.run(session())
    assert got == [" ".join(split(t)) for t in (first, with_history, fresh)]


@pytest.mark.heavy
def test_a_new_transcript_from_the_same_satellite_stops_the_answer_at_once(daemon, tmp_path):
    with Client(daemon.settings.socket) as c:
        before = c.stats()["finished"]

    async def session():
        async with bridge(daemon, tmp_path, max_tokens=600, ignore_eos=True) as client:   # seconds to run
            await client.write_event(Transcript(text="Tell me a long story.").event())
            assert (await client.read_event()).type == "handled-start"
            assert await asyncio.to_thread(wait_until, lambda: in_flight(daemon) == 1, 10)  # under way
            await client.write_event(Transcript(text="Stop.").event())
            return await answer_events(client), await answer_events(client)

    first, second = asyncio.run(session())
    assert [e.type for e in first if e.type != "handled-chunk"] == ["handled-stop"]
    assert [e.type for e in second][0] == "handled-start" and [e.type for e in second][-2:] == ["handled", "handled-stop"]
    with Client(daemon.settings.socket) as c:
        after = c.stats()["finished"]
    assert after.get("cancelled", 0) - before.get("cancelled", 0) == 1
    assert after.get("length", 0) - before.get("length", 0) == 1


@pytest.mark.heavy
def test_iter_sentences_yields_what_the_splitter_cuts(daemon, sampling):
    messages = [{"role": "user", "content": "What time is it?"}]
    expected = split(direct_answer(daemon, messages, **sampling))
    with Client(daemon.settings.socket) as c:
        assert list(iter_sentences(c.chat(messages, **sampling))) == expected


@pytest.mark.heavy
def test_a_conversation_that_outgrows_the_context_drops_its_oldest_exchanges(model_factory, tmp_path):
    """A 192-position model and 100-token answers: within a few questions the history no longer fits;
    the bridge drops the oldest exchanges and still answers, instead of refusing every later question."""
    settings = daemon_settings(model_factory("voice-short", max_pos=192), tmp_path / "d")

    async def session(server):
        async with bridge(server, tmp_path, max_tokens=100, ignore_eos=True) as client:
            out = []
            for q in ("One?", "Two?", "Three?", "Four?", "Five?", "Six?"):
                await client.write_event(Transcript(text=q, context={"conversation_id": "long"}).event())
                out.append([e.type for e in await answer_events(client)])
            return out

    with running_daemon(settings) as server:
        turns = asyncio.run(session(server))
    assert all(t[0] == "handled-start" and t[-2:] == ["handled", "handled-stop"] for t in turns), turns


@pytest.mark.heavy
def test_a_malformed_transcript_is_not_handled_and_the_connection_goes_on(daemon, tmp_path):
    from wyoming.event import Event

    async def session():
        async with bridge(daemon, tmp_path, max_tokens=4) as client:
            await client.write_event(Event(type="transcript", data={"context": {"conversation_id": "x"}}))
            missing = await client.read_event()
            await client.write_event(Transcript(text="x" * 10_000).event())
            too_long = await client.read_event()
            await client.write_event(Transcript(text="Hi.").event())
            return missing, too_long, [e.type for e in await answer_events(client)]

    missing, too_long, after = asyncio.run(session())
    assert missing.type == too_long.type == "not-handled"
    assert after[0] == "handled-start" and after[-1] == "handled-stop"


@pytest.mark.heavy
def test_a_frame_over_the_size_limits_closes_only_its_own_connection(daemon, tmp_path):
    import json as _json

    async def session():
        async with bridge(daemon, tmp_path, max_tokens=4) as client:
            reader, writer = await asyncio.open_unix_connection(str(tmp_path / "voice.sock"))
            writer.write((_json.dumps({"type": "transcript", "data_length": 10 ** 9}) + "\n").encode())
            await writer.drain()
            closed = await asyncio.wait_for(reader.read(), 10) == b""      # closed at once, nothing buffered
            writer.close()
            await client.write_event(Transcript(text="Hi.").event())
            return closed, [e.type for e in await answer_events(client)]

    closed, after = asyncio.run(session())
    assert closed and after[0] == "handled-start" and after[-1] == "handled-stop"
