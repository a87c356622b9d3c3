"""Ollama's API on `llmd http` against a real daemon, through the real `ollama` client (the one Home
Assistant's Ollama integration uses): the same text as the OpenAI endpoints, JSON-lines streaming,
fill in the middle by `suffix`, the model listings, and refusals of what llmd cannot honour."""
from __future__ import annotations

import json
import random

import ollama
import pytest

from daemon_fixtures import wait_until
from http_fixtures import call, front_fixtures, fuzz_bodies
from llmd.clients.client import Client

PROMPT = "def fibonacci(n):"


served, url = front_fixtures("ollama")


@pytest.fixture
def client(url):
    return ollama.Client(host=url, timeout=30)


def openai_text(url: str, path: str, body: dict) -> str:
    status, _, raw = call(url + path, body)
    assert status == 200, raw
    choice = json.loads(raw)["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


# -- generate --------------------------------------------------------------------------------------


@pytest.mark.heavy
def test_raw_generate_is_the_greedy_text_of_v1_completions(client, url):
    r = client.generate(model="llmd", prompt=PROMPT, raw=True, options={"num_predict": 12, "temperature": 0})
    assert r.response == openai_text(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 12})
    assert r.done and r.done_reason == "length" and r.model == "llmd" and r.created_at.endswith("Z")
    assert r.eval_count == 12 and r.prompt_eval_count > 0
    assert r.total_duration >= r.eval_duration > 0 and r.load_duration == 0


@pytest.mark.heavy
def test_templated_generate_is_the_chat_answer(client, url):
    r = client.generate(model="llmd", prompt="Write a sort.", system="Be brief.", options={"num_predict": 10})
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Write a sort."}]
    assert r.response == openai_text(url, "/v1/chat/completions", {"messages": messages, "max_tokens": 10})


@pytest.mark.heavy
def test_streamed_generate_sends_json_lines_that_add_up_to_the_whole(client, url):
    options = {"num_predict": 12}
    parts = list(client.generate(model="llmd", prompt=PROMPT, raw=True, stream=True, options=options))
    whole = client.generate(model="llmd", prompt=PROMPT, raw=True, options=options)
    assert "".join(p.response for p in parts) == whole.response
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert parts[-1].eval_count == whole.eval_count and parts[-1].done_reason == "length"
    # on the wire: application/x-ndjson, one object a line; Ollama's default is to stream
    status, headers, raw = call(url + "/api/generate", {"model": "m", "prompt": PROMPT, "raw": True,
                                                        "options": options})
    assert status == 200 and headers["Content-Type"].startswith("application/x-ndjson")
    lines = [json.loads(line) for line in raw.decode().splitlines()]
    assert "".join(x["response"] for x in lines) == whole.response and lines[-1]["done"] is True


@pytest.mark.heavy
def test_fill_in_the_middle_by_suffix(client, url):
    r = client.generate(model="llmd", prompt="def add(a, b):\n    return ", suffix="\n\nprint(add(1, 2))\n",
                        options={"num_predict": 10})
    assert r.response == openai_text(url, "/v1/completions", {"prompt": "def add(a, b):\n    return ",
                                                              "suffix": "\n\nprint(add(1, 2))\n", "max_tokens": 10})
    streamed = client.generate(model="llmd", prompt="def add(a, b):\n    return ", suffix="\n\nprint(add(1, 2))\n",
                               options={"num_predict": 10}, stream=True)
    assert "".join(p.response for p in streamed) == r.response
    # an empty suffix still asks for the middle: the cursor is at the end of the file
    at_end = client.generate(model="llmd", prompt="def add(a, b):\n    return ", suffix="", options={"num_predict": 10})
    assert at_end.response == openai_text(url, "/v1/completions", {"prompt": "def add(a, b):\n    return ",
                                                                   "suffix": "", "max_tokens": 10})


@pytest.mark.heavy
def test_continues_autocomplete_requests(url):
    """Continue's Ollama provider (core/llm/llms/Ollama.ts): /api/show by `name`, whose template
    and parameters it reads, then /api/generate with `suffix` when the template has `.Suffix`."""
    status, _, raw = call(url + "/api/show", {"name": "qwen2.5-coder:1.5b"})
    shown = json.loads(raw)
    assert status == 200 and ".Suffix" in shown["template"] and shown["parameters"] == "num_ctx 1024"
    stops = ["<|endoftext|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>",
             "<|file_sep|>", "<|im_start|>", "<|im_end|>"]
    body = {"model": "qwen2.5-coder:1.5b", "prompt": "def add(a, b):\n    return ", "suffix": "\n",
            "options": {"temperature": 0, "num_predict": 12, "stop": stops, "num_ctx": 1024},
            "keep_alive": 1800, "stream": True}
    status, _, raw = call(url + "/api/generate", body)
    lines = [json.loads(line) for line in raw.decode().splitlines()]
    assert status == 200 and lines[-1]["done"] and lines[0]["model"] == "qwen2.5-coder:1.5b"
    assert "".join(x["response"] for x in lines) == openai_text(url, "/v1/completions", {
        "prompt": "def add(a, b):\n    return ", "suffix": "\n", "max_tokens": 12, "stop": stops})


@pytest.mark.heavy
def test_seeded_sampling_matches_the_openai_endpoint(client, url):
    options = {"num_predict": 12, "temperature": 0.9, "top_k": 20, "top_p": 0.9, "seed": 11}
    r = client.generate(model="llmd", prompt=PROMPT, raw=True, options=options)
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0.9, "top_k": 20, "top_p": 0.9, "seed": 11}
    assert r.response == openai_text(url, "/v1/completions", body)


@pytest.mark.heavy
def test_repeat_penalty_reaches_the_daemon(client, served):
    daemon, _ = served
    r = client.generate(model="llmd", prompt=PROMPT, raw=True,
                        options={"num_predict": 12, "repeat_penalty": 1.5, "repeat_last_n": -1})
    with Client(daemon.settings.socket, timeout=30) as c:
        assert r.response == c.generate(PROMPT, max_tokens=12, repetition_penalty=1.5).text()
    # a window of 0 turns penalties off, as in llama.cpp
    off = client.generate(model="llmd", prompt=PROMPT, raw=True,
                          options={"num_predict": 12, "repeat_penalty": 1.5, "repeat_last_n": 0})
    assert off.response == client.generate(model="llmd", prompt=PROMPT, raw=True, options={"num_predict": 12}).response


@pytest.mark.heavy
def test_typical_p_reaches_the_daemon(client, served):
    daemon, _ = served
    options = {"num_predict": 12, "temperature": 1.0, "seed": 5}
    r = client.generate(model="llmd", prompt=PROMPT, raw=True, options={**options, "typical_p": 0.2})
    with Client(daemon.settings.socket, timeout=30) as c:
        assert r.response == c.generate(PROMPT, max_tokens=12, temperature=1.0, seed=5, typical_p=0.2).text()
    assert r.response != client.generate(model="llmd", prompt=PROMPT, raw=True, options=options).response


@pytest.mark.heavy
def test_a_client_that_leaves_a_stream_cancels_its_request(client, served):
    daemon, _ = served

    def stats():
        with Client(daemon.settings.socket) as c:
            return c.stats()

    before = stats()["finished"].get("cancelled", 0)
    parts = client.generate(model="llmd", prompt=PROMPT, raw=True, stream=True, options={"num_predict": 5000})
    for i, _ in enumerate(parts):
        if i == 3:
            break
    parts.close()
    assert wait_until(lambda: stats()["finished"].get("cancelled", 0) > before, 10)
    assert wait_until(lambda: stats()["in_flight"] == 0, 10)


@pytest.mark.heavy
def test_nothing_to_generate_answers_loaded(client, url):
    assert client.generate(model="llmd", prompt="").done_reason == "load"
    assert client.chat(model="llmd", messages=[]).done_reason == "load"
    r = client.generate(model="llmd", prompt=PROMPT, raw=True, options={"num_predict": 0})
    assert r.response == "" and r.done and r.eval_count == 0 and r.prompt_eval_count > 0


@pytest.mark.heavy
def test_harmless_fields_are_accepted_and_change_nothing(client):
    plain = client.generate(model="llmd", prompt=PROMPT, raw=True, options={"num_predict": 8}).response
    r = client.generate(model="llmd", prompt=PROMPT, raw=True, keep_alive="5m", format="",
                        options={"num_predict": 8, "num_ctx": 512, "num_thread": 2, "num_gpu": 0, "use_mmap": True,
                                 "num_keep": 4, "seed": -1, "mirostat": 0, "mirostat_tau": 5.0, "typical_p": 1.0,
                                 "tfs_z": 1.0, "penalize_newline": False})
    assert r.response == plain
    assert client.generate(model="llmd", prompt=PROMPT, raw=True, keep_alive=-1,
                           options={"num_predict": 8}).response == plain


# -- chat ------------------------------------------------------------------------------------------


@pytest.mark.heavy
def test_chat_and_streamed_chat_are_the_chat_answer(client, url):
    messages = [{"role": "user", "content": "Write a sorting function."}]
    expected = openai_text(url, "/v1/chat/completions", {"messages": messages, "max_tokens": 16})
    r = client.chat(model="llmd", messages=messages, options={"num_predict": 16})
    assert r.message.role == "assistant" and r.message.content == expected and r.done
    parts = list(client.chat(model="llmd", messages=messages, options={"num_predict": 16}, stream=True))
    assert "".join(p.message.content for p in parts) == expected
    assert parts[-1].done and parts[-1].eval_count == r.eval_count and parts[-1].prompt_eval_count > 0


@pytest.mark.heavy
def test_home_assistants_chat_call(client, url):
    """The call of Home Assistant's Ollama integration: streamed chat, `keep_alive` in seconds and
    `num_ctx`, no `num_predict` (so the answer runs to its end or to the context window)."""
    messages = [{"role": "system", "content": "You are a voice assistant."}, {"role": "user", "content": "Hi"}]
    parts = list(client.chat(model="qwen2.5:0.5b", messages=messages, stream=True, keep_alive="-1s",
                             options={"num_ctx": 1024}))
    final = parts[-1]
    assert final.done and final.done_reason in ("stop", "length")
    assert final.prompt_eval_count + final.eval_count <= 1024
    expected = openai_text(url, "/v1/chat/completions", {"messages": messages, "max_tokens": final.eval_count})
    assert "".join(p.message.content for p in parts) == expected


# -- listings --------------------------------------------------------------------------------------


@pytest.mark.heavy
def test_tags_show_ps_and_version(client, url):
    models = json.loads(call(url + "/v1/models", method="GET")[2])["data"]
    tags = client.list().models
    assert [m.model for m in tags] == [models[0]["id"] + ":latest"] and tags[0].details.format == "safetensors"
    shown = client.show(tags[0].model)
    assert shown.modelinfo["llmd.context_length"] == models[0]["max_model_len"]
    assert shown.capabilities == ["completion", "insert"] and ".Suffix" in shown.template
    running = client.ps().models
    assert running[0].model == tags[0].model and running[0].context_length == models[0]["max_model_len"]
    assert running[0].expires_at.year > 2100
    status, _, raw = call(url + "/api/version", method="GET")
    assert status == 200 and json.loads(raw)["version"].count(".") == 2


# -- refusals --------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, field", [
    ({"images": ["aGVsbG8="]}, "images"),
    ({"format": "json", "suffix": "x"}, "format"),
    ({"think": True}, "think"),
    ({"template": "{{ .Prompt }}"}, "template"),
    ({"context": [1, 2, 3]}, "context"),
    ({"logprobs": True}, "logprobs"),
    ({"raw": True, "suffix": "x"}, "suffix"),
    ({"raw": True, "system": "s"}, "system"),
    ({"options": {"mirostat": 2}}, "options.mirostat"),
    ({"options": {"typical_p": 0.0}}, "options.typical_p"),
    ({"options": {"tfs_z": 0.9}}, "options.tfs_z"),
    ({"options": {"num_ctx": 1 << 20}}, "options.num_ctx"),
    ({"options": {"repeat_penalty": 1.2, "repeat_last_n": 64}}, "options.repeat_last_n"),
    ({"options": {"penalize_newline": True}}, "options.penalize_newline"),
    ({"options": {"no_such_option": 1}}, "options.no_such_option"),
    ({"width": 512}, "width"),
])
@pytest.mark.heavy
def test_what_llmd_cannot_honour_is_refused_by_name(client, kwargs, field):
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model="llmd", prompt=PROMPT, **{"options": {"num_predict": 2}, **kwargs})
    assert e.value.status_code == 400 and e.value.error.startswith(field + ":"), e.value.error
    assert client.generate(model="llmd", prompt=PROMPT, raw=True, options={"num_predict": 2}).done


@pytest.mark.parametrize("body, field", [
    ({"tools": [{"type": "retrieval"}]}, "tools.0"),
    ({"format": [1]}, "format"),
    ({"messages": [{"role": "user", "content": "hi", "images": ["aGVsbG8="]}]}, "messages.0.images"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}]},
     "messages.0.tool_calls"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
    ({"unknown_field": True}, "unknown_field"),
])
@pytest.mark.heavy
def test_chat_refusals_name_the_field_in_ollamas_error_shape(url, body, field):
    status, _, raw = call(url + "/api/chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                              "stream": False, "options": {"num_predict": 2}, **body})
    error = json.loads(raw)["error"]
    assert status == 400 and isinstance(error, str) and error.startswith(field + ":"), error


GENERATE_FIELDS = {"model": "str", "prompt": "str", "suffix": "str", "system": "str", "raw": "bool", "stream": "bool",
                   "images": "list", "context": "list", "options.temperature": "float", "options.top_p": "float",
                   "options.top_k": "int", "options.num_predict": "int", "options.seed": "int", "options.stop": "list",
                   "options.repeat_penalty": "float", "options.typical_p": "float", "options.num_ctx": "int",
                   "options.use_mmap": "bool"}
CHAT_FIELDS = {"model": "str", "messages": "list", "stream": "bool", "tools": "list", "options.min_p": "float",
               "options.presence_penalty": "float", "options.repeat_last_n": "int", "options.num_thread": "int"}


@pytest.mark.parametrize("path, fields, base", [
    ("/api/generate", GENERATE_FIELDS, {"model": "m", "prompt": "a", "stream": False, "options": {"num_predict": 2}}),
    ("/api/chat", CHAT_FIELDS, {"model": "m", "messages": [{"role": "user", "content": "a"}], "stream": False,
                                "options": {"num_predict": 2}}),
    ("/api/show", {"model": "str", "name": "str", "verbose": "bool"}, {"model": "m"}),
])
@pytest.mark.heavy
def test_fuzzed_bodies_get_4xx_and_the_front_keeps_serving(client, url, path, fields, base):
    for body in fuzz_bodies(fields, random.Random(path), 40, base):
        status, _, raw = call(url + path, body)
        assert 400 <= status < 500, (body[:200], raw[:300])
        assert isinstance(json.loads(raw)["error"], str)
    assert client.generate(model="llmd", prompt=PROMPT, raw=True, options={"num_predict": 2}).done
