"""The plan's attention options on each layer's ``attend(layer, q, k, v)`` hook: a window per layer (a
sliding layer sees the last ``window`` positions from each query, itself included) and soft-capped
scores (cap * tanh(scores / cap), before the mask and softmax: Gemma 2).

Over llmd's paged pools (``PagedAttention``) a window goes to its ``attend``, which computes it on
the kernel and in torch alike; soft-capping, which neither llmd's kernel nor torch's SDPA computes, is
plain torch here, one request at a time, over the same pools (keys and values stored as the ordinary
path stores them). Dense attention from position 0 (``causal_attention``, references and training)
takes both here. Another backend's attention has no windows: such a backend serves a sliding model
with its context capped at ``ModelConfig.window_cap``, where every window still holds everything.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from llmd.runtime.attention import PagedAttention


def layer_attention(attend, windows: Sequence[Optional[int]], cap: Optional[float], scale: float):
    """``attend`` with each layer's window (``windows[layer]``, None: all) and, where ``cap`` is set,
    capped scores scaled by ``scale``; ``attend`` itself where the plan asks for neither."""
    if cap is None and not any(windows):
        return attend
    pools = getattr(attend, "__self__", None)
    if isinstance(pools, PagedAttention):
        if cap is None:
            return lambda layer, q, k, v: pools.attend(layer, q, k, v, windows[layer])
        if pools.scales is not None:
            raise NotImplementedError("attention soft-capping does not run over int8 KV pools yet; "
                                      "serve this model with a float KV cache")
        return lambda layer, q, k, v: _paged(pools, layer, q, k, v, cap, scale, windows[layer])
    if pools is not None:
        if cap is not None:
            raise NotImplementedError(f"attention soft-capping has no form on {type(pools).__name__}'s attention; "
                                      "serve this model on the cpu execution backend")
        return attend             # no windows there: the context stops at ModelConfig.window_cap
    if cap is not None:
        return lambda layer, q, k, v: _dense(q, k, v, cap, scale, windows[layer])
    # a window no shorter than the batch's rows holds them all: the plain causal form as before
    return lambda layer, q, k, v: (attend(layer, q, k, v) if windows[layer] is None or windows[layer] >= q.shape[1]
                                   else _dense(q, k, v, None, None, windows[layer]))


def planned_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: int, cap: Optional[float],
                      scale: Optional[float], window: Optional[int]) -> torch.Tensor:
    """q [n, H, D] at positions first.., keys/values [L, kvh, D] at 0..L-1 -> [n, H, D] (float32 math):
    scores scaled (``scale``, else 1/sqrt(D)), capped where ``cap`` is set, each query seeing the
    positions up to its own, the last ``window`` of them where one is set."""
    rep = q.shape[1] // k.shape[1]
    ks, vs = k.float().repeat_interleave(rep, dim=1), v.float().repeat_interleave(rep, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.float(), ks) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if cap is not None:
        scores = torch.tanh(scores / cap) * cap
    qpos = torch.arange(first, first + q.shape[0]).view(1, -1, 1)
    keys = torch.arange(k.shape[0]).view(1, 1, -1)
    hidden = keys > qpos
    if window is not None:
        hidden |= keys <= qpos - window
    scores = scores.masked_fill(hidden, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), vs).to(q.dtype)


def _dense(q, k, v, cap, scale, window) -> torch.Tensor:
    """[B, T, H, D] from position 0."""
    return torch.stack([planned_attention(q[b], k[b], v[b], 0, cap, scale, window) for b in range(q.shape[0])])


def _paged(pools: PagedAttention, layer: int, q, k, v, cap: float, scale: float, window: Optional[int]) -> torch.Tensor:
    kp, vp = pools.k_pool[layer], pools.v_pool[layer]
    kp.index_copy_(0, pools.slot_mapping, k.to(kp.dtype))
    vp.index_copy_(0, pools.slot_mapping, v.to(vp.dtype))
    out = torch.empty_like(q)
    for s in pools.spans:
        slots = s.kv_slots(pools.block_size)
        rows = slice(s.start, s.start + s.num_q)
        out[rows] = planned_attention(q[rows], kp.index_select(0, slots).to(q.dtype),
                                      vp.index_select(0, slots).to(q.dtype), s.ctx_len - s.num_q, cap, scale, window)
    return out
