"""The demo models as Hugging Face model directories: their config, a fresh model, and writing one."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from llmd.runtime.models.config import ModelConfig
from llmd.runtime.models.llama import LlamaForCausalLM
from llmd.runtime.models.loader import save_model

from .train_loop import init_weights

MAX_WEIGHT_BYTES = 40 * 2**20
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def hf_config(shape: dict, vocab_size: int, eot_id: int, seq_len: int) -> dict:
    """A Hugging Face config.json for a Llama of this shape."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **shape,
            "vocab_size": vocab_size, "max_position_embeddings": seq_len, "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": True,
            "attention_bias": False, "mlp_bias": False, "bos_token_id": eot_id, "eos_token_id": eot_id,
            "torch_dtype": "float32"}


def new_model(config: dict, seed: int) -> LlamaForCausalLM:
    model = LlamaForCausalLM(ModelConfig.from_dict(config))
    init_weights(model, seed)
    return model


def write_model_dir(model: LlamaForCausalLM, config: dict, tokenizer_dir: Path, out: Path) -> None:
    """A complete Hugging Face model directory: weights, config, generation config, tokenizer.

    Weights are float32 unless that would exceed MAX_WEIGHT_BYTES; then bfloat16."""
    out.mkdir(parents=True, exist_ok=True)
    save_model(model, out)
    if (out / "model.safetensors").stat().st_size > MAX_WEIGHT_BYTES:
        tensors = load_file(str(out / "model.safetensors"))
        save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, str(out / "model.safetensors"),
                  metadata={"format": "pt"})
        config = {**config, "torch_dtype": "bfloat16"}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id") if config.get(k) is not None} | {"do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        shutil.copyfile(tokenizer_dir / name, out / name)


# ---- stages ------------------------------------------------------------------------------------
