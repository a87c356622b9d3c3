"""Resolve what EngineConfig.model names (a Hugging Face directory) into a ready model, its tokenizer
and the size of the KV pool."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional
from pathlib import Path

from .config import EngineConfig
from .errors import EngineDirError, ModelLoadError
from .formats.gguf_import import resolve_model_path
from .model_runner import kv_bytes_per_block
from .models.config import ModelConfig
from .models.llama import LlamaForCausalLM
from .models.loader import load_model
from .tokenizer import Tokenizer


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Tokenizer
    num_blocks: int
    draft: Optional[LlamaForCausalLM] = None
    draft_config: Optional[ModelConfig] = None
    kv_dtype: str = "auto"
    backend: Optional[object] = None          # a StepBackend when the engine directory was compiled for one


def load_for_engine(config: EngineConfig, progress=None) -> LoadedModel:
    path = Path(resolve_model_path(config.model, config.dtype))      # a .gguf file: its cached import
    if not path.exists():
        raise ModelLoadError(f"{path}: no such model directory; pass a Hugging Face model directory "
                             "(config.json, *.safetensors, tokenizer.json) or an llmd engine directory")
    kv_dtype = config.kv_dtype
    backend = None
    draft_path = (Path(resolve_model_path(config.draft, config.dtype))
                  if config.draft and config.draft not in ("ngram", "auto", "none") else None)
    if (path / "manifest.json").is_file():
        from llmd.export.engine_dir import engine_draft_dir, load_engine_model     # quantized / compiled engines
        from llmd.export.manifest import read_manifest
        manifest = read_manifest(path, verify_hashes=False)     # its values are used once load_engine_model verified it
        check_device(path, backend_name(manifest), config.device)
        model, cfg, tokenizer = load_engine_model(path, config, progress=progress)
        if kv_dtype == "auto":
            kv_dtype = (manifest.get("quantization") or {}).get("kv_dtype", "auto")
        backend = engine_backend(path, manifest, config.device)
        if config.draft in (None, "auto") and engine_draft_dir(path) is not None:
            draft_path = path                                   # an engine's own draft speculates by default
    elif (path / "target" / "weights.safetensors").is_file():
        raise EngineDirError(f"{path}: an engine directory without manifest.json: the export did not finish; "
                             "run `llmd export` again")
    else:
        check_device(path, "torch", config.device)
        model, cfg, tokenizer = load_hf_model(path, config.dtype, progress)
    draft = draft_cfg = None
    if draft_path is not None:
        draft, draft_cfg = load_draft(draft_path, config, tokenizer)
    blocks = kv_blocks([cfg] + ([draft_cfg] if draft_cfg else []), config, kv_dtype)
    return LoadedModel(model, cfg, tokenizer, blocks, draft, draft_cfg, kv_dtype, backend)


def load_draft(path: Path, config: EngineConfig, target_tokenizer: Tokenizer):
    """A draft from a model directory, an engine directory's own draft, or an engine directory."""
    if not path.exists():
        raise ModelLoadError(f"{path}: no such draft model directory; pass a directory, 'ngram', or no draft")
    if (path / "manifest.json").is_file():
        from llmd.export.engine_dir import engine_draft_dir, load_engine_draft, load_engine_model
        model, cfg, tok = load_engine_draft(path, config) if engine_draft_dir(path) else load_engine_model(path, config)
    else:
        model, cfg, tok = load_hf_model(path, config.dtype)
    if tok.vocab_size != target_tokenizer.vocab_size or tok.encode(PROBE) != target_tokenizer.encode(PROBE):
        raise ModelLoadError(f"{path / 'tokenizer.json'}: the draft's tokenizer differs from the target's; "
                             "speculative decoding needs the same tokenizer")
    return model, cfg


PROBE = "def f(x):\n    return {'a': [1, 2.5]}  # héllo 日本 🙂\n"


def backend_name(manifest: dict) -> str:
    name = manifest.get("backend", "torch")
    return "aot" if name == "torch" and (manifest.get("artifacts") or {}).get("aot") else name


def check_device(path: Path, backend: str, device: str) -> None:
    """Refuse, before any weights load, a device the model cannot run on. llmd's own model code and
    kernels (Hugging Face directories, torch and AOT engines) run on the CPU; a GPU is reached through
    an engine directory compiled for ONNX Runtime or TensorRT (the backend checks its provider)."""
    if device == "cuda" and backend in ("torch", "aot"):
        raise EngineDirError(f"{path}: llmd runs {'this AOT engine' if backend == 'aot' else 'this model'} on the CPU "
                             "only; for a GPU, export an engine with `llmd export --backend onnxruntime` (needs "
                             "llmd[gpu], onnxruntime-gpu) or `--backend tensorrt`, or serve with --device cpu")
    if device == "cpu" and backend == "tensorrt":
        raise EngineDirError(f"{path}: a TensorRT engine runs only on a CUDA GPU; export for the CPU with "
                             "`llmd export --backend torch` or `--backend onnxruntime`")


def engine_backend(path: Path, manifest: dict, device: str = "auto"):
    """The compiled step backend an engine directory asks for, or None for plain torch modules."""
    name = backend_name(manifest)
    if name == "torch":
        return None
    from .backends.base import create_backend
    return create_backend(name, path, manifest, device)


def load_hf_model(path: Path, dtype: str, progress=None) -> tuple[LlamaForCausalLM, ModelConfig, Tokenizer]:
    cfg = ModelConfig.from_dir(path)
    tokenizer = Tokenizer.from_dir(path)
    check_vocab(path, tokenizer, cfg)
    model = load_model(path, dtype, cfg, progress=progress)
    model.prepare_for_inference()
    return model, cfg, tokenizer


def check_vocab(path: Path, tokenizer: Tokenizer, cfg: ModelConfig) -> None:
    """A tokenizer with more tokens than the model's embedding would feed it ids it has no row for."""
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ModelLoadError(f"{Path(path) / 'tokenizer.json'}: tokenizer has {tokenizer.vocab_size} tokens but "
                             f"config.json says vocab_size {cfg.vocab_size}")


def kv_blocks(cfgs: list[ModelConfig], config: EngineConfig, kv_dtype: str = "auto") -> int:
    """Blocks that fit the budget when each block holds KV for every model in ``cfgs``."""
    per_block = sum(kv_bytes_per_block(c, config.block_size, config.dtype, kv_dtype) for c in cfgs)
    num_blocks = config.kv_memory_bytes // per_block
    if num_blocks < 1:
        raise ModelLoadError(f"kv_memory {config.kv_memory} cannot hold one block of {config.block_size} tokens "
                             f"for this model ({per_block} bytes)")
    return num_blocks
