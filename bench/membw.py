"""Memory read bandwidth, and the decode rate it allows a model: the ceiling for one stream.

    python -m llmd.bench.membw --threads 2 MODEL.gguf ENGINE_DIR ...
    python -m llmd.bench.membw --threads 2 --types Q4_K,Q5_K,Q6_K,Q8_0

One decode step of one stream reads every weight once, so no engine decodes faster than
bandwidth / (bytes of weights): the weights' bytes are the files' (a GGUF file, or an engine
directory's tensors), read here as they lie on disk, which counts a tied embedding once (it is read
whole as the head) and an untied embedding whole (only one row of it is read: the bound is then a
little low). The bandwidth is the best of ``--rounds`` sums over a ``--size-mib`` float32 tensor with
``--threads`` threads, far larger than any cache.

``--types`` times llmd's product of one row with GGUF blocks of each type, over a weight of about
``--size-mib`` (random blocks, llmd.bench.random_blocks), the layout the engine serves (8-row copies
where the type has one), and prints the bytes it reads per second beside the sum's: a type whose
product reads well below the bandwidth is bound by its arithmetic, not by memory, on this host.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

from llmd.bench.random_blocks import BLOCK_TYPES, random_blocks
from llmd.runtime.formats.gguf_native import BLOCKS, TYPES, GGUFLinear
from llmd.runtime.kernels import ops

WEIGHT_SUFFIXES = (".gguf", ".safetensors", ".bin", ".pt")
PRODUCT_K = 4096           # the weight's columns: a multiple of every block


def read_bandwidth(threads: int, size_mib: int = 1024, rounds: int = 8) -> float:
    """Bytes per second that a sum over a large float32 tensor reads, best of ``rounds``."""
    torch.set_num_threads(threads)
    x = torch.ones(size_mib * (1 << 20) // 4, dtype=torch.float32)
    x.sum()
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best


def product_bandwidth(name: str, threads: int, size_mib: int = 1024, rounds: int = 8) -> float:
    """Bytes of ``name`` blocks per second that llmd's one-row product reads, best of ``rounds``; 0 where
    the kernels do not run here."""
    torch.set_num_threads(threads)
    per, size = BLOCKS[TYPES[name]]
    row_bytes = PRODUCT_K // per * size
    rows = max(8, size_mib * (1 << 20) // row_bytes // 8 * 8)
    blocks = random_blocks(name, rows, PRODUCT_K, np.random.default_rng(0))
    weight = GGUFLinear(PRODUCT_K, [(TYPES[name], torch.from_numpy(blocks))])
    weight.prepare()
    x = torch.randn(1, PRODUCT_K)
    if ops.gg_matvec(x, weight.parts(), 1, rows) is None:
        return 0.0
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        ops.gg_matvec(x, weight.parts(), 1, rows)
        best = min(best, time.perf_counter() - t)
    return rows * row_bytes / best


def weight_bytes(path: Path) -> int:
    """The bytes of a model's weights: a file's size, or a directory's weight files together."""
    if path.is_file():
        return path.stat().st_size
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))
    raise FileNotFoundError(f"{path}: no such file or directory")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("models", nargs="*", help="GGUF files or model/engine directories whose decode ceiling to print")
    p.add_argument("--threads", type=int, default=2, help="threads reading (default 2, as the benchmarks run)")
    p.add_argument("--size-mib", type=int, default=1024, help="tensor summed, in MiB (default 1024)")
    p.add_argument("--rounds", type=int, default=8, help="sums timed, the best kept (default 8)")
    p.add_argument("--types", default="", help="comma-separated GGUF block types whose one-row product to time "
                   f"against the bandwidth ({', '.join(BLOCK_TYPES)})")
    args = p.parse_args(argv)
    if args.threads < 1 or args.size_mib < 64 or args.rounds < 1:
        p.error("--threads and --rounds must be >= 1 and --size-mib >= 64")
    types = [t.strip() for t in args.types.split(",") if t.strip()]
    if any(t not in BLOCK_TYPES for t in types):
        p.error(f"--types takes {', '.join(BLOCK_TYPES)}; got {args.types}")
    bw = read_bandwidth(args.threads, args.size_mib, args.rounds)
    print(f"read bandwidth: {bw / 1e9:.1f} GB/s ({args.threads} threads, {args.size_mib} MiB, best of {args.rounds})")
    for t in types:
        got = product_bandwidth(t, args.threads, args.size_mib, args.rounds)
        if not got:
            print(f"{t} product, one row: llmd's kernels do not run on this machine")
            continue
        print(f"{t} product, one row: {got / 1e9:.1f} GB/s of blocks read, {100 * got / bw:.0f} % of the bandwidth")
    for m in args.models:
        try:
            n = weight_bytes(Path(m).expanduser())
        except FileNotFoundError as e:
            print(f"llmd membw: {e}", file=sys.stderr)
            return 2
        print(f"{m}: {n / 1e6:.1f} MB of weights, at most {bw / n:.1f} tokens/s for one stream")
    return 0


if __name__ == "__main__":
    sys.exit(main())
