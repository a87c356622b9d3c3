"""A TensorRT plan of the step graph (llmd.export.tensorrt) as a CompiledStep. CUDA only.

Untested on the machines llmd is built on: TensorRT cannot be installed there. Inputs and outputs
are torch CUDA tensors whose addresses are handed to the execution context; the profile is the
first whose token range holds T.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..errors import EngineDirError
from .base import CompiledStep


class TensorRTBackend(CompiledStep):
    name = "tensorrt"

    def __init__(self, plan_file: Path, token_ranges: list[tuple[int, int]], num_layers: int):
        import tensorrt as trt
        if not torch.cuda.is_available():
            raise EngineDirError("the tensorrt backend needs a CUDA GPU; none is visible")
        self.trt = trt
        runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self.engine = runtime.deserialize_cuda_engine(plan_file.read_bytes())
        if self.engine is None:
            raise EngineDirError(f"{plan_file}: TensorRT cannot deserialize the plan (other TensorRT version or GPU?)")
        self.context = self.engine.create_execution_context()
        self.token_ranges, self.num_layers = token_ranges, num_layers
        self.stream = torch.cuda.Stream()
        self.profile = -1

    @classmethod
    def from_engine_dir(cls, engine_dir: Path, manifest: dict, device: str = "auto") -> "TensorRTBackend":
        # TensorRT runs only on CUDA: loading refuses device cpu before this
        rel = manifest.get("artifacts", {}).get("tensorrt")
        if not rel:
            raise EngineDirError(f"{engine_dir}: the manifest names no TensorRT plan; export with --backend tensorrt")
        cfg = manifest["artifacts"]["tensorrt_shapes"]
        return cls(engine_dir / rel, profiles(manifest["shape_buckets"], cfg["max_context"]), cfg["num_layers"])

    def _select_profile(self, t: int) -> None:
        idx = next((i for i, (lo, hi) in enumerate(self.token_ranges) if lo <= t <= hi), None)
        if idx is None:
            raise EngineDirError(f"no TensorRT profile holds {t} new tokens; export with larger token buckets")
        if idx != self.profile:
            self.context.set_optimization_profile_async(idx, self.stream.cuda_stream)
            self.profile = idx

    def forward(self, input_ids, positions, past_k, past_v):
        t = input_ids.shape[0]
        self._select_profile(t)
        inputs = {"input_ids": input_ids.cuda().long(), "positions": positions.cuda().long(),
                  "past_k": past_k.cuda().float().contiguous(), "past_v": past_v.cuda().float().contiguous()}
        for name, x in inputs.items():
            self.context.set_input_shape(name, tuple(x.shape))
            self.context.set_tensor_address(name, x.data_ptr())
        outputs = {}
        for name in ("logits", "new_k", "new_v"):
            shape = tuple(self.context.get_tensor_shape(name))
            outputs[name] = torch.empty(shape, dtype=torch.float32, device="cuda")
            self.context.set_tensor_address(name, outputs[name].data_ptr())
        if not self.context.execute_async_v3(self.stream.cuda_stream):
            raise EngineDirError("TensorRT execution failed")
        self.stream.synchronize()
        return tuple(outputs[n].cpu() for n in ("logits", "new_k", "new_v"))


def profiles(buckets: dict, max_context: int) -> list[tuple[int, int]]:
    """(lowest T, highest T) for each token bucket: [1,1], [2,16], [17,64], ..."""
    tokens = sorted(set(buckets.get("tokens", [1, 16, 64, 256, 512])))
    lows = [1] + [t + 1 for t in tokens[:-1]]
    return [(lo, hi) for lo, hi in zip(lows, tokens) if hi <= max_context]
