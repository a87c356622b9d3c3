"""The Triton kernels as torch operators (``torch.ops.llmd.store_kv``, ``torch.ops.llmd.paged_attention``),
each with a fake implementation so a step can be traced, linted under FakeTensorMode and captured.

Launch choices (tile height, number of key splits) are made here from shapes alone, never from tensor
values, so the same launch serves every replay of a captured graph.
"""
from __future__ import annotations

import os

import torch
import triton

from . import kernels

BLOCK_SIZE = 16          # tokens per KV block: the block manager's default, and the kernel's key tile
MAX_SPLITS = 16


def interpreted() -> bool:
    """Kernels run on the Triton interpreter (CPU tensors, tests); read when a kernel launches."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@torch.library.custom_op("llmd::store_kv", mutates_args=("k_cache", "v_cache"))
def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v [T, kv_heads, head_dim] into the pools [S, kv_heads, head_dim] at ``slot_mapping`` [T]
    (slot -1: nothing written)."""
    t, kvh, d = k.shape
    if t == 0:
        return
    # rounded to the pool's type by torch (nearest, ties to even) as the CPU path writes them
    k, v = _rows_contiguous(k.to(k_cache.dtype)), _rows_contiguous(v.to(v_cache.dtype))
    row = kvh * d
    kernels.store_kv_kernel[(t,)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0),
                                  k_cache.stride(0), ROW=row, ROW_PAD=triton.next_power_of_2(row))


@store_kv.register_fake
def _(k, v, k_cache, v_cache, slot_mapping) -> None:
    _check_same_device(k, v, k_cache, v_cache, slot_mapping)


@torch.library.custom_op("llmd::paged_attention", mutates_args=())
def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, query_start: torch.Tensor,
                    seq_lens: torch.Tensor, block_table: torch.Tensor, max_query_len: int, num_splits: int,
                    scale: float) -> torch.Tensor:
    """Attention of the packed rows ``q`` [T, heads, head_dim] over the paged pools (see kernels.py
    for the metadata). ``max_query_len`` bounds every request's new rows; ``num_splits`` > 1 splits
    each request's keys over that many programs (decode rows only)."""
    return launch_attention(q, k_cache, v_cache, query_start, seq_lens, block_table, max_query_len, num_splits,
                            scale)[0]


def launch_attention(q, k_cache, v_cache, query_start, seq_lens, block_table, max_query_len: int, num_splits: int,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The attention kernels' launch: the output, and with key splits their partials [T, heads, splits,
    head_pad] and (max, sum) statistics [T, heads, splits, 2] (else the output in their place)."""
    out = torch.zeros_like(q)            # rows that belong to no request stay zero
    t, heads, d = q.shape
    b = seq_lens.shape[0]
    if t == 0 or b == 0:
        return out, out, out
    kvh = k_cache.shape[1]
    group = heads // kvh
    group_pad = triton.next_power_of_2(group)
    head_pad = max(16, triton.next_power_of_2(d))
    block_q = query_tile(max_query_len, group_pad)
    tiles = triton.cdiv(max(1, max_query_len), block_q)
    splits = 1 << (max(1, min(num_splits, block_table.shape[1])).bit_length() - 1)     # a power of two (tl.arange)
    part = stats = out
    if splits > 1:
        part = torch.empty(t, heads, splits, head_pad, dtype=torch.float32, device=q.device)
        stats = torch.empty(t, heads, splits, 2, dtype=torch.float32, device=q.device)
    dot_f32 = interpreted() or k_cache.dtype == torch.float32
    kernels.paged_attention_kernel[(b, tiles, kvh * splits)](
        q, k_cache, v_cache, out, part, stats, query_start, seq_lens, block_table,
        scale, q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        block_table.stride(0),
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=d, HEAD_PAD=head_pad, BLOCK_Q=block_q,
        BLOCK_SIZE=BLOCK_SIZE, NUM_SPLITS=splits, DOT_F32=dot_f32)
    if splits > 1:
        kernels.combine_splits_kernel[(t, heads)](part, stats, out, query_start, b, out.stride(0), out.stride(1), heads,
                                                  HEAD_DIM=d, HEAD_PAD=head_pad, NUM_SPLITS=splits)
    return out, part, stats


@paged_attention.register_fake
def _(q, k_cache, v_cache, query_start, seq_lens, block_table, max_query_len, num_splits, scale):
    _check_same_device(q, k_cache, v_cache, query_start, seq_lens, block_table)
    return torch.empty_like(q)


def query_tile(max_query_len: int, group_pad: int) -> int:
    """Query rows per program: enough rows x heads for a 16-row product (the tensor cores' least),
    64 for prompt chunks."""
    target = 16 if max_query_len * group_pad <= 16 else 64
    return max(1, target // group_pad)


def decode_splits(num_seqs: int, kv_heads: int, table_width: int, num_programs: int = 264) -> int:
    """Key splits for a decode or verification step: enough programs to fill the GPU (two per
    streaming multiprocessor on an H200 by default), at most one split per block of the table."""
    if num_seqs * kv_heads >= num_programs:
        return 1
    return max(1, min(MAX_SPLITS, table_width, triton.next_power_of_2(num_programs // (num_seqs * kv_heads)) // 2))


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """Each token's [kv_heads, head_dim] values contiguous (a q/k/v split's view already is)."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


def _check_same_device(*tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise RuntimeError(f"llmd paged attention: tensors on different devices {sorted(map(str, devices))}")
