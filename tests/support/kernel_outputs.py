"""Every kind of kernel call on fixed inputs, for comparing the AVX-512 and AVX2 libraries bit for bit.

    LLMD_KERNELS=avx2 python tests/support/kernel_outputs.py OUT.safetensors

writes ``outputs()`` as computed by that library (tests/kernels/test_kernels.py compares them with the other
library's, in its own process: the library is chosen once per process).
"""
from __future__ import annotations

import sys

import torch


def outputs() -> dict[str, torch.Tensor]:
    import numpy as np

    from llmd.bench.random_blocks import BLOCK_TYPES, random_blocks
    from llmd.runtime.attention import PagedAttention, SeqSpan
    from llmd.runtime.formats.gguf_native import TYPES, GGUFLinear
    from llmd.runtime.formats.quantized import quantize_int4, quantize_int8
    from llmd.runtime.kernels import ops

    g = torch.Generator().manual_seed(11)
    x = torch.randn(9, 576, generator=g)
    x[:, 3] *= 30                                        # an outlier column, as real activations have
    w = torch.randn(200, 576, generator=g) * 0.05
    out: dict[str, torch.Tensor] = {}
    rows = (1, 4, 9)
    q8, s8 = quantize_int8(w)
    q8g, s8g = quantize_int8(w, 64)
    q4, s4, z4 = quantize_int4(w[:, :512], 64)
    forms = {"int8": ops.int8_pack(q8, s8), "int8g": ops.int8_pack(q8g, s8g),
             "q4h": ops.int4_pack(q4, s4, z4, 64), "q4": ops.int4_pack(q4, s4, z4, 64, half=False)}
    for name, form in forms.items():
        for m in rows:
            out[f"{name}_{m}"] = ops.packed_matvec(x[:m, :form.k], form)
    for m in rows:
        out[f"w8a8_{m}"] = ops.w8a8_matvec(x[:m], q8, s8, None)
    idx = torch.tensor([7, 0, 199, 64])
    out["q8_pick"] = ops.q8_pick(x[:4], q8, s8, idx)
    out["q8g_pick"] = ops.q8_pick(x[:4], q8g, s8g, idx)
    wf = torch.randn(128, 576, generator=g) * 0.05
    for name, blocks in (("f32", ops.f32_blocks(wf)), ("bf16", ops.f32_blocks(wf.bfloat16().float()))):
        for m in rows:
            out[f"{name}_{m}"] = ops.f32_matvec(x[:m], blocks, None)
        out[f"{name}_pick"] = ops.f32_pick(x[:4], blocks, torch.tensor([7, 0, 127, 64, 7]))
    rng = np.random.default_rng(5)
    xg = torch.cat([x[:, :512], torch.randn(31, 512, generator=g)])
    # GGUF blocks: rows one at a time, 8 interleaved, widened for 32 rows and more; from 16 rows, 64
    # outputs take the AVX-512 library's two-group forms (4, 2 and 1 rows a call), 40 its one-group forms
    for name in BLOCK_TYPES:
        for n in (64, 40):
            layer = GGUFLinear(512, [(TYPES[name], torch.from_numpy(random_blocks(name, n, 512, rng)))])
            for m in (1, 2, 3, 4, 9, 18, 19, 40):
                out[f"gguf_{name}_{n}_{m}"] = layer(xg[:m])
    h, norm = torch.randn(9, 576, generator=g), torch.rand(576, generator=g) + 0.5
    out["rmsnorm"] = ops.rmsnorm(x, norm, 1e-5)
    out["add_rmsnorm"] = torch.cat(ops.add_rmsnorm(x, h, norm, 1e-5))
    out["silu_mul"] = ops.silu_mul(torch.randn(9, 2 * 320, generator=g) * 4)
    logits = torch.randn(3, 49152, generator=g)
    logits[1, 1000] = logits[1, 40000] = 50.0            # a tie: the first wins
    out["argmax"] = ops.argmax(logits)
    bs, heads, kv_heads, dim = 16, 6, 2, 64
    for pool_dtype in (torch.float32, torch.bfloat16):
        kp = torch.randn(1, 10 * bs, kv_heads, dim, generator=g).to(pool_dtype)
        vp = torch.randn(1, 10 * bs, kv_heads, dim, generator=g).to(pool_dtype)
        spans = [SeqSpan(0, 1, 37, [5, 2, 9]), SeqSpan(1, 20, 50, [1, 3, 4, 6])]
        slots = torch.cat([s.kv_slots(bs)[s.ctx_len - s.num_q:] for s in spans])
        q = torch.randn(21, heads, dim, generator=g)
        k, v = torch.randn(21, kv_heads, dim, generator=g), torch.randn(21, kv_heads, dim, generator=g)
        attn = PagedAttention(kp, vp, bs, kernel=True)
        attn.prepare(slots, spans)
        out[f"attend_{str(pool_dtype)[6:]}"] = attn.attend(0, q, k, v)
    missing = [name for name, t in out.items() if t is None]
    if missing:
        raise RuntimeError(f"the kernels declined: {missing}")
    return {name: t.contiguous() for name, t in out.items()}


if __name__ == "__main__":
    from safetensors.torch import save_file

    from llmd.runtime import kernels
    with torch.inference_mode():
        result = outputs()
    save_file(result, sys.argv[1], metadata={"variant": kernels.variant()})
