"""The runner contract: what the engine, the speculative proposers, the disk tier and the stats read
from a model runner, and from its ``execution``. Every runner (``ModelRunner`` on the cpu, reference
and compiled backends, ``CudaBackend``) has every member; what a runner cannot do it says through a
capability flag, never through a missing attribute the caller would have to probe for.

    engine.step     copy_slots, copy_shifted (if can_shift), prepare, run / run_greedy (if screens_head),
                    sample (if samples_on_device), execution.greedy
    spec/draft.py   prepare_feeds, run, execution.greedy, execution.greedy_rounds
    kv_tier.py      block_views
    engine.stats    k_pool, model, execution.kernels, step_graphs
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional

import torch

# data members every runner sets (methods are the abstract ones below)
RUNNER_ATTRIBUTES = {
    "model": "the LlamaForCausalLM it runs (its head screen, its weights for the bench)",
    "k_pool": "keys [layers, slots, kv_heads, head_dim]; ``v_pool`` the values, same shape and dtype",
    "v_pool": "values, as ``k_pool``",
    "device": "where the pools and the step's tensors live",
    "execution": "the step's backend: ``greedy``, ``greedy_rounds`` and ``kernels`` (EXECUTION_MEMBERS)",
    "can_shift": "capability: ``copy_shifted`` moves keys to other positions (else it raises)",
    "screens_head": "capability: greedy steps find their tokens through the head's screen (``run_greedy``)",
    "samples_on_device": "capability: ``run``'s logits stay on the device and ``sample`` draws there",
    "step_graphs": "how steps are replayed from captured graphs (None: never), for the stats",
}
EXECUTION_MEMBERS = ("greedy", "greedy_rounds", "kernels")


class Runner(ABC):
    """One model's pools and steps. Subclasses set every name in RUNNER_ATTRIBUTES."""

    # how steps are replayed: None where a runner captures nothing (the CPU's), else the CUDA runner's
    # "captured", "standin" (the CPU stand-in), "off", or "failed: <error>" (steps run eagerly)
    step_graphs: Optional[str] = None

    @abstractmethod
    def prepare(self, scheduled: list) -> object:
        """The step's inputs for the scheduler's requests (a batch ``run`` takes, with ``sample_counts``)."""

    @abstractmethod
    def prepare_feeds(self, feeds: list) -> object:
        """The step's inputs from model_runner.Feed items (the draft's own forwards)."""

    @abstractmethod
    def run(self, batch) -> torch.Tensor:
        """Float32 logits of the batch's sampled rows [rows, vocab] (on ``device``)."""

    @abstractmethod
    def run_greedy(self, batch) -> list[int]:
        """Each sampled row's greedy token, where every sampled row of the batch is greedy."""

    @abstractmethod
    def sample(self, logits: torch.Tensor, rows: list) -> list[int]:
        """One token per row of ``logits``, drawn with each sampler.SamplingRow's parameters."""

    @abstractmethod
    def copy_slots(self, src: int, dst: int, n: int) -> None:
        """Copy the first ``n`` slots of block ``src`` into block ``dst`` (partial-block prefix reuse)."""

    @abstractmethod
    def copy_shifted(self, src: list[int], dst: list[int], delta: int) -> None:
        """Copy slots ``src`` to ``dst`` with each key rotated by ``delta`` positions (``can_shift``)."""

    @abstractmethod
    def block_views(self, block_id: int) -> list[torch.Tensor]:
        """One block's keys and values in every layer, as views of the pools (the disk tier's unit)."""


def missing_members(runner) -> list[str]:
    """The contract's names that ``runner`` (an instance) or its ``execution`` lacks."""
    methods = sorted(Runner.__abstractmethods__)
    missing = [m for m in [*methods, *RUNNER_ATTRIBUTES] if not hasattr(runner, m)]
    execution: Optional[object] = getattr(runner, "execution", None)
    if execution is not None:
        missing += [f"execution.{m}" for m in EXECUTION_MEMBERS if not hasattr(execution, m)]
    return missing
