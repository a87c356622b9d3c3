"""Torch-facing wrappers of qmatvec.c. Each takes x [M, K] (M <= MAX_ROWS) and returns float32
[M, N], or None when the kernel cannot run (not built, unsupported CPU or shape): the caller then
uses torch's kernel."""
from __future__ import annotations

import torch

from . import lib

MAX_ROWS = 4
_SERIAL_BELOW = 1 << 18      # weights in a product below which one thread beats the parallel split


def _threads(n: int, k: int) -> int:
    return 1 if n * k < _SERIAL_BELOW else torch.get_num_threads()


def shape_ok(m: int, k: int) -> bool:
    return 1 <= m <= MAX_ROWS and k % 128 == 0


def _start(x: torch.Tensor):
    """(library, x as contiguous float32, M, K), or None when the kernels cannot take x."""
    so = lib()
    m, k = x.shape
    if so is None or not shape_ok(m, k):
        return None
    return so, x.float().contiguous(), m, k


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


def int8_matvec(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
    if (start := _start(x)) is None:
        return None
    so, x, m, k = start
    n = qweight.shape[0]
    xh, xl = torch.empty(m, k, dtype=torch.uint8), torch.empty(m, k, dtype=torch.uint8)
    neg = torch.empty(m, k // 64, dtype=torch.int64)
    sx = torch.empty(m)
    if so.llmd_x16_quantize(x.data_ptr(), m, k, xh.data_ptr(), xl.data_ptr(), neg.data_ptr(), sx.data_ptr()):
        return None
    y = torch.empty(m, n)
    rc = so.llmd_int8(xh.data_ptr(), xl.data_ptr(), neg.data_ptr(), sx.data_ptr(), m, k, qweight.data_ptr(),
                      scales.data_ptr(), _ptr(bias), y.data_ptr(), n, _threads(n, k))
    return y if rc == 0 else None


def int4_pack(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int):
    """uint8 [N, K] nibbles with [N, K/G] scales and zeros -> the kernel's form (packed weights
    uint8 [N, K/2], scales, offsets z - 8 s; see qmatvec.c), or None where the kernel does not run
    (not built, K not a multiple of 128, G not 64, 128 or 256)."""
    so = lib()
    n, k = q.shape
    if so is None or k % 128 or group_size not in (64, 128, 256):
        return None
    q = q.to(torch.uint8).contiguous()
    packed = torch.empty(n, k // 2, dtype=torch.uint8)
    so.llmd_int4_pack(q.data_ptr(), n, k, packed.data_ptr())
    return packed, scales.float().contiguous(), (zeros - 8 * scales).float().contiguous()


def int4_matvec(x: torch.Tensor, form: tuple, group_size: int, bias: torch.Tensor | None):
    """``form`` from ``int4_pack``."""
    if (start := _start(x)) is None:
        return None
    so, x, m, k = start
    packed, scales, offsets = form
    n = packed.shape[0]
    xq, sx, xs = torch.empty(m, k, dtype=torch.int8), torch.empty(m, k // 128), torch.empty(m, k // group_size)
    if so.llmd_x8_blocks(x.data_ptr(), m, k, group_size, xq.data_ptr(), sx.data_ptr(), xs.data_ptr()):
        return None
    y = torch.empty(m, n)
    rc = so.llmd_int4(xq.data_ptr(), sx.data_ptr(), xs.data_ptr(), m, k, group_size, packed.data_ptr(),
                      scales.data_ptr(), offsets.data_ptr(), _ptr(bias),
                      y.data_ptr(), n, _threads(n, k // 2))
    return y if rc == 0 else None


def w8a8_matvec(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
    if (start := _start(x)) is None:
        return None
    so, x, m, k = start
    n = qweight.shape[0]
    xa = torch.empty(m, k, dtype=torch.uint8)
    neg = torch.empty(m, k // 64, dtype=torch.int64)
    sx = torch.empty(m)
    if so.llmd_w8a8_quantize(x.data_ptr(), m, k, xa.data_ptr(), neg.data_ptr(), sx.data_ptr()):
        return None
    y = torch.empty(m, n)
    rc = so.llmd_w8a8(xa.data_ptr(), neg.data_ptr(), sx.data_ptr(), m, k, qweight.data_ptr(), scales.data_ptr(),
                      _ptr(bias), y.data_ptr(), n, _threads(n, k))
    return y if rc == 0 else None
