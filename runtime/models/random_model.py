"""Random-weight model directories of a given shape, for benchmarks and tests (nothing downloaded).

The tokenizer is a plain byte-level one (256 byte tokens + <|endoftext|>); the model's vocabulary may be
larger, as in real checkpoints that pad their embedding table.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from . import registry
from .config import ModelConfig
from .llama import LlamaForCausalLM
from .loader import save_model

SHAPES = {
    # hidden, layers, heads, kv heads, intermediate, vocab, tied
    "qwen2-0.5b": dict(architectures=["Qwen2ForCausalLM"], hidden_size=896, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864,
                       vocab_size=151936, tie_word_embeddings=True, rope_theta=1000000.0,
                       max_position_embeddings=32768),
    "tiny": dict(architectures=["LlamaForCausalLM"], hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=4, intermediate_size=1024, vocab_size=8192, tie_word_embeddings=False,
                 rope_theta=10000.0, max_position_embeddings=4096),
}


def hf_config(shape: str | dict, **overrides) -> dict:
    base = SHAPES[shape] if isinstance(shape, str) else shape
    family = base["architectures"][0].replace("ForCausalLM", "").lower()
    return {"model_type": family, "rms_norm_eps": 1e-6, "hidden_act": "silu", "torch_dtype": "float32",
            "eos_token_id": 256, "bos_token_id": None, **base, **overrides}


def init_weights(model: LlamaForCausalLM, seed: int, std: float = 0.02) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)


def write_byte_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "bos_token": None}))


def write_random_model(path: str | Path, shape: str | dict = "tiny", seed: int = 0, std: float = 0.02,
                       **overrides) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    raw = hf_config(shape, **overrides)
    cfg = ModelConfig.from_dict(raw)
    model = registry.get(cfg.architecture).model_class(cfg)
    init_weights(model, seed, std)
    save_model(model, path)
    (path / "config.json").write_text(json.dumps(raw, indent=1))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": raw["eos_token_id"]}))
    if not (path / "tokenizer.json").exists():
        write_byte_tokenizer(path)
    return path
