"""The language server: prompt budgets, trimming and the cache exactly; then end to end with a real
LSP client (pygls) talking to `llmd lsp` over stdio, and the server talking to a real daemon."""
from __future__ import annotations

import asyncio

import pytest

from daemon_fixtures import daemon_settings, running_daemon
from llmd.clients.client import Client
from llmd.clients.lsp_cache import CompletionCache
from llmd.clients.lsp_probe import LspProbe, first_text
from llmd.clients.lsp_prompt import FimBudget, build_fim, fit_budget
from llmd.clients.lsp_service import percentile
from llmd.clients.lsp_trim import trim_suggestion

# -- prompt budgets -----------------------------------------------------------------------------


def test_prefix_and_suffix_are_cut_to_their_budgets_at_line_boundaries():
    text = "".join(f"line{i:02d}\n" for i in range(40))        # 7 characters a line
    cursor = text.index("line20")
    p = build_fim(text, cursor, [], FimBudget(prefix_tokens=10, suffix_tokens=5, chars_per_token=2.0))
    assert p.prefix == "line18\nline19\n"                         # 20 chars allowed: 2 whole lines
    assert p.suffix == "line20\n"                                 # 10 chars allowed: 1 whole line
    whole = build_fim(text, cursor, [], FimBudget())
    assert whole.prefix + whole.suffix == text


def test_a_line_split_carries_the_line_before_the_cursor_as_the_middle():
    text = "def f(x):\n    y = x + 1\n    return y\n"
    cursor = text.index("+ 1")
    p = build_fim(text, cursor, [], FimBudget(), "line")
    assert (p.prefix, p.middle, p.held, p.suffix) == ("def f(x):\n", "    y = x", " ", text[cursor:])
    assert p.completion(" + 1") == "+ 1" and p.completion("+ 1") == "+ 1"    # the held space written or not
    indent = build_fim(text, text.index("return"), [], FimBudget(), "line")
    assert (indent.middle, indent.held) == ("", "    ") and indent.completion("    return y") == "return y"
    assert build_fim(text, cursor, [], FimBudget()).middle == ""                    # split at the cursor
    long_line = "x = [" + "1, " * 200
    assert build_fim(long_line, len(long_line), [], FimBudget(), "line").middle == ""   # too long to carry
    with pytest.raises(ValueError, match="split"):
        build_fim(text, 0, [], FimBudget(), "word")


def test_other_files_share_one_budget_nearest_first():
    others = [("a.py", "a = 1\n" * 3), ("b.py", "b = 2\n" * 100), ("c.py", "c = 3\n")]
    p = build_fim("x = ", 4, others, FimBudget(context_tokens=30, chars_per_token=1.0))
    assert p.files[0] == ("a.py", "a = 1\n" * 3)
    assert p.files[1][0] == "b.py" and p.files[1][1] == "b = 2\n" * 1   # what is left of 30, whole lines
    assert len(p.files) == 2
    assert build_fim("x", 1, others, FimBudget(context_tokens=0)).files == ()


def test_budgets_shrink_to_the_models_context_window():
    b = FimBudget(prefix_tokens=600, suffix_tokens=200, context_tokens=200, chars_per_token=3.0)
    assert fit_budget(b, 2048, 16) == b
    small = fit_budget(b, 516, 16, chars_per_token=1.5)
    assert (small.prefix_tokens, small.suffix_tokens, small.context_tokens, small.chars_per_token) == (300, 100, 100, 1.5)
    assert fit_budget(b, None, 16) == b


@pytest.mark.heavy
def test_a_negative_cache_size_is_a_message_not_a_traceback():
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-m", "llmd.clients.cli", "lsp", "--cache-size", "-1"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--cache-size must be >= 0" in done.stderr and "Traceback" not in done.stderr


def test_bad_budgets_and_cursors_are_refused():
    with pytest.raises(ValueError, match="prefix_tokens"):
        FimBudget(prefix_tokens=-1)
    with pytest.raises(ValueError, match="chars_per_token"):
        FimBudget(chars_per_token=0)
    with pytest.raises(ValueError, match="outside the document"):
        build_fim("abc", 4, [], FimBudget())


# -- trimming -----------------------------------------------------------------------------------


def test_mid_line_suggestions_are_one_line_without_the_text_after_the_cursor():
    assert trim_suggestion("a + b)\n    more", "    return add(", ")") == "a + b"
    assert trim_suggestion("x, y\nz", "f(", ")") == "x, y"
    assert trim_suggestion("   \n", "f(", ")") == ""


def test_block_suggestions_stop_at_dedent_repeated_suffix_and_blank_pairs():
    raw = "if x:\n        y = 1\n    return y\nprint(2)"
    assert trim_suggestion(raw, "    ", "", "\n") == "if x:\n        y = 1\n    return y"
    assert trim_suggestion("a = 1\nb = 2\nc = 3\n", "", "", "\nb = 2\n") == "a = 1"
    assert trim_suggestion("a = 1\n\n\nb = 2", "", "", "") == "a = 1"
    assert trim_suggestion("\n".join("abcdefghij"), "", "", "", max_lines=3) == "a\nb\nc"
    assert trim_suggestion("total  \n", "x = ", "", "") == "total"


# -- cache --------------------------------------------------------------------------------------


def test_the_cache_serves_the_rest_of_a_suggestion_being_typed():
    c = CompletionCache(capacity=2)
    c.store("u", "def f(", ")\n", "a, b")
    assert c.lookup("u", "def f(", ")\n") == "a, b"
    assert c.lookup("u", "def f(a", ")\n") == ", b"
    assert c.lookup("u", "def f(a, b", ")\n") is None          # all typed: nothing left to offer
    assert c.lookup("u", "def f(x", ")\n") is None              # typed something else
    assert c.lookup("u", "def f(a", "):\n") is None             # the text after the cursor changed
    assert c.lookup("v", "def f(a", ")\n") is None              # another document
    c.store("u", "q", "", "1")
    c.store("u", "r", "", "2")                                   # evicts the oldest entry
    assert c.lookup("u", "def f(", ")\n") is None and len(c) == 2
    c.forget("u")
    assert len(c) == 0


def test_percentile_is_nearest_rank():
    assert percentile([], 50) is None
    assert percentile([5, 1, 3, 2, 4], 50) == 3
    assert percentile(list(range(1, 101)), 95) == 95


# -- end to end ---------------------------------------------------------------------------------

DOC = "import math\n\ndef area(r):\n    return \n\nprint(area(2))\n"
URI = "file:///work/area.py"


@pytest.fixture(scope="module")
def daemon(tiny_model_dir, tmp_path_factory):
    # no speculation, so that the burst test's 200-token infills are still running when replaced
    settings = daemon_settings(tiny_model_dir, tmp_path_factory.mktemp("lsp"), draft="none")
    with running_daemon(settings) as server:
        yield server


def finished(server) -> dict:
    with Client(server.settings.socket) as c:
        return c.stats()["finished"]


def delta(after: dict, before: dict) -> dict:
    return {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before) if after.get(k, 0) != before.get(k, 0)}


def lsp_args(server, tmp_path, *extra) -> list[str]:
    return ["--socket", server.settings.socket, "--log-file", str(tmp_path / "lsp.log"), *extra]


def counting_args(server, tmp_path, *extra) -> list[str]:
    """For tests that count the daemon's requests: no prompt-only prefills besides the completions."""
    return lsp_args(server, tmp_path, "--no-prefill", *extra)


@pytest.mark.heavy
def test_inline_completion_is_the_daemons_infill_trimmed_to_fit(daemon, tmp_path):
    cursor = DOC.index("return ") + len("return ")
    with Client(daemon.settings.socket) as c:
        # the language server's prompt: the prefix up to the cursor's line, the line so far as the middle
        line = DOC.rfind("\n", 0, cursor) + 1
        p = build_fim(DOC, cursor, [], FimBudget(), "line")
        assert p.prefix == DOC[:line] and p.middle + p.held == DOC[line:cursor]
        raw = p.completion(c.infill(p.prefix, p.suffix, middle=p.middle, max_tokens=16).text())
    assert raw.strip(), "the model should propose something here for the test to mean anything"
    expected = trim_suggestion(raw, "    return ", "", DOC[cursor:])

    async def session():
        async with LspProbe(lsp_args(daemon, tmp_path)) as lsp:
            assert lsp.capabilities.inline_completion_provider is not None
            lsp.open(URI, DOC)
            inline = await lsp.inline(URI, 3, 11)
            fallback = await lsp.completion(URI, 3, 11)
            return inline, fallback, await lsp.stats()

    inline, fallback, stats = asyncio.run(session())
    assert inline == expected and inline
    assert "\n" not in inline or all(ln.startswith("    ") for ln in inline.split("\n")[1:] if ln.strip())
    assert fallback.items[0].text_edit.new_text == expected
    assert stats["completed"] == 1 and stats["cache_hit"] == 1 and stats["latency_ms"]["n"] == 2
    assert "completion completed in" in (tmp_path / "lsp.log").read_text()


@pytest.mark.heavy
def test_typing_through_a_suggestion_reuses_it_without_asking_the_daemon(daemon, tmp_path):
    async def session():
        async with LspProbe(counting_args(daemon, tmp_path)) as lsp:
            lsp.open(URI, DOC)
            first = await lsp.inline(URI, 3, 11)
            before = await asyncio.to_thread(finished, daemon)
            lsp.insert(URI, 3, 11, first[:2])
            second = await lsp.inline(URI, 3, 13)
            after = await asyncio.to_thread(finished, daemon)
            return first, second, delta(after, before), await lsp.stats()

    first, second, daemon_delta, stats = asyncio.run(session())
    assert len(first) > 2 and second == first[2:]
    assert daemon_delta == {} and stats["cache_hit"] == 1 and stats["completed"] == 1


@pytest.mark.parametrize("debounce_ms", [200, 0])
@pytest.mark.heavy
def test_a_burst_of_edits_completes_one_request_and_cancels_the_rest(daemon, tmp_path, debounce_ms):
    """With a debounce the superseded requests never reach the daemon; without one, each new
    request replaces the previous infill in the daemon (its ``replace`` key)."""
    burst = 6
    line = "    return "

    async def session():
        args = counting_args(daemon, tmp_path, "--debounce-ms", str(debounce_ms), "--max-tokens", "200", "--cache-size", "0")
        async with LspProbe(args) as lsp:
            lsp.open(URI, DOC)
            lsp.open(URI + ".warm", DOC)
            await lsp.inline(URI + ".warm", 3, 11)           # connected to the daemon before the burst
            warm = await lsp.stats()
            before = await asyncio.to_thread(finished, daemon)
            futures = []
            for i, ch in enumerate("math.p"[:burst]):       # one keystroke, one request, no waiting
                lsp.insert(URI, 3, len(line) + i, ch)
                futures.append(lsp.inline_future(URI, 3, len(line) + i + 1))
            results = await asyncio.gather(*futures)
            stats = await lsp.stats()
            after = await asyncio.to_thread(finished, daemon)
            return results, {k: v - warm[k] for k, v in stats.items() if k != "latency_ms"}, delta(after, before)

    results, stats, daemon_delta = asyncio.run(session())
    why = f"{stats} {daemon_delta} {[first_text(r) for r in results]}"
    assert [first_text(r) for r in results[:-1]] == [None] * (burst - 1), why
    assert first_text(results[-1]), why
    assert stats["completed"] == 1, why
    if debounce_ms:
        assert stats["debounced"] == burst - 1 and daemon_delta == {"length": 1}, why
    else:
        assert stats["replaced"] == burst - 1 and daemon_delta == {"length": 1, "cancelled": burst - 1}, why


@pytest.mark.heavy
def test_a_document_larger_than_the_context_window_still_gets_completions(daemon, tmp_path):
    body = "".join(f"def f{i}(x):\n    return x * {i}\n\n" for i in range(600))     # ~20k characters
    doc = body + "def g(y):\n    return \n"

    async def session():
        async with LspProbe(counting_args(daemon, tmp_path)) as lsp:
            lsp.open(URI, doc)
            line = doc.count("\n") - 1
            before = await asyncio.to_thread(finished, daemon)
            answers = [await lsp.inline(URI, line, 11)]
            lsp.insert(URI, line, 11, "y")
            answers.append(await lsp.inline(URI, line, 12))
            after = await asyncio.to_thread(finished, daemon)
            return answers, await lsp.stats(), delta(after, before)

    answers, stats, daemon_delta = asyncio.run(session())
    # Both keystrokes were answered: by the daemon (a prompt cut to fit its 1,024-position window,
    # which it completed normally) or by the cache; an empty outcome is a daemon answer trimmed away.
    assert stats["error"] == 0 and stats["completed"] + stats["empty"] + stats["cache_hit"] == 2
    asked = stats["completed"] + stats["empty"]
    assert asked >= 1 and set(daemon_delta) <= {"length", "stop"} and sum(daemon_delta.values()) == asked
    assert sum(1 for a in answers if a) == stats["completed"] + stats["cache_hit"]


def test_prefix_start_is_stable_while_typing():
    from llmd.clients.lsp_prompt import ANCHOR_LINES, stable_tail
    doc = "".join(f"line {i} = {i * 7}\n" for i in range(400))
    starts = set()
    for cut in range(6000, 6400, 7):                         # the cursor moves through ~30 lines
        kept = stable_tail(doc[:cut], 3000)
        assert len(kept) <= 3000 and doc[:cut].endswith(kept)
        start_line = doc[:cut].count("\n") - kept.count("\n")
        assert start_line % ANCHOR_LINES == 0
        starts.add(start_line)
    assert len(starts) <= 2                                  # the window jumped at most once


def test_a_small_budget_never_loses_more_than_a_quarter_of_its_prefix():
    """With the bundled models' 512-token context the prefix budget is a few hundred characters: rounding
    its start up to a 32-line anchor used to leave an empty prefix every 32 lines."""
    from llmd.clients.lsp_prompt import stable_tail
    doc = "".join(f"value_{i:04d} = compute({i}) + 1\n" for i in range(400))     # 32 characters a line
    for line in range(20, 400):
        text = doc[:doc.index(f"value_{line:04d}")]
        kept = stable_tail(text, 648)
        assert text.endswith(kept) and 0.75 * 648 - 32 <= len(kept) <= 648, (line, len(kept))


def test_one_document_keeps_at_most_its_share_of_the_cache():
    c = CompletionCache(capacity=64, per_document=8)
    c.store("other", "p", "", "x")
    for i in range(20):
        c.store("big", "a" * i, "", "suggestion")
    assert len(c) == 9 and c.lookup("other", "p", "") == "x"          # another document's entry stays
    assert c.lookup("big", "a" * 19 + "s", "") == "uggestion"       # the newest are kept
    assert c.lookup("big", "a" * 5 + "s", "") is None               # the oldest went


# -- prefill while typing and the prompt budget -------------------------------------------------
from llmd.clients.lsp_service import (CompletionService, LspConfig, PromptRate,  # noqa: E402
                                      replace_key, speed_budget, warm_key)
from llmd.protocol import Done  # noqa: E402


class _Stream:
    def __init__(self, done: Done, gate: asyncio.Event | None):
        self.final, self._done, self._gate = None, done, gate

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.final is None:
            if self._gate is not None:
                await self._gate.wait()
            self.final = self._done
        raise StopAsyncIteration

    async def aclose(self):
        pass


class RecordingClient:
    """Stands in for the daemon: records each infill; a warm-up answers only once ``warm`` is set.
    Every answer says each character was a token, all computed at 1,000 tokens/s."""

    def __init__(self):
        self.calls: list[dict] = []
        self.warm = asyncio.Event()
        self.line = asyncio.Event()       # gates a new line's background prompt (line split)

    async def models(self):
        return [{"context_length": 32768}]

    async def infill(self, prefix, suffix="", **kw):
        self.calls.append({"prefix": prefix, "suffix": suffix, **kw})
        n = len(prefix) + len(suffix)
        done = Done(f"r{len(self.calls)}", "length", {"prompt_tokens": n, "cached_tokens": 0}, {"prompt_ms": float(n)})
        gates = {"lsp-warm:": self.warm, "lsp-line:": self.line}
        return _Stream(done, next((g for k, g in gates.items() if kw["replace"].startswith(k)), None))

    async def aclose(self):
        pass


def test_a_new_line_keeps_the_cached_prefix_until_its_own_prompt_is_computed():
    async def go():
        client = RecordingClient()
        service = CompletionService(LspConfig(debounce_ms=0, cache_size=0), client)
        uri = "file:///a.py"
        text = "def f(x):\n    y = x\n"
        await service.complete(uri, text, len("def f(x):\n    y = x"))
        first = client.calls[-1]
        assert first["prefix"] == "def f(x):\n" and first["middle"] == "    y = x"
        assert first["stop"] == ["\n\n\n"]                           # the trimming's own end: 2 blank lines
        await service.complete(uri, text, len("def f(x):\n    y ="))
        assert client.calls[-1]["stop"] == ["\n"]                     # mid-line: one line is shown
        at, before = len(text), len(client.calls)
        text = text + "    return y\n"                               # a new line typed below
        service.edited(uri, text, at + len("    re"))
        await asyncio.sleep(0)
        await service.complete(uri, text, at + len("    re"))
        same = [c for c in client.calls[before:] if c["replace"].startswith("lsp:")]
        assert all(c["prefix"] == "def f(x):\n" and c["middle"] == "    y = x\n    re" for c in same)
        for _ in range(5):
            await asyncio.sleep(0)
        line = [c for c in client.calls if c["replace"].startswith("lsp-line:")]
        assert len(line) == 1 and line[0]["prefix"] == "def f(x):\n    y = x\n" and line[0]["priority"] == "batch"
        assert line[0]["middle"] == "    re" and line[0]["prompt_only"]
        client.line.set()
        for _ in range(3):
            await asyncio.sleep(0)
        await service.complete(uri, text, at + len("    ret"))
        assert client.calls[-1]["prefix"] == "def f(x):\n    y = x\n" and client.calls[-1]["middle"] == "    ret"
        text = "# header\n" + text                                    # an edit above the anchor
        await service.complete(uri, text, len(text) - len("urn y\n"))
        assert client.calls[-1]["prefix"] == "# header\ndef f(x):\n    y = x\n"
        await service.aclose()
    asyncio.run(go())


def test_a_backend_without_a_middle_gets_prompts_split_at_the_cursor():
    async def go():
        client = RecordingClient()
        client.features = {"middle": "off (joins the prefix)"}
        service = CompletionService(LspConfig(debounce_ms=0), client)
        text = "def f(x):\n    y = x\n"
        await service.complete("file:///a.py", text, len("def f(x):\n    y = x"))
        call = client.calls[-1]
        assert call["prefix"] == "def f(x):\n    y = x" and call.get("middle") is None
        await service.aclose()
    asyncio.run(go())


def test_an_edits_prefill_waits_out_the_debounce_and_gives_way():
    async def go():
        client = RecordingClient()
        service = CompletionService(LspConfig(debounce_ms=20, cache_size=0), client)
        uri, text = "file:///a.py", "def f(x):\n    y = x\n"
        for n in range(3):                                          # a burst: only the last one is sent
            service.edited(uri, text[:13 + n], 13 + n)
        await asyncio.sleep(0.1)
        assert [c["middle"] for c in client.calls] == ["    y"]
        service.edited(uri, text, 16)
        await service.complete(uri, text, 16)                       # asked within the debounce
        await asyncio.sleep(0.1)
        assert len(client.calls) == 2 and "prompt_only" not in client.calls[-1]
        await service.aclose()
    asyncio.run(go())


def test_speed_budget_cuts_context_first_then_prefix():
    full = FimBudget(prefix_tokens=1024, suffix_tokens=64, context_tokens=512)
    assert speed_budget(full, None, 150) == full
    assert speed_budget(full, 4000, 150) == FimBudget(536, 64, 0)          # 600 tokens of room
    assert speed_budget(full, 20000, 150) == FimBudget(1024, 64, 512)      # room for all of it
    assert speed_budget(full, 1000, 150) == FimBudget(113, 37, 0)         # the suffix keeps a quarter
    assert speed_budget(full, 10, 150) == FimBudget(32, 8, 0)              # never below the floors


def test_prompt_rate_comes_from_the_daemons_timings():
    rate = PromptRate()
    rate.observe({"prompt_tokens": 10, "cached_tokens": 0}, {"prompt_ms": 5.0})    # too few tokens to count
    assert rate.tokens_per_s is None
    rate.observe({"prompt_tokens": 600, "cached_tokens": 100}, {"prompt_ms": 250.0})
    assert rate.tokens_per_s == pytest.approx(2000)


def test_a_cold_document_window_grows_once_its_warm_up_is_cached():
    async def go():
        client = RecordingClient()
        budget = FimBudget(prefix_tokens=1000, suffix_tokens=20, context_tokens=0, chars_per_token=1.0)
        service = CompletionService(LspConfig(budget=budget, debounce_ms=0, target_ms=100), client)
        text = "".join(f"line {i:04d}\n" for i in range(400))       # 4,000 characters
        service.rate.tokens_per_s = 1000.0                            # 100 tokens fit in 100 ms
        service.opened("file:///a.py", text)
        await asyncio.sleep(0)
        warm = client.calls[-1]
        assert warm["prompt_only"] and warm["priority"] == "batch" and warm["replace"] == warm_key("file:///a.py")
        assert warm["prefix"] == text[:1000]                          # from the file's start, whole lines
        await service.complete("file:///a.py", text, 4000)
        cold = client.calls[-1]
        assert "prompt_only" not in cold and len(cold["prefix"]) <= 80    # 100 tokens less the suffix's 20
        client.warm.set()
        for _ in range(3):
            await asyncio.sleep(0)
        service.cache.forget("file:///a.py")
        await service.complete("file:///a.py", text, 4000)
        assert 900 <= len(client.calls[-1]["prefix"]) <= 1000             # the whole window now
        service.edited("file:///a.py", text, 2200)
        await asyncio.sleep(0)
        edit = client.calls[-1]
        assert edit["prompt_only"] and edit["priority"] == "interactive"
        assert edit["replace"] == replace_key("file:///a.py") and edit["prefix"].endswith(text[2100:2200])
        await service.aclose()
        assert service.stats.counts["prefilled"] == 2
    asyncio.run(go())


def test_suffix_first_windows_grow_per_cursor_spot():
    async def go():
        client = RecordingClient()
        budget = FimBudget(prefix_tokens=1000, suffix_tokens=20, context_tokens=0, chars_per_token=1.0)
        service = CompletionService(LspConfig(budget=budget, debounce_ms=0, target_ms=100, layout="spm"), client)
        text = "".join(f"line {i:04d}\n" for i in range(400))
        service.rate.tokens_per_s = 1000.0
        service.opened("file:///a.py", text)
        await asyncio.sleep(0)
        assert client.calls == []                                     # the cursor is not known yet
        await service.complete("file:///a.py", text, 3000)
        await asyncio.sleep(0)
        cold, warm = client.calls[0], client.calls[1]
        assert cold["layout"] == "spm" and "prompt_only" not in cold and len(cold["prefix"]) <= 80
        assert warm["prompt_only"] and warm["priority"] == "batch" and warm["replace"] == warm_key("file:///a.py")
        assert warm["layout"] == "spm" and 600 <= len(warm["prefix"]) <= 1000 and warm["suffix"] == cold["suffix"]
        client.warm.set()
        for _ in range(3):
            await asyncio.sleep(0)
        service.cache.forget("file:///a.py")
        typed = text[:3000] + "x" + text[3000:]                      # one keystroke at the same spot
        await service.complete("file:///a.py", typed, 3001)
        assert 600 <= len(client.calls[-1]["prefix"]) <= 1001 and client.calls[-1]["suffix"] == cold["suffix"]
        await service.complete("file:///a.py", typed, 1001)           # another spot: cold again
        await asyncio.sleep(0)
        assert len(client.calls[-2]["prefix"]) <= 80 and client.calls[-1]["prompt_only"]
        await service.aclose()
    asyncio.run(go())


@pytest.mark.heavy
def test_prompt_only_infills_replace_each_other_and_leave_the_answer_unchanged(daemon):
    prefix, suffix = "def area(r):\n    return ", "\n\nprint(area(2))\n"
    with Client(daemon.settings.socket) as c:
        alone = c.infill(prefix + "3", suffix, max_tokens=8, ignore_eos=True)
        alone_ids = [t for e in alone for t in getattr(e, "token_ids", [])]
        first = c.infill(prefix, suffix, replace="doc", prompt_only=True, max_tokens=1)
        second = c.infill(prefix + "3", suffix, replace="doc", prompt_only=True, max_tokens=1)
        assert [e for e in second if not isinstance(e, Done)] == [] and second.final.finish_reason == "length"
        list(first)
        assert first.final.finish_reason in ("cancelled", "length")   # replaced unless it already finished
        assert second.final.usage["completion_tokens"] == 0
        real = c.infill(prefix + "3", suffix, replace="doc", max_tokens=8, ignore_eos=True)
        real_ids = [t for e in real for t in getattr(e, "token_ids", [])]
        assert real_ids == alone_ids
        assert real.final.usage["cached_tokens"] == real.final.usage["prompt_tokens"] - 1


@pytest.mark.heavy
def test_suffix_first_prompts_keep_all_but_the_typed_end_cached(daemon):
    """After a keystroke at the cursor, a suffix-prefix-middle prompt shares everything up to the
    cursor with the one before; a prefix-suffix-middle one computes its whole suffix again."""
    prefix = "def area(r):\n    return "
    suffix = "\n\n" + "".join(f"print(area({i}))\n" for i in range(40))

    def computed_after_keystroke(layout: str) -> tuple[int, int]:
        with Client(daemon.settings.socket) as c:
            c.infill(prefix, suffix, max_tokens=1, prompt_only=True, layout=layout).text()
            real = c.infill(prefix + "3", suffix, max_tokens=2, layout=layout)
            real.text()
            usage = real.final.usage
            return usage["prompt_tokens"] - usage["cached_tokens"], usage["prompt_tokens"]

    spm, total = computed_after_keystroke("spm")
    psm, _ = computed_after_keystroke("psm")
    assert spm <= 4 < total // 2 < psm


@pytest.mark.heavy
def test_the_language_server_sends_the_configured_layout(daemon, tmp_path):
    cursor = DOC.index("return ") + len("return ")
    with Client(daemon.settings.socket) as c:
        p = build_fim(DOC, cursor, [], FimBudget(), "line")
        raw = p.completion(c.infill(p.prefix, p.suffix, middle=p.middle, max_tokens=16, layout="spm").text())
    expected = trim_suggestion(raw, "    return ", "", DOC[cursor:])

    async def session():
        async with LspProbe(lsp_args(daemon, tmp_path, "--fim-layout", "spm")) as lsp:
            lsp.open(URI, DOC)
            return await lsp.inline(URI, 3, 11)

    assert asyncio.run(session()) == expected


@pytest.mark.heavy
def test_a_keystroke_on_a_line_computes_only_the_lines_new_tokens(daemon):
    """With the line split, the prompt up to the middle token stays the same while the user types on
    a line: the next completion computes the line's new tokens only."""
    prefix = "def area(r):\n"
    suffix = "\n\n" + "".join(f"print(area({i}))\n" for i in range(40))
    with Client(daemon.settings.socket) as c:
        c.infill(prefix, suffix, middle="    ret", max_tokens=1, prompt_only=True).text()
        real = c.infill(prefix, suffix, middle="    retu", max_tokens=8, ignore_eos=True)
        assert real.text()
        usage = real.final.usage
        assert usage["prompt_tokens"] - usage["cached_tokens"] <= 3 < usage["prompt_tokens"] // 10
