"""Gemma 3, text only (Gemma3ForCausalLM): Gemma 2's norms, activation and embedding scale, per-head
q/k norms instead of soft-capping, and five sliding layers to each full one, the sliding layers
rotating with a local base (10000) and the full ones with rope_theta and its scaling."""
from ..plan import LayerPlan, layer_kinds, number, split_products
from ..planned import PlannedForCausalLM
from ..registry import Architecture, register


def local_theta(raw: dict) -> float:
    """The sliding layers' rotary base: ``rope_parameters.sliding_attention``, else ``rope_local_base_freq``."""
    local = (raw.get("rope_parameters") or {}).get("sliding_attention")
    if isinstance(local, dict):
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"sliding layers' rope type {local.get('rope_type')!r} is not supported (only default)")
        return number(local, "rope_theta", 10000.0)
    return number(raw, "rope_local_base_freq", 10000.0)


def plan(raw: dict, bias: bool) -> LayerPlan:
    return LayerPlan(products=split_products(qkv_bias=bias, o_bias=bias), norm_kind="rms_one_plus", sandwich=True,
                     activation="gelu_tanh", embed_scale=True, qk_norm=True, rope_local_theta=local_theta(raw),
                     attention_scale=(number(raw, "query_pre_attn_scalar", 256) or 256.0) ** -0.5,
                     attn_softcap=number(raw, "attn_logit_softcapping", None),
                     final_softcap=number(raw, "final_logit_softcapping", None),
                     sliding_window=raw.get("sliding_window", 4096),
                     sliding_layers=layer_kinds(raw, raw.get("num_hidden_layers", 0),
                                                every=raw.get("sliding_window_pattern", 6)))


register(Architecture("Gemma3ForCausalLM", "gemma3_text", PlannedForCausalLM, plan))
