"""The quantized products alone beside the bfloat16-block product, one model shape's weights, in one
process: microseconds per product (the best of --rounds, taken in turns), for each row count.

    .venv/bin/python bench/bench_quant_products.py --hidden 576 --intermediate 1536 --heads 9 --kv-heads 3 \\
        --vocab 49152 --rows 1,8,16 --threads 1

SmolLM2-135M's shapes by default. Each weight is reused every round, so it sits in cache: this is the
kernels' arithmetic rate, not the memory-bound rate of a whole model (bench_quant.py measures that).
"""
from __future__ import annotations

import argparse
import time

import torch

from llmd.runtime.formats.quantized import quantize_int4, quantize_int8
from llmd.runtime.kernels import ops


def forms(n: int, k: int) -> dict:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)) * 0.05
    blocks = ops.f32_blocks(w.to(torch.bfloat16).float())
    int8, int8g = ops.int8_pack(*quantize_int8(w)), ops.int8_pack(*quantize_int8(w, 64))
    int4 = ops.int4_pack(*quantize_int4(w, 64), 64)
    return {"bf16": lambda x: ops.f32_matvec(x, blocks, None), "int8": lambda x: ops.packed_matvec(x, int8),
            "int8g": lambda x: ops.packed_matvec(x, int8g), "int4": lambda x: ops.packed_matvec(x, int4)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--rows", default="1,8,16", help="row counts of x (default %(default)s)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=100)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    d = a.hidden // a.heads
    shapes = {"qkv": ((a.heads + 2 * a.kv_heads) * d, a.hidden), "o": (a.hidden, a.hidden),
              "gate_up": (2 * a.intermediate, a.hidden), "down": (a.hidden, a.intermediate), "head": (a.vocab, a.hidden)}
    print(f"{'product':8s} {'rows':>4s}  " + "  ".join(f"{k:>8s}" for k in ("bf16", "int8", "int8g", "int4"))
          + "   (us, best of rounds)")
    with torch.inference_mode():
        for name, (n, k) in shapes.items():
            fns = forms(n, k)
            for m in map(int, a.rows.split(",")):
                x = torch.randn(m, k)
                best = dict.fromkeys(fns, float("inf"))
                for _ in range(a.rounds):
                    for kind, fn in fns.items():
                        t = time.perf_counter()
                        fn(x)
                        best[kind] = min(best[kind], time.perf_counter() - t)
                print(f"{name:8s} {m:4d}  " + "  ".join(f"{best[kind] * 1e6:8.1f}" for kind in fns))


if __name__ == "__main__":
    main()
