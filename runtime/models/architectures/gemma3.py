"""Gemma 3, text only (Gemma3ForCausalLM): Gemma 2's norms, activation and embedding scale, per-head
q/k norms instead of soft-capping, and five sliding layers to each full one, the sliding layers
rotating with a local base (10000) and the full ones with rope_theta and its scaling."""
from ..gguf_family import (GELU_TANH, SANDWICH, GGUFFamily, read_pre_attn_scalar, read_sliding_layers,
                           write_sandwich)
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


def read(fam: GGUFFamily, f, cfg: dict) -> None:
    """The sliding layers' own rotary base (``rope.freq_base_swa``, 10000 where absent); no score cap; a
    logit cap where the file gives one; five sliding layers to each full one, or none without a
    window; the 62-layer size scales by hidden / heads."""
    cfg.update(GELU_TANH)
    read_pre_attn_scalar(fam, f, cfg, hidden_scaled_layers=62)
    cfg["rope_local_base_freq"] = f.get(fam.key("rope.freq_base_swa"), float, 10000.0)
    cfg["attn_logit_softcapping"] = None
    cfg["final_logit_softcapping"] = f.get(fam.key("final_logit_softcapping"), float, 0.0) or None
    read_sliding_layers(fam, f, cfg, f.get(fam.key("attention.sliding_window"), int, 0), period=6)


register(Architecture("Gemma3ForCausalLM", "gemma3_text", PlannedForCausalLM, plan,
                      GGUFFamily("gemma3", layer=SANDWICH, norms_plus_one=True, read=read, write=write_sandwich)))
