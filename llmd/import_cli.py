"""`llmd import FILE.gguf --out DIR`: a GGUF file as a Hugging Face model directory llmd (and
`llmd export`) load like any other."""
from __future__ import annotations

import sys

from llmd.runtime.errors import LLMDError
from llmd.runtime.formats.gguf_import import import_gguf


def add_import_parser(sub) -> None:
    p = sub.add_parser("import", help="convert a GGUF file (llama.cpp, Ollama) into a model directory",
                       description="Read FILE.gguf (architectures llama, mistral, qwen2, qwen3; byte-level BPE "
                       "tokenizers) and write config.json, model.safetensors, tokenizer.json and the chat template "
                       "into DIR. Quantized tensors are dequantized. `--model FILE.gguf` does this once on its own, "
                       "into a cache keyed by the file's sha256.")
    p.add_argument("file", help="the .gguf file")
    p.add_argument("--out", required=True, help="directory to write (must not exist or be empty)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="weight dtype of the import (default float32: every GGUF type dequantizes to it exactly)")
    p.set_defaults(func=run_import)


def run_import(args) -> int:
    try:
        out = import_gguf(args.file, args.out, args.dtype)
    except (LLMDError, OSError) as e:
        print(f"llmd import: {e}", file=sys.stderr)
        return 2
    print(f"imported {args.file} into {out}")
    return 0
