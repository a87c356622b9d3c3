"""Qwen3: Qwen2's window rule, a per-head RMSNorm on q and k before rotary, and an
``attention_bias`` that biases q, k, v and o."""
from ..llama import LlamaForCausalLM
from ..gguf_family import GGUFFamily
from ..plan import LayerPlan, split_products
from ..registry import Architecture, register
from .qwen2 import qwen_layers, qwen_window


def plan(raw: dict, bias: bool) -> LayerPlan:
    return LayerPlan(products=split_products(qkv_bias=bias, o_bias=bias), qk_norm=True,
                     sliding_window=qwen_window(raw), sliding_layers=qwen_layers(raw))


register(Architecture("Qwen3ForCausalLM", "qwen3", LlamaForCausalLM, plan, GGUFFamily("qwen3")))
