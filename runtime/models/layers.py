"""Building blocks shared by the Llama-family models: linear, RMSNorm, rotary embedding."""
from __future__ import annotations

import math
import time
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn

from .config import RopeScaling


class Linear(nn.Module):
    """y = x W^T + b, with W stored [out, in] as in checkpoints.

    ``prepare()`` picks the inference storage for this shape: CPU matrix-vector products read a
    contiguous [in, out] copy about twice as fast for wide outputs (896 -> 4864: 544 us against
    1054 us here) but not for narrow ones, so the faster layout is measured once per shape.
    Quantized variants replace this module as a whole (see llmd.export.quantize).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.weight_t: torch.Tensor | None = None

    def prepare(self) -> None:
        w = self.weight.detach()
        if transposed_is_faster(self.in_features, self.out_features, w.dtype):
            self.weight_t = w.t().contiguous()
            self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_t is None:
            return F.linear(x, self.weight, self.bias)
        if self.bias is not None:
            return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight_t).view(*x.shape[:-1], -1)
        return x @ self.weight_t

    def dense_weight(self) -> torch.Tensor:
        """The [out, in] weight, whichever storage is active."""
        return self.weight if self.weight_t is None else self.weight_t.t()


@lru_cache(maxsize=None)
def transposed_is_faster(in_features: int, out_features: int, dtype: torch.dtype) -> bool:
    """Time one-row products with both layouts on random data of this shape."""
    w = torch.randn(out_features, in_features).to(dtype)
    wt = w.t().contiguous()
    x = torch.randn(1, in_features).to(dtype)

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(5):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return min(times)

    return best(lambda: x @ wt) < best(lambda: F.linear(x, w))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)      # one fused op
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


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
