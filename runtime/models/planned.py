"""The decoder for plans beyond the Llama family's (llmd.runtime.models.plan): norms around attention
and the MLP as well as before them, a gelu activation, a local rotary base for sliding layers, an
attention scale of its own, soft-capped attention scores and logits, scaled embeddings.

It reuses the Llama modules (products, norms, rotary tables) and computes the rest in torch; the fused
step and the kernel rotary, which compute the Llama plan only, step aside (``prepare_for_inference``
says so in the log). Norms whose checkpoints store w for a (1 + w) scale hold the scale itself
(the loader adds 1), so every norm computes alike on every backend.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig, RopeScaling
from .layers import TORCH_OPS, Linear, RMSNorm, Rotary, TorchOps, apply_rotary
from .llama import Attention, LlamaForCausalLM, split_heads

log = logging.getLogger("llmd.models")


@dataclass
class LayerRope:
    """Rotary over rotate-half pairs with each layer's own tables (local or global base), q/k norms,
    and q scaled so that attention's 1/sqrt(head_dim) gives the plan's scale."""
    tables: tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]   # (global, local)
    local: tuple[bool, ...]
    q_scale: float

    def rotate(self, attn: Attention, qkv: torch.Tensor, ops: TorchOps):
        q, k, v = split_heads(attn, qkv, ops)
        cos, sin = self.tables[self.local[attn.layer_idx]]
        q = apply_rotary(q, cos, sin)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        return q, apply_rotary(k, cos, sin), v


class PlannedMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.gelu = cfg.plan.activation == "gelu_tanh"

    def forward(self, x: torch.Tensor, ops: TorchOps = TORCH_OPS) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if not self.gelu:
            return self.down_proj(ops.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class PlannedLayer(nn.Module):
    """A decoder layer with the plan's norms: before attention and the MLP, and with ``sandwich``
    after each as well (their outputs normed before the residual add)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = PlannedMLP(cfg)
        self.sandwich = cfg.plan.sandwich
        self.norm_before = cfg.plan.norm_before()     # (norm, product) pairs: column equalization reads them
        for name in cfg.plan.layer_norms():
            setattr(self, name, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps))

    def forward(self, x, rope, attend, ops: TorchOps, pending=None) -> tuple[torch.Tensor, torch.Tensor]:
        x, h = ops.add_norm(x, pending, self.input_layernorm)
        a = self.self_attn(h, rope, attend, ops)
        if not self.sandwich:
            x, h = ops.add_norm(x, a, self.post_attention_layernorm)
            return x, self.mlp(h, ops)
        x, h = ops.add_norm(x, ops.rmsnorm(a, self.post_attention_layernorm), self.pre_feedforward_layernorm)
        return x, ops.rmsnorm(self.mlp(h, ops), self.post_feedforward_layernorm)


class PlannedForCausalLM(LlamaForCausalLM):
    interleaves = False       # its rotary runs per layer on rotate-half pairs (LayerRope)

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        plan = cfg.plan
        self.layers = nn.ModuleList(PlannedLayer(cfg, i) for i in range(cfg.num_layers))
        self.local = tuple(plan.rope_local_theta is not None and plan.slides(i) for i in range(cfg.num_layers))
        with torch.device("cpu"):
            theta = plan.rope_local_theta or cfg.rope_theta
            self.local_rotary = Rotary(cfg.head_dim, cfg.max_position_embeddings, theta, RopeScaling())
        scale = plan.attention_scale
        # with soft-capping the scale is applied with the cap (plan_attention); else folded into q
        self.q_scale = 1.0 if scale is None or plan.attn_softcap else scale * math.sqrt(cfg.head_dim)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = super().embed(input_ids)
        if self.config.plan.embed_scale:
            x = x * torch.tensor(self.config.hidden_size ** 0.5, dtype=x.dtype)
        return x

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> LayerRope:
        tables = (self.rotary.lookup(positions, dtype), self.local_rotary.lookup(positions, dtype))
        return LayerRope(tables, self.local, self.q_scale)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.config.plan.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def prepare_for_inference(self) -> None:
        super().prepare_for_inference()
        log.info("%s runs llmd's torch path: the fused step and kernel rotary do not compute %s yet",
                 self.config.architecture, ", ".join(self.config.plan.features()))
