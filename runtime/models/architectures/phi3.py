"""Phi-3: Llama's layers with q, k, v stored as one ``qkv_proj`` and gate, up as one ``gate_up_proj``
(the checkpoint map takes them whole); a window when config.json gives one. Rotary scaling llmd lacks
(longrope, the 128k variants') is refused by the config's rope check."""
from ..llama import LlamaForCausalLM
from ..gguf_family import FUSED, GGUFFamily, read_window, write_window
from ..plan import LayerPlan, fused_products
from ..registry import Architecture, register


def plan(raw: dict, bias: bool) -> LayerPlan:
    if bias:
        raise ValueError("Phi-3 has no attention bias; 'attention_bias' must be false")
    return LayerPlan(products=fused_products(), sliding_window=raw.get("sliding_window"))


register(Architecture("Phi3ForCausalLM", "phi3", LlamaForCausalLM, plan,
                      GGUFFamily("phi3", layer=FUSED, read=read_window, write=write_window)))
