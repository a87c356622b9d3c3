"""Tiny random-weight model directories built in the test run (no downloads)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from llmd.runtime.models.config import ModelConfig
from llmd.runtime.models.llama import LlamaForCausalLM
from llmd.runtime.models.loader import save_model

SPECIAL_TOKENS = ["<|endoftext|>", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>",
                  "<|file_sep|>", "<|repo_name|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = [
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "import os\nimport sys\n\nclass Reader:\n    def __init__(self, path):\n        self.path = path\n",
    "for i in range(10):\n    print(i, 'hello world', i * 2)\n",
    "The quick brown fox jumps over the lazy dog. Hello, world! How are you today?\n",
    "héllo wörld — ünïcode text, 日本語のテキスト, emoji 🙂🚀\n",
]


def write_tokenizer(path: Path, vocab_size: int = 512) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 20, trainer)
    tok.save(str(path / "tokenizer.json"))
    added = {str(tok.token_to_id(t)): {"content": t, "special": True} for t in SPECIAL_TOKENS}
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": None, "eos_token": "<|endoftext|>", "added_tokens_decoder": added,
        "chat_template": CHAT_TEMPLATE, "model_max_length": 2048}))
    return tok.get_vocab_size()


def make_model_dir(path: Path, *, seed: int = 0, hidden: int = 64, layers: int = 2, heads: int = 4,
                   kv_heads: int = 2, intermediate: int = 128, max_pos: int = 1024, tie: bool = True,
                   architecture: str = "LlamaForCausalLM", std: float = 0.5, **extra) -> Path:
    """A random Llama-family model with a real byte-level BPE tokenizer.

    A large init std makes the logits peaky, so greedy choices are far from ties and stable.
    """
    path.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(path)
    eos = 0
    raw = {"architectures": [architecture], "model_type": architecture.replace("ForCausalLM", "").lower(),
           "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": intermediate,
           "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
           "max_position_embeddings": max_pos, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
           "tie_word_embeddings": tie, "eos_token_id": eos, "bos_token_id": None, "torch_dtype": "float32",
           "hidden_act": "silu", **extra}
    (path / "config.json").write_text(json.dumps(raw))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    cfg = ModelConfig.from_dict(raw)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    for name, p in model.named_parameters():
        if "norm" in name:
            torch.nn.init.ones_(p)
        else:
            torch.nn.init.normal_(p, std=std / (p.shape[-1] ** 0.5) if p.dim() > 1 else 0.02)
    save_model(model, path)
    return path
