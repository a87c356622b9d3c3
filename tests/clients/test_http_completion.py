"""llama.cpp's `/completion`, `/tokenize` and `/detokenize` on `llmd http` against a real daemon:
Tabby's request body (its llama.cpp binding), token-id prompts, the answer's fields, and refusals of
what llmd cannot honour."""
from __future__ import annotations

import json
import random

import pytest

from http_fixtures import call, front_fixtures, fuzz_bodies
from llmd.clients.client import Client

PROMPT = "def fibonacci(n):"


served, url = front_fixtures("completion")


def tabby_body(prompt: str, n_predict: int, temperature: float, seed: int, stream: bool = True) -> dict:
    """The body Tabby's llama.cpp binding (crates/http-api-bindings, completion/llama.rs) posts to
    /completion, field for field."""
    return {"seed": seed, "prompt": prompt, "n_predict": n_predict, "temperature": temperature, "stream": stream,
            "penalty_last_n": 0, "presence_penalty": 0.0}


def events(raw: bytes) -> list[dict]:
    """The server-sent events of a streamed answer, read as Tabby reads them (up to ``stop``)."""
    out = []
    for block in raw.decode().split("\n\n"):
        if block.startswith("data: "):
            out.append(json.loads(block[6:]))
            if out[-1].get("stop"):
                break
    return out


def complete(url: str, body: dict) -> dict:
    status, _, raw = call(url + "/completion", body)
    assert status == 200, raw
    return json.loads(raw)


def v1_text(url: str, body: dict) -> str:
    status, _, raw = call(url + "/v1/completions", body)
    assert status == 200, raw
    return json.loads(raw)["choices"][0]["text"]


@pytest.mark.heavy
def test_tabbys_streamed_body_gets_the_text_of_v1_completions(url):
    status, headers, raw = call(url + "/completion", tabby_body(PROMPT, 16, 0.1, 7))
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    chunks = events(raw)
    assert [c["stop"] for c in chunks] == [False] * (len(chunks) - 1) + [True]
    text = "".join(c["content"] for c in chunks)
    assert text == v1_text(url, {"prompt": PROMPT, "max_tokens": 16, "temperature": 0.1, "seed": 7})
    final = chunks[-1]
    assert final["timings"]["predicted_n"] == final["tokens_predicted"] == 16 and final["stop_type"] == "limit"
    # Tabby's next-edit mode posts the same body unstreamed and reads `content`
    assert complete(url, tabby_body(PROMPT, 16, 0.1, 7, stream=False))["content"] == text


@pytest.mark.heavy
def test_a_64_bit_seed_keeps_its_low_63_bits(url):
    first = complete(url, tabby_body(PROMPT, 12, 0.8, (1 << 64) - 1, stream=False))["content"]
    assert first == complete(url, tabby_body(PROMPT, 12, 0.8, (1 << 64) - 1, stream=False))["content"]
    assert first == v1_text(url, {"prompt": PROMPT, "max_tokens": 12, "temperature": 0.8, "seed": (1 << 63) - 1})


@pytest.mark.heavy
def test_greedy_answer_fields_and_returned_tokens(url, served):
    reply = complete(url, {"prompt": PROMPT, "n_predict": 12, "temperature": 0, "return_tokens": True,
                           "cache_prompt": True, "id_slot": -1})
    daemon, _ = served
    with Client(daemon.settings.socket, timeout=30) as c:
        stream = c.generate(PROMPT, max_tokens=12)
        assert reply["content"] == stream.text()
    assert len(reply["tokens"]) == reply["tokens_predicted"] == 12
    assert reply["tokens_evaluated"] == stream.final.usage["prompt_tokens"] and reply["stop"] is True
    assert reply["model"] == json.loads(call(url + "/v1/models", method="GET")[2])["data"][0]["id"]


@pytest.mark.heavy
def test_token_id_prompts_and_tokenize_agree_with_the_daemon(url):
    ids = complete(url, {"prompt": PROMPT, "n_predict": 1})["tokens_evaluated"]
    tokens = json.loads(call(url + "/tokenize", {"content": PROMPT})[2])["tokens"]
    assert len(tokens) == ids
    by_text = complete(url, {"prompt": PROMPT, "n_predict": 10})["content"]
    assert complete(url, {"prompt": tokens, "n_predict": 10})["content"] == by_text
    assert complete(url, {"prompt": [PROMPT], "n_predict": 10})["content"] == by_text


@pytest.mark.heavy
def test_tokenize_and_detokenize(url):
    text = "def f(x):\n    return x  # héllo"
    tokens = json.loads(call(url + "/tokenize", {"content": text})[2])["tokens"]
    assert json.loads(call(url + "/detokenize", {"tokens": tokens})[2])["content"] == text
    pieces = json.loads(call(url + "/tokenize", {"content": "def f", "with_pieces": True})[2])["tokens"]
    assert "".join(p["piece"] for p in pieces) == "def f" and all(isinstance(p["id"], int) for p in pieces)
    special = json.loads(call(url + "/tokenize", {"content": "<|fim_prefix|>"})[2])["tokens"]
    plain = json.loads(call(url + "/tokenize", {"content": "<|fim_prefix|>", "parse_special": False})[2])["tokens"]
    assert len(special) == 1 and len(plain) > 1
    status, _, raw = call(url + "/detokenize", {"tokens": [1 << 30]})
    assert status == 400 and json.loads(raw)["error"]["param"] == "tokens"


@pytest.mark.heavy
def test_n_predict_zero_computes_the_prompt_only(url):
    reply = complete(url, {"prompt": PROMPT + " # warm", "n_predict": 0})
    assert reply["content"] == "" and reply["tokens_predicted"] == 0 and reply["tokens_evaluated"] > 0


@pytest.mark.heavy
def test_penalty_windows(url, served):
    plain = complete(url, {"prompt": PROMPT, "n_predict": 12})["content"]
    assert complete(url, {"prompt": PROMPT, "n_predict": 12, "presence_penalty": 1.5, "repeat_penalty": 1.5,
                          "penalty_last_n": 0})["content"] == plain
    penalized = complete(url, {"prompt": PROMPT, "n_predict": 12, "repeat_penalty": 1.5, "repeat_last_n": -1})
    daemon, _ = served
    with Client(daemon.settings.socket, timeout=30) as c:
        assert penalized["content"] == c.generate(PROMPT, max_tokens=12, repetition_penalty=1.5).text()


@pytest.mark.heavy
def test_typical_p_reaches_the_daemon(url, served):
    body = {"prompt": PROMPT, "n_predict": 12, "temperature": 1.0, "seed": 5}
    daemon, _ = served
    with Client(daemon.settings.socket, timeout=30) as c:
        typical = c.generate(PROMPT, max_tokens=12, temperature=1.0, seed=5, typical_p=0.2).text()
        assert typical != c.generate(PROMPT, max_tokens=12, temperature=1.0, seed=5).text()
    assert complete(url, {**body, "typical_p": 0.2})["content"] == typical
    # llama.cpp's typical_p of 1 or more is off; a chain without typ_p leaves it out
    assert complete(url, {**body, "typical_p": 5.0})["content"] == complete(url, body)["content"]
    assert complete(url, {**body, "typical_p": 0.2, "samplers": ["temperature"]})["content"] == \
        complete(url, body)["content"]


@pytest.mark.heavy
def test_stop_strings_and_samplers(url):
    full = complete(url, {"prompt": PROMPT, "n_predict": 24, "ignore_eos": True})["content"]
    stop = full[len(full) // 2:len(full) // 2 + 2]
    assert complete(url, {"prompt": PROMPT, "n_predict": 24, "ignore_eos": True, "stop": [stop]})["content"] == \
        full[:full.index(stop)]
    # a chain without temperature samples greedily, as on /infill
    assert complete(url, {"prompt": PROMPT, "n_predict": 24, "ignore_eos": True, "temperature": 0.9, "seed": 3,
                          "samplers": ["top_k", "top_p"]})["content"] == full


@pytest.mark.parametrize("extra, field", [
    ({"input_prefix": "a"}, "input_prefix"),
    ({"n_probs": 3}, "n_probs"),
    ({"grammar": "root ::= \"x\""}, "grammar"),
    ({"json_schema": {"type": "object"}}, "json_schema"),
    ({"logit_bias": [[1, -100]]}, "logit_bias"),
    ({"mirostat": 1}, "mirostat"),
    ({"typical_p": 0.0}, "typical_p"),
    ({"top_n_sigma": 1.0}, "top_n_sigma"),
    ({"dry_multiplier": 0.8}, "dry_multiplier"),
    ({"repeat_penalty": 1.1, "penalty_last_n": 64}, "penalty_last_n"),
    ({"presence_penalty": 0.5, "repeat_last_n": 64}, "repeat_last_n"),
    ({"prompt": ["a", 1]}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"n_predict": 5.0}, "n_predict"),
])
@pytest.mark.heavy
def test_what_llmd_cannot_honour_is_refused_by_name(url, extra, field):
    status, _, raw = call(url + "/completion", {"prompt": PROMPT, "n_predict": 2, **extra})
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"].startswith(field) and error["message"].startswith(field), error
    assert complete(url, {"prompt": PROMPT, "n_predict": 2})["stop"] is True


COMPLETION_FIELDS = {"prompt": "text_or_ids", "n_predict": "int", "temperature": "float", "top_k": "int",
                     "top_p": "float", "min_p": "float", "seed": "int", "stop": "list", "stream": "bool", "ignore_eos": "bool",
                     "presence_penalty": "float", "repeat_penalty": "float", "penalty_last_n": "int",
                     "typical_p": "float", "samplers": "list", "cache_prompt": "bool", "return_tokens": "bool", "t_max_predict_ms": "int"}


@pytest.mark.parametrize("path, fields, base", [
    ("/completion", COMPLETION_FIELDS, {"prompt": "a", "n_predict": 2}),
    ("/tokenize", {"content": "str", "add_special": "bool", "parse_special": "bool", "with_pieces": "bool"},
     {"content": "a"}),
    ("/detokenize", {"tokens": "list"}, {"tokens": [1, 2]}),
])
@pytest.mark.heavy
def test_fuzzed_bodies_get_4xx_and_the_front_keeps_serving(url, path, fields, base):
    for body in fuzz_bodies(fields, random.Random(path), 40, base):
        status, _, raw = call(url + path, body)
        assert 400 <= status < 500, (body[:200], raw[:300])
        assert json.loads(raw)["error"]["message"]
    assert complete(url, {"prompt": PROMPT, "n_predict": 2})["stop"] is True
