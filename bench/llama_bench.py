"""llama.cpp's ``llama-bench`` as the one-stream peer of ``llmd bench --against llama-bench``.

llmd's one-stream decode figure is the tokens after the first divided by the time from the first to
the last: the prompt is computed, then every further token is one decode step over a growing
context. ``llama-bench -p 0 -n N -d P`` times exactly that for llama.cpp: N single-token decode
steps after a P-token context that it fills, untimed, before each repetition. One repetition per
call (``-r 1``), so that the caller can alternate it with llmd's rounds and take the best of each.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

from .llama_server import CACHE


class LlamaBenchError(RuntimeError):
    """llama-bench is missing, failed, or printed something other than one decode test."""


def llama_bench_binary() -> Path:
    """``llama-bench`` from the cached llama.cpp build (``bench/build_llama_server.sh``'s folder)."""
    for path in (CACHE / "bin" / "llama-bench", CACHE / "build" / "bin" / "llama-bench"):
        if path.is_file():
            return path
    raise LlamaBenchError(f"no llama-bench under {CACHE}: build the llama.cpp tools there with "
                          f"`cmake --build {CACHE / 'build'} --target llama-bench`")


def decode_command(binary: str | Path, gguf: str | Path, threads: int, depth: int, gen: int) -> list[str]:
    if depth < 0 or gen < 1 or threads < 1:
        raise ValueError(f"llama-bench needs depth >= 0, gen >= 1 and threads >= 1; got {depth}, {gen}, {threads}")
    return [str(binary), "-m", str(gguf), "-p", "0", "-n", str(gen), "-d", str(depth), "-t", str(threads),
            "-r", "1", "-o", "json"]


def parse_decode(stdout: str) -> dict:
    """The one decode test of llama-bench's JSON output: tokens/s, tokens, depth, and what it ran."""
    try:
        rows = json.loads(stdout)
    except json.JSONDecodeError as e:
        raise LlamaBenchError(f"llama-bench printed no JSON ({e}): {stdout[:200]!r}") from None
    if not isinstance(rows, list) or len(rows) != 1 or not isinstance(rows[0], dict):
        raise LlamaBenchError(f"expected one llama-bench test, got {type(rows).__name__} of "
                              f"{len(rows) if isinstance(rows, list) else '?'}")
    row = rows[0]
    if row.get("n_prompt") != 0 or not row.get("n_gen"):
        raise LlamaBenchError(f"not a decode test: n_prompt {row.get('n_prompt')}, n_gen {row.get('n_gen')}")
    samples = row.get("samples_ts")
    if not isinstance(samples, list) or len(samples) != 1 or not float(samples[0]) > 0:
        raise LlamaBenchError(f"expected one positive sample, got {samples!r}")
    return {"decode_tok_s": float(samples[0]), "tokens": int(row["n_gen"]), "depth": int(row.get("n_depth", 0)),
            "threads": row.get("n_threads"), "model_type": row.get("model_type"),
            "kv": f"{row.get('type_k')}/{row.get('type_v')}"}


def decode_rate(binary: str | Path, gguf: str | Path, threads: int, depth: int, gen: int,
                timeout_s: float = 600.0) -> dict:
    """Run llama-bench once on ``gguf`` and return ``parse_decode`` of its output."""
    cmd = decode_command(binary, gguf, threads, depth, gen)
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise LlamaBenchError(f"llama-bench did not finish within {timeout_s:.0f} s: {' '.join(cmd)}") from None
    if out.returncode != 0:
        raise LlamaBenchError(f"llama-bench exited {out.returncode}: {out.stderr[-1500:]}")
    return parse_decode(out.stdout)
