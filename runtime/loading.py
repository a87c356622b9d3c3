"""Resolve what EngineConfig.model names (a Hugging Face directory) into a ready model, its tokenizer
and the size of the KV pool."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .config import EngineConfig
from .errors import ModelLoadError
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


def load_for_engine(config: EngineConfig, progress=None) -> LoadedModel:
    path = Path(config.model)
    if not path.exists():
        raise ModelLoadError(f"{path}: no such model directory; pass a Hugging Face model directory "
                             "(config.json, *.safetensors, tokenizer.json)")
    cfg = ModelConfig.from_dir(path)
    tokenizer = Tokenizer.from_dir(path)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ModelLoadError(f"{path / 'tokenizer.json'}: tokenizer has {tokenizer.vocab_size} tokens but "
                             f"config.json says vocab_size {cfg.vocab_size}")
    model = load_model(path, config.dtype, cfg, progress=progress)
    model.prepare_for_inference()
    num_blocks = config.kv_memory_bytes // kv_bytes_per_block(cfg, config.block_size, config.dtype)
    if num_blocks < 1:
        raise ModelLoadError(f"kv_memory {config.kv_memory} cannot hold one block of {config.block_size} tokens "
                             f"for this model ({kv_bytes_per_block(cfg, config.block_size, config.dtype)} bytes)")
    return LoadedModel(model, cfg, tokenizer, num_blocks)
