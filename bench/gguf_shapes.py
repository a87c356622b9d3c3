"""Random-weight GGUF files at the shapes people run, with a real tokenizer, for speed and memory
measurements at 1.5B-8B (`make models-shapes`).

    python -m llmd.bench.gguf_shapes --shapes qwen2.5-1.5b --types Q4_K_M,Q8_0 [--out DIR]

Each shape is written once as BF16 by llmd's own writer, streamed tensor by tensor (a 7B file never
sits in memory), and re-typed by llama.cpp's `llama-quantize` (bench/build_llama_server.sh) to each
asked type; the BF16 source is deleted afterwards unless --keep-source. The tokenizer (vocabulary,
merges, token types, chat template) is copied from a GGUF file that has the real one: the Qwen2.5
family's from Qwen2.5-Coder-0.5B (`make models-real`), Llama 3's (128256 tokens) from the vocabulary
file in llama.cpp's sources (`ggml-vocab-llama-bpe.gguf`, unpacked by bench/build_llama_server.sh).

Weights are normal with std 0.02 (norms 1): the text is noise, the arithmetic is the real model's.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llmd.bench.llama_server import CACHE as BUILD_DIR
from llmd.models_real import cached_file, models_dir as real_models_dir


@dataclass(frozen=True)
class Shape:
    arch: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool
    rope_theta: float
    qkv_bias: bool


SHAPES = {
    "qwen2.5-1.5b": Shape("qwen2", 1536, 8960, 28, 12, 2, 151936, True, 1e6, True),
    "qwen2.5-3b": Shape("qwen2", 2048, 11008, 36, 16, 2, 151936, True, 1e6, True),
    "llama-3.2-3b": Shape("llama", 3072, 8192, 28, 24, 8, 128256, True, 5e5, False),
    "qwen2.5-7b": Shape("qwen2", 3584, 18944, 28, 28, 4, 152064, False, 1e6, True),
    "llama-3.1-8b": Shape("llama", 4096, 14336, 32, 32, 8, 128256, False, 5e5, False),
}
TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")


def models_dir() -> Path:
    return real_models_dir() / "shapes"


def tokenizer_source(arch: str) -> Path:
    if arch == "llama":
        return llama_vocab()
    path = cached_file("qwen2.5-coder-0.5b-instruct")
    if path is None:
        raise SystemExit("the Qwen2.5 tokenizer comes from Qwen2.5-Coder-0.5B: run `make models-real` first")
    return path


def llama_vocab() -> Path:
    """Llama 3's tokenizer: the vocabulary file in llama.cpp's sources, which build_llama_server.sh
    fetches and unpacks."""
    _llama_bin("llama-quantize")
    found = sorted(BUILD_DIR.glob("src/llama_cpp_python-*/vendor/llama.cpp/models/ggml-vocab-llama-bpe.gguf"))
    if not found:
        raise SystemExit(f"no ggml-vocab-llama-bpe.gguf under {BUILD_DIR}/src: run bench/build_llama_server.sh")
    return found[-1]


def _llama_bin(name: str) -> Path:
    """One of llama.cpp's programs, built (and its sources unpacked) by build_llama_server.sh."""
    root = Path(__file__).resolve().parent
    server = subprocess.run(["bash", str(root / "build_llama_server.sh")], check=True, capture_output=True,
                            text=True).stdout.strip().splitlines()[-1]
    return Path(server).with_name(name)


def _tensors(s: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """(name, numpy shape [rows, columns]) in file order."""
    d = s.hidden // s.heads
    out = [("token_embd.weight", (s.vocab, s.hidden))]
    for i in range(s.layers):
        p = f"blk.{i}."
        out += [(p + "attn_norm.weight", (s.hidden,)), (p + "attn_q.weight", (s.heads * d, s.hidden)),
                (p + "attn_k.weight", (s.kv_heads * d, s.hidden)), (p + "attn_v.weight", (s.kv_heads * d, s.hidden))]
        if s.qkv_bias:
            out += [(p + "attn_q.bias", (s.heads * d,)), (p + "attn_k.bias", (s.kv_heads * d,)),
                    (p + "attn_v.bias", (s.kv_heads * d,))]
        out += [(p + "attn_output.weight", (s.hidden, s.heads * d)), (p + "ffn_norm.weight", (s.hidden,)),
                (p + "ffn_gate.weight", (s.intermediate, s.hidden)), (p + "ffn_up.weight", (s.intermediate, s.hidden)),
                (p + "ffn_down.weight", (s.hidden, s.intermediate))]
    out.append(("output_norm.weight", (s.hidden,)))
    if not s.tied:
        out.append(("output.weight", (s.vocab, s.hidden)))
    return out


def _bf16(x: np.ndarray) -> np.ndarray:
    u = x.astype(np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def write_shape(name: str, out: Path, seed: int = 0) -> Path:
    """The shape's BF16 file at ``out`` (written beside it, then renamed)."""
    import gguf
    from tqdm import tqdm
    s = SHAPES[name]
    src = gguf.GGUFReader(str(tokenizer_source(s.arch)))
    tmp = out.with_suffix(".part")
    w = gguf.GGUFWriter(str(tmp), s.arch)
    w.add_name(f"llmd random {name}")
    w.add_context_length(32768 if s.arch == "qwen2" else 131072)
    w.add_embedding_length(s.hidden)
    w.add_block_count(s.layers)
    w.add_feed_forward_length(s.intermediate)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_rope_dimension_count(s.hidden // s.heads)
    w.add_rope_freq_base(s.rope_theta)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    _copy_tokenizer(src, w, s.vocab)
    tensors = _tensors(s)
    for tname, shape in tensors:
        dt = gguf.GGMLQuantizationType.F32 if len(shape) == 1 else gguf.GGMLQuantizationType.BF16
        nbytes = int(np.prod(shape)) * (4 if len(shape) == 1 else 2)
        w.add_tensor_info(tname, shape, np.float32 if len(shape) == 1 else np.uint16, nbytes, raw_dtype=dt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    total = sum(int(np.prod(sh)) for _, sh in tensors)
    with tqdm(total=total, unit="w", unit_scale=True, desc=f"writing {out.name}") as bar:
        for tname, shape in tensors:
            if len(shape) == 1:
                t = (np.ones(shape, np.float32) if tname.endswith("norm.weight")
                     else rng.standard_normal(shape, np.float32) * np.float32(0.02))
            else:
                t = np.empty(shape, np.uint16)
                for r in range(0, shape[0], 4096):          # a slice at a time: bounded memory
                    t[r:r + 4096] = _bf16(rng.standard_normal((min(4096, shape[0] - r), shape[1]), np.float32)
                                          * np.float32(0.02))
            w.write_tensor_data(t)
            bar.update(t.size)
    w.close()
    tmp.rename(out)
    return out


def _copy_tokenizer(src, w, vocab: int) -> None:
    """The source file's tokenizer metadata, its vocabulary padded to ``vocab`` with unused entries."""
    def field(key):
        f = src.fields[key]
        return f.contents() if hasattr(f, "contents") else f.parts[f.data[0]]
    tokens = list(field("tokenizer.ggml.tokens"))
    types = list(field("tokenizer.ggml.token_type"))
    if len(tokens) > vocab:          # cutting it would leave merges naming tokens that are gone
        raise ValueError(f"the tokenizer has {len(tokens)} tokens, more than the shape's {vocab} rows")
    tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab)]
    types += [5] * (vocab - len(types))
    w.add_tokenizer_model(field("tokenizer.ggml.model"))
    w.add_tokenizer_pre(field("tokenizer.ggml.pre"))
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(list(field("tokenizer.ggml.merges")))
    for key, add in (("tokenizer.ggml.eos_token_id", w.add_eos_token_id),
                     ("tokenizer.ggml.padding_token_id", w.add_pad_token_id),
                     ("tokenizer.ggml.bos_token_id", w.add_bos_token_id)):
        if key in src.fields:
            add(int(field(key)))
    w.add_add_bos_token(False)
    if "tokenizer.chat_template" in src.fields:
        w.add_chat_template(field("tokenizer.chat_template"))


def quantize(source: Path, out: Path, qtype: str, threads: int = 2) -> Path:
    """``source`` re-typed to ``qtype`` by llama.cpp's llama-quantize (built by build_llama_server.sh)."""
    tool = _llama_bin("llama-quantize")
    tmp = out.with_suffix(".part")
    subprocess.run([str(tool), str(source), str(tmp), qtype, str(threads)], check=True,
                   stdout=subprocess.DEVNULL)
    tmp.rename(out)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m llmd.bench.gguf_shapes", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="qwen2.5-1.5b", help=f"comma-separated, of {', '.join(SHAPES)}, or all")
    ap.add_argument("--types", default=",".join(TYPES), help="comma-separated llama-quantize types")
    ap.add_argument("--out", type=Path, default=None, help="directory (default: llmd's model cache, shapes/)")
    ap.add_argument("--keep-source", action="store_true", help="keep each shape's BF16 file")
    ap.add_argument("--threads", type=int, default=2, help="llama-quantize threads")
    a = ap.parse_args(argv)
    out = a.out or models_dir()
    out.mkdir(parents=True, exist_ok=True)
    shapes = list(SHAPES) if a.shapes == "all" else a.shapes.split(",")
    for name in shapes:
        if name not in SHAPES:
            ap.error(f"unknown shape {name!r}; choose from {', '.join(SHAPES)}")
        targets = {t: out / f"{name}-{t}.gguf" for t in a.types.split(",") if t}
        if all(p.exists() for p in targets.values()):
            print(*targets.values(), sep="\n")
            continue
        source = out / f"{name}-BF16.gguf"
        if not source.exists():
            write_shape(name, source)
        for t, path in targets.items():
            if not path.exists():
                t0 = time.time()
                quantize(source, path, t, a.threads)
                print(f"{path} ({path.stat().st_size / 1e9:.2f} GB, {time.time() - t0:.0f} s)", file=sys.stderr)
            print(path)
        if not a.keep_source:
            source.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
