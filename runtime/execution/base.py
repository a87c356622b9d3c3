"""Execution backends: how one step of a model runs on a device.

A model (llmd.runtime.models) says what a step computes: embeddings, projections, rotary, attention
over the paged pool, MLPs, norms, the head. A backend says how, and is chosen once at load (from the
``execution`` setting, the device and the weights), so the hot path asks no questions:

    ModelRunner.run(batch) ─▶ backend.run(batch)
        attn.prepare(slots, spans)    the step's metadata (slots, positions, block tables), once per step
        backend.forward(batch)        the whole-step hook: a fused call (cpu) or a graph replay, else
          model.forward(ids, positions, step=backend)
            per layer: step.ops.add_norm / rmsnorm / silu_mul   this backend's forms of the row operations
                       step.rope(model, positions, dtype)       its rotary form (once per step)
                       step.attend(layer, q, k, v)              KV store into the pool, then attention
        model.compute_logits(rows)    the head, for the sampled rows only
    backend.run_greedy(batch)         the same step where every sampled row is greedy: its tokens, through
                                      the head's screen where the model has one (formats.head_screen)
    backend.greedy(logits)            the argmax on the device (engine and draft)
    backend.greedy_rounds(...)        a draft's greedy rounds fused into calls, where it can

Products run the plan each weight was stored in by ``prepare`` (the weight formats' own forms).
A backend is held to ``reference`` by tests: greedy tokens identical in float32, logits close.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Optional

import torch

from ..attention import PagedAttention
from ..models.layers import TORCH_OPS, TorchOps


class Execution(ABC):
    """One model's steps on one device. Built by the ModelRunner with the model and its attention
    over the pools (``attention``); the model calls it back as its ``step``."""

    name: ClassVar[str]
    device: ClassVar[torch.device] = torch.device("cpu")     # where the pools and step tensors live
    ops: TorchOps = TORCH_OPS                                 # norms and activation between products
    kernels: Optional[bool] = None      # llmd's CPU kernels: on or off where the backend may run them, else None

    def __init__(self, model, attn: PagedAttention):
        self.model, self.attn = model, attn
        self.attend = attn.attend            # the model's per-layer hook: store keys/values, attend

    @staticmethod
    @abstractmethod
    def prepare(model) -> None:
        """Once at load, before any runner: the weights in the forms this backend's products read."""

    @classmethod
    def attention(cls, k_pool: torch.Tensor, v_pool: torch.Tensor, block_size: int,
                  scales: Optional[tuple[torch.Tensor, torch.Tensor]] = None, reference: bool = False) -> PagedAttention:
        """The KV store and attention over the runner's pools: ``prepare(slots, spans)`` once per
        step, then ``attend(layer, q, k, v)`` per layer. ``reference``: the per-request loop."""
        return PagedAttention(k_pool, v_pool, block_size, reference=reference, scales=scales)

    def rope(self, model, positions: torch.Tensor, dtype: torch.dtype):
        """The step's rotary form (``HalfRope``/``PairRope`` in llmd.runtime.models.llama, or this
        backend's own): ``rotate(attn, qkv, ops) -> q, k, v``."""
        return model.rope(positions, dtype)

    @torch.inference_mode()
    def run(self, batch) -> torch.Tensor:
        """One step (the ModelRunner's StepBatch) -> float32 logits [len(sample_rows), vocab]."""
        hidden = self._sampled_hidden(batch)
        if hidden.shape[0] == 0:
            return hidden.new_empty(0, self.model.config.vocab_size, dtype=torch.float32)
        return self.model.compute_logits(hidden).float()

    @torch.inference_mode()
    def run_greedy(self, batch) -> list[int]:
        """One step whose sampled rows are all greedy -> each row's token, the first largest of its logits:
        through the head's screen where the model has one (llmd.runtime.formats.head_screen), which reads
        fewer bytes and finds the same token, else from the whole head's logits."""
        screen = self.model.head_screen
        if screen is None:
            return self.greedy(self.run(batch)).tolist()
        hidden = self._sampled_hidden(batch)
        if hidden.shape[0] == 0:
            return []
        ids = screen.argmax(hidden)
        return ids if ids is not None else self.greedy(self.model.compute_logits(hidden).float()).tolist()

    def _sampled_hidden(self, batch) -> torch.Tensor:
        """The step's final hidden states of its sampled rows only."""
        self.attn.prepare(batch.slot_mapping, batch.spans)
        hidden = self.forward(batch)
        if batch.sample_rows.numel() != hidden.shape[0]:
            hidden = hidden.index_select(0, batch.sample_rows)
        return hidden

    def forward(self, batch) -> torch.Tensor:
        """Final hidden states [T, hidden] of the step's packed rows: the whole-step hook a fused
        call or a captured graph replaces."""
        return self.model(batch.input_ids, batch.positions, self)

    def greedy(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's first largest value (int64 [M]), on the device."""
        return logits.argmax(-1)

    def greedy_rounds(self, runner, feeds: list[list[int]], positions: list[int], block_ids: list[list[int]],
                      steps: int) -> Optional[list[list[int]]]:
        """A draft's greedy forwards and argmaxes in fewer calls (llmd.runtime.spec.draft), or None:
        the draft's loop runs them one step at a time."""
        return None
