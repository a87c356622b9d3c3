"""Architectures resolve through the registry: by ``architectures``, else ``model_type``, with the
traits each family fixes; a new one is a registration away from running end to end."""
import json

import pytest

from llmd import LLM, SamplingParams
from llmd.runtime.errors import ModelLoadError
from llmd.runtime.models import registry
from llmd.runtime.models.config import ModelConfig
from llmd.runtime.models.llama import LlamaForCausalLM
from llmd.runtime.models.random_model import hf_config


def config(arch: str, **extra) -> ModelConfig:
    return ModelConfig.from_dict(hf_config("tiny", architectures=[arch], **extra))


def test_the_families_are_registered_with_their_traits():
    assert registry.supported() == ["Gemma2ForCausalLM", "Gemma3ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM",
                                    "Phi3ForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
    llama, biased = config("LlamaForCausalLM"), config("LlamaForCausalLM", attention_bias=True)
    assert (llama.family, llama.attention_bias, llama.o_proj_bias, llama.qk_norm) == ("llama", False, False, False)
    assert biased.attention_bias and biased.o_proj_bias
    qwen2 = config("Qwen2ForCausalLM")
    assert qwen2.attention_bias and not qwen2.o_proj_bias and not qwen2.qk_norm       # q, k, v biased always
    qwen3 = config("Qwen3ForCausalLM", attention_bias=True)
    assert qwen3.qk_norm and qwen3.o_proj_bias
    # Mistral slides every layer (over 4096 when config.json gives no window); the context is not capped
    mistral = config("MistralForCausalLM", max_position_embeddings=32768)
    assert mistral.max_position_embeddings == 32768 and mistral.window_cap == 4096
    assert config("MistralForCausalLM", sliding_window=1024).window_cap == 1024
    # Qwen2 slides only with use_sliding_window, and only the layers from max_window_layers on
    assert config("Qwen2ForCausalLM", sliding_window=1024).window_cap is None
    qwen2 = config("Qwen2ForCausalLM", sliding_window=1024, use_sliding_window=True, max_window_layers=2)
    assert qwen2.window_cap == 1024 and qwen2.max_position_embeddings == 4096
    assert qwen2.plan.windows(qwen2.num_layers)[:3] == (None, None, 1024)


def test_model_type_resolves_only_where_no_architecture_is_listed():
    raw = hf_config("tiny")
    del raw["architectures"]
    assert ModelConfig.from_dict({**raw, "model_type": "qwen2"}).architecture == "Qwen2ForCausalLM"
    with pytest.raises(ModelLoadError, match=r"unsupported architecture \['LlamaForSequenceClassification'\]"):
        ModelConfig.from_dict({**raw, "architectures": ["LlamaForSequenceClassification"], "model_type": "llama"})
    with pytest.raises(ModelLoadError, match="unsupported architecture 'gpt2'; llmd supports"):
        ModelConfig.from_dict({**raw, "model_type": "gpt2"})


def test_a_name_is_registered_once():
    llama = registry.get("LlamaForCausalLM")
    assert registry.register(llama) is llama            # the same record again is harmless
    with pytest.raises(ValueError, match="already registered"):
        registry.register(registry.Architecture("LlamaForCausalLM", "other", LlamaForCausalLM, llama.traits))


def test_a_new_architecture_runs_once_registered(model_factory, monkeypatch):
    """A family registered from outside (here: Qwen2's traits under a new name) loads and generates the
    tokens its twin under a registered name does."""
    toy = registry.Architecture("ToyForCausalLM", "toy", LlamaForCausalLM,
                                lambda raw, bias: registry.Traits(qkv_bias=True))
    monkeypatch.setitem(registry._BY_NAME, toy.name, toy)
    monkeypatch.setitem(registry._BY_TYPE, toy.model_type, toy)
    path = model_factory("toy", architecture="ToyForCausalLM")
    assert ModelConfig.from_dir(path).architecture == "ToyForCausalLM"
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    toy_tokens = LLM(str(path), kv_memory="4MiB").generate([[5, 6, 7, 8]], params)[0].token_ids
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}))
    assert LLM(str(path), kv_memory="4MiB").generate([[5, 6, 7, 8]], params)[0].token_ids == toy_tokens
