"""GGUF files of every block type llmd reads in place, written in the test run from random blocks with
sane scales (llmd.bench.random_blocks)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from llmd.bench.random_blocks import BLOCK_TYPES, random_blocks  # noqa: F401 (the tests import them here)
from llmd.bench.to_gguf import _hparams, _vocab
from llmd.runtime.formats.gguf_native import BLOCKS, TYPES
from llmd.runtime.models import registry

from modelfactory import make_model_dir

ALL_TYPES = ["F32", "F16", "BF16", *BLOCK_TYPES]


def write_model(path: Path, types: dict[str, str], *, arch: str = "llama", hidden: int = 256, intermediate: int = 512,
                layers: int = 2, heads: int = 4, kv_heads: int = 2, tie: bool = True, seed: int = 0) -> Path:
    """A GGUF model of random blocks: ``types`` maps a tensor kind (attn_q, ffn_down, token_embd, output,
    ...) to its type, "*" the rest. The tokenizer is modelfactory's (a real byte-level BPE)."""
    import gguf
    import json
    src = make_model_dir(path.parent / (path.stem + "-src"), hidden=hidden, intermediate=intermediate, layers=layers,
                         heads=heads, kv_heads=kv_heads, tie=tie, seed=seed,
                         architecture={"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch])
    cfg = json.loads((src / "config.json").read_text())
    w = gguf.GGUFWriter(str(path), arch)
    _hparams(w, cfg, registry.by_gguf()[arch].gguf)
    _vocab(w, src, cfg)
    rng = np.random.default_rng(seed)
    d = hidden // heads

    def matrix(name: str, rows: int, cols: int, scale: float = 1.0) -> None:
        kind = name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0]
        t = types.get(kind, types.get("*", "Q8_0"))
        raw = random_blocks(t, rows, cols, rng, scale)
        w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType(TYPES[t]))

    def vector(name: str, n: int, ones: bool = True) -> None:
        w.add_tensor(name, np.ones(n, np.float32) if ones else (rng.standard_normal(n) * 0.02).astype(np.float32))

    vocab = cfg["vocab_size"]
    matrix("token_embd.weight", vocab, hidden, 20.0)
    for i in range(layers):
        p = f"blk.{i}."
        vector(p + "attn_norm.weight", hidden)
        matrix(p + "attn_q.weight", heads * d, hidden)
        matrix(p + "attn_k.weight", kv_heads * d, hidden)
        matrix(p + "attn_v.weight", kv_heads * d, hidden)
        if arch == "qwen2":
            vector(p + "attn_q.bias", heads * d, False)
            vector(p + "attn_k.bias", kv_heads * d, False)
            vector(p + "attn_v.bias", kv_heads * d, False)
        matrix(p + "attn_output.weight", hidden, heads * d)
        vector(p + "ffn_norm.weight", hidden)
        matrix(p + "ffn_gate.weight", intermediate, hidden)
        matrix(p + "ffn_up.weight", intermediate, hidden)
        matrix(p + "ffn_down.weight", hidden, intermediate)
    vector("output_norm.weight", hidden)
    if not tie:
        matrix("output.weight", vocab, hidden, 20.0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
