"""Building blocks shared by the Llama-family models: linear, RMSNorm, rotary embedding."""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn

from llmd.runtime import kernels
from llmd.runtime.kernels import ops

from .config import RopeScaling


class Linear(nn.Module):
    """y = x W^T + b, with W stored [out, in] as in checkpoints.

    ``prepare()`` stores the weight as its plan says (``matvec_plan``, a rule on the shape):
    - a few rows (decode): a matrix-vector product bound by memory bandwidth. Where llmd's kernels
      run (llmd.runtime.kernels), the weight is stored in blocks of 64 output columns that each
      thread streams front to back, kept in bfloat16 when every value is one (a bfloat16 checkpoint:
      half the bytes, the same float32 products). Otherwise torch's own kernel, which streams the
      weight from one core, is split in ``threads`` parts run as one ``bmm`` over views of the weight;
    - more rows (prompt chunks, batches, verification): the blocks again, on the same kernel, so each
      row is summed in one order at every row count (a request's output does not depend on its
      batch or its prompt's chunks); bfloat16 blocks past ``ops.bf16_amx_rows()`` rows on AMX's tile
      unit where the CPU has it (its own order). Weights outside the blocked layout get a second
      copy in oneDNN's layout, whose kernel beats the default one there.
    Quantized variants replace this module as a whole (see llmd.runtime.formats.quantized).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.stored: torch.Tensor | None = None     # the weight in the plan's layout, once prepared
        self.packed: torch.Tensor | None = None
        self.plan = MatvecPlan()

    def prepare(self) -> None:
        self.apply_plan(matvec_plan(self.in_features, self.out_features, self.weight.dtype, torch.get_num_threads()))

    def apply_plan(self, plan: MatvecPlan) -> None:
        """Store the weight as ``plan`` says (from the [out, in] checkpoint layout)."""
        w = self.dense_weight().detach()
        self.plan = plan
        if plan.layout == "out_in":
            self.stored = None
            self.weight = nn.Parameter(w, requires_grad=False) if self.weight is None else self.weight
        else:
            self.stored = store(w, plan.layout)
            self.weight = None
        self.packed = pack_weight(w) if self.wants_packed() else None

    def wants_packed(self) -> bool:
        """The plan's oneDNN copy, unless the kernel takes all rows of these blocks itself."""
        return plan_packs(self.plan, self.stored)

    def __getstate__(self):
        """oneDNN's packed copy is opaque (it cannot be copied): a copy of the layer packs its own."""
        return {**super().__getstate__(), "packed": None}

    def __setstate__(self, state):
        super().__setstate__(state)
        if self.wants_packed():
            self.packed = pack_weight(self.dense_weight().detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight if self.stored is None else self.stored
        return planned_product(x, w, self.packed, self.plan, self.bias)

    def kernel_product(self) -> ops.KernelProduct | None:
        """The weight as the fused step reads it: blocked float32 or bfloat16 values on llmd's kernel
        (for as many rows as the plan sends there), else None."""
        if self.plan.layout != "blocked" or self.stored is None:
            return None
        # planned_product: more rows than the split takes go to the packed copy, or without one to the
        # kernel again
        most = self.plan.split_max_rows
        if self.packed is None:
            most = max(most, ops.block_rows(self.stored))
        return ops.KernelProduct.blocks(self.stored, most)

    def permute_outputs(self, rows: torch.Tensor) -> None:
        """Reorder the output features (before ``prepare()``): output i becomes old output rows[i]."""
        with torch.no_grad():
            self.weight.copy_(self.weight[rows])
            if self.bias is not None:
                self.bias.copy_(self.bias[rows])

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the [out, in] weight (an embedding lookup in a tied head), any storage."""
        if self.stored is None:
            return self.weight.index_select(0, ids)
        if self.plan.layout == "in_out":
            return self.stored.index_select(1, ids).t()
        return self.stored[ids // 64, :, ids % 64].float()      # bfloat16 blocks hold exact float32 values

    def dense_weight(self) -> torch.Tensor:
        """The [out, in] weight, whichever storage is active."""
        return self.weight if self.stored is None else unstore(self.stored, self.plan.layout)


@dataclass(frozen=True)
class MatvecPlan:
    """How one weight shape is stored and multiplied. ``layout``: "out_in" (as in checkpoints),
    "in_out" (transposed copy) or "blocked" (llmd's float32 kernel: [out/64, in, 64]). Products of at
    most ``split_max_rows`` rows run in ``splits`` parts (the kernel for "blocked"); more rows go to
    one matmul over the oneDNN-packed copy when ``packed``, else the plain one."""
    layout: str = "out_in"
    splits: int = 1
    split_max_rows: int = 0
    packed: bool = False


def plan_packs(plan: MatvecPlan, stored: torch.Tensor | None) -> bool:
    """Whether a weight stored by ``plan`` (``stored``: its blocks, or None) gets oneDNN's copy for
    products of more than ``plan.split_max_rows`` rows: not where llmd's kernel takes those itself."""
    if not plan.packed:
        return False
    if plan.layout != "blocked" or stored is None:
        return True
    return ops.block_rows(stored) <= plan.split_max_rows


def can_pack(dtype: torch.dtype) -> bool:
    return (dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def store(w: torch.Tensor, layout: str) -> torch.Tensor:
    """The [out, in] weight in ``layout``."""
    if layout == "out_in":
        return w
    return w.t().contiguous() if layout == "in_out" else ops.f32_blocks(w)


def unstore(stored: torch.Tensor, layout: str) -> torch.Tensor:
    """The [out, in] weight (a view where possible) from its stored ``layout``."""
    if layout == "out_in":
        return stored
    return stored.t() if layout == "in_out" else ops.f32_unblock(stored)


def can_block(in_features: int, out_features: int, dtype: torch.dtype) -> bool:
    """llmd's float32 kernel can serve this shape (and a packed copy can serve many rows)."""
    return dtype == torch.float32 and out_features % 64 == 0 and can_pack(dtype) and kernels.available()


def pack_weight(w: torch.Tensor) -> torch.Tensor:
    """The [out, in] weight in oneDNN's blocked layout, tuned for products of about 128 rows."""
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), 128)


def planned_product(x: torch.Tensor, w: torch.Tensor, packed: torch.Tensor | None, plan: MatvecPlan,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] times a weight stored as ``plan`` says (``w`` in the plan's layout, ``packed`` its
    oneDNN copy or None): split for a few rows, packed for more, blocks the kernel takes for more,
    else the plain product."""
    k = w.shape[0] if plan.layout == "in_out" else w.shape[1]
    x2 = x if x.dim() == 2 else x.reshape(-1, k)
    rows = x2.shape[0]
    y = None
    if rows <= plan.split_max_rows:
        y = split_product(x2, w, plan, bias)
    elif packed is not None:
        y = torch.ops.mkldnn._linear_pointwise(x2, packed, bias, "none", [], "")
    elif plan.layout == "blocked" and kernels.usable(x2):
        y = ops.f32_matvec(x2, w, bias)         # the kernel takes these rows itself (plan_packs)
    if y is None:
        y = (x2 @ w if bias is None else torch.addmm(bias, x2, w)) if plan.layout == "in_out" else \
            F.linear(x2, unstore(w, plan.layout), bias)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], -1)


def split_product(x: torch.Tensor, w: torch.Tensor, plan: MatvecPlan, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, in] times the weight (plus ``bias``): llmd's kernel for a blocked weight (bias
    included), else ``splits`` independent products in one bmm (one part is a plain product).

    in_out weight [in, out]: split the reduction, each part multiplies its slice of x by its rows of
    W^T (a free view) and the parts are summed. out_in weight [out, in]: split the outputs, each
    part computes its block of columns, then the blocks are laid side by side."""
    if plan.layout == "blocked":
        y = ops.f32_matvec(x, w, bias) if kernels.usable(x) else None
        return y if y is not None else F.linear(x, ops.f32_unblock(w), bias)
    s, rows = plan.splits, x.shape[0]
    if s == 1:
        y = F.linear(x, w) if plan.layout == "out_in" else x @ w
    elif plan.layout == "in_out":
        k, n = w.shape
        y = torch.bmm(x.view(rows, s, k // s).transpose(0, 1), w.view(s, k // s, n)).sum(0)
    else:
        n, k = w.shape
        y = torch.bmm(x.expand(s, rows, k), w.view(s, n // s, k).transpose(1, 2)).transpose(0, 1).reshape(rows, n)
    return y if bias is None else y.add_(bias)


SPLIT_MIN_WEIGHT = 1 << 18    # values of a weight below which a single-row product stays on one thread


@lru_cache(maxsize=None)
def matvec_plan(in_features: int, out_features: int, dtype: torch.dtype, threads: int) -> MatvecPlan:
    """How a weight of this shape is stored and multiplied: a rule on its shape, its dtype, the thread
    count and what this machine offers (llmd's kernels, oneDNN), never a timing, so that every load
    of a model sums its products in the same order and gives the same logits, whatever else the
    machine was doing then.

    - llmd's float32 kernel where it serves the shape (``can_block``): every product on the kernel
      (each row's sums in one order, whatever the row count; bfloat16 blocks past
      ``ops.bf16_amx_rows()`` rows on AMX where the CPU has it), and oneDNN's packed copy for more rows
      only with a kernel library that takes no more (``plan_packs``);
    - else torch's product over the checkpoint layout. In float32 a single row is split over the
      threads by output columns (torch's own kernel streams the weight from one core) once the weight
      is large enough to pay for waking them, and more rows go to one matmul over oneDNN's packed
      copy; bfloat16 products stay whole (torch already spreads them, and a split only added time)."""
    if can_block(in_features, out_features, dtype):
        return MatvecPlan("blocked", 1, ops.F32_MAX_ROWS, packed=True)
    split = (dtype == torch.float32 and threads > 1 and out_features % threads == 0
             and in_features * out_features >= SPLIT_MIN_WEIGHT)
    return MatvecPlan("out_in", threads if split else 1, 1 if split else 0, packed=can_pack(dtype))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class TorchOps:
    """The row operations between a model's products, in plain torch: what the model computes. An
    execution backend hands the model its own forms of them (llmd.runtime.execution); the dense
    forward (training, references, export graphs) uses these."""

    @staticmethod
    def rmsnorm(x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        return norm(x)

    def add_norm(self, x: torch.Tensor, h: torch.Tensor | None, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual step: (x + h, norm(x + h)); h None adds nothing."""
        if h is None:
            return x, self.rmsnorm(x, norm)
        x = x + h
        return x, self.rmsnorm(x, norm)

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


TORCH_OPS = TorchOps()


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling.rope_type == "linear":
        inv = inv / scaling.factor
    elif scaling.rope_type == "llama3":
        # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
        old = scaling.original_max_position_embeddings
        low_wavelen = old / scaling.low_freq_factor
        high_wavelen = old / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        interp = (1 - smooth) * inv / scaling.factor + smooth * inv
        inv = torch.where(wavelen > low_wavelen, inv / scaling.factor, torch.where(wavelen < high_wavelen, inv, interp))
    return inv.float()


class Rotary(nn.Module):
    """cos/sin tables for every position, looked up once per forward and shared by all layers."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling):
        super().__init__()
        inv = rope_inv_freq(head_dim, theta, scaling)
        self.inv_freq = inv          # float32 [D/2], a plain attribute: no dtype cast rounds it
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv)
        self.register_buffer("cos", freqs.cos(), persistent=False)   # [P, D/2]
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions].to(dtype).unsqueeze(-2), self.sin[positions].to(dtype).unsqueeze(-2)

    def lookup_cis(self, positions: torch.Tensor) -> torch.Tensor:
        """cos + i sin per position, [T, 1, D/2] complex64 (built per step: a complex buffer would not
        survive a module-wide dtype cast)."""
        return torch.complex(self.cos[positions].float(), self.sin[positions].float()).unsqueeze(-2)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half convention: the first and second halves of each head form the pairs."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
