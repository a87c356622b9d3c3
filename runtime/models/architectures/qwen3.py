"""Qwen3: Qwen2's window rule, a per-head RMSNorm on q and k before rotary, and an
``attention_bias`` that biases q, k, v and o."""
from ..llama import LlamaForCausalLM
from ..registry import Architecture, Traits, register
from .qwen2 import qwen_window

register(Architecture("Qwen3ForCausalLM", "qwen3", LlamaForCausalLM,
                      lambda raw, bias: Traits(qkv_bias=bias, o_proj_bias=bias, qk_norm=True,
                                               sliding_window=qwen_window(raw))))
