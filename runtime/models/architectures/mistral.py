"""Mistral: Llama's layers, every one sliding over a window (transformers' default, 4096, when
config.json gives none)."""
from ..llama import LlamaForCausalLM
from ..gguf_family import GGUFFamily, read_bias, read_window, write_window
from ..plan import LayerPlan, split_products
from ..registry import Architecture, register


def plan(raw: dict, bias: bool) -> LayerPlan:
    return LayerPlan(products=split_products(qkv_bias=bias), sliding_window=raw.get("sliding_window", 4096))


def read(fam: GGUFFamily, f, cfg: dict) -> None:
    read_bias(fam, f, cfg)
    read_window(fam, f, cfg)


register(Architecture("MistralForCausalLM", "mistral", LlamaForCausalLM, plan,
                      GGUFFamily("mistral", rotary_adjacent=True, read=read, write=write_window)))
