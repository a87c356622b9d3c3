"""llmd's CPU kernels as they are now against the same kernels at another git revision, in one process:
single-stream and 16-stream decode on one random model, rounds alternating between the two builds.

    .venv/bin/python bench/bench_kernels.py --against HEAD~1 --shape tiny --threads 2 --rounds 7
    .venv/bin/python bench/bench_kernels.py --against HEAD~1 --products 1,4,5,9,16    # the products alone
    .venv/bin/python bench/bench_kernels.py --against HEAD~1 --products 1,4,64 --form int4 --shape qwen2-0.5b

The kernels of ``--against`` are compiled from that revision's sources (``git show``) with the flags
llmd uses; the engine is built once and each round swaps the loaded library, so the model, the KV pool
and the prompts are the same for both. Reported: medians of each build's decode tokens/s (prompts
cached, counted from the first token, as ``llmd bench`` does), the 16-stream / one-stream ratio, and
whether both builds produced the same tokens (a kernel change must not change greedy output). A
revision whose library lacks an entry point llmd now calls (the fused decode step, ``llmd_decode2``,
before it existed in this form) runs that step's Python fallback.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from llmd.runtime import kernels
from llmd.runtime.formats.quantized import quantize_int4, quantize_int8
from llmd.runtime.kernels import ops
from llmd.runtime.llm import LLM
from llmd.runtime.models.layers import can_pack, pack_weight
from llmd.runtime.models.random_model import SHAPES, write_random_model
from llmd.runtime.request import SamplingParams

ROOT = Path(__file__).resolve().parent.parent


def build_at(rev: str, out_dir: Path) -> Path:
    """The kernel library compiled from ``rev``'s sources."""
    src = out_dir / "src"
    src.mkdir()
    sources = []
    for name in [p.name for p in kernels._SOURCES] + [kernels._HEADER.name, "avx2.h"]:
        shown = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:runtime/kernels/{name}"],
                               capture_output=True, text=True)
        if shown.returncode:        # a source that revision did not have yet (its entry points stay unbound)
            continue
        (src / name).write_text(shown.stdout)
        sources += [src / name] if name.endswith(".c") else []
    lib = out_dir / "kernels.so"
    # the library this process runs (AVX-512 or AVX2); a revision before avx2.h builds the AVX-512 one only
    subprocess.run(kernels.compile_command(kernels.compiler(), sources, lib, kernels.variant()), check=True)
    return lib


def decode_rate(llm: LLM, prompts: list, params: SamplingParams) -> tuple[float, list]:
    llm.generate(prompts, params)                 # prompts cached, as in llmd bench
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    first = max(o.metrics["ttft_s"] for o in outs)
    return sum(len(o.token_ids) - 1 for o in outs) / (wall - first), [o.token_ids for o in outs]


def add_decode_args(ap: argparse.ArgumentParser) -> None:
    """The options of a side-by-side decode run (also used by bench_decode_paths.py)."""
    ap.add_argument("--shape", default="tiny", choices=sorted(SHAPES), help="random model shape (default tiny)")
    ap.add_argument("--threads", type=int, default=2, help="torch and kernel threads (default 2)")
    ap.add_argument("--streams", type=int, default=16, help="concurrent streams (default 16)")
    ap.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per stream (default 128)")
    ap.add_argument("--gen", type=int, default=64, help="tokens generated per stream (default 64)")
    ap.add_argument("--rounds", type=int, default=7, help="alternating rounds; medians reported (default 7)")


def layer_shapes(shape: str) -> list[tuple[int, int]]:
    """(in, out) of one layer's float32 products and the head, for a model shape."""
    c = SHAPES[shape]
    h, d = c["hidden_size"], c["hidden_size"] // c["num_attention_heads"]
    qkv = (c["num_attention_heads"] + 2 * c.get("num_key_value_heads", c["num_attention_heads"])) * d
    return [(h, qkv), (c["num_attention_heads"] * d, h), (h, 2 * c["intermediate_size"]),
            (c["intermediate_size"], h), (h, c["vocab_size"])]


FORMS = ("bf16", "int8", "int4")


def weight_forms(shape: str, form: str) -> list[tuple[int, callable]]:
    """(in, product of x) per weight of the shape's layer and head: bfloat16-valued float32 blocks (as llmd
    stores such weights), int8 with a scale per row, or int4 in groups of 32 (float16 scales), packed."""
    out = []
    for k, n in layer_shapes(shape):
        w = torch.randn(n, k) * 0.05
        if form == "bf16":
            wb = w.to(torch.bfloat16).float()
            blocks, copy = ops.f32_blocks(wb), (pack_weight(wb) if can_pack(torch.float32) else None)
            out.append((k, lambda x, b=blocks, c=copy: bf16_product(x, b, c)))
        elif form == "int8":
            packed = ops.int8_pack(*quantize_int8(w))
            out.append((k, lambda x, p=packed: ops.packed_matvec(x, p)))
        else:
            q, s, z = quantize_int4(w, 32)
            packed = ops.int4_pack(q, s, z, 32)
            out.append((k, lambda x, p=packed: ops.packed_matvec(x, p)))
    return out


def bf16_product(x: torch.Tensor, blocks: torch.Tensor, copy: torch.Tensor | None) -> torch.Tensor | None:
    """The product as the engine takes it: llmd's kernel where the build takes the row count (more than 16
    rows on AMX), else the oneDNN copy a layer keeps for many rows."""
    y = ops.f32_matvec(x, blocks, None)
    if y is None and copy is not None:
        y = torch.ops.mkldnn._linear_pointwise(x, copy, None, "none", [], "")
    return y


def products(builds: dict, shape: str, rows: list[int], rounds: int, form: str = "bf16") -> dict:
    """Microseconds for one pass of the products of each row count over the shape's layer and head
    weights in ``form``, per build, rounds alternating; and whether both builds gave the same bits."""
    weights = weight_forms(shape, form)
    out = {}
    for m in rows:
        xs = [torch.randn(m, k) for k, _ in weights]
        times = {name: [] for name in builds}
        ys = {}
        for _ in range(rounds):
            for name, so in builds.items():
                kernels._lib = so
                t0 = time.perf_counter()
                for _ in range(20):
                    ys[name] = [fn(x) for x, (_, fn) in zip(xs, weights)]
                times[name].append((time.perf_counter() - t0) / 20)
        now, base = (statistics.median(v) for v in times.values())
        same = all(a is not None and b is not None and torch.equal(a, b) for a, b in zip(*ys.values()))
        out[m] = {"now_us": round(now * 1e6, 1), "baseline_us": round(base * 1e6, 1),
                  "now_over_baseline": round(now / base, 3), "same_bits": same}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", default="HEAD", help="git revision whose kernels are the baseline (default HEAD)")
    ap.add_argument("--products", help="instead of decoding, time the products of these row counts "
                    "(e.g. 1,4,5,9,16) over the shape's layer and head weights")
    ap.add_argument("--form", choices=FORMS, default="bf16",
                    help="the weights --products multiplies: bfloat16-valued float32 blocks, int8, or int4 "
                    "groups of 32 (default bf16)")
    add_decode_args(ap)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if kernels.lib() is None:
        raise SystemExit(f"llmd's kernels are unavailable here: {kernels.why()}")
    with tempfile.TemporaryDirectory() as tmp:
        baseline = kernels.bind(ctypes.CDLL(str(build_at(args.against, Path(tmp)))))
        builds = {"now": kernels.lib(), args.against: baseline}
        if args.products:
            result = products(builds, args.shape, [int(r) for r in args.products.split(",")], args.rounds,
                              args.form)
            kernels._lib = builds["now"]
            print(json.dumps({"shape": args.shape, "form": args.form, "threads": args.threads,
                              "library": kernels.variant(), "rows": result}, indent=1))
            return 0 if all(r["same_bits"] for r in result.values()) else 1
        model = write_random_model(Path(tmp) / "model", args.shape)
        llm = LLM(str(model), dtype="float32", kv_memory="1GiB", draft="none")
        vocab = SHAPES[args.shape]["vocab_size"]
        rng = random.Random(0)
        prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.streams)]
        params = SamplingParams(max_tokens=args.gen, ignore_eos=True)
        rates = {k: ([], []) for k in builds}
        tokens = {}
        for _ in range(args.rounds):
            for name, so in builds.items():
                kernels._lib = so
                one, _ = decode_rate(llm, prompts[:1], params)
                many, tokens[name] = decode_rate(llm, prompts, params)
                rates[name][0].append(one)
                rates[name][1].append(many)
    result = {"shape": args.shape, "threads": args.threads, "streams": args.streams, "rounds": args.rounds,
              "same_tokens": tokens["now"] == tokens[args.against]}
    for name, (one, many) in rates.items():
        a, b = statistics.median(one), statistics.median(many)
        result[name] = {"one_stream_tok_s": round(a, 1), "streams_tok_s": round(b, 1), "ratio": round(b / a, 2)}
    result["streams_now_over_baseline"] = round(result["now"]["streams_tok_s"] / result[args.against]["streams_tok_s"], 3)
    print(json.dumps(result, indent=1))
    return 0 if result["same_tokens"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
