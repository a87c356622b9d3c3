"""Step backends: something other than the torch module that runs one model step.

A backend runs one sequence's new tokens against that sequence's past keys/values, which llmd
gathers from its own paged pool; it returns the new tokens' keys/values for llmd to write back.
The pool, the block tables and the scheduling stay llmd's. Backends are created through a lazy
registry, so importing llmd never imports onnxruntime or TensorRT.
"""
from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from pathlib import Path

import torch

from ..errors import EngineDirError


class CompiledStep(ABC):
    """forward(input_ids [T], positions [T], past_k/past_v [L, P, kvh, D]) ->
    (logits [T, vocab] f32, new_k/new_v [L, T, kvh, D] f32). Past positions are 0..P-1."""

    name = ""

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, past_k: torch.Tensor,
                past_v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ...


# name -> "module:factory"; the factory takes (engine_dir: Path, manifest: dict, device: str)
_REGISTRY = {
    "onnxruntime": "llmd.runtime.backends.onnxruntime:OnnxRuntimeBackend.from_engine_dir",
    "tensorrt": "llmd.runtime.backends.tensorrt:TensorRTBackend.from_engine_dir",
    "aot": "llmd.runtime.backends.aot:AotBackend.from_engine_dir",
}


def available_backends() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def create_backend(name: str, engine_dir: Path, manifest: dict, device: str = "auto") -> CompiledStep:
    """Import the backend's module only now; a missing library is an EngineDirError naming the extra."""
    if name not in _REGISTRY:
        raise EngineDirError(f"unknown backend {name!r}; known: {sorted(_REGISTRY)}")
    module, _, attr = _REGISTRY[name].partition(":")
    try:
        obj = importlib.import_module(module)
    except ImportError as e:
        raise EngineDirError(f"backend {name!r} needs a library that is not installed ({e}); "
                             f"install llmd[{'gpu' if name == 'tensorrt' else 'onnx'}]") from None
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj(Path(engine_dir), manifest, device)
