"""Read a GGUF file (llama.cpp's format) with the `gguf` package: its metadata as checked Python
values, a Hugging Face style config.json, and its tensors dequantized under Hugging Face names.

Supported: the architectures whose file declares a GGUF family (llama, mistral, qwen2, qwen3, phi3,
gemma2, gemma3; runtime.models.gguf_family says what each may add to the Llama layout). Every tensor type the `gguf` package
can dequantize is read, and becomes float32 (exact) or bfloat16. Q8_0, Q5_0, Q6_K, Q4_0, Q4_1 and
Q4_K blocks can instead be kept as llmd's int8 and int4 layouts, unrounded (gguf_blocks.py, and
`llmd import --keep-blocks`, which writes an engine directory).

llama.cpp stores the llama and mistral architectures' q and k rows so that rotary pairs are adjacent
(rows 2i and 2i+1 of a head); llmd, like the Hugging Face layout, pairs row i with row i + d/2, so
those rows are put back (`_rotary_order`). The other architectures keep the halves layout. Gemma
files store norms as 1 + w; the import takes 1 away, so the directory holds the checkpoint's w.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from .gguf_check import GGUFError, TensorSpan, read_header
from ..models import registry
from ..models.gguf_family import TOP, GGUFFamily

@dataclass
class GGUFFile:
    """An opened, checked GGUF file. ``meta`` holds every metadata value the header walk accepted
    (key -> (value type, value)); the `gguf` package's reader, which the float import's tensors come
    from, is opened on first use (it reads a vocabulary's metadata far more slowly)."""
    path: Path
    meta: dict
    spans: list[TensorSpan]
    _reader: Any = None

    @property
    def reader(self):
        """The `gguf` package's reader of the file (for dequantizing its tensors)."""
        if self._reader is None:
            import gguf
            try:
                self._reader = gguf.GGUFReader(str(self.path))
            except (ValueError, KeyError, IndexError, TypeError, OverflowError, UnicodeDecodeError) as e:
                raise GGUFError(f"{self.path}: the gguf package cannot read it: {e}") from None
        return self._reader

    def fail(self, field: str, msg: str):
        raise GGUFError(f"{self.path}: {field}: {msg}")

    def has(self, key: str) -> bool:
        return key in self.meta

    def get(self, key: str, kind: type | tuple, default: Any = ...) -> Any:
        """The value of metadata ``key``, checked to be of ``kind`` (str, int, float, bool, list)."""
        if key not in self.meta:
            if default is ...:
                self.fail(key, "missing")
            return default
        value = self.meta[key][1]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if float in kinds and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kinds) or (bool not in kinds and isinstance(value, bool)):
            self.fail(key, f"expected {' or '.join(k.__name__ for k in kinds)}, found {type(value).__name__}")
        return value

    def tensor_names(self) -> list[str]:
        return [s.name for s in self.spans]


def open_gguf(path: str | Path, reader: bool = True) -> GGUFFile:
    """Walk and check the header, reading its metadata. ``reader``: also let the `gguf` package map the
    file now (the float import reads its tensors through it). Any failure is a GGUFError."""
    import gguf
    path = Path(path)
    spans, meta = read_header(path, {int(t): s for t, s in gguf.GGML_QUANT_SIZES.items()})
    f = GGUFFile(path, meta, spans)
    if reader:
        f.reader
    return f


def architecture(f: GGUFFile) -> str:
    arch = f.get("general.architecture", str)
    known = registry.by_gguf()
    if arch not in known:
        f.fail("general.architecture", f"{arch!r} is not supported (llmd imports {', '.join(sorted(known))})")
    return arch


def family(f: GGUFFile) -> GGUFFamily:
    """How ``f``'s architecture is stored, as its architecture file declares it."""
    return registry.by_gguf()[architecture(f)].gguf


def hf_config(f: GGUFFile, dtype: str = "float32") -> dict:
    """config.json for the model in ``f``, from its metadata and tensor shapes."""
    arch = architecture(f)
    declared = registry.by_gguf()[arch]
    a = f"{arch}."
    names = set(f.tensor_names())
    if "rope_freqs.weight" in names:
        f.fail("rope_freqs.weight", "per-frequency rope factors (llama 3.1 style scaling) are not supported")
    if "rope_factors_long.weight" in names:
        f.fail("rope_factors_long.weight", "long-context rotary factors (longrope) are not supported")
    hidden, heads = f.get(a + "embedding_length", int), f.get(a + "attention.head_count", int)
    if hidden < 1 or heads < 1 or hidden % heads and not f.has(a + "attention.key_length"):
        f.fail(a + "attention.head_count", f"{heads} heads do not divide the width {hidden}")
    head_dim = f.get(a + "attention.key_length", int, hidden // heads)
    if f.get(a + "rope.dimension_count", int, head_dim) != head_dim:
        f.fail(a + "rope.dimension_count", "partial rotary embeddings are not supported")
    layers = f.get(a + "block_count", int)
    if not 1 <= layers <= len(names) // 6:          # six tensors a layer at the least (phi3)
        f.fail(a + "block_count", f"{layers} layers but the file has {len(names)} tensors")
    embd = next(s for s in f.spans if s.name == "token_embd.weight") if "token_embd.weight" in names else None
    if embd is None or len(embd.dims) != 2 or embd.dims[0] != hidden:
        f.fail("token_embd.weight", f"missing or not a [{hidden}, vocabulary] matrix")
    cfg = {
        "architectures": [declared.name], "model_type": declared.model_type, "hidden_act": "silu",
        "vocab_size": int(embd.dims[1]), "hidden_size": hidden,
        "intermediate_size": f.get(a + "feed_forward_length", int),
        "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": f.get(a + "attention.head_count_kv", int, heads),
        "head_dim": head_dim, "max_position_embeddings": f.get(a + "context_length", int),
        "rms_norm_eps": f.get(a + "attention.layer_norm_rms_epsilon", float),
        "rope_theta": f.get(a + "rope.freq_base", float, 10000.0),
        "tie_word_embeddings": "output.weight" not in names,
        "torch_dtype": dtype,
    }
    scaling = f.get(a + "rope.scaling.type", str, "none")
    if scaling == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": f.get(a + "rope.scaling.factor", float)}
    elif scaling != "none":
        f.fail(a + "rope.scaling.type", f"{scaling!r} is not supported (none or linear)")
    declared.gguf.config(f, cfg)
    for key, name in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        value = f.get(f"tokenizer.ggml.{name}", int, None)
        if value is not None:
            cfg[key] = value
    return cfg


def hf_name(f: GGUFFile, name: str) -> str:
    if name in TOP:
        return TOP[name]
    parts = name.split(".", 2)
    layer = family(f).layer
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer:
        return f"model.layers.{int(parts[1])}.{layer[parts[2]]}"
    f.fail(name, "a tensor llmd does not know; the file may be of an architecture variant it does not run")


def read_tensors(f: GGUFFile, cfg: dict, dtype: str = "float32", progress: bool = True) -> Iterator[tuple[str, Any]]:
    """Yield (Hugging Face name, torch tensor of ``dtype``) for every tensor, dequantized."""
    import torch
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    if dtype not in dtypes:
        raise GGUFError(f"{f.path}: cannot import as {dtype!r} (float32 or bfloat16)")
    for _, name, values, _ in tensor_values(f, cfg, progress):
        yield name, torch.from_numpy(values).to(dtypes[dtype])


def tensor_values(f: GGUFFile, cfg: dict, progress: bool = True, desc: str = "dequantizing", as_checkpoint: bool = True):
    """Yield (the reader's tensor, Hugging Face name, float32 values in llmd's row order, the row order
    applied to the file's rows or None) for every tensor, dequantized by the `gguf` package. Norms a
    file stores as 1 + w come as the checkpoint's w (``as_checkpoint``), else as stored: the scale itself,
    which is what llmd's own modules hold."""
    import gguf
    from tqdm import tqdm
    fam = family(f)
    heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}
    bar = tqdm(f.reader.tensors, desc=f"{desc} {f.path.name}", unit="tensor", disable=not progress, leave=False)
    with contextlib.closing(bar):
        for t in bar:
            name = hf_name(f, t.name)
            try:
                values = gguf.quants.dequantize(t.data, t.tensor_type)
            except (NotImplementedError, ValueError) as e:
                f.fail(t.name, f"tensor type {t.tensor_type.name} cannot be dequantized: {e}")
            values = np.array(values, dtype=np.float32).reshape(tuple(reversed([int(d) for d in t.shape])))
            kind = t.name.split(".")[-2] if t.name.startswith("blk.") else ""
            order = None
            if fam.rotary_adjacent and kind in heads:
                order = _rotary_order(f, t.name, values.shape[0], heads[kind])
                values = values[order]
            if as_checkpoint and (shift := fam.norm_shift(name)):
                values = values - np.float32(shift)
            yield t, name, np.ascontiguousarray(values), order


def _rotary_order(f: GGUFFile, name: str, rows: int, heads: int) -> np.ndarray:
    """Undo llama.cpp's row order: within each head, rows (2i, 2i + 1) go back to (i, i + d/2).
    Row j of the result is row order[j] of the file."""
    if rows % (2 * heads):
        f.fail(name, f"{rows} rows cannot be {heads} heads of rotary pairs")
    return np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(rows)
