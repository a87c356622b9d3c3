"""GGUF quantized blocks read as llmd's quantized layouts, where both hold the same numbers.

A GGUF block type stores integers and one or two scales per block; where an llmd layout has the
same integers and scales, the tensor keeps them and is not rounded a second time:

    GGUF type  block                                    llmd form   llmd values
    Q8_0       w = d q,            q in [-128, 127]     int8g/32    q, s = d
    Q5_0       w = d (q - 16),     q in [0, 31]         int8g/32    q - 16, s = d
    Q6_K       w = d sc_j (q - 32) per 16 of 256        int8g/16    q - 32, s = d sc_j
    Q4_0       w = d (q - 8),      q in [0, 15]         int4/32     q, s = d, z = 0
    Q4_1       w = d q + m                              int4/32     q, s = d, z = 8 d + m
    Q4_K       w = d sc_j q - dmin m_j per 32 of 256    int4/32     q, s = d sc_j, z = 8 s - dmin m_j

(llmd's int8g: w = q s; int4: w = (q - 8) s + z.) d, m and dmin are float16 and sc_j, m_j small
integers, so s and d sc_j q are exact in float32. The one rounding llmd's int4 formula could add is
z = 8 s + m: ``decode`` computes it in float64 and keeps the int4 form only where every z is a float32,
and then (q - 8) s + z is the same real number as the `gguf` package's d q + m, rounded once by both.
Beyond that argument, ``exact_form`` checks every tensor: llmd's dequantization of the form must
equal the `gguf` package's, value for value in float32, or the tensor is read as float. Other types
(Q5_1 and Q5_K carry a minimum with 5-bit values, which no llmd layout holds; Q2_K, Q3_K, the IQ
types) are dequantized to float32.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .quantized import dequantize_int4, dequantize_int8

FLOAT16 = np.dtype("<f2")


@dataclass
class Blocks:
    """One tensor [N, K] in an llmd form: ``kind`` "int8g" (q int8) or "int4" (q uint8 in [0, 15],
    with ``zeros``); ``scales`` and ``zeros`` float32 [N, K / group]."""
    kind: str
    group: int
    q: np.ndarray
    scales: np.ndarray
    zeros: np.ndarray | None = None

    @property
    def form(self) -> str:
        return f"{self.kind}/{self.group}"

    def rows(self, order: np.ndarray) -> "Blocks":
        return Blocks(self.kind, self.group, self.q[order], self.scales[order],
                      None if self.zeros is None else self.zeros[order])

    def dequantize(self) -> np.ndarray:
        """The float32 weight by llmd's own formulas (llmd.runtime.formats.quantized)."""
        q, s = torch.from_numpy(self.q), torch.from_numpy(self.scales)
        if self.kind == "int8g":
            return dequantize_int8(q, s).numpy()
        return dequantize_int4(q, s, torch.from_numpy(self.zeros)).numpy()

    def as_int8g(self) -> "Blocks | None":
        """The same values as int8 with a scale per group: int4 blocks without offsets only."""
        if self.kind == "int8g":
            return self
        if np.any(self.zeros != 0):
            return None
        return Blocks("int8g", self.group, (self.q.astype(np.int16) - 8).astype(np.int8), self.scales)

    def regroup(self, group: int) -> "Blocks":
        """int8g with a smaller group that divides this one (each scale repeated): the same values."""
        reps = self.group // group
        return Blocks(self.kind, group, self.q, np.repeat(self.scales, reps, axis=1),
                      None if self.zeros is None else np.repeat(self.zeros, reps, axis=1))


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(FLOAT16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Bytes [..., n] -> [..., 2n]: the low nibbles, then the high ones (GGUF's order in a block)."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _q8_0(b):
    return "int8g", 32, np.ascontiguousarray(b[:, 2:]).view(np.int8), _f16(b[:, :2]), None


def _q5_0(b):
    bits = np.ascontiguousarray(b[:, 2:6]).view("<u4")
    high = ((bits >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
    q = _nibbles(b[:, 6:]) | (high << 4)
    return "int8g", 32, (q.astype(np.int16) - 16).astype(np.int8), _f16(b[:, :2]), None


def _q6_k(b):
    n = b.shape[0]
    ql = (b[:, :128].reshape(n, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 15
    qh = (b[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
    q = ql.reshape(n, 8, 32) | (qh.reshape(n, 8, 32) << 4)
    sc = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)
    return "int8g", 16, (q.astype(np.int16) - 32).astype(np.int8).reshape(n * 16, 16), \
        (_f16(b[:, 208:210]) * sc).reshape(n * 16, 1), None


def _q4_0(b):
    d = _f16(b[:, :2])
    return "int4", 32, _nibbles(b[:, 2:]), d, np.zeros_like(d)


def _q4_1(b):
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    return "int4", 32, _nibbles(b[:, 4:]), d, 8 * d.astype(np.float64) + m


def _q4_k(b):
    import gguf
    n = b.shape[0]
    sc, mn = gguf.quants.Q4_K.get_scale_min(np.ascontiguousarray(b[:, 4:16]))
    s = (_f16(b[:, :2]) * sc.astype(np.float32)).reshape(n * 8, 1)
    m = (_f16(b[:, 2:4]) * mn.astype(np.float32)).reshape(n * 8, 1)
    q = _nibbles(b[:, 16:].reshape(n, 4, 32)).reshape(n * 8, 32)
    return "int4", 32, q, s, 8 * s.astype(np.float64) - m


DECODERS = {"Q8_0": _q8_0, "Q5_0": _q5_0, "Q6_K": _q6_k, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q4_K": _q4_k}
ROUTES = {"Q8_0": "int8g/32", "Q5_0": "int8g/32", "Q6_K": "int8g/16", "Q4_0": "int4/32", "Q4_1": "int4/32",
          "Q4_K": "int4/32"}


def decode(type_name: str, raw: np.ndarray, shape: tuple[int, int]) -> tuple[Blocks | None, str]:
    """GGUF blocks ``raw`` (the tensor's bytes) of a [N, K] tensor as an llmd form, or (None, why not)."""
    if type_name not in DECODERS:
        return None, f"{type_name} has no llmd form"
    import gguf
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    n, k = shape
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(-1, size)
    kind, group, q, scales, zeros = DECODERS[type_name](blocks)
    if zeros is not None:
        z32 = zeros.astype(np.float32)
        if not np.array_equal(z32.astype(np.float64), zeros):
            return None, "an offset 8 s + m is not a float32"
        zeros = z32.reshape(n, k // group)
    return Blocks(kind, group, q.reshape(n, k), scales.reshape(n, k // group), zeros), ""


def exact_form(type_name: str, raw: np.ndarray, shape: tuple[int, int], reference: np.ndarray,
               order: np.ndarray | None = None):
    """``decode`` (its rows taken in ``order`` when given), kept only where llmd's dequantization equals
    ``reference`` (the `gguf` package's float32 values of the same rows [N, K]) at every element."""
    form, why = decode(type_name, raw, shape)
    if form is None:
        return None, why
    if order is not None:
        form = form.rows(order)
    if not np.array_equal(form.dequantize(), reference):
        return None, "llmd's dequantization differs from the gguf package's"
    return form, ""


def common_form(parts: list[Blocks | None]) -> list[Blocks] | None:
    """The parts of one fused llmd module (q, k, v; gate, up) in one form, or None where they have none:
    int4 parts of one group size stay int4 (where the rows come in the multiples of 16 llmd's int4
    takes); int8g parts, and int4 parts without offsets, become int8g with the smallest group."""
    if any(p is None for p in parts):
        return None
    if all(p.kind == "int4" for p in parts) and len({p.group for p in parts}) == 1 \
            and sum(p.q.shape[0] for p in parts) % 16 == 0:
        return parts
    wide = [p.as_int8g() for p in parts]
    if any(p is None for p in wide):
        return None
    group = min(p.group for p in wide)
    if any(p.group % group for p in wide):
        return None
    return [p.regroup(group) for p in wide]
