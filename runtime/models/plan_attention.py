"""Attention with soft-capped scores (cap * tanh(scores / cap), before the causal mask and softmax),
for plans that ask for it (Gemma 2): llmd's attention kernel and torch's SDPA do not cap, so this is
plain torch, one request at a time, over the same paged pools (keys and values stored as the
ordinary path stores them).
"""
from __future__ import annotations

import torch

from llmd.runtime.attention import PagedAttention


def softcapped(attend, cap: float, scale: float):
    """The per-layer hook ``attend(layer, q, k, v)`` with capped scores: over a dense batch from
    position 0 (``causal_attention``), or over ``attend``'s paged pools."""
    pools = getattr(attend, "__self__", None)
    if isinstance(pools, PagedAttention):
        if pools.scales is not None:
            raise NotImplementedError("attention soft-capping does not run over int8 KV pools yet; "
                                      "serve this model with a float KV cache")
        return lambda layer, q, k, v: _paged(pools, layer, q, k, v, cap, scale)
    if pools is not None:
        raise NotImplementedError(f"attention soft-capping has no form on {type(pools).__name__}'s attention; "
                                  "serve this model on the cpu execution backend")
    return lambda layer, q, k, v: _dense(q, k, v, cap, scale)


def capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: int, cap: float,
                     scale: float) -> torch.Tensor:
    """q [n, H, D] at positions first.., keys/values [L, kvh, D] at 0..L-1 -> [n, H, D] (float32 math)."""
    rep = q.shape[1] // k.shape[1]
    ks, vs = k.float().repeat_interleave(rep, dim=1), v.float().repeat_interleave(rep, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.float(), ks) * scale
    scores = torch.tanh(scores / cap) * cap
    qpos = torch.arange(first, first + q.shape[0]).view(1, -1, 1)
    scores = scores.masked_fill(torch.arange(k.shape[0]).view(1, 1, -1) > qpos, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), vs).to(q.dtype)


def _dense(q, k, v, cap: float, scale: float) -> torch.Tensor:
    """[B, T, H, D] from position 0."""
    return torch.stack([capped_attention(q[b], k[b], v[b], 0, cap, scale) for b in range(q.shape[0])])


def _paged(pools: PagedAttention, layer: int, q, k, v, cap: float, scale: float) -> torch.Tensor:
    kp, vp = pools.k_pool[layer], pools.v_pool[layer]
    kp.index_copy_(0, pools.slot_mapping, k.to(kp.dtype))
    vp.index_copy_(0, pools.slot_mapping, v.to(vp.dtype))
    out = torch.empty_like(q)
    for s in pools.spans:
        slots = s.kv_slots(pools.block_size)
        rows = slice(s.start, s.start + s.num_q)
        out[rows] = capped_attention(q[rows], kp.index_select(0, slots).to(q.dtype),
                                     vp.index_select(0, slots).to(q.dtype), s.ctx_len - s.num_q, cap, scale)
    return out
