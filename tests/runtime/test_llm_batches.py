"""The library as a real model needs it: any number of prompts, LLM.chat, and int4/embedding choices
of `llmd export` that fit real widths."""
from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from llmd import LLM, SamplingParams
from llmd.export.cli import ExportOptions, export_engine
from llmd.runtime.formats.quantized import QuantizationError, auto_group_size
from llmd.runtime.models.config import ModelConfig

from modelfactory import CORPUS, make_model_dir

FAST = dict(eval_windows=1, eval_tokens=16)


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("untied") / "m", hidden=96, heads=4, kv_heads=2,
                          intermediate=160, tie=False, seed=5)


def test_more_prompts_than_the_queue_holds_all_complete_in_order(tiny_model_dir):
    prompts = [CORPUS[i % len(CORPUS)][: 8 + i % 17] for i in range(24)]
    params = SamplingParams(max_tokens=3)
    single = LLM(str(tiny_model_dir), kv_memory="16MiB")
    alone = [single.generate([p], params)[0].token_ids for p in prompts[:5]]
    outs = LLM(str(tiny_model_dir), kv_memory="16MiB", max_waiting=4).generate(prompts, params)
    assert len(outs) == 24 and all(o.finish_reason == "length" for o in outs)
    assert [o.token_ids for o in outs[:5]] == alone


@pytest.mark.slow
def test_three_thousand_prompts_do_not_raise(tiny_model_dir):
    outs = LLM(str(tiny_model_dir), kv_memory="16MiB").generate([[1 + i % 50] for i in range(3000)],
                                                               SamplingParams(max_tokens=1))
    assert len(outs) == 3000 and all(len(o.token_ids) == 1 for o in outs)


def test_chat_is_the_template_rendered_prompt(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), kv_memory="16MiB")
    messages = [{"role": "user", "content": "def fib(n):"}]
    params = SamplingParams(max_tokens=6)
    assert llm.chat(messages, params).token_ids == llm.generate([llm.tokenizer.encode_chat(messages)], params)[0].token_ids


def test_int4_group_size_divides_every_width(untied):
    cfg = ModelConfig.from_dir(untied)
    assert auto_group_size([cfg]) == 32
    smollm2 = ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576,
                                     "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                                     "num_key_value_heads": 3})
    assert auto_group_size([smollm2]) == 64
    odd = ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 72,
                                 "intermediate_size": 144, "num_hidden_layers": 1, "num_attention_heads": 2})
    with pytest.raises(QuantizationError):
        auto_group_size([odd])


@pytest.mark.heavy
def test_int4_export_picks_the_group_and_stores_the_embedding_quantized(untied, tmp_path):
    out = tmp_path / "e"
    # random weights: the quality gate would refuse any int4 rounding of them
    export_engine(ExportOptions(str(untied), str(out), quant="int4", accept_loss=True, **FAST))
    spec = json.loads((out / "manifest.json").read_text())["quantization"]
    assert spec["group_size"] == 32 and spec["embed"] == "int8"
    with safe_open(str(out / "target" / "weights.safetensors"), "pt") as f:
        embed = {k: f.get_slice(k).get_dtype() for k in f.keys() if k.startswith("embed_tokens")}
    assert embed and "F32" not in {d for k, d in embed.items() if not k.endswith(("scale", "scales"))}
    assert LLM(str(out), kv_memory="16MiB").generate(["def f"], SamplingParams(max_tokens=4))[0].token_ids
