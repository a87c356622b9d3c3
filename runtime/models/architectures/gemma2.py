"""Gemma 2: norms before and after attention and the MLP, stored as w for a (1 + w) scale; gelu (tanh);
embeddings scaled by sqrt(hidden); scores scaled by query_pre_attn_scalar ** -0.5 and soft-capped,
logits soft-capped; every other layer slides over a window."""
from ..gguf_family import (GELU_TANH, SANDWICH, GGUFFamily, read_pre_attn_scalar, read_sliding_layers,
                           write_sandwich)
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


def read(fam: GGUFFamily, f, cfg: dict) -> None:
    """One rotary base for every layer; both caps (50 and 30 where the file gives none); every other
    layer slides (4096 where the file gives no window); the 46-layer size scales by hidden / heads."""
    cfg.update(GELU_TANH)
    read_pre_attn_scalar(fam, f, cfg, hidden_scaled_layers=46)
    base, local = cfg["rope_theta"], f.get(fam.key("rope.freq_base_swa"), float, cfg["rope_theta"])
    if local != base:
        f.fail(fam.key("rope.freq_base_swa"), f"a local rotary base ({local}) apart from rope.freq_base ({base}) "
                                              "is not part of gemma2")
    cfg["attn_logit_softcapping"] = f.get(fam.key("attn_logit_softcapping"), float, 50.0)
    cfg["final_logit_softcapping"] = f.get(fam.key("final_logit_softcapping"), float, 30.0)
    read_sliding_layers(fam, f, cfg, f.get(fam.key("attention.sliding_window"), int, 4096), period=2)


# norms stored as 1 + w, as llama.cpp's converter and llmd's writer store them
register(Architecture("Gemma2ForCausalLM", "gemma2", PlannedForCausalLM, plan,
                      GGUFFamily("gemma2", layer=SANDWICH, norms_plus_one=True, read=read, write=write_sandwich)))
