"""What each GGUF architecture llmd reads and writes adds to the Llama layout: llama.cpp's tensor names
(its gguf-py ``MODEL_TENSORS``), the metadata keys of its options, and the way norms are stored.

- phi3: q, k, v as one ``attn_qkv`` and gate, up as one ``ffn_up`` (gate rows first), both taken whole
  by the plan's fused products; rotary halves, as checkpoints store them.
- gemma2, gemma3: four norms a layer (``attn_norm``, ``post_attention_norm`` after attention,
  ``ffn_norm`` before the MLP, ``post_ffw_norm`` after it), stored as the scale 1 + w where checkpoints
  store w: llama.cpp's converter adds 1, llmd's writer does too, and the reader takes 1 away again on
  import. ``attention.sliding_window`` and ``attention.sliding_window_pattern`` (a period, or one flag
  per layer) say which layers slide; ``rope.freq_base_swa`` is gemma3's local rotary base;
  ``attn_logit_softcapping`` and ``final_logit_softcapping`` the caps; ``attention.scale`` the scores'
  scale where the writer knows it (else llama.cpp's rule: 1/sqrt(hidden / heads) for the 27B sizes,
  1/sqrt(head size) otherwise).
"""
from __future__ import annotations

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
                 "gemma3": "Gemma3ForCausalLM"}
MODEL_TYPES = {"gemma3": "gemma3_text"}           # config.json's model_type where it is not the GGUF name
ROTARY_ADJACENT = ("llama", "mistral")            # q and k rows stored with rotary pairs adjacent
GEMMA = ("gemma2", "gemma3")
NORMS_STORED_PLUS_ONE = GEMMA
GEMMA_PATTERN = {"gemma2": 2, "gemma3": 6}         # llama.cpp's default: every n-th layer is full
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}    # the sizes whose scale is 1/sqrt(hidden / heads)

TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
       "output.weight": "lm_head.weight"}
LAYER = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
         "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
         "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
         "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
         "attn_v.bias": "self_attn.v_proj.bias", "attn_output.bias": "self_attn.o_proj.bias",
         "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
         "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
         "ffn_down.weight": "mlp.down_proj.weight"}
FUSED = {"attn_qkv.weight": "self_attn.qkv_proj.weight", "ffn_up.weight": "mlp.gate_up_proj.weight"}
SANDWICH = {"attn_norm.weight": "input_layernorm.weight", "post_attention_norm.weight": "post_attention_layernorm.weight",
            "ffn_norm.weight": "pre_feedforward_layernorm.weight",
            "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
FUSED_ONLY = {"phi3": ("attn_q.weight", "attn_k.weight", "attn_v.weight", "ffn_gate.weight")}


def layer_names(arch: str) -> dict[str, str]:
    """GGUF layer tensor name (after ``blk.N.``) -> checkpoint name (after ``model.layers.N.``)."""
    names = {k: v for k, v in LAYER.items() if k not in FUSED_ONLY.get(arch, ())}
    if arch == "phi3":
        names.update(FUSED)
    if arch in GEMMA:
        names.update(SANDWICH)
    return names


def norm_shift(arch: str, checkpoint_name: str) -> float:
    """What the GGUF stores beyond the checkpoint's value: 1 for Gemma norms (stored 1 + w), else 0."""
    return 1.0 if arch in NORMS_STORED_PLUS_ONE and checkpoint_name.endswith("norm.weight") else 0.0


def family_config(f, arch: str, cfg: dict) -> dict:
    """The config.json keys of ``arch``'s options, from the metadata of GGUFFile ``f``."""
    a = f"{arch}."
    names = set(f.tensor_names())
    if arch in ("llama", "mistral"):
        cfg["attention_bias"] = "blk.0.attn_q.bias" in names
    if arch in ("mistral", "phi3"):        # phi3 writes 0 where a model has no window
        cfg["sliding_window"] = f.get(a + "attention.sliding_window", int, 0) or None
    if arch in GEMMA:
        cfg.update(_gemma(f, arch, cfg))
    return cfg


def _gemma(f, arch: str, cfg: dict) -> dict:
    a = f"{arch}."
    layers = cfg["num_hidden_layers"]
    out = {"hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh"}
    if f.has(a + "attention.scale"):
        scale = f.get(a + "attention.scale", float)
        if not scale > 0:
            f.fail(a + "attention.scale", f"must be positive, got {scale}")
        scalar = scale ** -2          # a whole number in Gemma configs, stored as a float32 scale
        out["query_pre_attn_scalar"] = round(scalar) if abs(scalar - round(scalar)) < 1e-5 * scalar else scalar
    elif layers == GEMMA_27B_LAYERS[arch]:
        out["query_pre_attn_scalar"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    else:
        out["query_pre_attn_scalar"] = cfg["head_dim"]
    base = cfg["rope_theta"]
    local = f.get(a + "rope.freq_base_swa", float, base if arch == "gemma2" else 10000.0)
    if arch == "gemma2":
        if local != base:
            f.fail(a + "rope.freq_base_swa", f"a local rotary base ({local}) apart from rope.freq_base ({base}) "
                                              "is not part of gemma2")
        out["attn_logit_softcapping"] = f.get(a + "attn_logit_softcapping", float, 50.0)
        out["final_logit_softcapping"] = f.get(a + "final_logit_softcapping", float, 30.0)
        window = f.get(a + "attention.sliding_window", int, 4096)
    else:
        out["rope_local_base_freq"] = local
        out["attn_logit_softcapping"] = None
        out["final_logit_softcapping"] = f.get(a + "final_logit_softcapping", float, 0.0) or None
        window = f.get(a + "attention.sliding_window", int, 0)
    if window < 1:                                   # gemma3 without a window: every layer is full
        out["sliding_window"] = None
        out["layer_types"] = ["full_attention"] * layers
        return out
    out["sliding_window"] = window
    out["layer_types"] = ["sliding_attention" if s else "full_attention" for s in _swa_layers(f, arch, layers)]
    return out


def _swa_layers(f, arch: str, layers: int) -> list[bool]:
    """Which layers slide: ``attention.sliding_window_pattern`` as one flag per layer, or as a period n
    (layer i slides unless i % n == n - 1; 0: every layer slides), else the architecture's period."""
    key = f"{arch}.attention.sliding_window_pattern"
    pattern = f.get(key, (int, list), GEMMA_PATTERN[arch])
    if isinstance(pattern, list):
        if len(pattern) != layers or not all(isinstance(p, bool) for p in pattern):
            f.fail(key, f"expected {layers} true/false flags, one per layer")
        return list(pattern)
    if pattern < 0:
        f.fail(key, f"must not be negative, got {pattern}")
    return [pattern == 0 or i % pattern < pattern - 1 for i in range(layers)]
