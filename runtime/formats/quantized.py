"""Quantized weight layouts: the modules an engine directory's quantized tensors load into (a module swap).

Every quantized module keeps the forward signature of ``llmd.runtime.models.layers.Linear``
(x [..., in] -> [..., out], output in x's dtype) and picks its kernel by the number of rows M:

    method  stored (safetensors)                       M <= 16 (ops.MAX_ROWS)       more rows
    int8    qweight int8 [N,K], scales f32 [N]         llmd int8 kernel: x as       the same kernel; without it, x
                                                       16-bit integers per row      split the same way, two _int_mm
    int4    qweight u8 [N,K/2] (two nibbles, low       llmd int4 kernel: x as 8-bit the same kernel up to 640 rows,
            first), scales/zeros f32 [N, K/G]          integers per 128 columns     then bf16 matmul, weight
                                                                                    dequantized once per call
    w8a8    qweight int8 [N,K], scales f32 [N]         llmd w8a8 kernel             _int_mm: activations quantized
                                                                                    per token (dynamic, symmetric)

Batch invariance: up to the last column above, a row's output does not depend on the other rows of
the product. Each row of x is quantized alone, and the int8 and w8a8 sums are exact integers, so the
kernel and the _int_mm form give the same numbers; int4 runs one kernel, whose per-row sums keep one
order whatever M is. A request's greedy tokens are the same alone and in a batch.

The llmd kernels (llmd.runtime.kernels: AVX-512 VNNI, or AVX2) read int8, int8g and int4 weights from a copy
packed at ``prepare()`` into blocks of 16 outputs (quant.c; the stored tensors stay for prompts, token
rows and saving): each weight load serves every row of a tile with one vpdpbusd per row (int8: two;
the AVX2 library's int8 one vpmaddwd per pair of columns),
fewer instructions per weight and row than the bfloat16 blocks' FMAs
(docs/perf/2026-12-01-quantized-kernels.md, "Blocked quantized products"). They stream the weights at memory speed; where
they cannot run (other CPUs, no compiler, a graph being compiled, int4 groups under 32, widths not
a multiple of 64) torch's packed kernels take their place for M <= small_m (more rows as above):
_weight_int8pack_mm and _weight_int4pack_mm_for_cpu with x rounded to bfloat16, which are
compute-bound here.

Method ``mixed`` gives each module its own form (``QuantSpec.modules``: float, int8, int8g/G or
int4/G, G down to 16 for int8g and 32 for int4): what `llmd import --keep-blocks` writes, keeping a
GGUF file's blocks (llmd.runtime.formats.gguf_blocks). llmd's kernels take int8g groups of 64 columns
and more and int4 groups of 32 and more (GGUF's Q4 blocks); smaller groups run through torch's forms
(bf16 weights, or torch's int4 kernel).

Formulas (q is the stored integer, G the group size):
    int8:  w = q * s[n]                              q in [-127, 127]
    int4:  w = (q - 8) * s[n, g] + z[n, g]           q in [0, 15]; symmetric groups have z = 0
    w8a8:  y = (xq @ q^T) * sx[m] * s[n]             xq = round(x / sx), sx = max|x[m]| / 127

Embedding and head: the output head holds int8 weights unless ``head="float"``. It is the largest
matrix of a small model (896 x 151936 in Qwen2-0.5B) and is read for one row per sampled token, and
it is where quantization error first changes a greedy choice. ``head="auto"`` (default for every
quantized method) is ``int8g``: int8 weights with a scale per 64 input columns, the input at 16 bits.
Of the 8-bit heads it keeps greedy output closest to a float head
(docs/perf/2026-12-01-first-figures.md, "Quantized greedy agreement"). ``head="int4"`` makes every matrix 4-bit,
as llama.cpp's Q4_0 files here are. In a tied model the embedding *is* the head's table, so it
follows the head: a quantized head's rows are looked up and dequantized (``rows()``). An untied
embedding is int8 in a quantized export (``embed="auto"``) and float only when asked
(``embed="float"``): it is read one row per token, so quantizing it saves memory and costs no time.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn

from llmd.runtime import kernels
from llmd.runtime.config import KV_DTYPES
from llmd.runtime.errors import InvalidRequest
from llmd.runtime.kernels import ops
from llmd.runtime.models.fused_decode import FusedDecode
from llmd.runtime.models.layers import Linear
from llmd.runtime.models.plan import LayerPlan

METHODS = ("none", "int8", "int4", "w8a8", "mixed")
HEADS = ("auto", "float", "int8", "int8g", "w8a8", "int4")
HEAD_GROUP = 64        # int8g: input columns per scale of the head
SMALL_M = 4            # rows up to which the packed low-bit kernels beat dense bf16 here
MODULE_FORM = re.compile(r"float|int8|int8g/(16|32|64|128|256)|int4/(32|64|128|256)")
MAX_MODULES = 1 << 16


class QuantizationError(InvalidRequest):
    """The requested quantization does not fit this model (shape, group size, method)."""


@dataclass(frozen=True)
class QuantSpec:
    method: str = "none"          # none | int8 | int4 | w8a8
    group_size: int = 128         # int4 only: input columns sharing one scale
    symmetric: bool = False       # int4 only: zero points (False) or none (True)
    head: str = "auto"            # auto | float | int8 | int8g | w8a8 | int4: the output head (and a tied embedding)
    embed: str = "auto"           # auto | float | int8: an untied embedding (a tied one follows the head)
    kv_dtype: str = "auto"        # one of KV_DTYPES (recorded; the runtime owns the pool)
    small_m: int = SMALL_M
    # method "mixed" only: llmd module name ("layers.0.self_attn.qkv_proj", "lm_head", "embed_tokens")
    # -> its form: "float", "int8" (a scale per row), "int8g/G" or "int4/G" (a scale, and for int4 an
    # offset, per G input columns). A GGUF import keeps each tensor's blocks in the form that holds them.
    modules: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.method not in METHODS:
            raise QuantizationError(f"quantization must be one of {METHODS}, got {self.method!r}")
        check_modules(self.method, self.modules)
        if self.group_size not in (32, 64, 128, 256):
            raise QuantizationError(f"group size must be 32, 64, 128 or 256, got {self.group_size}")
        if self.head not in HEADS or self.embed not in ("auto", "float", "int8"):
            raise QuantizationError(f"head must be one of {HEADS}; embed auto, float or int8")
        if self.embed == "auto":
            object.__setattr__(self, "embed", "float" if self.method == "none" else "int8")
        if self.head == "auto":     # resolved once, so manifests record the concrete choice
            auto = "float" if self.method == "none" else "int8g"
            object.__setattr__(self, "head", auto)
        if self.kv_dtype not in KV_DTYPES:
            raise QuantizationError(f"kv dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}")

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "modules" or self.modules}

    def form(self, module: str) -> tuple[str, int]:
        """(kind, group size) of ``module`` under method "mixed": kind float, int8, int8g or int4."""
        kind, _, group = self.modules.get(module, "float").partition("/")
        return kind, int(group or 0)

    @classmethod
    def from_dict(cls, d: dict) -> "QuantSpec":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


def check_modules(method: str, modules) -> None:
    """A "mixed" spec's module table: bounded, every form one llmd holds."""
    if not isinstance(modules, dict) or (modules and method != "mixed") or len(modules) > MAX_MODULES:
        raise QuantizationError("a module table (at most 65536 entries) goes with quantization 'mixed' only")
    for name, form in modules.items():
        if not isinstance(name, str) or len(name) > 256 or not isinstance(form, str) \
                or not MODULE_FORM.fullmatch(form):
            raise QuantizationError(f"module {str(name)[:256]!r}: form {str(form)[:64]!r} is not float, int8, "
                                    "int8g/G or int4/G")


# ---- pure quantizers (also used by the round-trip tests) ---------------------------------------

def quantize_int8(w: torch.Tensor, group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric: w [N,K] -> (q int8 [N,K], scale f32 [N]); |w - q*s| <= s/2.
    With ``group_size``, one scale per group of that many input columns: scale [N, K/G]."""
    w = w.float()
    n, k = w.shape
    g = w.reshape(n, k // group_size, group_size) if group_size else w.reshape(n, 1, k)
    scale = (g.abs().amax(dim=-1) / 127).clamp(min=1e-12)
    q = torch.round(g / scale[..., None]).clamp(-127, 127).to(torch.int8).view(n, k)
    return q, scale if group_size else scale.view(n)


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q times its scales (per row [N], or per group [N, K/G]) in ``dtype`` (float64: exactly)."""
    q, scale = q.to(dtype), scale.to(dtype)
    if scale.dim() == 2:
        n, k = q.shape
        return (q.view(n, scale.shape[1], -1) * scale[..., None]).view(n, k)
    return q * scale[:, None]


FLOAT16_NORMAL = 2.0 ** -14     # the smallest normal float16: scales below it would lose bits as float16


def quantize_int4(w: torch.Tensor, group_size: int, symmetric: bool = False):
    """Group-wise: w [N,K] -> (q uint8 [N,K] in [0,15], scales [N,K/G], zeros [N,K/G]) with
    w ~ (q - 8) * s + z. Asymmetric groups span [min, max] in 15 steps; symmetric ones
    [-8 s, 7 s] with s = max|w| / 8 clipped so that +max is representable to within s/2.

    Scales and zeros are float32 tensors holding float16 values (the kernels then keep them in half
    the bytes: llmd.runtime.kernels.ops.int4_pack): s rounded to float16, z = float16(min + 8 s), and q
    rounded against those, so |w - w~| <= s/2 plus float16's rounding of z (and of s, at the clamped
    ends). A weight with a scale below float16's normal range (or a zero past its largest value) keeps
    its float32 scales and zeros, so tiny layers lose nothing."""
    n, k = w.shape
    g = w.float().view(n, k // group_size, group_size)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = (g.abs().amax(-1) / 7.5 if symmetric else (hi - lo) / 15).clamp(min=1e-12)
    s16 = scale.half().float()
    z16 = torch.zeros_like(scale) if symmetric else (lo + 8 * s16).half().float()
    if bool((s16 >= FLOAT16_NORMAL).all() and torch.isfinite(s16).all() and torch.isfinite(z16).all()):
        scale, zero = s16, z16
        lo = zero - 8 * scale            # the value of q = 0, as the kernels form it (8 s is exact)
    else:
        zero = torch.zeros_like(scale) if symmetric else lo + 8 * scale
    if symmetric:
        q = torch.round(g / scale[..., None]).clamp(-8, 7) + 8
    else:
        q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15)
    return q.to(torch.uint8).view(n, k), scale, zero


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    groups = scale.shape[1]
    g = (q.float().view(n, groups, k // groups) - 8) * scale[..., None] + zero[..., None]
    return g.view(n, k)


def split16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32 rows -> (hi, lo - 128, sx): xi = round(x / sx) in [-32767, 32767] with sx = max|x| / 32767
    per row (rounded as llmd's int8 decode kernel rounds it), xi = 256 hi + lo, both as int8."""
    sx = (x.abs().amax(1, keepdim=True) / 32767).clamp(min=1e-30)
    xi = torch.round(x * (1 / sx)).clamp(-32767, 32767).to(torch.int32)
    return (xi >> 8).to(torch.int8), ((xi & 255) - 128).to(torch.int8), sx


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 [N,K] values in [0,15] -> uint8 [N,K/2], column 2j in the low nibble."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_nibbles(p: torch.Tensor) -> torch.Tensor:
    return torch.stack((p & 15, p >> 4), dim=-1).view(p.shape[0], -1)


# ---- modules -----------------------------------------------------------------------------------

class QuantLinear(nn.Module):
    """Common part: bias, shapes, and the row-count dispatch. Subclasses store their tensors as
    persistent buffers (what the engine directory saves) and build kernel forms in ``prepare()``."""

    method = ""

    def __init__(self, in_features: int, out_features: int, bias: bool, small_m: int = SMALL_M):
        super().__init__()
        self.in_features, self.out_features, self.small_m = in_features, out_features, small_m
        self.register_buffer("bias", torch.zeros(out_features) if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)     # decode rows come 2-D: no reshape
        y = None
        if x2.shape[0] <= ops.MAX_ROWS and kernels.usable(x2):
            y = self.kernel_rows(x2)
        if y is None:
            y = self.small(x2) if x2.shape[0] <= self.small_m else self.large(x2)
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)

    def large(self, x: torch.Tensor) -> torch.Tensor:
        """Many rows: one dequantization amortized over all of them, then a dense bf16 product
        (methods with a faster form for prompts override this)."""
        return F.linear(x.to(torch.bfloat16), self.dense_weight().to(torch.bfloat16))

    def kernel_rows(self, x: torch.Tensor) -> torch.Tensor | None:
        """x times the weight through llmd's kernel, or None where it does not take these rows."""
        return None

    def kernel_product(self) -> ops.KernelProduct | None:
        """The weight as the fused step reads it (the same kernel ``kernel_rows`` calls), or None
        where that kernel does not serve this layer."""
        return None

    def prepare(self, use_kernels: bool = True) -> None:
        """Build the kernel forms; ``use_kernels=False`` keeps to torch's ops (graphs to be compiled)."""
        self.align()

    derived: tuple[str, ...] = ()     # attributes built from the buffers, rebuilt after a reorder

    def permute_outputs(self, rows: torch.Tensor) -> None:
        """Reorder the output features with their scales (before ``prepare()``)."""
        for name, t in list(self.named_buffers(recurse=False)):
            if t is not None and t.shape[0] == self.out_features:
                setattr(self, name, t[rows].contiguous())
        for name in self.derived:
            setattr(self, name, None)

    def align(self) -> None:
        """Tensors read from a file may sit at any address; the packed kernels need 64-byte aligned
        weights (a misaligned int8 weight crashed _weight_int8pack_mm), so copy those."""
        for name, t in self.named_buffers(recurse=False):
            if t is not None and t.data_ptr() % 64:
                setattr(self, name, t.clone())

    def extra_repr(self) -> str:
        return f"{self.method}, in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


class Int8Linear(QuantLinear):
    method = "int8"
    derived = ("_scales_bf16", "_offset", "_kernel_form")

    def __init__(self, in_features, out_features, bias=False, small_m=SMALL_M):
        super().__init__(in_features, out_features, bias, small_m)
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scales", torch.ones(out_features))
        self._scales_bf16 = None
        self._offset = None
        self._kernel_form = None

    def load_weight(self, w: torch.Tensor) -> None:
        self.qweight, self.scales = quantize_int8(w)

    def prepare(self, use_kernels: bool = True) -> None:
        self.align()
        self._scales_bf16 = self.scales.to(torch.bfloat16)
        self._offset = self.qweight.sum(1, dtype=torch.int32) * 128
        self.pack(use_kernels)

    def pack(self, use_kernels: bool) -> None:
        """The weight in llmd's kernel blocks (a second copy of it, as int4 keeps) where the kernels run."""
        self._kernel_form = ops.int8_pack(self.qweight, self.scales) if use_kernels and kernels.available() else None

    def large(self, x: torch.Tensor) -> torch.Tensor:
        """Prompt rows, eager: the decode kernel's packed blocks, each weight load shared by a tile of
        rows (faster than the two integer products below at every prompt size: docs/perf/2026-12-01-quantized-kernels.md,
        "The server under load, int8 against Q8_0, after these changes");
        where it does not run, two integer products carry x at the kernel's 16-bit precision, with its
        rounding: the same numbers, so a row gets what it would get alone either way. Graphs being
        traced keep the dequantizing form."""
        if not kernels.usable(x) or x.dtype != torch.float32:
            return super().large(x)
        if (y := self.kernel_rows(x)) is not None:
            return y
        if self._offset is None:
            self.prepare()
        hi, lo, sx = split16(x)
        wt = self.qweight.t()
        acc_hi = torch._int_mm(hi, wt).double()
        acc_lo = (torch._int_mm(lo, wt) + self._offset).double()     # lo entered shifted by -128
        return (acc_hi * 256 + acc_lo).float() * (sx * self.scales)   # sum w xi exact, rounded once

    def kernel_rows(self, x: torch.Tensor) -> torch.Tensor | None:
        return None if self._kernel_form is None else ops.packed_matvec(x, self._kernel_form)

    def kernel_product(self) -> ops.KernelProduct | None:
        return None if self._kernel_form is None else self._kernel_form.product()

    def table_form(self) -> ops.KernelProduct:
        """The weight as a token table whose rows a draft loop reads (``rows()``'s numbers)."""
        return ops.KernelProduct(ops.KIND_INT8, self.qweight, self.scales)

    def small(self, x: torch.Tensor) -> torch.Tensor:
        if kernels.usable(x) and (y := self.kernel_rows(x)) is not None:
            return y
        if self._scales_bf16 is None:
            self.prepare()
        return torch._weight_int8pack_mm(x.to(torch.bfloat16).contiguous(), self.qweight, self._scales_bf16)

    def dense_weight(self) -> torch.Tensor:
        return dequantize_int8(self.qweight, self.scales)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized rows ``ids`` of the weight (an embedding lookup in a tied table)."""
        return self.qweight.index_select(0, ids).float() * self.scales.index_select(0, ids)[:, None]


class Int8GroupLinear(Int8Linear):
    """int8 weights with a scale per HEAD_GROUP input columns, x at 16-bit precision: the default
    output head. A tied head is the embedding table, whose rows carry outliers that one scale per
    row rounds coarsely; on the demo target, greedy tokens of 200 held-out prompts (float body)
    matched float32 in 175 with a scale per row and 189 with one per 64 columns. llmd's kernel
    serves any number of rows; without it the bf16 dequantized weight is built once and kept. Groups
    the kernel does not take (under 64 columns: GGUF's blocks) run decode rows through llmd's float32
    kernel on that bf16 weight."""

    method = "int8g"
    derived = ("_dense_bf16", "_blocks", "_kernel_form")

    def __init__(self, in_features, out_features, bias=False, small_m=SMALL_M, group_size=HEAD_GROUP):
        super().__init__(in_features, out_features, bias, small_m)
        if in_features % group_size:
            raise QuantizationError(f"int8g needs input widths divisible by {group_size}, got {in_features}")
        self.group_size = group_size
        self.scales = torch.ones(out_features, in_features // group_size)
        self._dense_bf16 = None
        self._blocks = None
        self._kernel_form = None

    def load_weight(self, w: torch.Tensor) -> None:
        self.qweight, self.scales = quantize_int8(w, self.group_size)

    def prepare(self, use_kernels: bool = True) -> None:
        self.align()
        self.pack(use_kernels)

    def table_form(self) -> ops.KernelProduct:
        return ops.KernelProduct(ops.KIND_INT8G, self.qweight, self.scales, group=self.group_size)

    def small(self, x: torch.Tensor) -> torch.Tensor:
        return self.large(x)

    def large(self, x: torch.Tensor) -> torch.Tensor:
        if kernels.usable(x) and (y := self.kernel_rows(x)) is not None:
            return y
        if kernels.traced(x):
            return F.linear(x.to(torch.bfloat16), self.dense_weight().to(torch.bfloat16))   # a graph records it
        if kernels.usable(x) and (y := self.widened_rows(x)) is not None:
            return y
        if self._dense_bf16 is None:      # no kernel on this CPU: widen once, not per step
            self._dense_bf16 = self.dense_weight().to(torch.bfloat16)
        return F.linear(x.to(torch.bfloat16), self._dense_bf16)

    def widened_rows(self, x: torch.Tensor) -> torch.Tensor | None:
        """Where llmd's int8g kernel does not take the group (under 64 columns, as GGUF blocks of 32 and
        16 are): the weight widened once to bfloat16 in llmd's float32 kernel's blocks, which that kernel
        streams at memory speed with x kept in float32, 16 rows a call, so a row gets the numbers it gets
        alone (torch's bfloat16 product of one row is compute-bound here:
        docs/perf/2026-12-01-real-models.md, "GGUF blocks kept")."""
        if self.out_features % 64:
            return None
        if self._blocks is None:
            self._blocks = ops.f32_blocks(self.dense_weight().to(torch.bfloat16).float())
        x = x.float()
        parts = []
        for i in range(0, x.shape[0], ops.F32_MAX_ROWS):
            if (y := ops.f32_matvec(x[i:i + ops.F32_MAX_ROWS], self._blocks, None)) is None:
                return None
            parts.append(y)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return dequantize_int8(self.qweight.index_select(0, ids), self.scales.index_select(0, ids))

    def extra_repr(self) -> str:
        return super().extra_repr() + f", group_size={self.group_size}"


class W8A8Linear(Int8Linear):
    """int8 weights and per-token dynamic int8 activations: integer products at every row count."""

    method = "w8a8"

    def pack(self, use_kernels: bool) -> None:
        self._kernel_form = None           # its kernel reads the weight as stored

    def kernel_rows(self, x: torch.Tensor) -> torch.Tensor | None:
        return ops.w8a8_matvec(x, self.qweight, self.scales, None)     # declines over ops.MAX_ROWS rows

    def kernel_product(self) -> None:
        return None          # not a kind of the fused step

    def small(self, x: torch.Tensor) -> torch.Tensor:
        if kernels.usable(x) and (y := self.kernel_rows(x)) is not None:
            return y
        return self.integer_product(x)

    def integer_product(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        sx = (x.abs().amax(dim=1, keepdim=True) / 127).clamp(min=1e-12)
        xq = torch.round(x / sx).to(torch.int8)
        # qweight.t() is a column-major view; oneDNN reads it without a copy.
        return torch._int_mm(xq, self.qweight.t()).float() * (sx * self.scales)

    def large(self, x: torch.Tensor) -> torch.Tensor:
        return self.integer_product(x)


class Int4Linear(QuantLinear):
    method = "int4"
    KERNEL_ROWS = 640       # rows up to which the kernel serves (``large``)

    def __init__(self, in_features, out_features, bias=False, small_m=SMALL_M, group_size=128,
                 symmetric=False):
        super().__init__(in_features, out_features, bias, small_m)
        check_int4_shape(in_features, out_features, group_size)
        self.group_size, self.symmetric = group_size, symmetric
        groups = in_features // group_size
        self.register_buffer("qweight", torch.zeros(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("scales", torch.ones(out_features, groups))
        self.register_buffer("zeros", torch.zeros(out_features, groups))
        self._packed = self._scales_zeros = None
        self._kernel_form = None

    def load_weight(self, w: torch.Tensor) -> None:
        q, self.scales, self.zeros = quantize_int4(w, self.group_size, self.symmetric)
        self.qweight = pack_nibbles(q)

    def prepare(self, use_kernels: bool = True) -> None:
        """llmd's kernel layout where it runs (see llmd.runtime.kernels), else torch's packed form."""
        self.align()
        self._kernel_form = None
        if use_kernels and kernels.available():
            self._kernel_form = ops.int4_pack(unpack_nibbles(self.qweight), self.scales, self.zeros, self.group_size)
        if self._kernel_form is None:
            self.torch_pack()

    def torch_pack(self) -> None:
        q = unpack_nibbles(self.qweight).to(torch.int32)
        self._packed = torch._convert_weight_to_int4pack_for_cpu(q, 2)
        # the kernel wants [K/G, N, 2] (scale, zero) in bf16
        self._scales_zeros = torch.stack((self.scales, self.zeros), dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)

    def kernel_rows(self, x: torch.Tensor) -> torch.Tensor | None:
        if self._kernel_form is None:
            return None
        return ops.packed_matvec(x, self._kernel_form)

    def kernel_product(self) -> ops.KernelProduct | None:
        return None if self._kernel_form is None else self._kernel_form.product(self.KERNEL_ROWS)

    def large(self, x: torch.Tensor) -> torch.Tensor:
        """Prompt rows through the decode kernel up to 640 rows: the weights stay 4-bit, read once
        per 64 rows (faster than dequantizing to bf16: docs/perf/2026-12-01-first-figures.md, "Quantized
        products"), and a row gets the
        numbers it gets alone."""
        if x.shape[0] <= self.KERNEL_ROWS and kernels.usable(x) and (y := self.kernel_rows(x)) is not None:
            return y
        return super().large(x)

    def small(self, x: torch.Tensor) -> torch.Tensor:
        if kernels.usable(x) and (y := self.kernel_rows(x)) is not None:
            return y
        if self._packed is None:
            self.torch_pack()
        return torch._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16).contiguous(), self._packed,
                                                 self.group_size, self._scales_zeros)

    def dense_weight(self) -> torch.Tensor:
        return dequantize_int4(unpack_nibbles(self.qweight), self.scales, self.zeros)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return dequantize_int4(unpack_nibbles(self.qweight.index_select(0, ids)), self.scales.index_select(0, ids),
                               self.zeros.index_select(0, ids))

    def extra_repr(self) -> str:
        return super().extra_repr() + f", group_size={self.group_size}, symmetric={self.symmetric}"


class QuantEmbedding(nn.Module):
    """Rows of a quantized table (int8, or int4 for a tied int4 head; a GGUF file's blocks,
    formats.gguf_native), dequantized per looked-up row. For a tied model the table is the head's own
    (the same tensors, not a copy)."""

    def __init__(self, table, owns_table: bool):
        super().__init__()
        if owns_table:
            self.table = table                      # registered: saved as embed_tokens.table.*
        else:
            object.__setattr__(self, "table", table)   # the head's module; saved once, as lm_head.*

    @property
    def weight(self) -> torch.Tensor:       # LlamaForCausalLM.embed() checks this is not None
        return self.table.qweight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table.rows(ids.reshape(-1)).view(*ids.shape, -1)


def auto_group_size(cfgs) -> int:
    """The largest int4 group size that divides every input width of these models (hidden, attention
    output, MLP): SmolLM2's 576 takes 64."""
    widths = sorted({w for c in cfgs for w in (c.hidden_size, c.q_size, c.intermediate_size)})
    for group in (128, 64, 32):
        if all(w % group == 0 for w in widths):
            return group
    raise QuantizationError(f"no int4 group size of 128, 64 or 32 divides the input widths {widths}; use --quant int8")


def check_int4_shape(in_features: int, out_features: int, group_size: int) -> None:
    if in_features % group_size:
        raise QuantizationError(f"int4 group size {group_size} does not divide the input width {in_features}; "
                                "choose a group size that does (--group-size 32, 64 or 128)")
    if out_features % 16:
        raise QuantizationError(f"int4 needs output widths divisible by 16, got {out_features}")


def make_quant_linear(spec: QuantSpec, in_features: int, out_features: int, bias: bool) -> QuantLinear:
    if spec.method == "int8":
        return Int8Linear(in_features, out_features, bias, spec.small_m)
    if spec.method == "w8a8":
        return W8A8Linear(in_features, out_features, bias, spec.small_m)
    if spec.method == "int4":
        return Int4Linear(in_features, out_features, bias, spec.small_m, spec.group_size, spec.symmetric)
    raise QuantizationError(f"no quantized module for method {spec.method!r}")


# ---- whole-model swap --------------------------------------------------------------------------

EQUALIZE_ALPHA = 0.3     # how much of a column's size moves into the norm (0: none, 1: all)


@torch.no_grad()
def equalize_columns(model: nn.Module, alpha: float = EQUALIZE_ALPHA) -> None:
    """Move part of each projection input column's size into the RMSNorm weight before it.

    int8 keeps one scale per weight row, so the few input columns with large weights set the rounding
    step of every row. For a norm that feeds projections (qkv after input_layernorm, gate/up after
    post_attention_layernorm), column j is divided by s_j = (max_j / mean max)^alpha and the norm's
    weight multiplied by s_j: the same function in float, finer steps in int8 (the input stays at
    16 bits, so the larger norm outputs cost nothing there). It keeps more of the demo target's greedy
    tokens than no equalization (docs/perf/2026-12-01-first-figures.md, "Quantized greedy agreement")."""
    for layer in model.layers:
        equalize_layer(layer, alpha)


@torch.no_grad()
def equalize_layer(layer: nn.Module, alpha: float = EQUALIZE_ALPHA) -> None:
    """``equalize_columns`` for one decoder layer (it touches nothing outside the layer)."""
    for norm_name, proj_name in norm_pairs(layer):
        norm, proj = layer.get_submodule(norm_name), layer.get_submodule(proj_name)
        if not isinstance(proj, Linear) or proj.weight is None:
            continue
        w = proj.weight.float()
        col = w.abs().amax(dim=0)
        s = (col / col.mean()).clamp(min=1e-3) ** alpha
        proj.weight.copy_((w / s).to(proj.weight.dtype))
        norm.weight.copy_((norm.weight.float() * s).to(norm.weight.dtype))


def norm_pairs(layer: nn.Module) -> tuple[tuple[str, str], ...]:
    """(norm, product) pairs of a layer where the norm's output is the product's whole input, as the
    layer plan places its norms (llmd.runtime.models.plan; a sandwich norm after attention is not one)."""
    return getattr(layer, "norm_before", None) or LayerPlan().norm_before()


def quantize_model(model: nn.Module, spec: QuantSpec, from_weights: bool = True) -> nn.Module:
    """Replace every decoder ``Linear`` by the spec's module, then the head/embedding per the spec.

    from_weights=True quantizes the current float weights (export); False builds empty modules of
    the right shapes for tensors that are loaded afterwards (engine directories). Call before
    ``prepare_for_inference()``; works in place and returns the model.
    """
    if spec.method == "none":
        return model
    if spec.method == "mixed":
        return _quantize_mixed(model, spec, from_weights)
    for layer in model.layers:
        quantize_layer(layer, spec, from_weights)
    _quantize_head(model, spec, from_weights)
    return model


def quantize_layer(layer: nn.Module, spec: QuantSpec, from_weights: bool = True) -> nn.Module:
    """One decoder layer's ``Linear``s replaced by the spec's module (int8 equalizes its columns
    first); what ``quantize_model`` does to each layer, and all a streamed export does to it."""
    if spec.method == "none":
        return layer
    if spec.method == "mixed":
        raise QuantizationError("a mixed module table is applied to a whole model (quantize_model)")
    if from_weights and spec.method == "int8":
        equalize_layer(layer)
    for parent in (layer.self_attn, layer.mlp):
        for name, child in list(parent.named_children()):
            if isinstance(child, Linear):
                setattr(parent, name, _swap(child, make_quant_linear(spec, child.in_features, child.out_features,
                                                                     child.bias is not None), from_weights))
    return layer


def head_module(spec: QuantSpec, cfg) -> QuantLinear | None:
    """The spec's output head, empty (None: float); a tied model's embedding is the same table."""
    if spec.head == "float":
        return None
    if spec.head == "int8g":        # a hidden size that is no multiple of 64 keeps one scale per row
        group = HEAD_GROUP if cfg.hidden_size % HEAD_GROUP == 0 else cfg.hidden_size
        return Int8GroupLinear(cfg.hidden_size, cfg.vocab_size, False, spec.small_m, group)
    return make_quant_linear(replace(spec, method=spec.head), cfg.hidden_size, cfg.vocab_size, False)


def embedding_module(spec: QuantSpec, cfg) -> QuantLinear | None:
    """An untied model's quantized embedding table, empty (None: float)."""
    return Int8Linear(cfg.hidden_size, cfg.vocab_size, False, spec.small_m) if spec.embed == "int8" else None


def load_rows(module: QuantLinear, rows, chunk: int = 8192) -> QuantLinear:
    """Fill ``module`` (empty, from ``head_module``/``embedding_module``) from ``rows(start, end)`` ->
    float [end - start, in_features], a chunk of rows at a time: a table's float copy is never whole.
    Every method rounds each row on its own, so the result equals ``load_weight`` of the whole."""
    n = module.out_features
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        piece = _like(module, end - start)
        piece.load_weight(rows(start, end))
        for name, t in list(module.named_buffers(recurse=False)):
            if t is not None and t.shape[0] == n:
                t[start:end].copy_(getattr(piece, name))
    return module


def _like(m: QuantLinear, out_features: int) -> QuantLinear:
    """An empty module of ``m``'s method and form with ``out_features`` rows (no bias)."""
    if isinstance(m, Int8GroupLinear):
        return Int8GroupLinear(m.in_features, out_features, False, m.small_m, m.group_size)
    if isinstance(m, Int4Linear):
        return Int4Linear(m.in_features, out_features, False, m.small_m, m.group_size, m.symmetric)
    return type(m)(m.in_features, out_features, False, m.small_m)


def _swap(linear: Linear, q: QuantLinear, from_weights: bool) -> QuantLinear:
    if from_weights:
        q.load_weight(linear.dense_weight().detach())
        if linear.bias is not None:
            q.bias = linear.bias.detach().float().clone()
    return q


def _quantize_head(model: nn.Module, spec: QuantSpec, from_weights: bool) -> None:
    cfg = model.config
    if (head := head_module(spec, cfg)) is not None:      # built as a layer of that method would be
        _install_head(model, head, from_weights)
    if model.lm_head is not None and not isinstance(model.embed_tokens, QuantEmbedding) and \
            (table := embedding_module(spec, cfg)) is not None:
        _install_embedding(model, table, from_weights)


def _install_head(model: nn.Module, head: QuantLinear, from_weights: bool) -> None:
    """``head`` as the output head; a tied model's one quantized table then serves as its embedding too."""
    if model.lm_head is not None:
        model.lm_head = _swap(model.lm_head, head, from_weights)
        return
    if from_weights:
        head.load_weight(model.embed_tokens.weight.detach())
    model.lm_head = head
    model.embed_tokens = QuantEmbedding(head, owns_table=False)


def _install_embedding(model: nn.Module, table: QuantLinear, from_weights: bool) -> None:
    """``table`` as an untied model's embedding (its own quantized table)."""
    if from_weights:
        table.load_weight(model.embed_tokens.weight.detach())
    model.embed_tokens = QuantEmbedding(table, owns_table=True)


def make_module_form(spec: QuantSpec, name: str, in_features: int, out_features: int,
                     bias: bool) -> QuantLinear | None:
    """The module ``name`` of a "mixed" spec, empty; None where its form is float."""
    kind, group = spec.form(name)
    if kind == "int8g":
        return Int8GroupLinear(in_features, out_features, bias, spec.small_m, group)
    if kind == "int4":
        return Int4Linear(in_features, out_features, bias, spec.small_m, group)
    if kind == "int8":
        return Int8Linear(in_features, out_features, bias, spec.small_m)
    return None


def _quantize_mixed(model: nn.Module, spec: QuantSpec, from_weights: bool) -> nn.Module:
    """Each module in the form the spec's table names (absent: float)."""
    known = {"lm_head", "embed_tokens"}
    for i, layer in enumerate(model.layers):
        for part, parent in (("self_attn", layer.self_attn), ("mlp", layer.mlp)):
            for child_name, child in list(parent.named_children()):
                if isinstance(child, Linear):
                    name = f"layers.{i}.{part}.{child_name}"
                    known.add(name)
                    q = make_module_form(spec, name, child.in_features, child.out_features, child.bias is not None)
                    if q is not None:
                        setattr(parent, child_name, _swap(child, q, from_weights))
    unknown = sorted(set(spec.modules) - known)
    if unknown:
        raise QuantizationError(f"the module table names {unknown[0]!r}, which this model does not have")
    cfg = model.config
    head = make_module_form(spec, "lm_head", cfg.hidden_size, cfg.vocab_size, False)
    if head is not None:
        _install_head(model, head, from_weights)
    if model.lm_head is not None and not isinstance(model.embed_tokens, QuantEmbedding):
        table = make_module_form(spec, "embed_tokens", cfg.hidden_size, cfg.vocab_size, False)
        if table is not None:
            _install_embedding(model, table, from_weights)
    return model


def prepare_quantized(model: nn.Module, use_kernels: bool = True) -> None:
    """Build the kernel forms (packed int4, bf16 scales) after tensors are in place. ``use_kernels=False``
    builds torch's forms only, for a graph that torch.export traces (llmd's kernels are opaque to it)."""
    tables = {id(m.table) for m in model.modules() if isinstance(m, QuantEmbedding) and "table" in m._modules}
    for m in model.modules():
        if isinstance(m, QuantLinear):      # an untied embedding's own table: rows only, no kernel copy
            m.prepare(use_kernels and id(m) not in tables)
    if use_kernels and hasattr(model, "fused_decode"):      # its products' kernel forms are built now
        model.fused_decode = FusedDecode.build(model)
