"""Memory read bandwidth, and the decode rate it allows a model: the ceiling for one stream.

    python -m llmd.bench.membw --threads 2 MODEL.gguf ENGINE_DIR ...

One decode step of one stream reads every weight once, so no engine decodes faster than
bandwidth / (bytes of weights): the weights' bytes are the files' (a GGUF file, or an engine
directory's tensors), read here as they lie on disk, which counts a tied embedding once (it is read
whole as the head) and an untied embedding whole (only one row of it is read: the bound is then a
little low). The bandwidth is the best of ``--rounds`` sums over a ``--size-mib`` float32 tensor with
``--threads`` threads, far larger than any cache.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

WEIGHT_SUFFIXES = (".gguf", ".safetensors", ".bin", ".pt")


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
    args = p.parse_args(argv)
    if args.threads < 1 or args.size_mib < 64 or args.rounds < 1:
        p.error("--threads and --rounds must be >= 1 and --size-mib >= 64")
    bw = read_bandwidth(args.threads, args.size_mib, args.rounds)
    print(f"read bandwidth: {bw / 1e9:.1f} GB/s ({args.threads} threads, {args.size_mib} MiB, best of {args.rounds})")
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
