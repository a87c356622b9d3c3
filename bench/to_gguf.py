"""Write a model directory (safetensors) of any architecture llmd reads from GGUF (llama, mistral,
qwen2, qwen3, phi3, gemma2, gemma3) as a GGUF file for llama.cpp.

Tensor names map one to one, by the GGUF family each architecture's file declares (the reader's
own map, llmd.runtime.models.gguf_family), and the family writes what the layer plan says: window
and sliding layers, soft-caps, the scores' scale, the local rotary base. Families whose files rotate
query/key pairs that are adjacent (llama.cpp's `llama` and `mistral`: dimension 2i with 2i+1, where
the Hugging Face layout rotates halves, i with i + d/2) get q and k rows reordered; the others use
the halves layout. Norms a family stores as 1 + w (Gemma) are written so, as llama.cpp's converter
writes them.
The vocabulary is written in full (padded with unused entries up to the embedding rows): llama.cpp
receives token ids from the benchmark, never text, but checks that sizes agree.

Types: float32 stays F32, anything else becomes F16 (the nearest llama.cpp float), and `q8_0`,
`q4_0`, `q4_1` and `q5_0` quantize every matrix (the tied embedding/head included) for comparisons
with llmd's int8 and int4 weights (or each kind of matrix its own type, for tests).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from llmd.runtime.models import registry
from llmd.runtime.models.config import ModelConfig
from llmd.runtime.models.gguf_family import TOP as FILE_TOP

TOP = {v: k for k, v in FILE_TOP.items()}
QUANT_TYPES = {"q8_0": "Q8_0", "q4_0": "Q4_0", "q4_1": "Q4_1", "q5_0": "Q5_0"}


def convert(model_dir: str | Path, out: str | Path, quant: str | dict = "auto") -> Path:
    """Write `out` (once; an existing file is reused) and return its path. ``quant`` is one type for
    every matrix, or a type per GGUF tensor kind ("attn_q", "ffn_down", "token_embd", ...) with "*" for
    the rest."""
    import gguf
    from safetensors import safe_open
    model_dir, out = Path(model_dir), Path(out)
    if out.exists():
        return out
    if (model_dir / "manifest.json").exists():
        raise ValueError(f"{model_dir} is an llmd engine directory; convert its float source model instead")
    cfg = json.loads((model_dir / "config.json").read_text())
    declared = registry.by_gguf()
    fam = next((a.gguf for a in declared.values() if a.name == (cfg.get("architectures") or [""])[0]), None)
    if fam is None:
        raise ValueError(f"no GGUF mapping for architecture {cfg.get('architectures')}")
    w = gguf.GGUFWriter(str(out), fam.name)
    _hparams(w, cfg, fam)
    _vocab(w, model_dir, cfg)
    n_head, n_kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    names = {v: k for k, v in fam.layer.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    for f in files:
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                t = st.get_tensor(name).float().numpy()
                gname = _gguf_name(name, names)
                if fam.rotary_adjacent and gname.endswith(("attn_q.weight", "attn_k.weight")):
                    t = _pairs_adjacent(t, n_head if "attn_q" in gname else n_kv)
                if shift := fam.norm_shift(name):
                    t = t + np.float32(shift)
                _add(w, gguf, gname, t, quant, cfg.get("torch_dtype"))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _gguf_name(name: str, layer: dict[str, str]) -> str:
    if name in TOP:
        return TOP[name]
    parts = name.split(".")
    if parts[:2] == ["model", "layers"] and ".".join(parts[3:]) in layer:
        return f"blk.{parts[2]}.{layer['.'.join(parts[3:])]}"
    raise ValueError(f"no GGUF name for tensor {name!r}")


def _pairs_adjacent(w: np.ndarray, heads: int) -> np.ndarray:
    """Reorder each head's rows from halves (i, i + d/2) to adjacent pairs (2i, 2i + 1)."""
    rows = w.shape[0] // heads
    return w.reshape(heads, 2, rows // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _add(w, gguf, name: str, t: np.ndarray, quant: str | dict, dtype) -> None:
    if isinstance(quant, dict):
        kind = name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0]
        quant = quant.get(kind, quant.get("*", "auto"))
    if t.ndim == 1 or quant == "auto" and dtype in (None, "float32"):
        w.add_tensor(name, t.astype(np.float32))
    elif quant in QUANT_TYPES and t.shape[-1] % 32 == 0:
        qtype = getattr(gguf.GGMLQuantizationType, QUANT_TYPES[quant])
        q = gguf.quants.quantize(t, qtype)
        w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)
    else:
        w.add_tensor(name, t.astype(np.float16))


def _hparams(w, cfg: dict, fam) -> None:
    import gguf
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    model = ModelConfig.from_dict(cfg)
    w.add_context_length(cfg.get("max_position_embeddings", 4096))
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg.get("num_key_value_heads", cfg["num_attention_heads"]))
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(model.rope_theta)
    w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    scaling = model.rope_scaling
    if scaling.rope_type == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(scaling.factor)
    elif scaling.rope_type != "default":
        raise ValueError(f"no GGUF form here for {scaling.rope_type} rotary scaling")
    fam.write(w, model)            # the layer plan's options, under the keys llama.cpp reads


def _vocab(w, model_dir: Path, cfg: dict) -> None:
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    for added in tok.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
    n = cfg["vocab_size"]
    tokens, types = [f"[PAD{i}]" for i in range(n)], [5] * n          # 5: unused
    special = {a["id"] for a in tok.get("added_tokens", []) if a.get("special")}
    for text, i in vocab.items():
        if i < n:
            tokens[i], types[i] = text, (3 if i in special else 1)    # 3: control, 1: normal
    merges = tok["model"].get("merges") or []
    if not merges:          # a byte-level vocabulary without merges; the BPE loader still wants one
        merges = [f"{tokens[0]} {tokens[1]}"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    eos = cfg.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0]
    if eos is not None:
        w.add_eos_token_id(int(eos))
    w.add_add_bos_token(False)
