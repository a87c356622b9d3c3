"""The int8 KV-cache codec: one float32 scale per (layer, block, kv head).

Pool layout as in the runtime:

    k_pool[layer]:   int8 [num_blocks * block_size, kv_heads, head_dim]
    k_scale[layer]:  f32  [num_blocks, kv_heads]          value = q * scale[slot // block_size, head]

A block fills up a few tokens at a time, so its scale may have to grow: the writer then rescales
the block's earlier entries to the new scale (one extra rounding for those, bounded by the new
scale / 2), which keeps a single scale per block and head valid at all times.
"""
from __future__ import annotations

import torch

def write_kv_int8(pool: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor, new: torch.Tensor,
                  block_size: int) -> None:
    """Write new [T, H, D] float values at ``slots`` into an int8 pool [S, H, D] with per-block,
    per-head scales [S // block_size, H]; growing a block's scale requantizes what it holds."""
    new = new.float()
    blocks = slots // block_size
    need = new.abs().amax(dim=-1) / 127                                     # [T, H]
    uniq, inverse = torch.unique(blocks, return_inverse=True)
    want = torch.zeros(uniq.numel(), need.shape[1]).scatter_reduce_(0, inverse[:, None].expand_as(need), need, "amax")
    old = scales[uniq]                                                      # [U, H]
    grown = torch.maximum(old, want).clamp(min=1e-12)
    changed = (grown > old) & (old > 0)
    if changed.any():
        rows = (uniq[:, None] * block_size + torch.arange(block_size)).flatten()
        ratio = (old / grown).repeat_interleave(block_size, dim=0)[:, :, None]   # [U*bs, H, 1]
        pool[rows] = torch.round(pool[rows].float() * ratio).to(torch.int8)
    scales[uniq] = grown
    s = scales[blocks][:, :, None]
    pool[slots] = torch.round(new / s).clamp(-127, 127).to(torch.int8)


def read_kv_int8(pool: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor, block_size: int,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Gather slots [L] -> [L, H, D] dequantized values."""
    return (pool[slots].float() * scales[slots // block_size][:, :, None]).to(dtype)
