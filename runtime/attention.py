"""Attention over the paged KV pool.

The pool of one layer is a flat array of token slots, block after block:

    k_pool[layer]: [num_blocks * block_size, kv_heads, head_dim]     slot = block_id * block_size + offset

Each step, every layer first writes its new keys/values at ``slot_mapping`` (one slot per packed
token), then attends. Decode and verification rows, and prompt chunks over a context of at most
KERNEL_PROMPT_CONTEXT positions, go to llmd's attention kernel (llmd.runtime.kernels) where it runs
(float32 or bfloat16 pools), which reads keys and values in place through the block table: such a
row's attention is the same arithmetic in a prompt chunk as in a decode step, and faster than
torch's there. The kernel reads a request's keys once per query row, so over longer contexts
torch's blocked attention, which reuses them across rows, computes prompt chunks faster
(docs/perf/2026-12-01-quantized-kernels.md, "Prompt chunks on the attention kernel"). Those, and
every request where the kernel does not run (int8 pools, other CPUs), take the torch path: padded gather indices and masks built once per step for at most two
groups (single-token rows; multi-token rows), one scaled_dot_product_attention per group and layer.
The reference path loops over requests with explicit softmax; tests hold both fast paths to it.

A sliding layer (``attend(..., window=W)``) sees, from a query at position p, positions p - W + 1 .. p
only. Where no request of the step reaches past W that is everything, and the step's metadata serves
as is; else a windowed form is built once per step and window: torch groups with the window in their
mask, and kernel rows whose table is flat (block size 1, each row's slots from its window's first
position), so the kernel reads exactly those slots in the same order, the same arithmetic.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from llmd.runtime import kernels
from llmd.runtime.formats.kv_int8 import write_kv_int8
from llmd.runtime.kernels import ops

KERNEL_MAX_Q = 16               # query rows of a request the kernel serves at any context (decode, verification)
KERNEL_PROMPT_CONTEXT = 1536    # ... and more rows (a prompt chunk) over at most this many positions


@dataclass
class SeqSpan:
    """One request's rows in the packed step: query rows [start, start+num_q) at positions
    [ctx_len - num_q, ctx_len), attending to its first ctx_len slots, which live in ``block_ids``."""

    start: int
    num_q: int
    ctx_len: int
    block_ids: list[int]

    def kv_slots(self, block_size: int) -> torch.Tensor:
        blocks = torch.tensor(self.block_ids[:-(-self.ctx_len // block_size)], dtype=torch.long)
        return (blocks.unsqueeze(1) * block_size + torch.arange(block_size)).flatten()[:self.ctx_len]


@dataclass
class KernelRows:
    """The query rows the attention kernel serves this step (int32, as the kernel reads them)."""

    rows: torch.Tensor         # [R] packed row of each query
    spans: torch.Tensor        # [R] its request's row in ``table`` (a flat table: its first slot there)
    lengths: torch.Tensor      # [R] positions it attends to (causal within its request's rows)
    table: torch.Tensor        # [B, max blocks] block ids, zero-padded; or [slots, 1] with block size 1
    block_size: int            # the kernel's block size over ``table``

    @classmethod
    def build(cls, spans: list[SeqSpan], block_size: int) -> "KernelRows":
        rows, owner, lengths = [], [], []
        for i, s in enumerate(spans):
            rows += range(s.start, s.start + s.num_q)
            owner += [i] * s.num_q
            lengths += range(s.ctx_len - s.num_q + 1, s.ctx_len + 1)
        nb = max(-(-s.ctx_len // block_size) for s in spans)
        r = len(rows)
        flat = int_tensor(rows + owner + lengths, np.int32)     # one tensor, three views
        return cls(flat[:r], flat[r:2 * r], flat[2 * r:], block_table(spans, nb, np.int32), block_size)

    @classmethod
    def build_window(cls, spans: list[SeqSpan], block_size: int, window: int) -> "KernelRows":
        """Rows that see the last ``window`` positions each: one flat table of slots per request, from
        the first position any of its rows sees; a row starts at its own window's first slot there."""
        rows, owner, lengths, slots = [], [], [], []
        at = 0
        for s in spans:
            pos = np.arange(s.ctx_len - s.num_q, s.ctx_len)
            first = np.maximum(pos + 1 - window, 0)
            own = s.kv_slots(block_size)[int(first[0]):]
            rows.append(np.arange(s.start, s.start + s.num_q))
            owner.append(at + first - first[0])
            lengths.append(pos + 1 - first)
            slots.append(own.numpy())
            at += own.numel()
        r = sum(len(x) for x in rows)
        flat = torch.from_numpy(np.concatenate(rows + owner + lengths).astype(np.int32))
        table = torch.from_numpy(np.concatenate(slots).astype(np.int32)).view(-1, 1)
        return cls(flat[:r], flat[r:2 * r], flat[2 * r:], table, 1)


@dataclass
class Group:
    """Requests attended together: q_index [B, Lq] into packed rows, kv_index [B, Lk] into slots."""

    q_index: torch.Tensor
    kv_index: torch.Tensor
    mask: Optional[torch.Tensor]      # [B, 1, Lq, Lk] True = attend; None when nothing is masked
    valid: torch.Tensor               # [B, Lq] bool: real (non-padding) query rows
    rows: torch.Tensor                # packed row of each valid query, in valid order

    @property
    def kv_flat(self) -> torch.Tensor:
        return self.kv_index.view(-1)


class PagedAttention:
    """Holds the step's metadata and the pools; ``attend`` is called by each layer. Whether its
    kernel serves a step's few-row requests is settled when it is built (``kernel``: by default,
    wherever the kernel can read these pools), never per step."""

    def __init__(self, k_pool: torch.Tensor, v_pool: torch.Tensor, block_size: int, reference: bool = False,
                 scales: Optional[tuple[torch.Tensor, torch.Tensor]] = None, kernel: Optional[bool] = None):
        self.k_pool, self.v_pool = k_pool, v_pool        # [L, S, kvh, d], owned by the ModelRunner
        self.scales = scales                             # int8 pools: ([L, blocks, kvh], [L, blocks, kvh])
        self.block_size = block_size
        self.reference = reference
        self.kernel = self.kernel_fits() if kernel is None else kernel and self.kernel_fits()
        self.slot_mapping: torch.Tensor | None = None
        self.spans: list[SeqSpan] = []
        self.groups: list[Group] = []
        self.kernel_rows: KernelRows | None = None
        self.num_rows = 0
        self._split: tuple[list[SeqSpan], list[SeqSpan]] = ([], [])     # (kernel's spans, torch's spans)
        self._windowed: dict[int, tuple[Optional[KernelRows], list[Group]]] = {}

    def kernel_fits(self) -> bool:
        """llmd's attention kernel can read these pools (float32 or bfloat16, head sizes it handles)."""
        d = self.k_pool.shape[-1]
        return (not self.reference and self.scales is None and self.k_pool.dtype in ops.ATTEND_POOL_DTYPES
                and d % 16 == 0 and d <= 256 and self.k_pool.is_cpu and kernels.available())

    def prepare(self, slot_mapping: torch.Tensor, spans: list[SeqSpan]) -> None:
        """The step's metadata, built once for every layer: the kernel's rows and the torch groups."""
        self.slot_mapping, self.spans = slot_mapping, spans
        self.num_rows = slot_mapping.numel()
        self.kernel_rows, self.groups, self._windowed = None, [], {}
        if self.reference:
            return
        few: list[SeqSpan] = []
        if self.kernel:
            few = [s for s in spans if s.num_q <= KERNEL_MAX_Q or s.ctx_len <= KERNEL_PROMPT_CONTEXT]
            spans = [s for s in spans if s.num_q > KERNEL_MAX_Q and s.ctx_len > KERNEL_PROMPT_CONTEXT]
            self.kernel_rows = KernelRows.build(few, self.block_size) if few else None
        self._split = (few, spans)
        self.groups = self._build_groups(spans)

    def _build_groups(self, spans: list[SeqSpan], window: Optional[int] = None) -> list[Group]:
        singles = [s for s in spans if s.num_q == 1]
        multis = [s for s in spans if s.num_q > 1]
        bs = self.block_size
        return [g for g in (build_group(singles, bs, window), build_group(multis, bs, window)) if g is not None]

    def slides(self, window: Optional[int]) -> bool:
        """Does a request of this step reach past ``window`` positions (so a sliding layer's rows see
        less than the whole context)?"""
        return window is not None and any(s.ctx_len > window for s in self.spans)

    def window_metadata(self, window: Optional[int]) -> tuple[Optional[KernelRows], list[Group]]:
        """(kernel rows, torch groups) of a layer with this window (None: full attention), this step:
        the full form where no request reaches past the window, else a windowed one, built once."""
        if window is None:
            return self.kernel_rows, self.groups
        if window not in self._windowed:
            few, rest = self._split
            self._windowed[window] = (
                (KernelRows.build_window(few, self.block_size, window) if few else None,
                 self._build_groups(rest, window)) if self.slides(window) else (self.kernel_rows, self.groups))
        return self._windowed[window]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               window: Optional[int] = None) -> torch.Tensor:
        """Store this layer's keys and values, then attend: over the whole context, or with ``window``
        over its last positions from each query."""
        kp, vp = self.k_pool[layer], self.v_pool[layer]
        if self.scales is not None:
            return self._attend_int8(layer, q, k, v, window)
        kp.index_copy_(0, self.slot_mapping, k.to(kp.dtype))
        vp.index_copy_(0, self.slot_mapping, v.to(vp.dtype))
        rows, groups = self.window_metadata(None if self.reference else window)
        if rows is not None:
            return self._attend_kernel(q, kp, vp, rows, groups)
        return self._attend(q, kp, vp, groups, window)

    def _attend_kernel(self, q, kp, vp, kr: KernelRows, groups: list[Group]) -> torch.Tensor:
        """The kernel's rows in float32 (whatever the model's dtype), the torch groups' rows after."""
        dtype = q.dtype
        q = q.float().contiguous()
        out = torch.empty_like(q)
        if not ops.attend(q, kp, vp, kr.rows, kr.spans, kr.lengths, kr.table, kr.block_size, out):
            raise MemoryError("the attention kernel could not allocate its score buffers (out of memory)")
        out = self._attend_groups(q, _gatherer(kp, None, self.block_size, q.dtype),
                                  _gatherer(vp, None, self.block_size, q.dtype), out, groups)
        return out if dtype == torch.float32 else out.to(dtype)

    def _attend(self, q, kp, vp, groups: list[Group], window: Optional[int], ks=None, vs=None) -> torch.Tensor:
        k_get = _gatherer(kp, ks, self.block_size, q.dtype)
        v_get = _gatherer(vp, vs, self.block_size, q.dtype)
        if self.reference:
            return reference_attention(q, k_get, v_get, self.spans, self.block_size, window)
        if len(groups) == 1 and len(self.spans) == 1:
            return self._single(q, k_get, v_get, groups[0])
        return self._attend_groups(q, k_get, v_get, q.new_empty(q.shape), groups)

    def _attend_groups(self, q, k_get, v_get, out: torch.Tensor, groups: list[Group]) -> torch.Tensor:
        """Each torch-path group's rows of ``out``."""
        for g in groups:
            out.index_copy_(0, g.rows, self._group(q, k_get, v_get, g))
        return out

    def _attend_int8(self, layer, q, k, v, window: Optional[int] = None) -> torch.Tensor:
        """int8 pools with per-block, per-head scales (the codec: formats/kv_int8.py)."""
        bs = self.block_size
        ks, vs = self.scales[0][layer], self.scales[1][layer]
        fresh = self.slot_mapping[self.slot_mapping % bs == 0] // bs
        ks[fresh] = 0                       # a block starting anew forgets its previous owner's scale
        vs[fresh] = 0
        write_kv_int8(self.k_pool[layer], ks, self.slot_mapping, k, bs)
        write_kv_int8(self.v_pool[layer], vs, self.slot_mapping, v, bs)
        groups = self.window_metadata(None if self.reference else window)[1]
        return self._attend(q, self.k_pool[layer], self.v_pool[layer], groups, window, ks, vs)

    # index_select with flat indices: about 4x faster than advanced indexing for these gathers.
    def _single(self, q, k_get, v_get, g: Group) -> torch.Tensor:
        """One request: no padding, and a mask only when the chunk has more than one query (or a
        window)."""
        qq = q.unsqueeze(0).transpose(1, 2)                                     # [1, H, T, D]
        kk = k_get(g.kv_flat).unsqueeze(0).transpose(1, 2)                      # [1, kvh, Lk, D]
        vv = v_get(g.kv_flat).unsqueeze(0).transpose(1, 2)
        o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=g.mask, enable_gqa=True)
        return o.transpose(1, 2)[0]

    def _group(self, q, k_get, v_get, g: Group) -> torch.Tensor:
        b, lq = g.q_index.shape
        lk = g.kv_index.shape[1]
        qq = q.index_select(0, g.q_index.view(-1)).view(b, lq, *q.shape[1:]).transpose(1, 2)     # [B, H, Lq, D]
        kk = k_get(g.kv_flat)
        kk = kk.view(b, lk, *kk.shape[1:]).transpose(1, 2)                                         # [B, kvh, Lk, D]
        vv = v_get(g.kv_flat)
        vv = vv.view(b, lk, *vv.shape[1:]).transpose(1, 2)
        o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=g.mask, enable_gqa=True)
        return o.transpose(1, 2)[g.valid]                                       # [rows, H, D]


def _gatherer(pool: torch.Tensor, scales: Optional[torch.Tensor], block_size: int, dtype):
    """slots -> [n, kvh, D] values in `dtype`, dequantizing int8 pools on the fly."""
    if scales is None:
        return lambda slots: pool.index_select(0, slots).to(dtype)
    return lambda slots: (pool.index_select(0, slots).to(dtype)
                          * scales.index_select(0, slots // block_size).to(dtype).unsqueeze(-1))


def int_tensor(values: list[int], dtype) -> torch.Tensor:
    """A 1-D integer tensor from a list, through numpy: about 3x faster than torch.tensor on a list
    (per-step metadata is built this way every step)."""
    return torch.from_numpy(np.array(values, dtype=dtype))


def block_table(spans: list[SeqSpan], width: int, dtype) -> torch.Tensor:
    """[len(spans), width] block ids of each request (numpy integer ``dtype``), zero-padded (padding is
    never attended)."""
    flat: list[int] = []
    for s in spans:
        ids = s.block_ids[:width]
        flat += ids
        flat += [0] * (width - len(ids))
    return int_tensor(flat, dtype).view(len(spans), width)


def build_group(spans: list[SeqSpan], block_size: int, window: Optional[int] = None) -> Group | None:
    """Padded gather indices and mask for a group, from Python lists in a few tensor ops; with
    ``window``, a query at position p sees positions p - window + 1 .. p only."""
    if not spans:
        return None
    b = len(spans)
    lq = max(s.num_q for s in spans)
    lk = max(s.ctx_len for s in spans)
    nb = -(-lk // block_size)
    table = block_table(spans, nb, np.int64)
    kv_index = (table.unsqueeze(-1) * block_size + torch.arange(block_size)).view(b, -1)[:, :lk].contiguous()
    # padding query rows point at row 0 and attend to key 0 only (never an all-masked row)
    q_index = torch.tensor([list(range(s.start, s.start + s.num_q)) + [0] * (lq - s.num_q) for s in spans],
                           dtype=torch.long)
    qpos = torch.tensor([list(range(s.ctx_len - s.num_q, s.ctx_len)) + [0] * (lq - s.num_q) for s in spans],
                        dtype=torch.long)
    valid = torch.tensor([[True] * s.num_q + [False] * (lq - s.num_q) for s in spans])
    needs_mask = lq > 1 or any(s.ctx_len != lk for s in spans) or window is not None and lk > window
    keys = torch.arange(lk).view(1, 1, lk)
    mask = (keys <= qpos.unsqueeze(-1)) if needs_mask else None
    if mask is not None and window is not None:
        mask &= keys > qpos.unsqueeze(-1) - window
    mask = mask.unsqueeze(1) if mask is not None else None
    return Group(q_index, kv_index, mask, valid, q_index[valid])


def reference_attention(q: torch.Tensor, k_get, v_get, spans: list[SeqSpan], block_size: int,
                        window: Optional[int] = None) -> torch.Tensor:
    """Plain attention, one request at a time, in float32. ``k_get(slots)`` gathers keys. With
    ``window``, a query at position p sees positions p - window + 1 .. p only."""
    out = torch.empty_like(q)
    heads, d = q.shape[1], q.shape[2]
    for s in spans:
        slots = s.kv_slots(block_size)
        ks, vs = k_get(slots).float(), v_get(slots).float()
        rep = heads // ks.shape[1]
        qs = q[s.start:s.start + s.num_q].float()                              # [n, H, D]
        ks = ks.repeat_interleave(rep, dim=1)                                  # [L, H, D]
        vs = vs.repeat_interleave(rep, dim=1)
        scores = torch.einsum("nhd,lhd->hnl", qs, ks) / d ** 0.5
        qpos = torch.arange(s.ctx_len - s.num_q, s.ctx_len).view(1, -1, 1)
        keys = torch.arange(s.ctx_len).view(1, 1, -1)
        hidden = (keys > qpos) | (keys <= qpos - window) if window is not None else keys > qpos
        scores = scores.masked_fill(hidden, float("-inf"))
        out[s.start:s.start + s.num_q] = torch.einsum("hnl,lhd->nhd", scores.softmax(-1), vs).to(q.dtype)
    return out
