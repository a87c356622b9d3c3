"""Every decoder layer of a small float32 step in one kernel call (``llmd_decode`` in
llmd.runtime.kernels' decode.c).

The Python forward of a decode step calls a dozen kernels per layer, and the Python between them
(module calls, checks, allocations) cost as much as the arithmetic for a small model: 0.4 ms of a
1 ms tiny-shape token here. The fused call runs the same kernels in the same order, with the same
thread counts, so its hidden states are bit-identical to the Python forward's (tests hold the two
to it). It serves a step when everything that step needs has a kernel form: float32 weights in the
blocked layout, rotary on adjacent pairs without q/k norms, a float32 or bfloat16 KV pool (keys and
values rounded to bfloat16 as torch rounds them), and every request on the attention kernel (at most 16 rows: decode and verification). Anything else returns None and
the Python forward runs, as it always could.
"""
from __future__ import annotations

import ctypes

import torch

from llmd.runtime import kernels
from llmd.runtime.kernels import ops

MAX_ROWS = ops.F32_MAX_ROWS
POOL_DTYPES = (torch.float32, torch.bfloat16)     # KV pools the fused step writes and reads


class FusedDecode:
    """The weight pointers of one prepared model and a scratch buffer: called by one thread at a time,
    as the engine runs its model."""

    def __init__(self, model, linears: list, max_rows: int):
        cfg = model.config
        self.model = model
        self.max_rows = max_rows
        self.eps = cfg.rms_norm_eps
        # the tensors behind the pointers, held so that they live as long as the pointers do
        self._tensors = []
        for layer, (qkv, o, gu, down) in zip(model.layers, linears):
            self._tensors += [layer.input_layernorm.weight, qkv.stored, qkv.bias, o.stored, o.bias,
                              layer.post_attention_layernorm.weight, gu.stored, gu.bias, down.stored, down.bias]
        self._weights = (ctypes.c_void_p * len(self._tensors))(*map(_ptr, self._tensors))
        narrow = [m.stored.dtype == torch.bfloat16 for four in linears for m in four]
        self._narrow = (ctypes.c_uint8 * len(narrow))(*narrow)     # bfloat16 blocks (f32.c)
        h, kvh, d, i = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
        e = cfg.hidden_size
        self._dims = (ctypes.c_int * 12)(cfg.num_layers, 0, e, h, kvh, d, i, model.rotary.cos.shape[0], 0, 0, 0, 0)
        per_row = (h + 2 * kvh) * d + 2 * h * d + kvh * d + 3 * i + e
        self._work = torch.empty(MAX_ROWS * per_row)
        self.steps = 0           # steps served (tests check the fused path really ran)

    def __deepcopy__(self, memo):
        return None           # a copied model has its own weights: it runs the Python forward

    @staticmethod
    def possible(model) -> bool:
        """Every part of the model (not yet prepared) has a kernel form: float32 products whose
        outputs fill blocks of 64 columns, rotary on adjacent pairs without q/k norms, head sizes
        the attention kernel takes."""
        from .layers import Linear
        cfg = model.config
        if (not kernels.available() or not model._interleaved or cfg.qk_norm or cfg.hidden_size % 16
                or cfg.intermediate_size % 16 or cfg.head_dim % 16 or cfg.head_dim > 256):
            return False
        return all(type(m) is Linear and m.weight is not None and m.weight.dtype == torch.float32
                   and m.out_features % 64 == 0 for m in layer_linears(model))

    @classmethod
    def build(cls, model) -> "FusedDecode | None":
        """The fused form of a prepared model, or None when some part has no kernel form."""
        from .layers import Linear
        cfg = model.config
        if (not kernels.available() or not model._interleaved or cfg.qk_norm or cfg.hidden_size % 16
                or cfg.intermediate_size % 16):
            return None
        linears = []
        for layer in model.layers:
            four = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
            if not all(type(m) is Linear and m.plan.layout == "blocked" and m.stored is not None
                       and m.stored.dtype in (torch.float32, torch.bfloat16) for m in four):
                return None
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            if any(w.dtype != torch.float32 or not w.is_contiguous() for w in norms):
                return None
            linears.append(four)
        if model.norm.weight.dtype != torch.float32:
            return None
        # rows beyond what every product's plan sends to the kernel take the Python path, as they would anyway
        max_rows = min(min(m.plan.split_max_rows for m in four) for four in linears)
        return cls(model, linears, min(max_rows, MAX_ROWS)) if max_rows >= 1 else None

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor | None:
        """Final normed hidden states [T, hidden] of the packed rows, or None where this step needs
        the Python forward. Writes this step's keys and values into the pools as that would."""
        t = x.shape[0]
        kr = attn.kernel_rows
        if (t > self.max_rows or x.dtype != torch.float32 or x.dim() != 2 or not kernels.usable(x) or kr is None
                or attn.groups or kr.rows.numel() != t or attn.scales is not None
                or attn.k_pool.dtype not in POOL_DTYPES or positions.dtype != torch.int64):
            return None
        fn = getattr(kernels.lib(), "llmd_decode", None)     # None: a library built before it (kernel A/B)
        if fn is None:
            return None
        pools = attn.k_pool
        dims = self._dims
        dims[1], dims[8], dims[9], dims[10] = t, pools.shape[1], kr.table.shape[1], attn.block_size
        dims[11] = pools.element_size()
        rotary = self.model.rotary
        x = x.contiguous().clone()           # the residual stream, overwritten; the caller's x stays whole
        out = torch.empty_like(x)
        rc = fn(ctypes.addressof(dims), x.data_ptr(), out.data_ptr(), ctypes.addressof(self._weights),
                ctypes.addressof(self._narrow), self.model.norm.weight.data_ptr(), self.eps, rotary.cos.data_ptr(),
                rotary.sin.data_ptr(), positions.contiguous().data_ptr(), pools.data_ptr(), attn.v_pool.data_ptr(),
                attn.slot_mapping.data_ptr(), kr.rows.data_ptr(), kr.spans.data_ptr(), kr.lengths.data_ptr(),
                kr.table.data_ptr(), self._work.data_ptr(), torch.get_num_threads())
        if rc == -2:
            raise MemoryError("the attention kernel could not allocate its score buffers (out of memory)")
        if rc:
            return None      # a shape a kernel refused (a position past the rotary tables): the Python path says why
        self.steps += 1
        return out


def layer_linears(model) -> list:
    """Each layer's four products, in order."""
    return [m for layer in model.layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                 layer.mlp.gate_up_proj, layer.mlp.down_proj)]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()
