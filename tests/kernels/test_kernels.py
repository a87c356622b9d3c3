"""llmd's CPU kernels (llmd.runtime.kernels): products, attention and row operations against float64 or torch references of the
same formulas, with error bounds derived from how each kernel rounds its input rows."""
import os

import pytest
import torch

from llmd.runtime.formats.quantized import (Int4Linear, Int8GroupLinear, Int8Linear, W8A8Linear, dequantize_int4,
                                            dequantize_int8, quantize_int4, quantize_int8, split16)
from llmd.runtime import kernels
from llmd.runtime.kernels import ops

pytestmark = [pytest.mark.skipif(not kernels.available(), reason=f"llmd kernels unavailable: {kernels.why()}"),
              pytest.mark.usefixtures("no_grad")]


def rows(m, k, seed, outlier=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    if outlier:
        x[:, 3] *= 30                                # an outlier channel, as real activations have
    return x


def weight(n, k, seed):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9, 16])
@pytest.mark.parametrize("n,k", [(40, 128), (1152, 896), (384, 1024), (200, 576)])      # 576: 64 past 4 x 128
def test_int8_kernel_matches_weight_only_reference(m, n, k):
    q, s = quantize_int8(weight(n, k, n + k))
    x = rows(m, k, m)
    bias = torch.randn(n)
    y = ops.packed_matvec(x, ops.int8_pack(q, s), bias)
    w = dequantize_int8(q, s).double()
    ref = x.double() @ w.t() + bias.double()
    # x is carried as 16-bit integers: each element off by at most half a step, max|x| / 32767 / 2
    step = x.abs().amax(1, keepdim=True).double() / 32767
    bound = step / 2 * w.abs().sum(1) + 1e-5 * (x.double().abs() @ w.abs().t())
    assert ((y.double() - ref).abs() <= bound).all()


def float32_scales(t: torch.Tensor) -> torch.Tensor:
    """float32 values just past float16 ones (none of them a float16 value): int4's float32 blocks."""
    return torch.nextafter(t, torch.full_like(t, float("inf")))


@pytest.mark.parametrize("m", [1, 4, 7, 16, 70])      # 70: a chunk of 64 prompt rows, then a tile of 4 and of 2
@pytest.mark.parametrize("group,k", [(64, 1024), (128, 1024), (256, 1024), (64, 576), (64, 192),   # 576, 192: a half line
                                     (32, 1024), (32, 576), (32, 192)])         # 32: two groups per 64 columns
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("half", [True, False], ids=["float16-scales", "float32-scales"])
def test_int4_kernel_matches_reference(m, group, k, symmetric, half):
    n = 200
    q, s, z = quantize_int4(weight(n, k, group), group, symmetric)
    if not half:
        s, z = float32_scales(s), float32_scales(z)
    form = ops.int4_pack(q, s, z, group)
    assert form.half == half and form.kind == (ops.KIND_Q4H if half else ops.KIND_Q4)
    x = rows(m, k, group + m)
    y = ops.packed_matvec(x, form)
    w = dequantize_int4(q, s, z).double()
    ref = x.double() @ w.t()
    # x is quantized per block of 128 columns (the last 64 alone where K is 64 past a multiple of 128) to
    # 8 bits: half a step of that block per element
    step = torch.cat([x[:, c:c + 128].abs().amax(1, keepdim=True).double().expand(m, min(128, k - c)) / 127
                      for c in range(0, k, 128)], dim=1)                                                   # [m, k]
    bound = (step / 2) @ w.abs().t() + 1e-5 * (x.double().abs() @ w.abs().t())
    assert ((y.double() - ref).abs() <= bound).all()


@pytest.mark.parametrize("n", [35, 200])          # the last block of 16 outputs padded
def test_int8_blocks_give_the_integer_forms_numbers_bit_for_bit(n):
    """The packed int8 kernel's sums are exact integers: each of 1..16 rows, wherever it falls in a tile,
    gets the numbers of the prompt rows' integer form (split16, two integer products)."""
    k = 576
    q, s = quantize_int8(weight(n, k, n))
    x = rows(16, k, 2)
    hi, lo, sx = split16(x)
    wt = q.long().t()
    ref = ((hi.long() @ wt) * 256 + (lo.long() + 128) @ wt).float() * (sx * s)
    form = ops.int8_pack(q, s)
    for m in range(1, 17):
        assert torch.equal(ops.packed_matvec(x[:m], form), ref[:m]), m


@pytest.mark.parametrize("n,k", [(35, 576), (200, 1536), (16, 64)])
def test_int8_rows_on_amx_give_the_vector_loops_bits(n, k):
    """Where the CPU has AMX, int8 products of llmd_amx_min_rows rows or more take the tile unit, which forms
    the same exact sums: every row count gives the vector loop's numbers and the integer form's, an odd
    number of blocks (the last alone and padded) and rows past a multiple of 16 included."""
    so = kernels.lib()
    if not so.llmd_amx_min_rows(-1):
        pytest.skip("no AMX on this CPU (or LLMD_AMX=0)")
    q, s = quantize_int8(weight(n, k, n + k))
    x = rows(150, k, 5)
    hi, lo, sx = split16(x)
    wt = q.long().t()
    ref = ((hi.long() @ wt) * 256 + (lo.long() + 128) @ wt).float() * (sx * s)
    form = ops.int8_pack(q, s)
    before = so.llmd_amx_min_rows(-1)
    try:
        for m in (1, 15, 16, 17, 33, 150):
            so.llmd_amx_min_rows(0)
            vector = ops.packed_matvec(x[:m], form)
            so.llmd_amx_min_rows(1)
            tiles = ops.packed_matvec(x[:m], form)
            assert torch.equal(tiles, vector), m
            assert torch.equal(tiles, ref[:m]), m
    finally:
        so.llmd_amx_min_rows(before)


@pytest.mark.parametrize("wide", [True, False])
@pytest.mark.parametrize("n,k", [(576, 576), (960, 200), (64, 96), (192, 1536)])
def test_block_products_give_the_same_bits_on_any_thread_count(n, k, wide):
    """Threads share a product's blocks by halves (an odd count of blocks splits one down the middle):
    every output's bits are the same on one, two or three threads, within float32 rounding of the
    float64 product, with and without a bias, for every row count the vector loop takes."""
    so = kernels.lib()
    w = weight(n, k, n + k)
    w = w if wide else w.bfloat16().float()
    blocks = ops.f32_blocks(w)
    assert (blocks.dtype == torch.float32) == wide
    fn = so.llmd_f32 if wide else so.llmd_f32_w16
    bias = torch.randn(n, generator=torch.Generator().manual_seed(1))
    for m in (1, 2, 3, 5, 6, 9, 16):
        x = rows(m, k, m)
        for b in (None, bias):
            outs = []
            for nt in (1, 2, 3):
                y = torch.full((m, n), float("nan"))
                assert fn(x.data_ptr(), m, k, blocks.data_ptr(), b.data_ptr() if b is not None else None,
                          y.data_ptr(), n, nt) == 0
                outs.append(y)
            assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2]), (m, b is None)
            ref = x.double() @ w.double().t() + (b.double() if b is not None else 0)
            bound = (k + 2) * 2.0 ** -24 * (x.double().abs() @ w.double().abs().t() + (b.double().abs() if b is not None else 0))
            assert ((outs[0].double() - ref).abs() <= bound).all(), (m, b is None)


@pytest.mark.parametrize("n,k", [(192, 576), (576, 1536), (64, 100)])
def test_bfloat16_blocks_of_many_rows_on_amx_are_float32_products_row_by_row(n, k):
    """Where AMX multiplies bfloat16, products of more than ``bf16_amx_rows()`` rows over bfloat16 blocks
    take the tile unit with x split into three bfloat16 parts: within float32 rounding of the exact
    product (as close as the vector loop's 16 rows; two parts would be ~100x off), and a row's bits are
    the same whatever rows share its call (from one past the vector loop's rows to 200, any order, a
    bias, K not a multiple of 32); up to those rows, the vector loop's own."""
    a = ops.bf16_amx_rows()
    if not a:
        pytest.skip("no AMX with bfloat16 products on this CPU (or LLMD_AMX=0)")
    assert ops.F32_MAX_ROWS <= a < 38
    w = weight(n, k, n + k).bfloat16().float()
    blocks = ops.f32_blocks(w)
    assert blocks.dtype == torch.bfloat16
    bias = torch.randn(n, generator=torch.Generator().manual_seed(k))
    x = rows(200, k, 9)
    exact = x.double() @ w.double().t() + bias.double()
    scale = x.double().abs() @ w.double().abs().t() + bias.double().abs()
    y = ops.f32_matvec(x, blocks, bias)
    err = ((y.double() - exact).abs() / scale).max().item()
    vector = ((ops.f32_matvec(x[:16], blocks, bias).double() - exact[:16]).abs() / scale[:16]).max().item()
    assert err < 5e-7 and err < 2 * vector, (err, vector)
    order = torch.randperm(200, generator=torch.Generator().manual_seed(1))
    assert torch.equal(ops.f32_matvec(x[order], blocks, bias), y[order])
    for lo, hi in ((0, a + 1), (5, 38), (100, 200), (200 - a - 1, 200)):
        assert torch.equal(ops.f32_matvec(x[lo:hi], blocks, bias), y[lo:hi]), (lo, hi)
    assert torch.equal(ops.f32_matvec(x[:40], blocks, None) + bias, y[:40])     # the bias added to the sums
    few = ops.f32_matvec(x[:a], blocks, bias)                                     # the vector loop's rows
    assert all(torch.equal(ops.f32_matvec(x[i:i + 1], blocks, bias), few[i:i + 1]) for i in range(a))


@pytest.mark.parametrize("how", ["variable", "configure"])
@pytest.mark.heavy
def test_amx_off_keeps_every_product_on_the_vector_loop(how):
    """The amx setting off (LLMD_AMX=0, or the engine's amx = false through kernels.configure) turns the
    tile unit off for int8 and bfloat16 blocks: the vector loop then takes every row count of them (as on
    a CPU without AMX), each row summed as it is alone."""
    if not ops.bf16_amx_rows():
        pytest.skip("no AMX with bfloat16 products on this CPU")
    import subprocess
    import sys
    code = ("import torch; from llmd.runtime import kernels; from llmd.runtime.kernels import ops\n"
            + ("kernels.configure(amx=False)\n" if how == "configure" else "") +
            "w = ops.f32_blocks(torch.randn(128, 96).bfloat16().float()); x = torch.randn(40, 96)\n"
            "y = ops.f32_matvec(x, w, None)\n"
            "print(kernels.lib().llmd_amx_min_rows(-1), ops.bf16_amx_rows(), ops.bf16_max_rows(),"
            " all(torch.equal(ops.f32_matvec(x[i:i + 1], w, None), y[i:i + 1]) for i in range(40)))")
    env = {k: v for k, v in os.environ.items() if k != "LLMD_AMX"}
    out = subprocess.run([sys.executable, "-c", code], env={**env, "LLMD_AMX": "0"} if how == "variable" else env,
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["0", "0", str(ops.f32_rows()), "True"]


@pytest.mark.parametrize("k", [1472, 4800])
def test_int8_sums_past_float32_precision_are_rounded_once(k):
    """Where sum w xi needs more than float32's 24 bits (a long row of weights and x at their largest, as
    an outlier channel can make them), the kernel rounds the exact sum once: the numbers of the prompt
    rows' integer form, and no longer the sum of separately rounded high and low parts. K of several
    runs of 256 columns, and not a multiple of it."""
    n = 40
    w = weight(n, k, 7)
    w[:8] = w[:8].abs().amax(1, keepdim=True)            # rows of one value: every q at 127
    w[8:16] = -w[8:16].abs().amax(1, keepdim=True)
    q, s = quantize_int8(w)
    x = rows(9, k, 3)
    x[:4] = x[:4].abs().amax(1, keepdim=True)            # rows of one value: every xi at 32767
    x[4] = -x[4].abs().amax()
    hi, lo, sx = split16(x)
    wt = q.long().t()
    exact = (hi.long() @ wt) * 256 + (lo.long() + 128) @ wt
    assert exact.abs().max() >= 2 ** 32                  # past int32, and past 24 bits in each part
    ref = exact.float() * (sx * s)
    assert torch.equal(ops.packed_matvec(x, ops.int8_pack(q, s)), ref)
    layer = Int8Linear(k, n)
    layer.qweight, layer.scales = q, s
    layer.prepare(use_kernels=False)
    assert torch.equal(layer.large(x), ref)


@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("group,k,n", [(64, 576, 320), (128, 512, 200)])
def test_int8g_kernel_matches_reference(m, group, k, n):
    q, s = quantize_int8(weight(n, k, k), group)
    x = rows(m, k, m + 1)
    y = ops.packed_matvec(x, ops.int8_pack(q, s))
    w = dequantize_int8(q, s).double()
    ref = x.double() @ w.t()
    step = x.abs().amax(1, keepdim=True).double() / 32767                 # x at 16 bits per row, as int8
    bound = step / 2 * w.abs().sum(1) + 1e-5 * (x.double().abs() @ w.abs().t())
    assert ((y.double() - ref).abs() <= bound).all()


QUANT_LAYERS = {
    "int8": lambda k: Int8Linear(k, 192, bias=True),
    "int4-g64": lambda k: Int4Linear(k, 192, bias=True, group_size=64),
    "int4-g128": lambda k: Int4Linear(k, 192, bias=True, group_size=128),
    "int4-g32": lambda k: Int4Linear(k, 192, bias=True, group_size=32),
    "int8g": lambda k: Int8GroupLinear(k, 192, group_size=64),
    "w8a8": lambda k: W8A8Linear(k, 192, bias=True),
}


@pytest.mark.parametrize("k", [512, 576])
@pytest.mark.parametrize("kind", QUANT_LAYERS)
def test_every_row_of_one_to_sixteen_is_the_row_computed_alone(kind, k):
    """Batch invariance: rows 1..16 of a product, each count on the kernel, give every row bit for bit
    the numbers it gets alone (each row quantized on its own, its sums in one order whatever M)."""
    if kind == "int4-g128" and k % 128:
        pytest.skip("a group of 128 does not divide 576")
    layer = QUANT_LAYERS[kind](k)
    layer.load_weight(weight(192, k, k + 1))
    if layer.bias is not None:
        layer.bias = torch.randn(192)
    layer.prepare()
    x = rows(16, k, 3)
    alone = torch.cat([layer.kernel_rows(x[i:i + 1]) for i in range(16)])
    for m in range(1, 17):
        assert torch.equal(layer.kernel_rows(x[:m]), alone[:m]), m
    assert torch.equal(layer(x[:16]), torch.cat([layer(x[i:i + 1]) for i in range(16)]))
    if kind == "int8":        # past 16 rows the integer _int_mm form: the same numbers again
        many = rows(40, k, 4)
        many[:16] = x
        assert torch.equal(layer(many)[:16], layer(x))


@pytest.mark.parametrize("make", [lambda: Int4Linear(896, 208, bias=True, group_size=128),
                                  lambda: Int8Linear(896, 208, bias=True)], ids=["int4", "int8"])
def test_prompt_rows_get_the_numbers_each_row_gets_alone(make):
    """A prompt's rows go through the same kernel as decode rows, and each row's x is quantized on
    its own: a row's output does not depend on the rows beside it (prefill and decode agree)."""
    layer = make()
    layer.load_weight(weight(208, 896, 5))
    layer.bias = torch.randn(208)
    layer.prepare()
    x = rows(70, 896, 9)
    together = layer(x)
    alone = torch.cat([layer(x[i:i + 1]) for i in range(70)])
    assert torch.equal(together, alone)
    ref = x.double() @ layer.dense_weight().double().t() + layer.bias.double()
    assert (together.double() - ref).abs().max() < 0.05 * ref.abs().max()


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("group,k,n", [(32, 896, 200), (64, 576, 35), (128, 1024, 48), (32, 192, 16)])
def test_float16_int4_blocks_give_the_float32_blocks_numbers_bit_for_bit(group, k, n, symmetric):
    """The same float16 scales and zeros in float16 blocks (5 bits a weight at groups of 32) and in
    float32 ones (6): every output of 1..16 rows and of a prompt's rows the same bit for bit, the
    offsets z - 8 s formed in the kernel as torch forms them."""
    q, s, z = quantize_int4(weight(n, k, n + group), group, symmetric)
    half, full = ops.int4_pack(q, s, z, group), ops.int4_pack(q, s, z, group, half=False)
    assert half.half and not full.half and full.data.numel() == ops.packed_bytes(n, k, group, True)
    assert half.data.numel() == ops.packed_bytes(n, k, group, True, half=True)
    assert half.data.numel() == (n + 15) // 16 * (64 * (k // group) + 8 * k) < full.data.numel()
    x = rows(300, k, group)
    for m in [*range(1, 17), 70, 300]:
        assert torch.equal(ops.packed_matvec(x[:m], half), ops.packed_matvec(x[:m], full)), m


@pytest.mark.parametrize("group,k,n", [(32, 896, 200), (64, 576, 35), (128, 1024, 48), (256, 512, 16)])
def test_int4_rows_on_amx_give_the_vector_loops_bits(group, k, n):
    """Where the CPU has AMX, int4 products of llmd_amx_min_rows rows or more take the tile unit for each
    run's exact sums and follow them with the vector loop's float arithmetic in its order: the same bits,
    float16 and float32 blocks, at any row count."""
    so = kernels.lib()
    if not so.llmd_amx_min_rows(-1):
        pytest.skip("no AMX on this CPU (or LLMD_AMX=0)")
    q, s, z = quantize_int4(weight(n, k, n + group), group, False)
    x = rows(150, k, group + 1)
    before = so.llmd_amx_min_rows(-1)
    try:
        for form in (ops.int4_pack(q, s, z, group), ops.int4_pack(q, s, z, group, half=False)):
            for m in (1, 16, 17, 150):
                so.llmd_amx_min_rows(0)
                vector = ops.packed_matvec(x[:m], form)
                so.llmd_amx_min_rows(1)
                assert torch.equal(ops.packed_matvec(x[:m], form), vector), (form.half, m)
    finally:
        so.llmd_amx_min_rows(before)


def test_int4_scales_or_zeros_off_float16_keep_float32_blocks():
    """One scale or zero that float16 does not hold (a finer value, past its range, infinite) keeps the
    whole weight in the float32 blocks: the numbers never change."""
    q, s, z = quantize_int4(weight(64, 256, 1), 32)
    assert ops.int4_pack(q, s, z, 32).half
    x = rows(3, 256, 1)
    for which, value in [("s", None), ("z", None), ("z", 70000.0), ("z", float("inf")), ("s", float("nan"))]:
        s2, z2 = s.clone(), z.clone()
        t = s2 if which == "s" else z2
        t[5, 2] = float32_scales(t[5, 2]) if value is None else value
        form = ops.int4_pack(q, s2, z2, 32)
        assert not form.half and form.kind == ops.KIND_Q4, (which, value)
        assert form.data.numel() == ops.packed_bytes(64, 256, 32, True)
        if value is None:
            reference = dequantize_int4(q, s2, z2).double()
            assert torch.allclose(ops.packed_matvec(x, form).double(), x.double() @ reference.t(), rtol=0.02,
                                  atol=0.02 * (x.double().abs() @ reference.abs().t()).max().item())


def test_int4_kernel_takes_group_32_and_declines_widths_off_its_lines():
    q, s, z = quantize_int4(weight(64, 256, 0), 32)
    assert ops.int4_pack(q, s, z, 32) is not None
    q, s, z = quantize_int4(weight(64, 288, 0), 32)          # 288 = 4 x 64 + 32: not a whole half line
    assert ops.int4_pack(q, s, z, 32) is None
    q, s, z = quantize_int4(weight(64, 256, 0), 16)
    assert ops.int4_pack(q, s, z, 16) is None


@pytest.mark.parametrize("m", [1, 3])
def test_w8a8_kernel_matches_integer_reference(m):
    n, k = 300, 896
    q, s = quantize_int8(weight(n, k, 7))
    x = rows(m, k, 11)
    y = ops.w8a8_matvec(x, q, s, None)
    sx = (x.abs().amax(1, keepdim=True) / 127).clamp(min=1e-12)
    xq = torch.round(x / sx)
    ref = (xq.double() @ q.double().t()) * sx.double() * s.double()
    assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_kernels_refuse_rows_and_widths_they_do_not_take():
    q, s = quantize_int8(weight(16, 128, 0))
    assert ops.w8a8_matvec(rows(17, 128, 0), q, s, None) is None         # prompts go to torch._int_mm
    assert ops.packed_matvec(rows(ops.MANY_MAX_ROWS + 1, 128, 0), ops.int8_pack(q, s)) is None
    q, s = quantize_int8(weight(16, 96, 0))
    assert ops.int8_pack(q, s) is None


@pytest.mark.parametrize("m", [17, 150])
def test_int8_prompt_rows_take_the_kernel_with_the_integer_products_numbers(m, monkeypatch):
    """Prompt rows of an int8 layer run on the packed kernel and give exactly what the two integer
    products (its form where the kernel cannot run) give, and what each row gives alone."""
    layer = Int8Linear(576, 200)
    layer.load_weight(weight(200, 576, 4))
    layer.prepare()
    x = rows(m, 576, 6)
    served = []
    product = ops.packed_matvec
    monkeypatch.setattr(ops, "packed_matvec", lambda x, *a, **k: served.append(x.shape[0]) or product(x, *a, **k))
    with torch.inference_mode():
        fast = layer(x)
        assert served == [m]                # the kernel took all the rows, in one call
        alone = torch.cat([layer(x[i:i + 1]) for i in range(m)])
        form, layer._kernel_form = layer._kernel_form, None
        integer = layer(x)
        layer._kernel_form = form
    assert torch.equal(fast, integer) and torch.equal(fast, alone)


@pytest.mark.parametrize("cls", [Int8Linear, W8A8Linear, Int4Linear])
def test_modules_agree_with_and_without_kernels(cls, monkeypatch):
    """The kernel path and torch's fallback compute the same layer (within their rounding; the
    kernel tests above bound that rounding with outliers present)."""
    layer = cls(512, 256, bias=True) if cls is not Int4Linear else cls(512, 256, bias=True, group_size=128)
    layer.load_weight(weight(256, 512, 3))
    layer.bias = torch.randn(256)
    layer.prepare()
    x = rows(2, 512, 5, outlier=False)
    fast = layer(x)
    monkeypatch.setattr(kernels, "_lib", None)        # as on a machine where the kernels cannot load
    monkeypatch.setattr(kernels, "_tried", True)
    layer.prepare()
    slow = layer(x)
    ref = x.double() @ layer.dense_weight().double().t() + layer.bias.double()
    scale = ref.abs().max().item()
    assert (fast.double() - ref).abs().max().item() < 0.02 * scale
    assert (slow.double() - ref).abs().max().item() < 0.02 * scale


LAYOUTS = {   # (num_q, ctx_len, block ids): scattered, shared and partly filled blocks
    "mixed": [(1, 37, [5, 2, 9]), (4, 20, [7, 1]), (1, 1, [3]), (20, 50, [11, 12, 13, 14]), (8, 64, [15, 16, 17, 18])],
    "one decode row": [(1, 45, [4, 8, 6])],      # few rows: threads share out the kv heads instead
}


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 4, 64), (14, 2, 64), (8, 2, 32), (4, 1, 128), (10, 2, 80), (6, 1, 48)])
def test_attention_kernel_matches_reference_over_the_paged_pool(heads, kv_heads, dim, layout, pool_dtype):
    """Decode rows, verification rows and a prompt chunk in one step: the kernel serves them all
    (and torch's path, where the kernel does not run, too); every row equals the per-request
    reference, over float32 pools and over bfloat16 ones (the values widened exactly, the arithmetic
    float32 either way)."""
    from llmd.runtime.attention import PagedAttention, SeqSpan, reference_attention, _gatherer
    g = torch.Generator().manual_seed(heads + dim)
    bs, blocks = 16, 24
    kp = torch.randn(1, blocks * bs, kv_heads, dim, generator=g).to(pool_dtype)
    vp = torch.randn(1, blocks * bs, kv_heads, dim, generator=g).to(pool_dtype)
    spans, start = [], 0
    for nq, ctx, ids in LAYOUTS[layout]:
        spans.append(SeqSpan(start, nq, ctx, ids))
        start += nq
    slots = torch.cat([s.kv_slots(bs)[s.ctx_len - s.num_q:] for s in spans])
    q = torch.randn(start, heads, dim, generator=g)
    k = torch.randn(start, kv_heads, dim, generator=g)
    v = torch.randn(start, kv_heads, dim, generator=g)
    for kernel in (True, False):
        attn = PagedAttention(kp.clone(), vp.clone(), bs, kernel=kernel)
        attn.prepare(slots, spans)
        if kernel:          # every row, the 20-row prompt chunk's too (its context is short)
            assert attn.kernel_rows is not None and attn.kernel_rows.rows.numel() == start and not attn.groups
        else:
            assert attn.kernel_rows is None and attn.groups
        got = attn.attend(0, q, k, v)       # writes this step's keys and values first
        want = reference_attention(q, _gatherer(attn.k_pool[0], None, bs, q.dtype),
                                   _gatherer(attn.v_pool[0], None, bs, q.dtype), spans, bs)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_long_context_prompt_chunks_take_torchs_blocked_attention():
    """A prompt chunk over more than KERNEL_PROMPT_CONTEXT positions goes to torch (which reuses keys
    across rows); decode rows at that context and shorter chunks stay on the kernel; all match the
    reference."""
    from llmd.runtime import attention as A
    g = torch.Generator().manual_seed(7)
    bs, heads, kvh, dim = 16, 4, 2, 64
    long_ctx = A.KERNEL_PROMPT_CONTEXT + 40
    blocks = -(-long_ctx // bs) * 2 + 4
    kp = torch.randn(1, blocks * bs, kvh, dim, generator=g)
    vp = torch.randn(1, blocks * bs, kvh, dim, generator=g)
    per = -(-long_ctx // bs)
    spans = [A.SeqSpan(0, 20, long_ctx, list(range(per))),                 # a long prompt chunk
             A.SeqSpan(20, 1, long_ctx, list(range(per, 2 * per))),        # a decode row at that context
             A.SeqSpan(21, 20, 60, [2 * per, 2 * per + 1, 2 * per + 2, 2 * per + 3])]   # a short chunk
    slots = torch.cat([s.kv_slots(bs)[s.ctx_len - s.num_q:] for s in spans])
    q, k, v = (torch.randn(41, h, dim, generator=g) for h in (heads, kvh, kvh))
    attn = A.PagedAttention(kp, vp, bs)
    attn.prepare(slots, spans)
    assert attn.kernel_rows.rows.tolist() == list(range(20, 41))
    assert len(attn.groups) == 1 and attn.groups[0].rows.tolist() == list(range(20))
    got = attn.attend(0, q, k, v)
    want = A.reference_attention(q, A._gatherer(attn.k_pool[0], None, bs, q.dtype),
                                 A._gatherer(attn.v_pool[0], None, bs, q.dtype), spans, bs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_silu_mul_and_rmsnorm_kernels_match_torch():
    g = torch.Generator().manual_seed(5)
    gate_up = torch.randn(3, 2 * 1000, generator=g) * 8          # silu far into both tails
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_mul(gate_up), torch.nn.functional.silu(gate) * up, rtol=2e-6, atol=1e-6)
    x, w = torch.randn(2, 896, generator=g), torch.randn(896, generator=g)
    torch.testing.assert_close(ops.rmsnorm(x, w, 1e-6), torch.nn.functional.rms_norm(x, (896,), w, 1e-6),
                               rtol=2e-6, atol=1e-6)
    h = torch.randn(2, 896, generator=g)
    total, normed = ops.add_rmsnorm(x, h, w, 1e-6)
    assert torch.equal(total, x + h)                                  # the residual sum is exact
    assert torch.equal(normed, ops.rmsnorm(x + h, w, 1e-6))           # and normed as the norm kernel does


def test_a_cache_directory_others_can_write_is_not_trusted(tmp_path, monkeypatch):
    """A library planted in a shared directory must never be loaded: such a directory is skipped, whether
    the kernel_cache setting or the user's cache names it."""
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    monkeypatch.setenv("XDG_CACHE_HOME", str(shared))
    monkeypatch.setattr(kernels.Path, "home", staticmethod(lambda: shared))
    chosen = kernels._cache_dir(str(shared))
    assert chosen != shared                         # others may write there: skipped
    assert chosen.stat().st_mode & 0o077 == 0 and chosen.stat().st_uid == os.getuid()
    mine = tmp_path / "mine"
    assert kernels._cache_dir(str(mine)) == mine and mine.stat().st_mode & 0o077 == 0


def test_the_kernel_cache_setting_and_its_variable_choose_the_directory(tmp_path, monkeypatch):
    mine = tmp_path / "from-variable"
    monkeypatch.setenv("LLMD_KERNEL_CACHE", str(mine))
    monkeypatch.setattr(kernels, "_switches", None)       # as before any engine set it
    assert kernels.cache_dir() == mine
    monkeypatch.setattr(kernels, "_switches", kernels.Switches(kernel_cache=str(tmp_path / "set")))
    assert kernels.cache_dir() == tmp_path / "set"


@pytest.mark.parametrize("m,v", [(1, 8192), (16, 8192), (3, 151936), (5, 37)])
def test_argmax_kernel_is_torch_argmax(m, v):
    g = torch.Generator().manual_seed(m * v)
    x = torch.randn(m, v, generator=g)
    x[0, v // 3] = x[0, v // 2] = x[0].max() + 1          # a tie: the first index wins, as in torch
    if m > 1:
        x[1] = float("-inf")                               # a row with nothing allowed: index 0
    assert torch.equal(ops.argmax(x), x.argmax(-1))


def test_argmax_kernel_leaves_nan_rows_to_torch():
    x = torch.randn(4, 1000)
    x[2, 500] = float("nan")
    assert torch.equal(ops.argmax(x), x.argmax(-1))        # torch picks the NaN
    assert ops.argmax(x)[2] == 500


@pytest.mark.parametrize("m", [1, 3, 9, 70])
@pytest.mark.parametrize("group", [64, 128, 256])
def test_int8_group_kernel_matches_reference(m, group):
    n, k = 208, 1024
    w = weight(n, k, group)
    w[:, 5] *= 20                                          # an outlier column, as embedding rows have
    q, s = quantize_int8(w, group)
    x = rows(m, k, m + group)
    y = ops.packed_matvec(x, ops.int8_pack(q, s))
    ref = x.double() @ dequantize_int8(q, s).double().t()
    step = x.abs().amax(1, keepdim=True).double() / 32767          # x at 16 bits per row, as for int8
    wd = dequantize_int8(q, s).double()
    bound = step / 2 * wd.abs().sum(1) + 1e-5 * (x.double().abs() @ wd.abs().t())
    assert ((y.double() - ref).abs() <= bound).all()
    assert (dequantize_int8(q, s) - w).abs().max() <= s.max() / 2 + 1e-7    # round trip: half a step


def test_int8_group_head_rows_and_fallback_agree_with_the_kernel(monkeypatch):
    from llmd.runtime.formats.quantized import Int8GroupLinear
    layer = Int8GroupLinear(256, 320)
    layer.load_weight(weight(320, 256, 1))
    layer.prepare()
    x = rows(5, 256, 2)
    y = layer(x)
    assert torch.equal(torch.cat([layer(x[i:i + 1]) for i in range(5)]), y)     # rows independent of M
    ids = torch.tensor([3, 0, 319])
    assert torch.equal(layer.rows(ids), layer.dense_weight()[ids])
    monkeypatch.setattr(kernels, "usable", lambda t, has_gradient=True: False)
    assert (layer(x) - y).abs().max() < 0.02 * y.abs().max()                  # bf16 fallback, same layer


def test_rope_kernel_rotates_pairs_and_declines_positions_past_its_tables():
    g = torch.Generator().manual_seed(3)
    heads, kv_heads, d, p = 2, 1, 16, 10
    qkv = torch.randn(3, (heads + 2 * kv_heads) * d, generator=g)
    angles = torch.rand(p, d // 2, generator=g) * 6
    cos, sin = angles.cos(), angles.sin()
    positions = torch.tensor([0, 4, 9])
    q, k = ops.rope_qk(qkv, heads, kv_heads, d, cos, sin, positions)
    pairs = qkv[:, :(heads + kv_heads) * d].view(3, heads + kv_heads, d // 2, 2)
    c, s = cos[positions][:, None], sin[positions][:, None]
    ref = torch.stack((pairs[..., 0] * c - pairs[..., 1] * s, pairs[..., 0] * s + pairs[..., 1] * c), -1).flatten(-2)
    torch.testing.assert_close(torch.cat([q, k], 1), ref)
    assert ops.rope_qk(qkv, heads, kv_heads, d, cos, sin, torch.tensor([0, 4, p])) is None    # never read past
    assert ops.rope_qk(qkv, heads, kv_heads, d, cos, sin, torch.tensor([0, -1, 2])) is None


@pytest.mark.heavy
def test_every_entry_point_is_declared_once_in_the_header_and_bound_by_it():
    """kernels.h declares each exported function (the compiler holds the definitions to it), no .c file
    declares one again, and every one the library exports is bound with the header's signature."""
    import ctypes
    import re
    import shutil
    import subprocess
    so = kernels.lib()
    declared = set(dir(kernels._ffi().dlopen(so._name)))
    if shutil.which("nm"):
        symbols = subprocess.run(["nm", "-D", "--defined-only", so._name], capture_output=True, text=True).stdout
        assert set(re.findall(r" T (llmd_\w+)$", symbols, re.M)) == declared
    for source in kernels._SOURCES:
        assert not re.search(r"^\s*(?:int|void) llmd_\w+\([^{]*?\);", source.read_text(), re.M), source.name
    assert len(declared) == 32 and {"llmd_decode", "llmd_draft", "llmd_set_amx"} <= declared
    for name in declared:
        assert getattr(so, name).argtypes is not None, name
    assert so.llmd_q4_pack.restype is ctypes.c_int and so.llmd_rmsnorm.restype is ctypes.c_int
    assert so.llmd_rmsnorm.argtypes[4] is ctypes.c_float


@pytest.mark.heavy
def test_the_avx2_library_gives_the_same_bits_as_the_one_loaded(tmp_path):
    """The kernels setting avx2 (here its variable, ``LLMD_KERNELS=avx2``) loads the library for CPUs with
    AVX2, FMA and F16C only; every kind of call (each product form at 1, 4 and 9 rows, the picked int8
    outputs, norms, the activation, argmax with a tie, attention over float32 and bfloat16 pools) gives
    the same bits from it as from the library this process loaded: on a CPU with AVX-512 that is the
    AVX-512 library, so its pairs of 256-bit operations are shown to stand exactly for the 512-bit ones."""
    import subprocess
    import sys
    from pathlib import Path

    from safetensors import safe_open
    from kernel_outputs import outputs

    out = tmp_path / "avx2.safetensors"
    env = {**os.environ, "LLMD_KERNELS": "avx2"}
    script = Path(__file__).resolve().parents[1] / "support" / "kernel_outputs.py"
    subprocess.run([sys.executable, str(script), str(out)], env=env,
                   check=True, timeout=300)
    here = outputs()
    with safe_open(str(out), "pt") as f:
        assert f.metadata()["variant"] == "avx2"
        assert sorted(f.keys()) == sorted(here)
        for name in here:
            assert torch.equal(f.get_tensor(name), here[name]), f"{name}: the {kernels.variant()} library differs"
