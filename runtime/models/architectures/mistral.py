"""Mistral: Llama's layers, every one sliding over a window (transformers' default, 4096, when
config.json gives none)."""
from ..llama import LlamaForCausalLM
from ..plan import LayerPlan, split_products
from ..registry import Architecture, register


def plan(raw: dict, bias: bool) -> LayerPlan:
    return LayerPlan(products=split_products(qkv_bias=bias), sliding_window=raw.get("sliding_window", 4096))


register(Architecture("MistralForCausalLM", "mistral", LlamaForCausalLM, plan))
