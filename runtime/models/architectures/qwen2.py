"""Qwen2: q, k, v always biased (o never); with ``use_sliding_window``, layers from
``max_window_layers`` on slide over the window (or as config.json's ``layer_types`` say)."""
from ..llama import LlamaForCausalLM
from ..gguf_family import GGUFFamily
from ..plan import LayerPlan, layer_kinds, split_products
from ..registry import Architecture, register


def qwen_window(raw: dict):
    """The window when any layer slides (Qwen2, Qwen3), else None."""
    slides = raw.get("use_sliding_window", False) and raw.get("max_window_layers", 28) < raw.get("num_hidden_layers", 0)
    return raw.get("sliding_window") if slides else None


def qwen_layers(raw: dict):
    """Which layers slide: ``layer_types``, else those from ``max_window_layers`` on."""
    layers = raw.get("num_hidden_layers", 0)
    kinds = layer_kinds(raw, layers)
    first = raw.get("max_window_layers", 28)
    if kinds is None and isinstance(first, int) and not isinstance(first, bool):
        kinds = tuple(i >= first for i in range(layers))
    return kinds


def plan(raw: dict, bias: bool) -> LayerPlan:
    return LayerPlan(products=split_products(qkv_bias=True), sliding_window=qwen_window(raw),
                     sliding_layers=qwen_layers(raw))


register(Architecture("Qwen2ForCausalLM", "qwen2", LlamaForCausalLM, plan, GGUFFamily("qwen2")))
