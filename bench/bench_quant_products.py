"""The quantized products alone beside the bfloat16-block product, one model shape's weights, in one
process: microseconds per product (the best of --rounds, the forms taken in turns), for each row count.

    .venv/bin/python bench/bench_quant_products.py --hidden 576 --intermediate 1536 --heads 9 --kv-heads 3 \\
        --vocab 49152 --rows 1,8,16 --threads 1

SmolLM2-135M's shapes by default. By default each weight is reused every round, so it sits in cache:
this is the kernels' arithmetic rate, not the memory-bound rate of a whole model (bench_quant.py
measures that). ``--ring-mib`` reads each form's product from a ring of copies of its weight, that
many MiB of them (more than the last-level cache: each product then streams its weight from memory,
as a decode step does); the rate is then also given in GB/s of the form's bytes. ``int4`` holds its
scales and offsets as float32, ``int4h`` the same values as float16 (``--forms int4,int4h``: the two
alone, and the last column their time ratio).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import time

import torch

from llmd.runtime.formats.quantized import quantize_int4, quantize_int8
from llmd.runtime.kernels import ops

FORMS = ("bf16", "int8", "int8g", "int4", "int4h")
PRODUCTS = ("qkv", "o", "gate_up", "down", "head")


def forms(n: int, k: int, group: int, names) -> dict:
    """Each form's weight: bfloat16 blocks, or a packed quantized form (int4 and int4h from the same
    values: float16 scales and zeros, held as float32 or as float16)."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)) * 0.05
    make = {"bf16": lambda: ops.f32_blocks(w.to(torch.bfloat16).float()),
            "int8": lambda: ops.int8_pack(*quantize_int8(w)), "int8g": lambda: ops.int8_pack(*quantize_int8(w, 64)),
            "int4": lambda: ops.int4_pack(*quantize_int4(w, group), group, half=False),
            "int4h": lambda: ops.int4_pack(*quantize_int4(w, group), group)}
    return {name: make[name]() for name in names}


def nbytes(form) -> int:
    return (form.data if isinstance(form, ops.Packed) else form).numel() * (1 if isinstance(form, ops.Packed)
                                                                             else form.element_size())


def ring(form, mib: float) -> list:
    """Copies of a form's weight, ``mib`` MiB of them (at least one: the form itself)."""
    copies = max(1, math.ceil(mib * (1 << 20) / nbytes(form)))
    if isinstance(form, ops.Packed):
        return [form] + [dataclasses.replace(form, data=form.data.clone()) for _ in range(copies - 1)]
    return [form] + [form.clone() for _ in range(copies - 1)]


def product(x: torch.Tensor, form) -> None:
    if isinstance(form, ops.Packed):
        ops.packed_matvec(x, form)
    else:
        ops.f32_matvec(x, form, None)


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
    p.add_argument("--group", type=int, default=64, choices=(32, 64, 128, 256), help="int4 group size (default 64)")
    p.add_argument("--forms", default=",".join(FORMS), help="forms to compare (default %(default)s)")
    p.add_argument("--products", default=",".join(PRODUCTS), help="products to run (default %(default)s)")
    p.add_argument("--ring-mib", type=float, default=0,
                   help="read each form's weight from copies of it this many MiB in all (0: one copy, in cache)")
    a = p.parse_args()
    names = a.forms.split(",")
    if not set(names) <= set(FORMS) or not set(a.products.split(",")) <= set(PRODUCTS):
        p.error(f"forms are among {FORMS}, products among {PRODUCTS}")
    torch.set_num_threads(a.threads)
    d = a.hidden // a.heads
    shapes = {"qkv": ((a.heads + 2 * a.kv_heads) * d, a.hidden), "o": (a.hidden, a.hidden),
              "gate_up": (2 * a.intermediate, a.hidden), "down": (a.hidden, a.intermediate), "head": (a.vocab, a.hidden)}
    ratio = "int4" in names and "int4h" in names
    unit = "us, GB/s" if a.ring_mib else "us"
    print(f"{'product':8s} {'shape':>11s} {'rows':>4s}  " + "  ".join(f"{k:>14s}" for k in names)
          + ("   int4h/int4" if ratio else "") + f"   ({unit}: best of rounds)")
    with torch.inference_mode():
        for name in a.products.split(","):
            n, k = shapes[name]
            rings = {kind: ring(form, a.ring_mib) for kind, form in forms(n, k, a.group, names).items()}
            for m in map(int, a.rows.split(",")):
                x = torch.randn(m, k)
                best = dict.fromkeys(rings, float("inf"))
                for _ in range(a.rounds):
                    for kind, copies in rings.items():
                        t = time.perf_counter()
                        for form in copies:
                            product(x, form)
                        best[kind] = min(best[kind], (time.perf_counter() - t) / len(copies))
                cells = [f"{best[kind] * 1e6:8.1f}" + (f" {nbytes(rings[kind][0]) / best[kind] / 1e9:5.1f}"
                                                      if a.ring_mib else "") for kind in rings]
                print(f"{name:8s} {f'{n}x{k}':>11s} {m:4d}  " + "  ".join(f"{c:>14s}" for c in cells)
                      + (f"   {best['int4h'] / best['int4']:10.3f}" if ratio else ""))
            print(f"{'':8s} {'':>11s} {'MB':>4s}  " + "  ".join(f"{nbytes(rings[kind][0]) / 1e6:14.3f}" for kind in rings)
                  + (f"   {nbytes(rings['int4h'][0]) / nbytes(rings['int4'][0]):10.3f}" if ratio else ""))


if __name__ == "__main__":
    main()
