"""Qwen2: q, k, v always biased (o never); layers from ``max_window_layers`` on slide over the
window only with ``use_sliding_window``."""
from ..llama import LlamaForCausalLM
from ..plan import LayerPlan, split_products
from ..registry import Architecture, register


def qwen_window(raw: dict):
    """The window when any layer slides (Qwen2, Qwen3), else None."""
    slides = raw.get("use_sliding_window", False) and raw.get("max_window_layers", 28) < raw.get("num_hidden_layers", 0)
    return raw.get("sliding_window") if slides else None


def plan(raw: dict, bias: bool) -> LayerPlan:
    return LayerPlan(products=split_products(qkv_bias=True), sliding_window=qwen_window(raw))


register(Architecture("Qwen2ForCausalLM", "qwen2", LlamaForCausalLM, plan))
