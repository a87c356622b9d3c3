"""The ONNX step graph (llmd.export.onnx) on onnxruntime, bound with IO binding.

Inputs are bound straight from the torch tensors' memory (CPU) and outputs are allocated by
onnxruntime and handed back to torch without a copy. On a machine with the CUDA provider the
session uses it; everything else is unchanged.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from ..errors import EngineDirError
from .base import CompiledStep


def providers(device: str = "auto") -> list[str]:
    """Execution providers for a device: auto prefers CUDA when onnxruntime-gpu is installed."""
    have = ort.get_available_providers()
    if device == "cpu":
        return ["CPUExecutionProvider"]
    if device == "cuda":
        if "CUDAExecutionProvider" not in have:
            raise EngineDirError("device cuda: this onnxruntime has no CUDA provider (it offers "
                                 f"{', '.join(have)}); install llmd[gpu] (onnxruntime-gpu) or serve with --device cpu")
        return ["CUDAExecutionProvider"]
    return [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in have]


class OnnxRuntimeBackend(CompiledStep):
    name = "onnxruntime"

    def __init__(self, model_file: Path, threads: int | None = None, device: str = "auto"):
        so = ort.SessionOptions()
        # the file was optimized at export time; only the cheap provider-specific passes remain
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        if threads:
            so.intra_op_num_threads = threads
        chosen = providers(device)
        try:
            self.session = ort.InferenceSession(str(model_file), so, providers=chosen)
        except Exception as e:       # onnxruntime raises its own untyped errors
            raise EngineDirError(f"{model_file}: onnxruntime cannot load the graph ({e})") from None
        self.binding = self.session.io_binding()

    @classmethod
    def from_engine_dir(cls, engine_dir: Path, manifest: dict, device: str = "auto") -> "OnnxRuntimeBackend":
        rel = manifest.get("artifacts", {}).get("onnx")
        if not rel:
            raise EngineDirError(f"{engine_dir}: the manifest names no ONNX graph; export with --backend onnxruntime")
        return cls(engine_dir / rel, torch.get_num_threads(), device)

    def forward(self, input_ids, positions, past_k, past_v):
        b = self.binding
        b.clear_binding_inputs()
        b.clear_binding_outputs()
        for name, t in (("input_ids", input_ids), ("positions", positions), ("past_k", past_k), ("past_v", past_v)):
            b.bind_cpu_input(name, np.ascontiguousarray(t.numpy()))
        for name in ("logits", "new_k", "new_v"):
            b.bind_output(name, "cpu")
        self.session.run_with_iobinding(b)
        return tuple(torch.from_numpy(v.numpy()) for v in b.get_outputs())
