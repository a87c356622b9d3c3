"""Torch-facing wrappers of llmd's C kernels (quant.c, f32.c, attention.c, rows.c). The products take
x [M, K] and return float32 [M, N]; every wrapper returns None when its kernel cannot run (not
built, unsupported CPU or shape), and the caller then uses torch's ops."""
from __future__ import annotations

import ctypes

from dataclasses import dataclass

import torch

from . import lib, struct, usable

MAX_ROWS = 16             # rows of x the w8a8 kernel takes (decode batches, verification)
MANY_MAX_ROWS = 8192      # ... the packed forms (int8, int8g, int4) up to this many (prompts too)
F32_MAX_ROWS = 16         # f32_pick's rows (the head screen's float heads); the row functions' answer without a library
_SERIAL_BELOW = 1 << 18      # multiply-adds in a product below which one thread beats the parallel split


def _threads(m: int, n: int, k: int) -> int:
    """Threads for m rows times an [n, k] weight: one for a small single-row product (waking the others
    costs more than they save), all once the work is larger. 256 x 768 at 16 rows: 59 us on one
    thread, 33 us on two here; a prompt through a small quantized layer was held to one thread."""
    return 1 if m * n * k < _SERIAL_BELOW else torch.get_num_threads()


def _narrowed(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """float32 ``t`` in ``dtype`` when every value is one of its values, else None."""
    if t.dtype != torch.float32:
        return None
    narrow = t.to(dtype)
    return narrow if torch.equal(narrow.float(), t) else None


def as_bfloat16(w: torch.Tensor) -> torch.Tensor | None:
    """float32 ``w`` in bfloat16 when every value is one (a checkpoint stored in bfloat16 and loaded as
    float32), else None."""
    return _narrowed(w, torch.bfloat16)


def as_float16(t: torch.Tensor) -> torch.Tensor | None:
    """float32 ``t`` in float16 when every value is a finite float16 value, else None."""
    narrow = _narrowed(t, torch.float16)
    return narrow if narrow is not None and bool(torch.isfinite(narrow).all()) else None


def f32_blocks(w: torch.Tensor) -> torch.Tensor:
    """A float32 weight [N, K] (out, in) in the kernel's layout [N/64, K, 64]; N a multiple of 64. A weight
    whose values are all bfloat16 keeps them in bfloat16 (half the bytes; the kernel widens them exactly)."""
    n, k = w.shape
    w = w.detach().float()
    narrow = as_bfloat16(w)
    w = w if narrow is None else narrow
    return w.t().reshape(k, n // 64, 64).transpose(0, 1).contiguous()


def f32_unblock(blocks: torch.Tensor) -> torch.Tensor:
    """The inverse of ``f32_blocks``: the float32 [N, K] weight."""
    nb, k, _ = blocks.shape
    return blocks.float().transpose(0, 1).reshape(k, nb * 64).t()


def f32_rows() -> int:
    """The most rows one call of the kernel takes over float32 blocks: every row on the vector loop,
    summed in one order whatever the other rows (prompt chunks too: no oneDNN copy is kept for them)."""
    return _ask("llmd_f32_rows", F32_MAX_ROWS)


def bf16_max_rows() -> int:
    """The most rows one call of the kernel takes over bfloat16 blocks (past ``bf16_amx_rows()`` the
    tile unit's, where AMX multiplies bfloat16)."""
    return _ask("llmd_f32_w16_rows", F32_MAX_ROWS)


def bf16_amx_rows() -> int:
    """The rows of bfloat16 blocks past which a product takes AMX's tile unit (f32.c: x split into three
    bfloat16 parts, summed in the tile unit's order); 0 where it never does (no AMX, the amx setting off)."""
    return _ask("llmd_f32_w16_amx_rows", 0)


def block_rows(blocks: torch.Tensor) -> int:
    """The most rows one call of the kernel takes over these blocks (``f32_blocks``' float32 or
    bfloat16 values)."""
    return f32_rows() if blocks.dtype == torch.float32 else bf16_max_rows()


def _ask(name: str, without: int) -> int:
    """An entry point's answer that never changes for a library (asked on every product: one call per
    library; the amx switch is fixed before it loads), ``without`` where no library is loaded."""
    so = lib()
    if so is None:
        return without
    if (got := _answers.get((id(so), name))) is None:
        got = _answers[(id(so), name)] = getattr(so, name)()
    return got


_answers: dict[tuple, int] = {}


def draft_rows() -> int:
    """The most rows of one forward in a fused draft loop (decode.c's ``llmd_draft``)."""
    return _ask("llmd_draft_rows", F32_MAX_ROWS)


def fused_rows() -> int:
    """The most rows one fused step takes (decode.c's ``llmd_decode``)."""
    return _ask("llmd_fused_rows", F32_MAX_ROWS)


def f32_matvec(x: torch.Tensor, blocks: torch.Tensor, bias: torch.Tensor | None):
    """x [M, K] float32 times a weight in ``f32_blocks`` layout (float32 or bfloat16 blocks) -> [M, N]."""
    so = lib()
    m, k = x.shape
    n = blocks.shape[0] * 64
    most = block_rows(blocks)
    if so is None or m < 1 or x.dtype != torch.float32 or (m > most and most <= F32_MAX_ROWS):
        return None
    x = x.contiguous()
    y = torch.empty(m, n)
    fn = so.llmd_f32 if blocks.dtype == torch.float32 else so.llmd_f32_w16
    if m <= most:
        rc = fn(x.data_ptr(), m, k, blocks.data_ptr(), _ptr(bias), y.data_ptr(), n, _threads(m, n, k))
        return y if rc == 0 else None
    part = -(-m // -(-m // most))    # past the most rows of a call, in even parts (each on the same path)
    for i in range(0, m, part):
        rows = min(part, m - i)
        if fn(x[i].data_ptr(), rows, k, blocks.data_ptr(), _ptr(bias), y[i].data_ptr(), n, _threads(rows, n, k)):
            return None
    return y


def f32_pick(x: torch.Tensor, blocks: torch.Tensor, idx: torch.Tensor):
    """The values ``f32_matvec`` gives outputs ``idx`` (int64, any order) of a weight in ``f32_blocks`` layout
    without a bias, computed from those outputs' lanes alone: float32 [M, len(idx)], or None where the
    kernel does not take the shape."""
    so = lib()
    m, k = x.shape
    if (so is None or not 1 <= m <= F32_MAX_ROWS or x.dtype != torch.float32 or idx.numel() < 1
            or blocks.shape[1] != k or blocks.dtype not in (torch.float32, torch.bfloat16)):
        return None
    x, idx = x.contiguous(), idx.to(torch.int64).contiguous()
    y = torch.empty(m, idx.numel())
    rc = so.llmd_f32_pick(x.data_ptr(), m, k, blocks.data_ptr(), int(blocks.dtype == torch.float32),
                          blocks.shape[0] * 64,
            idx.data_ptr(), idx.numel(), y.data_ptr(), _threads(m, idx.numel(), k))
    return y if rc == 0 else None


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


@dataclass(frozen=True, eq=False)
class Packed:
    """A quantized weight [n, k] in the kernels' blocks of 16 outputs (quant.c): int8 (``group`` 0: a
    scale per row), int8g (a scale per ``group`` columns) or int4 (``nibbles``), scales inside; int4's
    held as float16 (``half``: q4h) where every scale and zero is a float16 value."""
    data: torch.Tensor        # uint8, packed_bytes(...) of them
    n: int
    k: int
    group: int
    nibbles: bool
    half: bool = False

    @property
    def kind(self) -> int:
        if self.nibbles:
            return KIND_Q4H if self.half else KIND_Q4
        return KIND_Q8G if self.group else KIND_Q8

    @property
    def max_rows(self) -> int:
        """Rows one call takes: prompts too, for every form (the fused step takes at most
        ``fused_rows()``)."""
        return MANY_MAX_ROWS

    def product(self, max_rows: int | None = None) -> "KernelProduct":
        return KernelProduct(self.kind, self.data, group=self.group,
                             max_rows=self.max_rows if max_rows is None else max_rows)


def packed_bytes(n: int, k: int, group: int, nibbles: bool, half: bool = False) -> int:
    """Bytes of a packed weight: per block of 16 outputs, 128 per group (scales and sums; ``half``:
    64) and 16 per column (int4: 8)."""
    groups = k // group if group else 1
    return (n + 15) // 16 * ((64 if half else 128) * groups + (8 if nibbles else 16) * k)


def int8_pack(qweight: torch.Tensor, scales: torch.Tensor) -> Packed | None:
    """int8 weight [N, K] with scales [N] (int8) or [N, K/G] (int8g, G 64, 128 or 256) in the kernels'
    blocks, or None where they do not run (not built, K not a multiple of 64 below 65536, another G)."""
    so = lib()
    n, k = qweight.shape
    group = 0 if scales.dim() == 1 else k // scales.shape[1]
    if so is None:
        return None
    out = torch.empty(packed_bytes(n, k, group, False), dtype=torch.uint8)
    rc = so.llmd_q8_pack(qweight.contiguous().data_ptr(), scales.float().contiguous().data_ptr(), n, k, group,
                         out.data_ptr())
    return Packed(out, n, k, group, False) if rc == 0 else None


def int4_pack(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
              half: bool = True) -> Packed | None:
    """uint8 [N, K] nibbles with [N, K/G] scales and zeros in the kernels' blocks, or None where they do
    not run (not built, G not 32, 64, 128 or 256, or K not a multiple of G and of 64). Float32 scales
    and zeros that are all float16 values are held as float16 (q4h: 5 bits a weight at groups of 32
    where float32 takes 6; ``half=False`` keeps float32 blocks, for comparisons), and the kernel forms
    z - 8 s as torch forms it here: the same numbers."""
    so = lib()
    n, k = q.shape
    if so is None:
        return None
    q = q.to(torch.uint8).contiguous()
    s16, z16 = (as_float16(scales), as_float16(zeros)) if half else (None, None)
    if s16 is not None and z16 is not None:
        out = torch.empty(packed_bytes(n, k, group_size, True, half=True), dtype=torch.uint8)
        s16, z16 = s16.contiguous(), z16.contiguous()
        rc = so.llmd_q4h_pack(q.data_ptr(), s16.data_ptr(), z16.data_ptr(), n, k, group_size, out.data_ptr())
        return Packed(out, n, k, group_size, True, half=True) if rc == 0 else None
    out = torch.empty(packed_bytes(n, k, group_size, True), dtype=torch.uint8)
    offsets = (zeros - 8 * scales).float().contiguous()
    rc = so.llmd_q4_pack(q.data_ptr(), scales.float().contiguous().data_ptr(), offsets.data_ptr(), n, k,
                         group_size, out.data_ptr())
    return Packed(out, n, k, group_size, True) if rc == 0 else None


def packed_matvec(x: torch.Tensor, form: Packed, bias: torch.Tensor | None = None):
    """x [M, K] times a packed weight -> float32 [M, N] (plus ``bias``), or None where the kernel does
    not take these rows (more than ``form.max_rows``)."""
    so = lib()
    m, k = x.shape
    if so is None or not 1 <= m <= form.max_rows or k != form.k:
        return None
    x = x.float().contiguous()
    n = form.n
    y = torch.empty(m, n)
    if form.nibbles:
        fn, work = (so.llmd_q4h_x if form.half else so.llmd_q4_x), k // 2
    else:
        fn, work = so.llmd_q8_x, k
    rc = fn(x.data_ptr(), m, k, form.group, form.data.data_ptr(), y.data_ptr(), n, _threads(m, n, work))
    if rc:
        return None
    return y if bias is None else y.add_(bias)


def gg_matvec(x: torch.Tensor, parts, count: int, n: int) -> torch.Tensor | None:
    """x [M, K] (float32, contiguous) times a weight of GGUF blocks (``parts``: ``count`` llmd_gg_part,
    n outputs in all) -> float32 [M, N], or None where the kernel refuses the shape."""
    so = lib()
    m, k = x.shape
    if so is None or m < 1:
        return None
    y = torch.empty(m, n)
    rc = so.llmd_gg_x(x.data_ptr(), m, k, ctypes.addressof(parts), count, y.data_ptr(), n, _threads(m, n, k // 2))
    if rc == -2:
        raise MemoryError("the GGUF block product could not allocate its buffer (out of memory)")
    return None if rc else y


def q8_pick(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, idx: torch.Tensor):
    """The values ``packed_matvec`` gives outputs ``idx`` (int64, any order) of the int8 / int8g weight
    [N, K] with scales [N] or [N, K/G], computed from those rows alone: float32 [M, len(idx)], or None
    where the kernel does not take the shape."""
    so = lib()
    m, k = x.shape
    if so is None or not 1 <= m <= MANY_MAX_ROWS or idx.numel() < 1 or qweight.shape[1] != k:
        return None
    group = 0 if scales.dim() == 1 else k // scales.shape[1]
    x, idx = x.float().contiguous(), idx.to(torch.int64).contiguous()
    y = torch.empty(m, idx.numel())
    rc = so.llmd_q8_pick(x.data_ptr(), m, k, group, qweight.contiguous().data_ptr(),
                         scales.float().contiguous().data_ptr(), idx.data_ptr(), idx.numel(), y.data_ptr(),
                         _threads(m, idx.numel(), k))
    return y if rc == 0 else None


def screen_select(xp: torch.Tensor, km: int, margin: float, s: torch.Tensor, norms: torch.Tensor) -> torch.Tensor | None:
    """The outputs (int64, ascending) whose screen score ``s`` [M, V] plus its bound (``norms`` [4, V] times
    factors of ``xp``, x's rows with the screen's ``km`` int4 columns first) reaches some row's floor, the
    lower bound of its highest score (llmd.runtime.formats.head_screen); None where the kernel does not
    run or a score is not finite."""
    so = lib()
    m, v = s.shape
    if so is None or not 1 <= m <= 64 or xp.shape[0] != m:
        return None
    xp, s = xp.float().contiguous(), s.float().contiguous()
    out = torch.empty(v, dtype=torch.int64)
    count = so.llmd_screen_select(xp.data_ptr(), m, xp.shape[1], km, margin, s.data_ptr(), v, norms.data_ptr(),
                                  out.data_ptr())
    return out[:count] if count >= 0 else None


def w8a8_matvec(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
    """w8a8: x quantized to int8 per row (token), int8 weight [N, K] as stored."""
    so = lib()
    m, k = x.shape
    if so is None or not 1 <= m <= MAX_ROWS or k % 64:
        return None
    x = x.float().contiguous()
    n = qweight.shape[0]
    y = torch.empty(m, n)
    rc = so.llmd_w8a8_x(x.data_ptr(), m, k, qweight.data_ptr(), scales.data_ptr(), _ptr(bias), y.data_ptr(), n,
                        _threads(m, n, k))
    return y if rc == 0 else None


# kernels.h's llmd_product kinds
(KIND_F32, KIND_BF16, KIND_INT8, KIND_INT8G, KIND_ROWS, KIND_Q8, KIND_Q8G, KIND_Q4, KIND_Q4H,
 KIND_GG) = range(10)


@dataclass(frozen=True, eq=False)
class KernelProduct:
    """One weight as the fused step reads it (kernels.h's llmd_product): its kind, its tensors, and
    the rows up to which the layer-by-layer forward runs the same kernel on it (so that the fused step,
    which serves no more rows than that, gives the same numbers)."""
    kind: int
    weight: torch.Tensor
    scales: torch.Tensor | None = None
    group: int = 0
    max_rows: int = MAX_ROWS
    held: tuple = ()          # further storage the weight's pointers reach (KIND_GG: the file's blocks)

    @classmethod
    def blocks(cls, stored: torch.Tensor, max_rows: int) -> "KernelProduct | None":
        """A weight in ``f32_blocks`` layout (float32 or bfloat16 values), or None for any other storage."""
        kinds = {torch.float32: KIND_F32, torch.bfloat16: KIND_BF16}
        return cls(kinds[stored.dtype], stored, max_rows=max_rows) if stored.dtype in kinds else None

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.weight, self.scales, *self.held) if t is not None]

    def struct(self, bias: torch.Tensor | None = None):
        """The llmd_product the kernels read (its pointers stay valid while these tensors live)."""
        return struct("llmd_product")(w=self.weight.data_ptr(), scales=_ptr(self.scales), bias=_ptr(bias),
                                      kind=self.kind, group=self.group)


ATTEND_POOL_DTYPES = (torch.float32, torch.bfloat16)     # pools the attention kernel reads


def attend(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, rows: torch.Tensor, spans: torch.Tensor,
           lengths: torch.Tensor, table: torch.Tensor, block_size: int, out: torch.Tensor) -> bool:
    """Attention of query rows ``rows`` of float32 q [T, H, D] over float32 or bfloat16 pools [S, KVH, D],
    row r seeing the first ``lengths[r]`` positions of request ``spans[r]``, whose block ids are
    ``table[spans[r]]`` (int32 tensors). Writes those rows of float32 ``out`` [T, H, D]; False when it ran
    out of memory. Shapes it does not take raise ValueError (PagedAttention.kernel_fits checks them first)."""
    so = lib()
    _, h, d = q.shape
    kvh = k_pool.shape[1]
    if (so is None or q.dtype != torch.float32 or k_pool.dtype not in ATTEND_POOL_DTYPES
            or v_pool.dtype != k_pool.dtype or not q.is_contiguous() or d % 16 or d > 256 or h % kvh):
        raise ValueError("attention kernel: float32 q, float32 or bfloat16 pools, head size a multiple of 16 up to 256")
    fn = so.llmd_attend if k_pool.dtype == torch.float32 else so.llmd_attend_bf16
    rc = fn(q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), rows.data_ptr(), spans.data_ptr(),
            lengths.data_ptr(), rows.numel(), table.data_ptr(), table.shape[1], block_size, h, kvh, d,
            out.data_ptr(), torch.get_num_threads())
    return rc == 0



def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float):
    """RMSNorm of float32 rows [..., K] (K a multiple of 16); None when the kernel cannot run."""
    so = lib()
    k = x.shape[-1]
    if so is None or x.dtype != torch.float32 or k % 16:
        return None
    x = x.contiguous()
    out = torch.empty_like(x)
    if so.llmd_rmsnorm(x.data_ptr(), x.numel() // k, k, weight.data_ptr(), eps, out.data_ptr()):
        return None
    return out


def add_rmsnorm(x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float):
    """(x + h, RMSNorm(x + h)) of float32 rows [..., K] (K a multiple of 16); None when the kernel
    cannot run."""
    so = lib()
    k = x.shape[-1]
    if so is None or x.dtype != torch.float32 or h.dtype != torch.float32 or k % 16 or x.shape != h.shape:
        return None
    x, h = x.contiguous(), h.contiguous()
    total, out = torch.empty_like(x), torch.empty_like(x)
    if so.llmd_add_rmsnorm(x.data_ptr(), h.data_ptr(), x.numel() // k, k, weight.data_ptr(), eps, total.data_ptr(),
                           out.data_ptr()):
        return None
    return total, out


def silu_mul(gate_up: torch.Tensor):
    """silu(gate) * up of float32 rows [..., 2I] -> [..., I]; None when the kernel cannot run."""
    so = lib()
    if so is None or gate_up.dtype != torch.float32:
        return None
    gate_up = gate_up.contiguous()
    i = gate_up.shape[-1] // 2
    out = gate_up.new_empty(*gate_up.shape[:-1], i)
    if so.llmd_silu_mul(gate_up.data_ptr(), gate_up.numel() // (2 * i), i, out.data_ptr()):
        return None
    return out


def rope_qk(qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor,
            positions: torch.Tensor):
    """Rotary embedding (adjacent pairs) of the q and k heads of float32 qkv rows [T, (H + 2 KVH) D]
    -> (q [T, H, D], k [T, KVH, D]), contiguous; None when the kernel cannot run or a position lies
    past the tables (the caller's own lookup then raises)."""
    so = lib()
    if (so is None or qkv.dtype != torch.float32 or positions.dtype != torch.int64
            or not cos.is_contiguous() or not sin.is_contiguous()):
        return None
    qkv, positions = qkv.contiguous(), positions.contiguous()     # held while the kernel reads them
    t = qkv.shape[0]
    q = qkv.new_empty(t, heads, head_dim)
    k = qkv.new_empty(t, kv_heads, head_dim)
    if so.llmd_rope_qk(qkv.data_ptr(), t, heads, kv_heads, head_dim, cos.data_ptr(), sin.data_ptr(), cos.shape[0],
                       positions.data_ptr(), q.data_ptr(), k.data_ptr()):
        return None
    return q, k


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Index of the first largest value of each row of float32 x [M, V] (int64 [M]), as
    ``x.argmax(-1)`` gives it; torch's own argmax where the kernel cannot run or a row holds NaN."""
    so = lib()
    if so is None or x.dtype != torch.float32 or x.dim() != 2 or not usable(x, has_gradient=False):
        return x.argmax(-1)
    x = x.contiguous()
    m, v = x.shape
    out = torch.empty(m, dtype=torch.int64)
    if so.llmd_argmax(x.data_ptr(), m, v, out.data_ptr(), torch.get_num_threads() if m * v >= 1 << 18 else 1):
        return x.argmax(-1)
    return out
