"""Load the models of an engine directory (layout and manifest: manifest.py; llmd.export writes them).

A model subdirectory (target/ or draft/) holds the source's config.json, generation config and
tokenizer files unchanged, plus weights.safetensors with llmd's own module names: float tensors
(norms, a float embedding or head) and the quantized modules' buffers (qweight, scales, zeros,
bias). safetensors only; nothing is unpickled.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..config import float_dtype
from ..errors import EngineDirError, ModelLoadError
from ..models.config import ModelConfig
from ..models import registry
from ..models.llama import LlamaForCausalLM
from ..tokenizer import Tokenizer, check_vocab
from .manifest import read_manifest
from .quantized import QuantizationError, QuantSpec, prepare_quantized, quantize_model

WEIGHTS = "weights.safetensors"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build_empty(cfg: ModelConfig, spec: QuantSpec, dtype: torch.dtype) -> LlamaForCausalLM:
    model = registry.get(cfg.architecture).model_class.empty(cfg, dtype)
    return quantize_model(model, spec, from_weights=False)


def load_model_dir(path: Path, spec: QuantSpec, dtype: str = "float32") -> tuple[LlamaForCausalLM, ModelConfig]:
    """Build the quantized model and load weights.safetensors with strict names, shapes and dtypes."""
    try:
        cfg = ModelConfig.from_dir(path)
        model = build_empty(cfg, spec, DTYPES[dtype])
    except (ModelLoadError, QuantizationError) as e:
        raise EngineDirError(f"{path}: {e}") from None
    expected = dict(model.state_dict())
    state = read_weights(path / WEIGHTS)
    missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or extra:
        raise EngineDirError(f"{path / WEIGHTS}: tensors do not match the manifest's quantization "
                             f"(missing {missing[:3]}, unexpected {extra[:3]}); re-export")
    for name, t in state.items():
        want = expected[name]
        if tuple(t.shape) != tuple(want.shape) or t.is_floating_point() != want.is_floating_point() or \
                (not t.is_floating_point() and t.dtype != want.dtype):
            raise EngineDirError(f"{path / WEIGHTS}: tensor {name!r} is {t.dtype}{tuple(t.shape)}, expected "
                                 f"{want.dtype}{tuple(want.shape)}")
        if t.is_floating_point():
            state[name] = t.to(want.dtype)
    model.load_state_dict(state, strict=True, assign=True)
    model.eval()
    model.prepare_for_inference()
    prepare_quantized(model)
    return model, cfg


def read_weights(file: Path) -> dict[str, torch.Tensor]:
    try:
        with safe_open(str(file), framework="pt") as st:
            return {name: st.get_tensor(name) for name in st.keys()}
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise EngineDirError(f"{file}: cannot read safetensors ({e}); re-export") from None


def load_engine_model(path, config, progress=None):
    """The engine's entry point: verify ENGINE/manifest.json, then load the target.

    Returns (model, ModelConfig, Tokenizer). ``config`` is the EngineConfig (its dtype applies to
    float tensors and activations; quantized tensors keep their integer storage).
    ``progress(done, total)``: 1 of 2 after the hashes are verified, 2 of 2 when loaded."""
    path = Path(path)
    manifest = read_manifest(path)
    if progress:
        progress(1, 2)
    loaded = load_engine_part(path, manifest, "target", float_dtype(config.dtype))
    if progress:
        progress(2, 2)
    return loaded


def load_engine_part(path: Path, manifest: dict, part: str, dtype: str = "float32"):
    """Load the "target" or "draft" model of a verified engine directory."""
    entry = manifest["models"].get(part)
    if not isinstance(entry, dict) or not isinstance(entry.get("dir"), str):
        raise EngineDirError(f"{path / 'manifest.json'}: no {part} model recorded")
    sub = path / entry["dir"]
    if not sub.resolve().is_relative_to(path.resolve()) or sub.resolve() == path.resolve():
        raise EngineDirError(f"{path / 'manifest.json'}: the {part} directory {entry['dir']!r} is not inside the "
                             "engine directory")
    spec = QuantSpec.from_dict(entry.get("quantization", manifest["quantization"]))
    model, cfg = load_model_dir(sub, spec, dtype)
    try:
        tokenizer = Tokenizer.from_dir(sub)
        check_vocab(sub, tokenizer, cfg)
    except ModelLoadError as e:
        raise EngineDirError(f"{sub}: {e}") from None
    return model, cfg, tokenizer


def engine_draft_dir(path) -> Path | None:
    """The draft's subdirectory when the engine directory carries one (unverified; see load_engine_draft)."""
    try:
        manifest = json.loads((Path(path) / "manifest.json").read_text())
        return Path(path) / manifest["models"]["draft"]["dir"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def load_engine_draft(path, config):
    """The draft recorded in an engine directory, verified like the target: (model, cfg, tokenizer)."""
    path = Path(path)
    return load_engine_part(path, read_manifest(path), "draft", float_dtype(config.dtype))
