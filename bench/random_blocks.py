"""Random GGUF blocks of every type llmd reads in place, with sane float16 scales: the weights of the
kernel benchmarks (llmd.bench.membw) and of the tests' GGUF files (the `gguf` package quantizes only
some types, and llama.cpp is not built in every run)."""
from __future__ import annotations

import numpy as np

from llmd.runtime.formats.gguf_native import BLOCKS, TYPES

# where each type keeps its float16 scales (and minimums) in a block
F16_AT = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "IQ4_NL": [0], "Q2_K": [80, 82],
          "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "IQ4_XS": [0]}
BLOCK_TYPES = list(F16_AT)


def random_blocks(name: str, rows: int, cols: int, rng: np.random.Generator, scale: float = 1.0) -> np.ndarray:
    """uint8 [rows, row bytes] of type ``name``: random integers, scales in [0.001, 0.02] * scale."""
    per, size = BLOCKS[TYPES[name]]
    if name in ("F32", "F16", "BF16"):
        w = (rng.standard_normal((rows, cols)) * 0.05 * scale).astype(np.float32)
        if name == "F32":
            return w.view(np.uint8)
        if name == "F16":
            return w.astype(np.float16).view(np.uint8)
        return (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    raw = rng.integers(0, 256, (rows * cols // per, size), dtype=np.uint8)
    for off in F16_AT[name]:
        d = rng.uniform(0.001, 0.02, len(raw)) * scale
        raw[:, off:off + 2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)
