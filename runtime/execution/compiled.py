"""The compiled backend: an engine directory's step compiled ahead of time (an ONNX graph, AOT
packages, a TensorRT engine: llmd.runtime.backends) run over llmd's own paged pool. The whole step is
the compiled one; the model's torch modules only describe it."""
from __future__ import annotations

import torch

from ..attention import PagedAttention
from ..backends.base import CompiledStep
from ..backends.paged import run_step
from ..kernels import ops
from .base import Execution


class CompiledBackend(Execution):
    name = "compiled"

    def __init__(self, model, attn: PagedAttention, step: CompiledStep):
        super().__init__(model, attn)
        self.step = step

    @staticmethod
    def prepare(model) -> None:
        """Nothing: the engine directory's loader prepared what it keeps in torch."""

    def run(self, batch) -> torch.Tensor:
        attn = self.attn
        return run_step(self.step, attn.k_pool, attn.v_pool, batch, attn.block_size)

    def greedy(self, logits: torch.Tensor) -> torch.Tensor:
        return ops.argmax(logits)
