"""Gemma 2: norms before and after attention and the MLP, stored as w for a (1 + w) scale; gelu (tanh);
embeddings scaled by sqrt(hidden); scores scaled by query_pre_attn_scalar ** -0.5 and soft-capped,
logits soft-capped; every other layer slides over a window."""
from ..plan import LayerPlan, layer_kinds, number, split_products
from ..planned import PlannedForCausalLM
from ..registry import Architecture, register


def plan(raw: dict, bias: bool) -> LayerPlan:
    return LayerPlan(products=split_products(qkv_bias=bias, o_bias=bias), norm_kind="rms_one_plus", sandwich=True,
                     activation="gelu_tanh", embed_scale=True,
                     attention_scale=(number(raw, "query_pre_attn_scalar", 256) or 256.0) ** -0.5,
                     attn_softcap=number(raw, "attn_logit_softcapping", 50.0),
                     final_softcap=number(raw, "final_logit_softcapping", 30.0),
                     sliding_window=raw.get("sliding_window", 4096),
                     sliding_layers=layer_kinds(raw, raw.get("num_hidden_layers", 0), every=2))


register(Architecture("Gemma2ForCausalLM", "gemma2", PlannedForCausalLM, plan))
