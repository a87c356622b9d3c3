"""AOTInductor packages of the step graph (llmd.export.onnx.OnnxStep) with llmd's own (quantized)
modules, compiled at export time so that a server starts warm.

Two packages, because the quantized modules choose their kernel by row count and a compiled graph
holds one choice: ``decode.pt2`` for 1..small_m new tokens (packed low-bit kernels) and
``prefill.pt2`` for more (dense or integer matmuls). Both take and return the same tensors as the
ONNX graph, so the same CompiledStep contract and paged driver (llmd.runtime.backends.paged) apply.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from llmd.runtime.formats.quantized import prepare_quantized, quantize_model
from llmd.runtime.models.loader import load_model

from .onnx import MAX_STEP_TOKENS, OnnxStep, example_inputs

PACKAGES = {"decode": "aot/decode.pt2", "prefill": "aot/prefill.pt2"}


def build_aot_package(source: Path, out: Path, spec, max_tokens: int = MAX_STEP_TOKENS) -> dict:
    from torch.export import Dim

    if spec.head == "int8g":
        # the int8g head has no form torch can trace but its dequantization, which a compiled graph
        # would redo every step: the packages (weights inside) carry a head with one scale per row
        spec = replace(spec, head="int8")
    model = quantize_model(load_model(source, "float32"), spec)
    model.requires_grad_(False)
    prepare_quantized(model, use_kernels=False)
    step = OnnxStep(model, separate_embedding=False).eval()
    (out / "aot").mkdir(parents=True, exist_ok=True)
    p = Dim("P", min=0, max=model.config.max_position_embeddings)
    ranges = {"decode": (1, spec.small_m), "prefill": (spec.small_m + 1, max_tokens)}
    for name, (lo, hi) in ranges.items():
        t = Dim(f"T_{name}", min=lo, max=hi)
        dynamic = {"input_ids": {0: t}, "positions": {0: t}, "past_k": {1: p}, "past_v": {1: p}}
        with torch.no_grad():
            program = torch.export.export(step, example_inputs(model, t=max(lo, 2) if hi > 1 else 1), dynamic_shapes=dynamic)
            torch._inductor.aoti_compile_and_package(program, package_path=str(out / PACKAGES[name]))
    return dict(PACKAGES, small_m=spec.small_m, head=spec.head)
