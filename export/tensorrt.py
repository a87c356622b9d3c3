"""TensorRT engine from the exported ONNX step graph, with one optimization profile per token-count
bucket. Written against the TensorRT 10 Python API and untested on the machines llmd is built on
(TensorRT cannot be installed there); the tests skip with that reason.

The step graph serves one sequence per call (llmd.export.onnx), so the profiles vary the new-token
count T and the past length P; the batch buckets of the manifest apply to the torch backend.
TensorRT gets the plain float graph (onnxruntime's contrib ops are not TensorRT ops) and builds it
with FP16 kernels; llmd's int8/int4 weight formats are not carried into TensorRT.
"""
from __future__ import annotations

from pathlib import Path

from llmd.runtime.backends.tensorrt import profiles
from llmd.runtime.errors import EngineDirError

PLAN = "tensorrt/target.plan"


def require_tensorrt():
    try:
        import tensorrt as trt
    except ImportError:
        raise EngineDirError("the tensorrt backend needs TensorRT and an NVIDIA GPU: install llmd[gpu] on a "
                             "machine with CUDA (TensorRT is not installed here)") from None
    return trt


def build_engine(out: Path, onnx_rel: str, buckets: dict, num_layers: int, kv_heads: int, head_dim: int,
                 max_context: int, workspace_bytes: int = 4 << 30) -> str:
    trt = require_tensorrt()
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(out / onnx_rel)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise EngineDirError(f"TensorRT cannot parse {onnx_rel}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)
    config.set_flag(trt.BuilderFlag.FP16)
    kv = lambda p: (num_layers, p, kv_heads, head_dim)   # noqa: E731
    for lo, hi in profiles(buckets, max_context):
        profile = builder.create_optimization_profile()
        for name in ("input_ids", "positions"):
            profile.set_shape(name, (lo,), (hi,), (hi,))
        for name in ("past_k", "past_v"):
            profile.set_shape(name, kv(0), kv(max_context // 2), kv(max_context - hi))
        config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise EngineDirError("TensorRT failed to build the engine (see its log above)")
    (out / PLAN).parent.mkdir(parents=True, exist_ok=True)
    (out / PLAN).write_bytes(bytes(plan))
    return PLAN
