"""The cpu backend: llmd's C kernels (llmd.runtime.kernels) for the few-row steps that decoding is
made of, torch's ops for the rest, and the whole step in one kernel call where every part of it has
a kernel form (llmd.runtime.models.fused_decode).

Where the kernels are not built (no compiler, neither AVX-512 VNNI nor AVX2, the ``kernels`` setting off) it is
decided once, when the backend is built: the step runs torch's ops and never asks again.

    norms, silu*mul, rotary   kernels (float32 rows), at every row count
    attention                 kernel, read in place; a prompt chunk of more than 16 rows over more than
                              1536 positions: torch SDPA, at most two groups
    whole step                one call (fused form) where every product's kernel takes the step's rows
                              (up to ``ops.fused_rows()``) and attention is all on the kernel; else the
                              Python forward
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .. import kernels
from ..attention import PagedAttention
from ..kernels import ops
from ..models.fused_decode import FusedDecode
from ..models.layers import TORCH_OPS, RMSNorm, Rotary, TorchOps
from ..models.llama import PairRope
from .base import Execution


class KernelOps(TorchOps):
    """The row operations on llmd's kernels for float32 rows (decode: one call, not five), at every
    row count: torch's rmsnorm and silu round differently, so a prompt of up to 16 rows alone and the
    same prompt in a batch of more rows would get other numbers (and greedy tokens)."""

    @staticmethod
    def rmsnorm(x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        if x.dtype == norm.weight.dtype == torch.float32:
            y = ops.rmsnorm(x, norm.weight, norm.eps)
            if y is not None:
                return y
        return norm(x)

    def add_norm(self, x: torch.Tensor, h: torch.Tensor | None, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        if (h is not None and x.dtype == norm.weight.dtype == torch.float32 and x.dim() == 2
                and (both := ops.add_rmsnorm(x, h, norm.weight, norm.eps)) is not None):
            return both
        return super().add_norm(x, h, norm)

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.dtype == torch.float32 and (h := ops.silu_mul(gate_up)) is not None:
            return h
        return TorchOps.silu_mul(gate_up)


KERNEL_OPS = KernelOps()


@dataclass
class KernelRope:
    """Rotary over adjacent pairs in one kernel call for q and k together (float32 rows without
    q/k norms), else ``PairRope``'s complex multiply."""
    positions: torch.Tensor
    rotary: Rotary

    def rotate(self, attn, qkv: torch.Tensor, ops_: TorchOps):
        if attn.q_norm is None:
            qk = ops.rope_qk(qkv, attn.num_heads, attn.num_kv_heads, attn.head_dim, self.rotary.cos, self.rotary.sin,
                             self.positions)
            if qk is not None:
                v = qkv[:, attn.q_size + attn.kv_size:].unflatten(-1, (attn.num_kv_heads, attn.head_dim))
                return qk[0], qk[1], v
        return PairRope(self.rotary.lookup_cis(self.positions)).rotate(attn, qkv, ops_)


class CpuBackend(Execution):
    name = "cpu"

    def __init__(self, model, attn: PagedAttention):
        super().__init__(model, attn)
        self.kernels = kernels.available()
        self.ops = KERNEL_OPS if self.kernels else TORCH_OPS
        self.fuses = self.kernels and FusedDecode.serves(attn)     # the pools suit the fused calls

    @staticmethod
    def prepare(model) -> None:
        """Kernel layouts, plans timed per shape, rotary on adjacent pairs, the tied head's storage
        and the fused form (LlamaForCausalLM.prepare_for_inference)."""
        model.prepare_for_inference()

    def rope(self, model, positions: torch.Tensor, dtype: torch.dtype):
        if self.kernels and model._interleaved and dtype == torch.float32:
            return KernelRope(positions, model.rotary)
        return model.rope(positions, dtype)

    def forward(self, batch) -> torch.Tensor:
        """The fused call (the model's prepared fused form, ``model.fused_decode``) where it serves
        this step, else the Python forward from the same embedded rows."""
        model = self.model
        x = model.embed(batch.input_ids)
        fused = model.fused_decode if self.fuses else None
        if fused is not None and (h := fused(x, batch.positions, self.attn)) is not None:
            return h
        return model.forward_hidden(x, batch.positions, self)

    def greedy(self, logits: torch.Tensor) -> torch.Tensor:
        return ops.argmax(logits)

    def greedy_rounds(self, runner, feeds: list[list[int]], positions: list[int], block_ids: list[list[int]],
                      steps: int) -> Optional[list[list[int]]]:
        fused = self.model.fused_decode if self.fuses else None
        return None if fused is None else fused.draft_greedy(runner, feeds, positions, block_ids, steps)
