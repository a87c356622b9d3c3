"""Raw FIM markers: a completion prompt that writes the model's fill-in-the-middle markers as text (as
Continue's OpenAI provider does for autocomplete) is the infill prompt, id for id, on every front: the
markers become the model's FIM tokens where the daemon's engine thread encodes a text prompt.

Other families' markers (DeepSeek-Coder, CodeLlama, StarCoder2) are checked in test_fim_metadata.py.
"""
from __future__ import annotations

import socket
from types import SimpleNamespace

import pytest

from daemon_fixtures import daemon_process, daemon_settings, wait_until
from http_fixtures import call
from llmd.clients.client import Client, Done, Token
from llmd.daemon.engine_thread import EngineThread, Submit
from llmd.runtime.tokenizer import Tokenizer

PREFIX, SUFFIX = "def f(x):\n    ", "\n    return y"
# Continue's autocomplete request to an OpenAI-compatible /v1/completions, for a Qwen-coder model
CONTINUE = {
    "model": "qwen2.5-coder",
    "prompt": f"<|fim_prefix|>{PREFIX}<|fim_suffix|>{SUFFIX}<|fim_middle|>",
    "max_tokens": 8,
    "temperature": 0.01,
    "stop": ["<|endoftext|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>",
             "<|file_sep|>", "<|im_start|>", "<|im_end|>", "\n\n", "\r\n\r\n", "/src/", "#- coding: utf-8", "```"],
    "stream": True,
}


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return Tokenizer.from_dir(tiny_model_dir)


def test_continues_prompt_is_the_infill_prompt(tok):
    ids = tok.encode_fim_markers(CONTINUE["prompt"])
    assert ids == tok.build_infill(PREFIX, SUFFIX)
    assert ids != tok.encode(CONTINUE["prompt"])         # as plain text the markers are many pieces
    assert [ids[0], ids[-1]] == [tok.fim_prefix_id, tok.fim_middle_id]


def test_only_fim_markers_become_tokens(tok):
    ids = tok.encode_fim_markers("<|im_start|>x<|fim_prefix|>a<|endoftext|><|fim_suffix|>b<|fim_middle|>")
    assert not {tok.token_id("<|im_start|>"), tok.token_id("<|endoftext|>")} & set(ids)
    assert ids[-1] == tok.fim_middle_id and tok.file_sep_id not in ids
    assert tok.encode_fim_markers("def f(x): return '<|fim'") is None      # no marker: ordinary text


def test_the_engine_thread_encodes_a_text_prompt_with_markers(tok):
    thread = SimpleNamespace(engine=SimpleNamespace(tokenizer=tok))
    submit = Submit(engine_id="r", kind="generate", params=None, priority=None, prompt=CONTINUE["prompt"])
    assert EngineThread._prompt(thread, submit) == tok.build_infill(PREFIX, SUFFIX)
    plain = Submit(engine_id="r", kind="generate", params=None, priority=None, prompt="def f(x):")
    assert EngineThread._prompt(thread, plain) == "def f(x):"          # left to the engine, as before


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    """`llmd serve --http`: (settings, base URL)."""
    settings = daemon_settings(tiny_model_dir, tmp_path_factory.mktemp("raw-fim"))
    url = f"http://127.0.0.1:{_free_port()}"
    proc = daemon_process(settings, "--http", url.removeprefix("http://"))

    def up() -> bool:
        try:
            return proc.poll() is not None or call(url + "/health", method="GET", timeout=2)[0] == 200
        except OSError:
            return False
    try:
        if not wait_until(up, timeout=90, interval=0.1) or proc.poll() is not None:
            proc.kill()
            raise RuntimeError(f"llmd serve --http did not start: {proc.communicate(timeout=10)}")
        yield settings, url
    finally:
        proc.kill()
        proc.wait(10)


@pytest.mark.heavy
def test_continues_request_through_openai_equals_the_infill(served, tok):
    openai = pytest.importorskip("openai")
    settings, url = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    body = {k: v for k, v in CONTINUE.items() if k not in ("model", "prompt")}
    chunks = list(client.completions.create(model=CONTINUE["model"], prompt=CONTINUE["prompt"], **body))
    assert chunks and all(c.object == "text_completion" for c in chunks)
    # greedy and not streamed: the prompt's size, and the text the daemon's own infill gives
    greedy = client.completions.create(model=CONTINUE["model"], prompt=CONTINUE["prompt"], max_tokens=8,
                                       temperature=0)
    assert greedy.usage.prompt_tokens == len(tok.build_infill(PREFIX, SUFFIX))
    with Client(settings.socket, timeout=30) as c:
        events = list(c.infill(PREFIX, SUFFIX, max_tokens=8, temperature=0))
    assert greedy.choices[0].text == "".join(e.text for e in events if isinstance(e, Token))
    assert greedy.usage.prompt_tokens == next(e for e in events if isinstance(e, Done)).usage["prompt_tokens"]
