"""Triton kernels of the CUDA backend: the paged KV store and one paged attention kernel.

Pools (one layer), as everywhere in llmd:

    k_cache, v_cache: [num_slots, kv_heads, head_dim]      slot = block_id * BLOCK_SIZE + offset

Step metadata (runtime/execution/cuda/metadata.py builds it):

    q, out:        [T, heads, head_dim]     packed query rows, request after request
    query_start:   [B + 1] int32            request b owns rows query_start[b] .. query_start[b+1]-1
    seq_lens:      [B] int32                keys request b attends to (its new rows included)
    block_table:   [B, W] int32             its block ids; entries past its length are never read

A request's q_len new rows sit at positions seq_len - q_len .. seq_len - 1 and each attends causally
to the keys up to its own position. A padding request has no rows and seq_len 0; rows past the last
request's (a graph bucket's unused rows) belong to no request and their output is zero. One program serves BLOCK_Q query rows of one request for one kv head and all
the query heads that share it (GQA), so each key block is read once per group. With NUM_SPLITS > 1
(small decode batches, where B * kv_heads programs cannot fill the GPU) each program covers one
share of its own request's key blocks (``split_range``: shares of the request's length, not of the
block table's width, which a graph bucket sets to the longest context) and writes an unnormalised
partial; ``combine_splits`` merges them.

Recompiles: Triton compiles a kernel once per specialization of its arguments (integers equal to 1 or
divisible by 16, pointers aligned to 16 bytes). The integers that change from step to step (the
block table's row stride, the number of requests) are left unspecialized (``VARYING``), and every
metadata view starts on a 128-byte boundary (metadata.py), so a run compiles each variant once.

Arithmetic: scores and the softmax are float32. With DOT_F32 the products read float32 operands in
IEEE precision (float32 pools, and the Triton interpreter, which computes bfloat16 arithmetic
wrongly); otherwise bfloat16 operands with float32 accumulation (tensor cores).
"""
from __future__ import annotations

import triton
import triton.language as tl

# per kernel, the integer arguments whose values change with the batch: never specialized on
VARYING = {"paged_attention_kernel": ("stride_bt",), "combine_splits_kernel": ("num_seqs",)}


@triton.jit
def store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                    stride_kt, stride_vt, stride_cs, ROW: tl.constexpr, ROW_PAD: tl.constexpr):
    """One program per token: its keys and values (kv_heads * head_dim contiguous values, already in
    the pool's type) to its slot. Slot -1 (a padding row) writes nothing."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs = tl.arange(0, ROW_PAD)
    mask = offs < tl.where(slot >= 0, ROW, 0)          # (a scalar-and-vector mask the interpreter refuses)
    safe = tl.maximum(slot, 0)
    k = tl.load(k_ptr + t.to(tl.int64) * stride_kt + offs, mask=mask)
    v = tl.load(v_ptr + t.to(tl.int64) * stride_vt + offs, mask=mask)
    tl.store(k_cache_ptr + safe * stride_cs + offs, k, mask=mask)
    tl.store(v_cache_ptr + safe * stride_cs + offs, v, mask=mask)


@triton.jit
def split_range(n_blocks, split, NUM_SPLITS: tl.constexpr):
    """The key blocks [first, end) of share ``split`` of ``n_blocks`` in NUM_SPLITS shares: equal
    shares of ceil(n_blocks / NUM_SPLITS) blocks, the last ones shorter or empty."""
    per = tl.cdiv(n_blocks, NUM_SPLITS)
    first = split * per
    return first, tl.minimum(first + per, n_blocks)


@triton.jit(do_not_specialize=VARYING["paged_attention_kernel"])
def paged_attention_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_ptr, stats_ptr,
        query_start_ptr, seq_lens_ptr, block_table_ptr,
        scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_cs, stride_ch, stride_bt,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
        BLOCK_Q: tl.constexpr, BLOCK_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_F32: tl.constexpr):
    b = tl.program_id(0)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS
    num_kv_heads = tl.num_programs(2) // NUM_SPLITS

    # (int32 scalars: the loop bounds below must share one type whatever the metadata's integer type)
    q_begin = tl.load(query_start_ptr + b).to(tl.int32)
    q_len = tl.load(query_start_ptr + b + 1).to(tl.int32) - q_begin
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)

    # rows of the tile: (query row i, head g of the group), flattened as i * GROUP_PAD + g
    M: tl.constexpr = BLOCK_Q * GROUP_PAD
    r = tl.arange(0, M)
    qi = q_tile * BLOCK_Q + r // GROUP_PAD
    g = r % GROUP_PAD
    row_ok = (qi < q_len) & (g < GROUP)
    head = kv_head * GROUP + g
    qpos = seq_len - q_len + qi                       # each row's own position (causal limit)
    d = tl.arange(0, HEAD_PAD)
    d_ok = d < HEAD_DIM

    row = (q_begin + qi).to(tl.int64)
    q = tl.load(q_ptr + row[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q = q.to(tl.float32) * scale
    if not DOT_F32:
        q = q.to(k_cache_ptr.dtype.element_ty)

    m_i = tl.full([M], -1.0e30, tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, HEAD_PAD], tl.float32)

    # keys this tile can see: up to the last valid row's position
    # (none for a tile past this request's rows)
    last = tl.minimum(seq_len, seq_len - q_len + (q_tile + 1) * BLOCK_Q)
    last = tl.where(q_tile * BLOCK_Q < q_len, last, 0)
    n_blocks = tl.cdiv(tl.maximum(last, 0), BLOCK_SIZE)
    first_block, end_block = split_range(n_blocks, split, NUM_SPLITS)
    offs = tl.arange(0, BLOCK_SIZE)
    for j in range(first_block, end_block):
        block_id = tl.load(block_table_ptr + b.to(tl.int64) * stride_bt + j).to(tl.int64)
        slots = block_id * BLOCK_SIZE + offs
        kv_off = slots[:, None] * stride_cs + kv_head * stride_ch + d[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=d_ok[None, :], other=0.0)
        v = tl.load(v_cache_ptr + kv_off, mask=d_ok[None, :], other=0.0)
        if DOT_F32:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        kpos = j * BLOCK_SIZE + offs
        visible = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] < seq_len) & row_ok[:, None]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if DOT_F32:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + row[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        # partials: [T, heads, NUM_SPLITS, HEAD_PAD] float32; stats: [T, heads, NUM_SPLITS, 2] (max, sum)
        heads = num_kv_heads * GROUP
        base = (row * heads + head) * NUM_SPLITS + split
        tl.store(part_ptr + base[:, None] * HEAD_PAD + d[None, :], acc, mask=row_ok[:, None])
        tl.store(stats_ptr + base * 2, m_i, mask=row_ok)
        tl.store(stats_ptr + base * 2 + 1, l_i, mask=row_ok)


@triton.jit(do_not_specialize=VARYING["combine_splits_kernel"])
def combine_splits_kernel(part_ptr, stats_ptr, out_ptr, query_start_ptr, num_seqs, stride_ot, stride_oh, heads,
                          HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """One program per (row, head): the splits' partials rescaled to their common maximum. Rows past
    the last request's (a graph bucket's unused rows, which no program wrote) get zeros."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    sp = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, HEAD_PAD)
    base = (row * heads + head) * NUM_SPLITS + sp
    live = (row + sp * 0) < tl.load(query_start_ptr + num_seqs)     # per split: this row is owned
    m = tl.load(stats_ptr + base * 2, mask=live, other=0.0)
    l = tl.load(stats_ptr + base * 2 + 1, mask=live, other=0.0)
    m_all = tl.max(m, 0)
    w = tl.exp(m - m_all)
    total = tl.sum(l * w, 0)
    part = tl.load(part_ptr + base[:, None] * HEAD_PAD + d[None, :], mask=live[:, None] & (d[None, :] < HEAD_PAD),
                   other=0.0)
    out = tl.sum(part * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + row * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)
