"""Paged attention cases shared by the interpreted kernel tests and the GPU tests: requests with
prompt chunks, decode rows and verification rows over pools whose blocks are handed out in shuffled
order (block-table holes), and two references: llmd's float32 attention and FlexAttention's paged form."""
from __future__ import annotations

import torch

from llmd.runtime.attention import SeqSpan, reference_attention
from llmd.runtime.execution.cuda.metadata import StepShape, build_metadata
from llmd.runtime.model_runner import Feed

BS = 16


def make_case(lens: list[tuple[int, int]], heads: int, kv_heads: int, head_dim: int, dtype=torch.float32,
              device="cpu", num_blocks: int | None = None, pad_to: StepShape | None = None, seed: int = 0):
    """``lens``: (new rows, context length) per request. Returns q, pools, metadata, spans."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-ctx // BS) for _, ctx in lens]
    num_blocks = num_blocks or sum(need) + 5
    order = torch.randperm(num_blocks, generator=g).tolist()      # shuffled: holes between a request's blocks
    feeds, start = [], 0
    for (n, ctx), nb in zip(lens, need):
        blocks, start = order[start:start + nb], start + nb
        feeds.append(Feed(list(range(n)), ctx - n, blocks, n))
    meta = build_metadata(feeds, BS, pad_to=pad_to)
    rows = meta.shape.num_rows
    q = torch.randn(rows, heads, head_dim, generator=g).to(dtype)
    k_cache = torch.randn(num_blocks * BS, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks * BS, kv_heads, head_dim, generator=g).to(dtype)
    spans, row = [], 0
    for f in feeds:
        spans.append(SeqSpan(row, len(f.token_ids), f.start + len(f.token_ids), f.block_ids))
        row += len(f.token_ids)
    return q.to(device), k_cache.to(device), v_cache.to(device), meta.to(device), spans


def reference(q, k_cache, v_cache, spans, rows: int) -> torch.Tensor:
    """llmd's float32 reference; rows that belong to no request are zero."""
    out = torch.zeros(rows, *q.shape[1:], dtype=torch.float32)
    qf = q.float().cpu()
    kf, vf = k_cache.float().cpu(), v_cache.float().cpu()
    got = reference_attention(qf[:sum(s.num_q for s in spans)], lambda s: kf[s], lambda s: vf[s], spans, BS)
    out[:got.shape[0]] = got
    return out


def flex_reference(q, k_cache, v_cache, spans) -> list[torch.Tensor]:
    """FlexAttention over the physical pool through its paged form (float32, on the CPU): per request
    [num_q, heads, head_dim]."""
    from torch.nn.attention.experimental._paged_attention import PagedAttention
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    b = len(spans)
    slots = k_cache.shape[0]
    pages = slots // BS
    pa = PagedAttention(pages, BS, b, device="cpu")
    for i, s in enumerate(spans):
        for j, p in enumerate(s.block_ids):
            pa.page_table[i, j] = p
            pa.physical_to_logical[i, p] = j
    lq = max(s.num_q for s in spans)
    lens = torch.tensor([s.ctx_len for s in spans])
    nq = torch.tensor([s.num_q for s in spans])

    def causal(bi, h, qi, kv):
        return (kv <= lens[bi] - nq[bi] + qi) & (kv < lens[bi]) & (qi < nq[bi])

    mask = pa.convert_logical_block_mask(create_block_mask(causal, b, 1, lq, slots, device="cpu", BLOCK_SIZE=(BS, BS)))
    qq = torch.zeros(b, q.shape[1], lq, q.shape[2])
    for i, s in enumerate(spans):
        qq[i, :, :s.num_q] = q[s.start:s.start + s.num_q].float().cpu().transpose(0, 1)
    kc = k_cache.float().cpu().transpose(0, 1).unsqueeze(0)
    vc = v_cache.float().cpu().transpose(0, 1).unsqueeze(0)
    out = flex_attention(qq, kc, vc, block_mask=mask, enable_gqa=True)
    return [out[i, :, :s.num_q].transpose(0, 1) for i, s in enumerate(spans)]
