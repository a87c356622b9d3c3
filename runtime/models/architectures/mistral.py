"""Mistral: Llama's layers, every one sliding over a window (transformers' default, 4096, when
config.json gives none)."""
from ..llama import LlamaForCausalLM
from ..registry import Architecture, Traits, register


def traits(raw: dict, bias: bool) -> Traits:
    return Traits(qkv_bias=bias, sliding_window=raw.get("sliding_window", 4096))


register(Architecture("MistralForCausalLM", "mistral", LlamaForCausalLM, traits))
