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
``--size-mib`` (random blocks, float16 scales held small), the layout the engine serves (8-row copies
where the type has one), and prints the bytes it reads per second beside the sum's: a type whose
product reads well below the bandwidth is bound by its arithmetic, not by memory, on this host.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from llmd.runtime.formats.gguf_native import BLOCKS, TYPES, GGUFLinear
from llmd.runtime.kernels import ops

WEIGHT_SUFFIXES = (".gguf", ".safetensors", ".bin", ".pt")
# where each block type keeps its float16 scales (byte offsets in a block), held small in random blocks
HALF_AT = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "IQ4_NL": (0,),
           "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_XS": (0,)}
PRODUCT_K = 4096           # the weight's columns: a multiple of every block


def read_bandwidth(threads: int, size_mib: int = 1024, rounds: int = 8) -> float:
    """Bytes per second that a sum over a large float32 tensor reads, best of ``rounds``."""
    import torch
    torch.set_num_threads(threads)
    x = torch.ones(size_mib * (1 << 20) // 4, dtype=torch.float32)
    x.sum()
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best


def random_blocks(name: str, rows: int, k: int, seed: int = 0):
    """uint8 rows [rows, row bytes] of random ``name`` blocks whose float16 scales are 2^-7 (finite sums)."""
    import torch
    per, size = BLOCKS[TYPES[name]]
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (rows, k // per, size), dtype=torch.uint8, generator=g)
    for at in HALF_AT[name]:
        blocks[:, :, at], blocks[:, :, at + 1] = 0x00, 0x20          # float16 0x2000 = 2^-7
    return blocks.view(rows, -1)


def product_bandwidth(name: str, threads: int, size_mib: int = 1024, rounds: int = 8) -> float:
    """Bytes of ``name`` blocks per second that llmd's one-row product reads, best of ``rounds``; 0 where
    the kernels do not run here."""
    import torch
    torch.set_num_threads(threads)
    probe = random_blocks(name, 8, PRODUCT_K)
    rows = max(8, size_mib * (1 << 20) // probe.shape[1] // 8 * 8)
    weight = GGUFLinear(PRODUCT_K, [(TYPES[name], random_blocks(name, rows, PRODUCT_K))])
    weight.prepare()
    x = torch.randn(1, PRODUCT_K)
    if ops.gg_matvec(x, weight.parts(), 1, rows) is None:
        return 0.0
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        ops.gg_matvec(x, weight.parts(), 1, rows)
        best = min(best, time.perf_counter() - t)
    return rows * probe.shape[1] / best


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
                   f"against the bandwidth ({', '.join(HALF_AT)})")
    args = p.parse_args(argv)
    if args.threads < 1 or args.size_mib < 64 or args.rounds < 1:
        p.error("--threads and --rounds must be >= 1 and --size-mib >= 64")
    types = [t.strip() for t in args.types.split(",") if t.strip()]
    if any(t not in HALF_AT for t in types):
        p.error(f"--types takes {', '.join(HALF_AT)}; got {args.types}")
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
