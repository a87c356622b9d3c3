"""`llmd import FILE.gguf --out DIR`: a GGUF file as a Hugging Face model directory llmd (and
`llmd export`) load like any other; with ``--keep-blocks``, an llmd engine directory whose quantized
tensors keep the file's blocks."""
from __future__ import annotations

import sys

from llmd.export.gguf_engine import import_engine, route_table
from llmd.runtime.errors import LLMDError
from llmd.runtime.formats.gguf_import import import_gguf


def add_import_parser(sub) -> None:
    p = sub.add_parser("import", help="convert a GGUF file (llama.cpp, Ollama) into a model directory",
                       description="Read FILE.gguf (architectures llama, mistral, qwen2, qwen3; byte-level BPE "
                       "tokenizers) and write config.json, model.safetensors, tokenizer.json and the chat template "
                       "into DIR. Quantized tensors are dequantized, unless --keep-blocks is given. `--model "
                       "FILE.gguf` does this once on its own, into a cache keyed by the file's sha256.")
    p.add_argument("file", help="the .gguf file")
    p.add_argument("--out", required=True, help="directory to write (must not exist or be empty)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="weight dtype of the import (default float32: every GGUF type dequantizes to it exactly)")
    p.add_argument("--keep-blocks", action="store_true",
                   help="write an llmd engine directory (serve it with --model DIR) that keeps quantized blocks "
                   "without rounding them again: Q8_0, Q5_0 as int8 with a scale per 32 columns, Q6_K as int8 "
                   "with a scale per 16, Q4_0, Q4_1, Q4_K as int4 with a scale and offset per 32; each tensor is "
                   "checked to dequantize to the gguf package's float32 values, and any other type (or a failed "
                   "check) is stored as float32. Prints which types took which route. --dtype does not apply")
    p.set_defaults(func=run_import)


def run_import(args) -> int:
    try:
        if args.keep_blocks:
            summary = import_engine(args.file, args.out)
            print(route_table(summary))
            out = args.out
        else:
            out = import_gguf(args.file, args.out, args.dtype)
    except (LLMDError, OSError) as e:
        print(f"llmd import: {e}", file=sys.stderr)
        return 2
    print(f"imported {args.file} into {out}")
    return 0
