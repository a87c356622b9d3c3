"""The Llama-family decoder (Llama, Llama 3, Mistral, Qwen2, Qwen3) in PyTorch: what a step computes.

Two ways to run it:
- ``forward(input_ids [T], positions [T], step)``: the serving path. All requests of a step are packed
  into one token axis; ``step`` comes from the execution backend (llmd.runtime.execution) and says
  how: ``step.attend`` writes each layer's new keys/values into the paged pool and attends over it,
  ``step.rope`` gives the step's rotary form and ``step.ops`` its norms and activation.
- ``forward_dense(input_ids [B, T])``: plain causal attention over a batch, in plain torch, for
  training and references.

q/k/v and gate/up are fused into one projection each; the loader maps checkpoint names onto slices.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


from .config import ModelConfig
from .fused_decode import FusedDecode
from .layers import TORCH_OPS, Linear, RMSNorm, Rotary, TorchOps, apply_rotary
from .plan_attention import layer_attention


@dataclass
class HalfRope:
    """Rotary over rotate-half pairs (i, i + d/2), the checkpoint layout: cos and sin per row."""
    cos: torch.Tensor
    sin: torch.Tensor

    def rotate(self, attn: "Attention", qkv: torch.Tensor, ops: TorchOps):
        q, k, v = split_heads(attn, qkv, ops)
        return apply_rotary(q, self.cos, self.sin), apply_rotary(k, self.cos, self.sin), v


def split_heads(attn: "Attention", qkv: torch.Tensor, ops: TorchOps):
    """q, k, v [..., T, heads, D] of a qkv product, q and k normed where the layer has q/k norms."""
    q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    q = q.unflatten(-1, (attn.num_heads, attn.head_dim))
    k = k.unflatten(-1, (attn.num_kv_heads, attn.head_dim))
    v = v.unflatten(-1, (attn.num_kv_heads, attn.head_dim))
    if attn.q_norm is not None:
        q, k = ops.rmsnorm(q, attn.q_norm), ops.rmsnorm(k, attn.k_norm)
    return q, k, v


@dataclass
class PairRope:
    """Rotary over adjacent pairs (2i, 2i + 1), the prepared layout (``interleave_rope``): one complex
    multiply over q and k together, cis [T, 1, D/2]."""
    cis: torch.Tensor

    def rotate(self, attn: "Attention", qkv: torch.Tensor, ops: TorchOps):
        """qkv [..., T, F] (packed rows, or a dense batch)."""
        d, h = attn.head_dim, attn.num_heads
        qk = qkv[..., :attn.q_size + attn.kv_size].unflatten(-1, (h + attn.num_kv_heads, d))
        v = qkv[..., attn.q_size + attn.kv_size:].unflatten(-1, (attn.num_kv_heads, d))
        if attn.q_norm is not None:
            qk = torch.cat([ops.rmsnorm(qk[..., :h, :], attn.q_norm), ops.rmsnorm(qk[..., h:, :], attn.k_norm)], dim=-2)
        rot = torch.view_as_real(torch.view_as_complex(qk.float().reshape(*qk.shape[:-1], d // 2, 2)) * self.cis)
        rot = rot.reshape(qk.shape).to(qkv.dtype)
        return rot[..., :h, :], rot[..., h:, :], v


def causal_attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Dense causal attention of a batch from position 0: q [B, T, H, D] -> [B, T, H, D]."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=True, enable_gqa=True)
    return out.transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.qkv_proj = Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.interleaved = False      # see interleave_rope()

    def can_interleave(self) -> bool:
        return hasattr(self.qkv_proj, "permute_outputs")

    def interleave_rope(self) -> bool:
        """Reorder each q/k head's dimensions from rotate-half pairs (i, i + d/2) to adjacent pairs
        (2i, 2i + 1), so that rotary embedding becomes one complex multiply (or one kernel call) over
        q and k together. Scores are unchanged: q and k get the same permutation, v and o_proj are
        untouched. Works on plain and quantized projections alike (output rows are permuted whole,
        with their scales), before their kernel forms are built."""
        if not self.can_interleave():
            return False
        d = self.head_dim
        perm = torch.stack([torch.arange(d // 2), torch.arange(d // 2) + d // 2], dim=-1).flatten()
        heads = self.num_heads + self.num_kv_heads
        rows = (torch.arange(heads).unsqueeze(1) * d + perm).flatten()
        rows = torch.cat([rows, torch.arange(heads * d, self.qkv_proj.out_features)])
        with torch.no_grad():
            self.qkv_proj.permute_outputs(rows)
            for norm in (self.q_norm, self.k_norm):
                if norm is not None:
                    norm.weight.copy_(norm.weight[perm])
        self.interleaved = True
        return True

    def project(self, x: torch.Tensor, rope, ops: TorchOps = TORCH_OPS):
        """q, k (rotated, as ``rope`` says) and v of x [..., T, hidden]: [..., T, heads, D] each."""
        return rope.rotate(self, self.qkv_proj(x), ops)

    def forward(self, x, rope, attend, ops: TorchOps) -> torch.Tensor:
        q, k, v = self.project(x, rope, ops)
        return self.o_proj(attend(self.layer_idx, q, k, v).flatten(-2))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor, ops: TorchOps = TORCH_OPS) -> torch.Tensor:
        return self.down_proj(ops.silu_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, rope, attend, ops: TorchOps, pending=None) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (residual stream, this layer's MLP output): the caller adds the latter with the next
        norm (``add_norm``), so that decode rows take one call for each add and norm."""
        x, h = ops.add_norm(x, pending, self.input_layernorm)
        x, h = ops.add_norm(x, self.self_attn(h, rope, attend, ops), self.post_attention_layernorm)
        return x, self.mlp(h, ops)


def materialize(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``module`` (built on the meta device) with uninitialised parameters in ``dtype`` on the CPU. Not
    to_empty(): its empty_like on meta is an op through torch's Python reference code."""
    for m in module.modules():
        for name, p in m._parameters.items():
            if p is not None:
                m._parameters[name] = nn.Parameter(torch.empty(p.shape, dtype=dtype), p.requires_grad)
    return module


class LlamaForCausalLM(nn.Module):
    interleaves = True        # prepared weights rotate adjacent pairs (the kernel rotary, the fused step)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        # built around an empty weight: nn.Embedding's random init is wasted on weights a checkpoint
        # overwrites, and on the meta device (see ``empty``) it would run a Python-level op
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size)
        with torch.device("cpu"):      # float32 tables, computed even when built on meta (``empty``)
            self.rotary = Rotary(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.windows = cfg.plan.windows(cfg.num_layers)       # each layer's window, None where it sees all
        self._tied_head: Linear | None = None      # the tied embedding, once prepared (see below)
        self._interleaved = False
        self.fused_decode: FusedDecode | None = None   # every layer in one kernel call, once prepared
        self.head_screen = None     # greedy rows' tokens from a screen of a quantized head (formats.head_screen)

    @classmethod
    def empty(cls, cfg: ModelConfig, dtype: torch.dtype) -> "LlamaForCausalLM":
        """The model with uninitialised weights in ``dtype`` on the CPU and float32 rotary tables: what
        a loader fills. Built on the meta device without running an op there: ops on meta go through
        torch's Python reference code, whose first use imports torch._dynamo (1.3 s of every load)."""
        with torch.device("meta"):
            model = cls(cfg)
        return materialize(model, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, step) -> torch.Tensor:
        """Packed tokens [T] -> final hidden states [T, hidden], run as the execution backend's
        ``step`` says (llmd.runtime.execution.base)."""
        return self.forward_hidden(self.embed(input_ids), positions, step)

    def forward_hidden(self, x: torch.Tensor, positions: torch.Tensor, step) -> torch.Tensor:
        """Embedded rows [T, hidden] -> final hidden states [T, hidden]."""
        return self._layers(x, step.rope(self, positions, x.dtype), step.attend, step.ops)

    def forward_dense(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, T] -> logits [B, T, vocab], plain causal attention from position 0."""
        x = self.embed(input_ids)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        return self.compute_logits(self._layers(x, self.rope(positions, x.dtype), causal_attention, TORCH_OPS))

    @property
    def rotary_pairs_adjacent(self) -> bool:
        """Do the keys written to the KV pool pair adjacent dimensions (prepared weights)?"""
        return self._interleaved

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        """The rotary form of these positions for the weights' layout, in plain torch."""
        if self._interleaved:           # prepared weights rotate adjacent pairs
            return PairRope(self.rotary.lookup_cis(positions))
        return HalfRope(*self.rotary.lookup(positions, dtype))

    def _layers(self, x, rope, attend, ops: TorchOps) -> torch.Tensor:
        """Every decoder layer, then the final norm; each layer's MLP output is added with the next
        norm (``add_norm``). ``attend`` takes the plan's windows and soft-cap (plan_attention)."""
        plan = self.config.plan
        attend = layer_attention(attend, self.windows, plan.attn_softcap,
                                 plan.attention_scale or self.config.head_dim ** -0.5)
        pending = None
        for layer in self.layers:
            x, pending = layer(x, rope, attend, ops, pending)
        return ops.add_norm(x, pending, self.norm)[1]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self._tied_head is not None:       # tied and prepared: rows live in the head's storage
            return self._tied_head.rows(input_ids.reshape(-1)).reshape(*input_ids.shape, -1)
        return self.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._tied_head is not None:
            return self._tied_head(hidden)
        if self.lm_head is not None:
            return self.lm_head(hidden)
        return F.linear(hidden, self.embed_tokens.weight)

    def prepare_for_inference(self) -> None:
        """Switch linear layers to their faster storage. A tied head is the largest matrix of a small
        model: it becomes a Linear with its own plan (its storage for products), and the
        embedding looks its rows up in that storage: no second copy."""
        self.requires_grad_(False)
        if self.interleaves and all(layer.self_attn.can_interleave() for layer in self.layers):
            self._interleaved = all([layer.self_attn.interleave_rope() for layer in self.layers])
        for m in self.modules():
            if isinstance(m, Linear) and m.weight is not None:
                m.prepare()
        if self.lm_head is None:
            head = Linear(self.config.hidden_size, self.config.vocab_size)
            head.weight = nn.Parameter(self.embed_tokens.weight.detach(), requires_grad=False)
            head.prepare()
            self.embed_tokens.weight = None
            object.__setattr__(self, "_tied_head", head)    # not a submodule: its tensor is embed_tokens
        self.fused_decode = FusedDecode.build(self)
