"""What an architecture adds to the Llama layout in a GGUF file, declared in its own file beside its
layer plan: llama.cpp's architecture name and tensor names (its gguf-py ``MODEL_TENSORS``), the
metadata keys of its options (read into config.json keys, written from the plan), and the way norms
are stored. The GGUF reader (runtime.formats.gguf), the native loader and the writer (bench.to_gguf)
read it from the registry, so a new architecture's GGUF support is in its one file.

The helpers below are the options more than one family stores alike: an attention bias, one window
for every layer, and the sliding-layer pattern, scores' scale and local rotary base of the
sandwich-norm families. ``f`` is a ``runtime.formats.gguf.GGUFFile`` (``get``, ``has``, ``fail``,
``tensor_names``); ``w`` a ``gguf.GGUFWriter``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

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
# q, k, v as one ``attn_qkv`` and gate, up as one ``ffn_up`` (gate rows first), taken whole
FUSED = {**{k: v for k, v in LAYER.items()
            if k not in ("attn_q.weight", "attn_k.weight", "attn_v.weight", "ffn_gate.weight")},
         "attn_qkv.weight": "self_attn.qkv_proj.weight", "ffn_up.weight": "mlp.gate_up_proj.weight"}
# four norms a layer: before and after attention, before and after the MLP
SANDWICH = {**LAYER, "post_attention_norm.weight": "post_attention_layernorm.weight",
            "ffn_norm.weight": "pre_feedforward_layernorm.weight",
            "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
GELU_TANH = {"hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh"}


def _nothing(*_) -> None:
    return None


@dataclass(frozen=True)
class GGUFFamily:
    name: str                                   # general.architecture
    layer: Mapping[str, str] = field(default_factory=lambda: LAYER)   # GGUF name after blk.N. -> checkpoint's
    rotary_adjacent: bool = False               # q and k rows stored with rotary pairs adjacent (2i, 2i + 1)
    norms_plus_one: bool = False                # norms stored as the scale 1 + w where checkpoints hold w
    read: Callable = _nothing                   # (family, f, config dict): adds the config.json keys of its options
    write: Callable = _nothing                  # (w, ModelConfig): writes them

    def config(self, f, cfg: dict) -> None:
        """Add the config.json keys of this family's options, read from GGUFFile ``f``'s metadata."""
        self.read(self, f, cfg)

    def key(self, name: str) -> str:
        return f"{self.name}.{name}"

    def norm_shift(self, checkpoint_name: str) -> float:
        """What the file stores beyond the checkpoint's value: 1 for norms stored as 1 + w, else 0."""
        return 1.0 if self.norms_plus_one and checkpoint_name.endswith("norm.weight") else 0.0


def read_bias(fam: GGUFFamily, f, cfg: dict) -> None:
    """``attention_bias``: the file has q biases."""
    cfg["attention_bias"] = "blk.0.attn_q.bias" in set(f.tensor_names())


def read_window(fam: GGUFFamily, f, cfg: dict) -> None:
    """One window for every layer, or none (0 where a model has no window)."""
    cfg["sliding_window"] = f.get(fam.key("attention.sliding_window"), int, 0) or None


def write_window(w, model) -> None:
    if model.plan.sliding_window is not None:
        w.add_sliding_window(model.plan.sliding_window)


def read_pre_attn_scalar(fam: GGUFFamily, f, cfg: dict, hidden_scaled_layers: int) -> None:
    """``query_pre_attn_scalar`` from ``attention.scale`` where the file has it, else llama.cpp's rule:
    hidden / heads for the size of ``hidden_scaled_layers`` layers (the 27B ones), the head size else."""
    key = fam.key("attention.scale")
    if f.has(key):
        scale = f.get(key, float)
        if not scale > 0:
            f.fail(key, f"must be positive, got {scale}")
        scalar = scale ** -2          # a whole number in real configs, stored as a float32 scale
        cfg["query_pre_attn_scalar"] = round(scalar) if abs(scalar - round(scalar)) < 1e-5 * scalar else scalar
    elif cfg["num_hidden_layers"] == hidden_scaled_layers:
        cfg["query_pre_attn_scalar"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    else:
        cfg["query_pre_attn_scalar"] = cfg["head_dim"]


def read_sliding_layers(fam: GGUFFamily, f, cfg: dict, window: int, period: int) -> None:
    """``sliding_window`` and ``layer_types``: ``attention.sliding_window_pattern`` as one flag per
    layer, or as a period n (layer i slides unless i % n == n - 1; 0: every layer slides), else
    ``period``; a window below 1 makes every layer full."""
    layers = cfg["num_hidden_layers"]
    if window < 1:
        cfg["sliding_window"] = None
        cfg["layer_types"] = ["full_attention"] * layers
        return
    key = fam.key("attention.sliding_window_pattern")
    pattern = f.get(key, (int, list), period)
    if isinstance(pattern, list):
        if len(pattern) != layers or not all(isinstance(p, bool) for p in pattern):
            f.fail(key, f"expected {layers} true/false flags, one per layer")
        slides = list(pattern)
    else:
        if pattern < 0:
            f.fail(key, f"must not be negative, got {pattern}")
        slides = [pattern == 0 or i % pattern < pattern - 1 for i in range(layers)]
    cfg["sliding_window"] = window
    cfg["layer_types"] = ["sliding_attention" if s else "full_attention" for s in slides]


def write_sandwich(w, model) -> None:
    """The sandwich families' options: scores' scale, window and per-layer pattern, caps, local base."""
    plan = model.plan
    if plan.attention_scale is not None:
        w.add_attention_scale(plan.attention_scale)
    w.add_sliding_window(plan.sliding_window or 0)
    w.add_sliding_window_pattern([plan.slides(i) for i in range(model.num_layers)])
    if plan.attn_softcap is not None:
        w.add_attn_logit_softcapping(plan.attn_softcap)
    if plan.final_softcap is not None:
        w.add_final_logit_softcapping(plan.final_softcap)
    if plan.rope_local_theta is not None:
        w.add_rope_freq_base_swa(plan.rope_local_theta)
