"""Write the models of an engine directory (llmd.runtime.formats.engine_dir reads them back).

A model subdirectory (target/ or draft/) holds the source's config.json, generation config and
tokenizer files unchanged, plus weights.safetensors with llmd's own module names: float tensors
(norms, a float embedding or head) and the quantized modules' buffers (qweight, scales, zeros,
bias). safetensors only; nothing is pickled.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from llmd.runtime.formats.engine_dir import WEIGHTS
from llmd.runtime.formats.manifest import sha256_file
from llmd.runtime.formats.quantized import QuantSpec
from llmd.runtime.models.llama import LlamaForCausalLM

COPIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
          "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja")


def save_model_dir(model: LlamaForCausalLM, source: Path, out: Path, spec: QuantSpec) -> None:
    """Copy the source's config and tokenizer files and write the (quantized) tensors."""
    out.mkdir(parents=True, exist_ok=True)
    for name in COPIED:
        if (source / name).is_file():
            shutil.copyfile(source / name, out / name)
    tensors = {k: v.float() if v.is_floating_point() else v for k, v in quantized_state(model).items()}
    save_file(tensors, str(out / WEIGHTS), metadata={"format": "pt", "quantization": json.dumps(spec.to_dict())})


def source_hashes(source: Path) -> dict:
    files = sorted(p for p in source.iterdir() if p.is_file() and (p.suffix == ".safetensors" or p.name in COPIED))
    return {"path": str(source.resolve()), "sha256": {p.name: sha256_file(p) for p in files}}


def quantized_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor an engine directory stores, each storage once (a tied int8 table appears under
    lm_head.* only)."""
    out, seen = {}, set()
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t is None or name.startswith("rotary.") or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        out[name] = t.detach().contiguous()
    return out
