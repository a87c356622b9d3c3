"""A step lint without a GPU: whole CUDA-backend steps under FakeTensorMode, with fake device tensors.

Fake tensors carry shapes, dtypes and devices but no values, so a step that reads a value on the host
(``.item()``, ``.tolist()``, ``bool(t)``, a ``nonzero`` or boolean-mask index, whose size depends on
values) raises, as does any op mixing a CPU tensor into the step's device tensors. A step that
passes has no host sync and keeps everything on the device, up to the sampled ids (the one copy back
is the caller's). The Triton kernels run through their fake implementations.

On a machine with CUDA the fake tensors are on ``cuda``. torch built without CUDA cannot even index a
fake ``cuda`` tensor (its device guard is missing), so there the fake tensors sit on ``meta``, which
stands for the GPU: a CPU tensor mixed into the step is caught the same way.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException,
                                           FakeTensor, FakeTensorMode, unset_fake_temporarily)

from llmd.runtime.model_runner import Feed
from llmd.runtime.models.config import ModelConfig
from llmd.runtime.models.llama import LlamaForCausalLM
from llmd.runtime.sampler import SamplingRow

from .backend import CudaRunner
from .sampling import SamplingBatch, host_values, sample_tokens

DEVICE = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("meta")


class StepLintError(RuntimeError):
    """What the lint caught: a host sync or a device mismatch inside the step."""


def lint_steps(cfg: ModelConfig, steps: list[tuple[list[Feed], list[SamplingRow]]], dtype: str = "bfloat16",
               num_blocks: int = 64, max_num_seqs: int = 8, num_spec_tokens: int = 0,
               graphs: str = "standin", runner_hook=None) -> list[torch.Tensor]:
    """Run ``steps`` (each: the feeds and the sampled rows' parameters) through a CudaRunner on fake
    device tensors, sampling on the device. Returns each step's fake token ids; raises StepLintError.
    ``runner_hook(runner)`` may change the runner before the steps (tests plant faults with it)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    out = []
    try:
        with mode:
            model = fake_cuda_model(cfg, getattr(torch, dtype), mode)
            runner = CudaRunner(model, num_blocks, 16, dtype, device=DEVICE, max_num_seqs=max_num_seqs,
                                     num_spec_tokens=num_spec_tokens, graphs=graphs, pin=False)
            if runner_hook is not None:
                runner_hook(runner)
            for feeds, rows in steps:
                logits = runner.run(runner.prepare_feeds(feeds))
                with unset_fake_temporarily():           # host work: the rows' generators draw on the CPU
                    host = host_values(rows)
                tokens = sample_tokens(logits, SamplingBatch.from_host(*host, logits.device))
                _expect_device(tokens, "sampled ids")
                out.append(tokens)
    except (DataDependentOutputException, DynamicOutputShapeException) as e:
        raise StepLintError(f"host sync inside the step: {_name(e)}") from e
    except RuntimeError as e:
        if "device" in str(e) and not isinstance(e, StepLintError):
            raise StepLintError(f"device mismatch inside the step: {e}") from e
        if "nonzero" in str(e) or "data-dependent" in str(e) or "dynamic" in str(e):
            raise StepLintError(f"host sync inside the step: {e}") from e
        raise
    return out


def fake_cuda_model(cfg: ModelConfig, dtype: torch.dtype, mode: FakeTensorMode) -> LlamaForCausalLM:
    """The model with fake parameters on the lint's device (``dtype``) and buffers (their own dtype)."""
    with unset_fake_temporarily():
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg)
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                module._parameters[name] = torch.nn.Parameter(_fake(mode, p.shape, dtype), requires_grad=False)
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = _fake(mode, b.shape, b.dtype)
    return model


def _fake(mode: FakeTensorMode, shape, dtype) -> FakeTensor:
    with unset_fake_temporarily():
        meta = torch.empty(shape, dtype=dtype, device="meta")
    return FakeTensor(mode, meta, DEVICE)


def _expect_device(t: torch.Tensor, what: str) -> None:
    if t.device != DEVICE:
        raise StepLintError(f"{what} ended on {t.device}, not the step's device ({DEVICE})")


def _name(e: Exception) -> Optional[str]:
    return str(getattr(e, "func", "") or e)
