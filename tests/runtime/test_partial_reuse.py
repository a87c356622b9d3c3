"""Partial-block reuse and prompt-only requests on the bundled coder: a prompt that extends or
repeats a cached one computes only its new tokens, and greedy output never changes."""
from pathlib import Path

import pytest

from llmd import LLM
from llmd.runtime.request import SamplingParams

TARGET = Path(__file__).resolve().parents[2] / "models" / "code-target"
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
BS = 16
CODE = "def merge(a, b):\n    out = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n"


@pytest.fixture(scope="module")
def engines():
    """One LLM with the prefix cache (emptied before each use) and one that recomputes everything."""
    return LLM(str(TARGET), kv_memory="8MiB", block_size=BS), LLM(str(TARGET), kv_memory="8MiB", prefix_cache=False)


@pytest.fixture
def llm(engines):
    engines[0].engine.block_manager.reset_prefix_cache()
    return engines[0]


@pytest.fixture
def recompute(engines):
    return engines[1]


@pytest.fixture
def prompt(engines):
    ids = engines[0].tokenizer.encode(CODE)
    # a prompt whose last block is partial, and whose first completion leaves a partial tail too
    assert len(ids) % BS and (len(ids) + GREEDY.max_tokens - 1) % BS
    return ids


def test_extending_prompt_computes_only_its_new_tokens(llm, recompute, prompt):
    first = llm.generate(prompt, GREEDY)[0]
    longer = prompt + first.token_ids + [prompt[0], prompt[1], prompt[2]]
    second = llm.generate(longer, GREEDY)[0]
    # the first request computed its prompt and all its output but the last token: all of it is reused
    assert second.metrics["cached_tokens"] == len(prompt) + GREEDY.max_tokens - 1
    again = llm.generate(prompt, GREEDY)[0]
    assert again.metrics["cached_tokens"] == len(prompt) - 1       # a repeat computes one token
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]
    assert recompute.generate(longer, GREEDY)[0].token_ids == second.token_ids
    assert recompute.generate(prompt, GREEDY)[0].token_ids == again.token_ids == first.token_ids


def test_prompt_only_request_fills_the_cache_and_generates_nothing(llm, recompute, prompt):
    pre = llm.generate(prompt, SamplingParams(max_tokens=8, prompt_only=True))[0]
    assert pre.token_ids == [] and pre.finish_reason == "length"
    assert pre.metrics["prompt_tokens"] == len(prompt) and pre.metrics["output_tokens"] == 0
    real = llm.generate(prompt, GREEDY)[0]
    assert real.metrics["cached_tokens"] == len(prompt) - 1
    assert real.token_ids == recompute.generate(prompt, GREEDY)[0].token_ids


def test_prompt_only_request_batched_with_others(llm, recompute, prompt):
    outs = llm.generate([prompt, prompt[:20]], [SamplingParams(prompt_only=True), GREEDY])
    assert outs[0].token_ids == [] and len(outs[1].token_ids) == GREEDY.max_tokens
    assert outs[1].token_ids == recompute.generate(prompt[:20], GREEDY)[0].token_ids
