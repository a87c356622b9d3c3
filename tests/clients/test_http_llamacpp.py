"""llmd's clients moved to a real llama.cpp server: `llmd lsp` and `llmd batch` with `--backend http://...`
against llama-server (built from the llama.cpp vendored in llama-cpp-python's sdist by
bench/build_llama_server.sh) serving a GGUF of models/code-target, and the same requests through
llmd's own daemon. Slow-marked unless the build is cached."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from daemon_fixtures import REPO, daemon_settings, running_daemon
from llmd.bench.llama_server import CACHE, LlamaServer, LlamaServerError, binary

BINARY = CACHE / "bin" / "llama-server"
MODEL = REPO / "models" / "code-target"
pytestmark = [] if BINARY.exists() else [pytest.mark.slow]

FILE = "import math\n\n\ndef circle_area(radius):\n    return \n\n\ndef main():\n    print(circle_area(2))\n"
CURSOR = (4, 11)                 # after "return "
PROMPTS = ["def fibonacci(n):\n", "class Stack:\n    def __init__(self):\n", "import os\n\ndef list_files(path):\n"]


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory):
    pytest.importorskip("gguf")
    from llmd.bench.to_gguf import convert
    gguf = convert(MODEL, tmp_path_factory.mktemp("gguf") / "code-target.gguf")
    with LlamaServer(ready_timeout_s=120) as server:
        yield server.start(binary(build=True), gguf, threads=1, extra_args=["-c", "512", "-np", "1", "--no-warmup"])


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with running_daemon(daemon_settings(MODEL, tmp_path_factory.mktemp("lcpp")), ready_timeout=300) as server:
        yield server


def run_batch(backend: str, tmp_path: Path, name: str) -> dict:
    from llmd.clients.cli import main
    src = tmp_path / "in.jsonl"
    lines = [{"id": f"p{i}", "prompt": p, "max_tokens": 12, "temperature": 0} for i, p in enumerate(PROMPTS)]
    lines.append({"id": "fim", "prefix": "def add(a, b):\n    return ", "suffix": "\n", "max_tokens": 8})
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / f"{name}.jsonl"
    assert main(["batch", str(src), str(out), "--backend", backend, "--no-progress"]) == 0
    return {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}


@pytest.mark.heavy
def test_batch_over_llama_cpp_gives_the_daemons_completions(llama_server, daemon, tmp_path):
    over_llama = run_batch(llama_server, tmp_path, "llama")
    over_llmd = run_batch(daemon.settings.socket, tmp_path, "llmd")
    assert set(over_llama) == set(over_llmd) and all("text" in r for r in over_llama.values()), over_llama
    for rid in over_llmd:
        assert over_llama[rid]["text"] == over_llmd[rid]["text"], rid
    assert over_llama["p0"]["usage"]["completion_tokens"] == over_llmd["p0"]["usage"]["completion_tokens"]


@pytest.mark.heavy
def test_language_server_over_llama_cpp_suggests_what_the_daemon_does(llama_server, daemon):
    from llmd.clients.lsp_probe import LspProbe

    async def suggest(args):
        # split at the cursor: llama.cpp's /infill has no middle, so over it the split is the cursor's
        async with LspProbe(["--debounce-ms", "0", "--max-tokens", "12", "--fim-split", "cursor", *args],
                            cwd=str(REPO)) as lsp:
            lsp.open("file:///area.py", FILE)
            text = await lsp.inline("file:///area.py", *CURSOR)
            return text, {**await lsp.stats(), "backend": await lsp.status()}

    over_llama, stats = asyncio.run(suggest(["--backend", llama_server]))
    over_llmd, native = asyncio.run(suggest(["--socket", daemon.settings.socket]))
    assert over_llama and over_llama == over_llmd
    assert stats["completed"] == 1 and stats["backend"]["off"] == ["replace", "sentences", "priority", "middle"]
    assert native["backend"]["off"] == []


@pytest.mark.heavy
def test_fill_in_the_middle_by_infill_and_by_fim_tokens_over_completions(llama_server, daemon):
    from llmd.clients.client import AsyncClient
    from llmd.clients.http_backend import HttpBackend

    async def fill(client) -> str:
        try:
            return await (await client.infill("def add(a, b):\n    return ", "\n", max_tokens=8)).text()
        finally:
            await client.aclose()

    expected = asyncio.run(fill(AsyncClient(daemon.settings.socket)))
    by_infill = HttpBackend(llama_server, fim="auto")
    assert asyncio.run(fill(by_infill)) == expected and by_infill.fim == "infill"
    assert asyncio.run(fill(HttpBackend(llama_server, fim="completions"))) == expected


def test_a_server_that_cannot_start_is_a_clear_error_and_leaves_nothing_running(tmp_path):
    bad = tmp_path / "not-a-model.gguf"
    bad.write_bytes(b"not a gguf file")
    server = LlamaServer(ready_timeout_s=60)
    with pytest.raises(LlamaServerError, match="exited"):
        server.start(binary(build=True), bad, threads=1)
    assert server.proc is None and server.url.startswith("http://127.0.0.1:")


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.heavy
def test_the_editor_benchmark_runs_the_same_keystrokes_against_llama_cpp(tmp_path):
    from llmd.bench.to_gguf import convert
    gguf = convert(MODEL, tmp_path / "code-target.gguf")
    out = subprocess.run([sys.executable, str(REPO / "bench" / "bench_editor.py"), "--model", str(MODEL), "--gguf",
                          str(gguf), "--against", "llamacpp-server", "--run", "spm:--fim-layout spm",
                          "--keystrokes", "4", "--first-in-file", "1", "--warmup", "1", "--json"],
                         capture_output=True, text=True, timeout=1800, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    runs = json.loads(out.stdout)
    assert list(runs) == ["llamacpp-server", "llmd", "spm"]
    for r in runs.values():
        assert r["keystrokes"] == 4 and r["server"]["error"] == 0 and r["first_in_file"]["n"] == 1
        assert r["model_served"]["n"] + r["cache_served"]["n"] == 4
    assert runs["llamacpp-server"]["server"]["prefilled"] == 0 and runs["llmd"]["server"]["prefilled"] >= 1


@pytest.mark.heavy
def test_llama_cpp_timings_reach_the_language_servers_prompt_rate(llama_server):
    """The cold-window budget needs the server's prompt time: llama.cpp's timings come through."""
    from llmd.clients.http_backend import HttpBackend

    async def fill():
        backend = HttpBackend(llama_server, fim="infill")
        try:
            stream = await backend.infill("def scale_points(points, factor):\n    return ", "\n", max_tokens=4)
            await stream.text()
            return stream.final
        finally:
            await backend.aclose()

    first, again = asyncio.run(fill()), asyncio.run(fill())
    for final in (first, again):
        assert final.timings["prompt_ms"] > 0 and final.timings["decode_ms"] > 0
    assert first.usage["prompt_tokens"] == again.usage["prompt_tokens"] > 0
    assert again.usage["cached_tokens"] > first.usage["cached_tokens"]      # the repeat is served from its cache
