"""The attention object the model's layers call on the CUDA backend (the same ``attend`` as
llmd.runtime.attention.PagedAttention): each layer writes its new keys and values into the pools at
the step's slots, then attends over the pools through the block table."""
from __future__ import annotations

import torch

from llmd.runtime.models.layers import TORCH_OPS

from . import ops  # noqa: F401  (registers torch.ops.llmd.*)
from .metadata import StepMetadata


class TritonAttention:
    """Pools [layers, slots, kv_heads, head_dim], owned by the runner; metadata set once per step.
    It is also the ``step`` the model calls back (llmd.runtime.execution.base): plain torch norms
    and activations, the model's own rotary form, and ``attend``."""

    ops = TORCH_OPS

    def __init__(self, k_pool: torch.Tensor, v_pool: torch.Tensor):
        self.k_pool, self.v_pool = k_pool, v_pool
        self.meta: StepMetadata | None = None
        self.num_splits = 1

    def prepare(self, meta: StepMetadata, num_splits: int = 1) -> None:
        self.meta, self.num_splits = meta, num_splits

    def rope(self, model, positions: torch.Tensor, dtype: torch.dtype):
        return model.rope(positions, dtype)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        m = self.meta
        kp, vp = self.k_pool[layer], self.v_pool[layer]
        torch.ops.llmd.store_kv(k, v, kp, vp, m.slot_mapping)
        return torch.ops.llmd.paged_attention(q, kp, vp, m.query_start, m.seq_lens, m.block_table,
                                              m.shape.max_query_len, self.num_splits, q.shape[-1] ** -0.5)
