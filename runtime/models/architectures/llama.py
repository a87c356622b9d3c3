"""Llama, Llama 2 and 3: an ``attention_bias`` biases q, k, v and o."""
from ..llama import LlamaForCausalLM
from ..registry import Architecture, Traits, register

register(Architecture("LlamaForCausalLM", "llama", LlamaForCausalLM,
                      lambda raw, bias: Traits(qkv_bias=bias, o_proj_bias=bias)))
