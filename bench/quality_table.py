"""Export quality on one model, llmd's formats beside llama.cpp's, on the same token windows.

    python -m llmd.bench.quality_table --model DIR [--gguf FILE.gguf] [--formats int8,int4] ...

The ``gguf-native`` row is the --gguf file served from its own blocks (llmd's default for a GGUF
model) on the same windows; set beside llama.cpp's row for the same file it compares the two
engines' arithmetic on the same numbers. The ``gguf-blocks`` row is ``llmd import --gguf FILE --keep-blocks`` (the file's quantized blocks kept
as llmd's int8g and int4 layouts), loaded as the engine loads it and run on the same windows;
``gguf-blocks-f32head`` and ``gguf-blocks-f32`` multiply the head, or every kept module, in float32 by
its dequantized weights, which separates the stored numbers from the arithmetic that runs them.
Every other llmd row is a real ``llmd export`` into a scratch directory, measured by the export's own quality
gate (so what is printed is what the engine runs, the ONNX graph included); the gate is told to accept
the loss so that every row is measured. llama.cpp rows quantize ``--gguf`` (a GGUF of the same model)
with llama.cpp's own ``llama-quantize`` (the file is dequantized and quantized again) and run the
same windows through its library, teacher-forced (``llmd.bench.llama_quality``: the programs
``bench/build_llama_server.sh`` builds). Perplexity change and top-1 agreement are
both against llmd's float32 model, the reference of every row.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch.nn.functional as F


from llmd.export import quality
from llmd.export.cli import ExportOptions, export_engine
from llmd.export.gguf_engine import import_engine
from llmd.runtime.formats.engine_dir import load_engine_part
from llmd.runtime.formats.gguf_import import resolve_model_path
from llmd.runtime.formats.gguf_native import load_native
from llmd.runtime.formats.manifest import read_manifest
from llmd.runtime.formats.quantized import QuantLinear
from llmd.runtime.models.loader import load_model
from llmd.runtime.tokenizer import Tokenizer

from . import llama_quality as llamacpp

FORMATS = {     # row name -> llmd export options
    "int8": dict(quant="int8"),
    "int8-onnxruntime": dict(quant="int8", backend="onnxruntime"),
    "w8a8-onnxruntime": dict(quant="w8a8", backend="onnxruntime"),
    "int4": dict(quant="int4"),                       # group size chosen, scale search on
    "int4-onnxruntime": dict(quant="int4", backend="onnxruntime"),
    **{f"int4-g{g}": dict(quant="int4", group_size=g) for g in (32, 64, 128)},
    **{f"int4-g{g}-plain": dict(quant="int4", group_size=g, scale_search=False) for g in (32, 64, 128)},
}


def llmd_row(model: str, name: str, windows: int, tokens: int, scratch: Path, eval_file: str | None) -> dict:
    t = time.perf_counter()
    s = export_engine(ExportOptions(model, str(scratch / name), eval_windows=windows, eval_tokens=tokens,
                                    eval_file=eval_file, accept_loss=True, **FORMATS[name]))
    q = s["quality"]
    return {"engine": f"llmd {name}", "ppl_increase": q["ppl_increase"], "top1": q["top1_agreement"],
            "ppl": q["ppl_quantized"], "ppl_reference": q["ppl_reference"], "tokens": q["num_tokens"],
            "detail": s["quantization"] | {"backend": s["backend"]}, "seconds": time.perf_counter() - t}


GGUF_BLOCKS = {   # row name -> which kept modules are computed in float32 from their dequantized weights
    "gguf-blocks": lambda name: False,
    "gguf-blocks-f32head": lambda name: name == "lm_head",
    "gguf-blocks-f32": lambda name: True,
}


def gguf_blocks_rows(model: str, gguf: Path, names: list[str], windows: int, tokens: int, scratch: Path,
                     eval_file: str | None) -> list[dict]:
    """The GGUF's blocks kept (llmd import --keep-blocks) against the float model ``model``: as the
    runtime runs them, and with the head or every kept module computed in float32 from its exact
    dequantized weights (what separates the stored numbers from the arithmetic that runs them)."""
    out = scratch / "gguf-blocks"
    summary = import_engine(gguf, out)
    tok = Tokenizer.from_dir(model)
    texts, source = quality.heldout_texts(eval_file)
    win = quality.token_windows(tok, texts, tokens, windows)
    reference = quality.predict(load_model(model, "float32"), win)
    rows = []
    for name in names:
        t = time.perf_counter()
        engine = load_engine_part(out, read_manifest(out), "target")[0]
        for module_name, module in engine.named_modules():
            if isinstance(module, QuantLinear) and GGUF_BLOCKS[name](module_name):
                _float32_products(module)
        q = quality.compare(reference, quality.predict(engine, win), None, source)
        rows.append({"engine": f"llmd {name}", "ppl_increase": q.ppl_increase, "top1": q.top1_agreement,
                     "ppl": q.ppl_quantized, "ppl_reference": q.ppl_reference, "tokens": q.num_tokens,
                     "detail": summary["routes"], "seconds": time.perf_counter() - t})
        print(row_text(rows[-1]), flush=True)
    return rows


def gguf_native_row(model: str, gguf: Path, windows: int, tokens: int, eval_file: str | None) -> dict:
    """The GGUF file served from its own blocks (the default for a .gguf model), on the same windows."""
    t = time.perf_counter()
    native, _, _ = load_native(gguf, progress=False)
    native.prepare_for_inference()
    tok = Tokenizer.from_dir(model)
    texts, source = quality.heldout_texts(eval_file)
    win = quality.token_windows(tok, texts, tokens, windows)
    q = quality.compare(quality.predict(load_model(model, "float32"), win), quality.predict(native, win), None, source)
    return {"engine": "llmd gguf-native", "ppl_increase": q.ppl_increase, "top1": q.top1_agreement,
            "ppl": q.ppl_quantized, "ppl_reference": q.ppl_reference, "tokens": q.num_tokens,
            "seconds": time.perf_counter() - t}


def _float32_products(module: QuantLinear) -> None:
    """Make ``module`` multiply in float32 by its dequantized weight (and bias)."""
    weight = module.dense_weight().float()
    bias = None if module.bias is None else module.bias.float()
    module.bias = None

    def product(x, weight=weight, bias=bias):
        return F.linear(x.float(), weight, bias)
    module.small = module.large = product


def llamacpp_rows(model: str, gguf: Path, types: list[str], windows: int, tokens: int, cache: Path,
                  eval_file: str | None) -> list[dict]:
    tools = llamacpp.find_tools()
    if tools is None:
        raise SystemExit(f"llama.cpp's tools were not found: {llamacpp.BUILD_HINT}")
    tok = Tokenizer.from_dir(model)
    win = quality.token_windows(tok, quality.heldout_texts(eval_file)[0], tokens, windows)
    reference = quality.predict(load_model(model, "float32"), win)
    rows = []
    for ftype in ["original"] + types:
        t = time.perf_counter()
        path = gguf if ftype == "original" else llamacpp.quantize(tools, gguf, ftype, cache)
        q = quality.compare(reference, llamacpp.predict(tools, path, win), None, "", "llama.cpp")
        rows.append({"engine": f"llama.cpp {ftype if ftype != 'original' else gguf.name}",
                     "ppl_increase": q.ppl_increase, "top1": q.top1_agreement, "ppl": q.ppl_quantized,
                     "ppl_reference": q.ppl_reference, "tokens": q.num_tokens, "seconds": time.perf_counter() - t})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="float model directory (Hugging Face layout), or a GGUF file "
                   "(its float32 import; also llama.cpp's source unless --gguf is given)")
    p.add_argument("--gguf", help="a GGUF of the same model, for llama.cpp's rows (bench/build_llama_server.sh builds its tools)")
    p.add_argument("--formats", default="int8,int8-onnxruntime,int4,int4-g32-plain,int4-g64-plain,int4-g64",
                   help=f"llmd rows, comma-separated, of {', '.join(FORMATS)}, gguf-native (the --gguf file served from "
                   "its own blocks, as llmd serves a .gguf model), and gguf-blocks (the --gguf file's "
                   "blocks kept: llmd import --keep-blocks), gguf-blocks-f32head, gguf-blocks-f32 (the same with "
                   "the head, or every kept module, multiplied in float32 by its dequantized weights)")
    p.add_argument("--llamacpp-types", default="Q8_0,Q4_0,Q4_1", help="llama.cpp rows, comma-separated, or none")
    p.add_argument("--eval-file", help="text measured (default: llmd's evaluation text)")
    p.add_argument("--windows", type=int, default=16, help="windows measured (default 16)")
    p.add_argument("--tokens", type=int, default=128, help="tokens per window (default 128)")
    p.add_argument("--cache", help="where llama.cpp's quantized files are kept (default: ~/.cache/llmd/llamacpp)")
    a = p.parse_args(argv)
    if a.model.endswith(".gguf"):
        a.gguf = a.gguf or a.model
        a.model = resolve_model_path(a.model)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        names = list(filter(None, a.formats.split(",")))
        blocks = [n for n in names if n in GGUF_BLOCKS]
        if blocks and not a.gguf:
            p.error(f"the {blocks[0]} row needs --gguf FILE.gguf")
        if blocks:
            rows += gguf_blocks_rows(a.model, Path(a.gguf), blocks, a.windows, a.tokens, Path(scratch), a.eval_file)
        if "gguf-native" in names:
            if not a.gguf:
                p.error("the gguf-native row needs --gguf FILE.gguf")
            rows.append(gguf_native_row(a.model, Path(a.gguf), a.windows, a.tokens, a.eval_file))
            print(row_text(rows[-1]), flush=True)
        for name in (n for n in names if n not in GGUF_BLOCKS and n != "gguf-native"):
            rows.append(llmd_row(a.model, name, a.windows, a.tokens, Path(scratch), a.eval_file))
            print(row_text(rows[-1]), flush=True)
    if a.gguf and a.llamacpp_types != "none":
        cache = Path(a.cache) if a.cache else llamacpp.cache_dir()
        for r in llamacpp_rows(a.model, Path(a.gguf), list(filter(None, a.llamacpp_types.split(","))),
                               a.windows, a.tokens, cache, a.eval_file):
            rows.append(r)
            print(row_text(r), flush=True)
    print(f"\n| engine and format | perplexity change | top-1 agreement |\n|---|---|---|")
    for r in rows:
        print(f"| {r['engine']} | {100 * r['ppl_increase']:+.2f} % | {100 * r['top1']:.1f} % |")
    return 0


def row_text(r: dict) -> str:
    return (f"{r['engine']:32s} ppl {r['ppl_reference']:.3f} -> {r['ppl']:.3f} ({100 * r['ppl_increase']:+.2f} %), "
            f"top-1 {100 * r['top1']:.2f} % of {r['tokens']} tokens, {r['seconds']:.0f} s")


if __name__ == "__main__":
    raise SystemExit(main())
