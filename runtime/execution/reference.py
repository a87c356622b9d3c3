"""The reference backend: a step in plain torch, the yardstick every other backend is held to.

Weights stay as loaded (no kernel layouts, rotary over the checkpoint's pairs), norms and activation
are torch's, attention loops over requests with an explicit softmax, and the argmax is torch's.
Slow, and simple enough to read against the model's definition.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..attention import PagedAttention
from .base import Execution


class ReferenceBackend(Execution):
    name = "reference"

    @staticmethod
    def prepare(model) -> None:
        model.requires_grad_(False)
        model.eval()

    @classmethod
    def attention(cls, k_pool: torch.Tensor, v_pool: torch.Tensor, block_size: int,
                  scales: Optional[tuple[torch.Tensor, torch.Tensor]] = None, reference: bool = True) -> PagedAttention:
        return PagedAttention(k_pool, v_pool, block_size, reference=True, scales=scales, kernel=False)
