"""Llama, Llama 2 and 3: q, k, v and gate, up stored apart; an ``attention_bias`` biases q, k, v and o."""
from ..llama import LlamaForCausalLM
from ..gguf_family import GGUFFamily, read_bias
from ..plan import LayerPlan, split_products
from ..registry import Architecture, register


def plan(raw: dict, bias: bool) -> LayerPlan:
    return LayerPlan(products=split_products(qkv_bias=bias, o_bias=bias))


register(Architecture("LlamaForCausalLM", "llama", LlamaForCausalLM, plan,
                      GGUFFamily("llama", rotary_adjacent=True, read=read_bias)))
