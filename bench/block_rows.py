"""GGUF block products at several row counts, on each of llmd's kernel libraries in turn:

    python -m llmd.bench.block_rows --types Q4_K,Q5_K,Q6_K,Q8_0 --rows 1,4,16,64,256

A product of ``--rows`` rows of x with a weight of random blocks of each type (``--n`` outputs by ``--k``
inputs, llmd.bench.random_blocks, the layout the engine serves: 8-row copies where the type has one,
widened for many rows) is timed in a child process per library (``LLMD_KERNELS=avx512``, ``avx2``:
the library is chosen once per process), the libraries alternating for ``--rounds`` rounds; each
cell keeps its best. The table gives milliseconds and the ratio of each library's time to the
first's. Both libraries give the same bits (tests/kernels/test_kernels.py); only their speed differs.
The default weight (8960 by 1536, Qwen2.5-1.5B's MLP) stays in cache: this is the arithmetic rate,
the one that bounds prompts and batches; ``membw`` measures the one-row rate from memory. The last
columns give the first library's rate in billions of operations a second and its share of the host's
int8 peak over the same threads (``bench/int8_peak.c``, built here: vpdpbusd where AVX-512 VNNI is
present, else the AVX2 pair), the ceiling a product of many rows can approach.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from llmd.bench.random_blocks import BLOCK_TYPES, random_blocks
from llmd.runtime import kernels
from llmd.runtime.formats.gguf_native import TYPES, GGUFLinear

LIBRARIES = ("avx512", "avx2")
PEAK_SOURCE = Path(__file__).with_name("int8_peak.c")


def int8_peak(threads: int, seconds: float = 1.0) -> tuple[str, float] | None:
    """The host's int8 multiply-add peak over ``threads`` threads: (the instruction timed, billions of
    operations a second), or None where no C compiler builds ``int8_peak.c`` (the compiler the kernel
    library is built with)."""
    try:
        cc = kernels.compiler()
    except RuntimeError:
        return None
    with tempfile.TemporaryDirectory(prefix="llmd-peak-") as d:
        exe = Path(d) / "int8-peak"
        built = subprocess.run([cc, "-O2", "-fopenmp", "-o", str(exe), str(PEAK_SOURCE)], capture_output=True,
                               text=True, timeout=300)
        if built.returncode:
            print(f"llmd block_rows: int8_peak.c did not build: {built.stderr.strip()[-300:]}", file=sys.stderr)
            return None
        done = subprocess.run([str(exe), str(threads), str(seconds)], capture_output=True, text=True, timeout=120)
    if done.returncode:
        print(f"llmd block_rows: the int8 peak did not run: {done.stderr.strip()[-300:]}", file=sys.stderr)
        return None
    form, rate = done.stdout.split()
    return form, float(rate)


def time_products(types: list[str], rows: list[int], n: int, k: int, reps: int, threads: int) -> dict:
    """{type: {rows: best seconds}} on the library this process loaded; {} where none loads."""
    torch.set_num_threads(threads)
    if not kernels.available():
        return {}
    out = {}
    for name in types:
        blocks = random_blocks(name, n, k, np.random.default_rng(0))
        layer = GGUFLinear(k, [(TYPES[name], torch.from_numpy(blocks))])
        layer.prepare()
        out[name] = {}
        for m in rows:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            layer(x)
            best = float("inf")
            for _ in range(reps):
                t = time.perf_counter()
                layer(x)
                best = min(best, time.perf_counter() - t)
            out[name][m] = best
    return out


def run_child(library: str, argv: list[str]) -> dict:
    env = {**os.environ, "LLMD_KERNELS": library}
    done = subprocess.run([sys.executable, "-m", "llmd.bench.block_rows", "--child", *argv], env=env,
                          capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise RuntimeError(f"the {library} library's run failed: {done.stderr.strip()[-500:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if result["variant"] != library:
        raise RuntimeError(f"asked for the {library} library, the child loaded {result['variant'] or 'none'}")
    return {t: {int(m): s for m, s in by.items()} for t, by in result["times"].items()}


def table(results: dict[str, dict], types: list[str], rows: list[int], n: int, k: int,
          peak: float | None = None) -> list[str]:
    """One line a type and row count: each library's milliseconds, the others' against the first's,
    the first's billions of operations a second and, given the host's ``peak``, its share of it."""
    libs = list(results)
    lines = [f"{'type':6} {'rows':>5} " + " ".join(f"{lib + ' ms':>11}" for lib in libs)
             + "".join(f" {lib + '/' + libs[0]:>14}" for lib in libs[1:]) + f" {'GOP/s':>7}"
             + (f" {'of peak':>8}" if peak else "")]
    for t in types:
        for m in rows:
            ms = [results[lib][t][m] * 1e3 for lib in libs]
            rate = 2 * n * k * m / (ms[0] * 1e-3) / 1e9
            lines.append(f"{t:6} {m:>5} " + " ".join(f"{v:>11.3f}" for v in ms)
                         + "".join(f" {v / ms[0]:>13.2f}x" for v in ms[1:]) + f" {rate:>7.0f}"
                         + (f" {rate / peak:>7.0%}" if peak else ""))
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--types", default="Q4_K,Q5_K,Q6_K,Q8_0", help=f"block types ({', '.join(BLOCK_TYPES)})")
    p.add_argument("--rows", default="1,4,16,64,256", help="row counts of x (1-4096)")
    p.add_argument("--libraries", default=",".join(LIBRARIES), help="kernel libraries, the first the baseline")
    p.add_argument("--n", type=int, default=8960, help="the weight's outputs, a multiple of 8 (default 8960)")
    p.add_argument("--k", type=int, default=1536, help="the weight's inputs, a multiple of 256 (default 1536)")
    p.add_argument("--reps", type=int, default=5, help="products timed per cell in each round (default 5)")
    p.add_argument("--rounds", type=int, default=2, help="rounds, the libraries alternating (default 2)")
    p.add_argument("--threads", type=int, default=2, help="threads (default 2)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    types = [t.strip() for t in args.types.split(",") if t.strip()]
    libraries = [v.strip() for v in args.libraries.split(",") if v.strip()]
    try:
        rows = [int(r) for r in args.rows.split(",") if r.strip()]
    except ValueError:
        p.error(f"--rows takes comma-separated whole numbers; got {args.rows}")
    if not types or any(t not in BLOCK_TYPES for t in types):
        p.error(f"--types takes {', '.join(BLOCK_TYPES)}; got {args.types}")
    if not rows or any(not 1 <= r <= 4096 for r in rows):
        p.error("--rows takes numbers from 1 to 4096")
    if not libraries or any(v not in LIBRARIES for v in libraries) or len(set(libraries)) < len(libraries):
        p.error(f"--libraries takes {', '.join(LIBRARIES)}, each once; got {args.libraries}")
    if args.n < 8 or args.n % 8 or args.k < 256 or args.k % 256 or min(args.reps, args.rounds, args.threads) < 1:
        p.error("--n must be a multiple of 8, --k of 256; --reps, --rounds and --threads at least 1")
    if args.child:
        times = time_products(types, rows, args.n, args.k, args.reps, args.threads)
        print(json.dumps({"variant": kernels.variant(), "times": times}))
        return 0
    child_argv = ["--types", ",".join(types), "--rows", ",".join(map(str, rows)), "--n", str(args.n),
                  "--k", str(args.k), "--reps", str(args.reps), "--threads", str(args.threads)]
    best: dict[str, dict] = {}
    for _ in range(args.rounds):
        for lib in libraries:
            try:
                got = run_child(lib, child_argv)
            except RuntimeError as e:
                print(f"llmd block_rows: {e}", file=sys.stderr)
                return 2
            old = best.setdefault(lib, got)
            for t in types:
                for m in rows:
                    old[t][m] = min(old[t][m], got[t][m])
    load = os.getloadavg()[0]
    peak = int8_peak(args.threads)
    print(f"GGUF block products, {args.n} x {args.k}, {args.threads} threads, best of {args.rounds} x {args.reps}; "
          f"load average {load:.1f}")
    if peak:
        print(f"int8 peak of this host: {peak[1]:.0f} GOP/s ({peak[0]}, {args.threads} threads)")
    print("\n".join(table(best, types, rows, args.n, args.k, peak[1] if peak else None)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
