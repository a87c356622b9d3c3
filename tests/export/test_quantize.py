"""Quantization: round-trip error bounds, each kernel against its dequantized reference at small and
large row counts, whole-model logits against float32, and the int8 KV-cache codec."""
import pytest
import torch

from llmd.runtime.formats.kv_int8 import read_kv_int8, write_kv_int8
from llmd.runtime.formats.quantized import (Int4Linear, Int8Linear, QuantEmbedding, QuantizationError, QuantSpec,
                                            W8A8Linear, dequantize_int4, dequantize_int8, pack_nibbles,
                                            prepare_quantized, quantize_int4, quantize_int8, quantize_model,
                                            unpack_nibbles)
from llmd.runtime.models.loader import load_model

pytestmark = pytest.mark.usefixtures("no_grad")      # kernels run only where no gradient is recorded


def randw(n=64, k=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    w[3] *= 50                                       # rows of very different ranges
    w[:, 7] *= 10                                    # an outlier input channel
    return w


def test_int8_round_trip_within_half_a_step_per_channel():
    w = randw()
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and s.shape == (64,)
    err = (dequantize_int8(q, s) - w).abs()
    assert (err <= s[:, None] / 2 + 1e-6).all()
    assert (q.abs().amax(1) == 127).all()            # every channel uses its full range


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_round_trip_within_half_a_step_per_group(group, symmetric):
    """Scales and zeros are float16 values (held in half the bytes by the kernels); the error stays
    within half a step plus float16's rounding of the zero (and of the scale, at a clamped end)."""
    w = randw()
    q, s, z = quantize_int4(w, group, symmetric)
    assert q.max() <= 15 and s.shape == (64, 128 // group)
    assert s.dtype == z.dtype == torch.float32
    assert torch.equal(s.half().float(), s) and torch.equal(z.half().float(), z)
    err = (dequantize_int4(q, s, z) - w).abs().view(64, -1, group)
    f16 = 2.0 ** -11 * (8 * s + z.abs())                  # float16's relative rounding, at most 2^-11
    assert (err <= (s / 2 + f16)[..., None] + 1e-5).all()
    if symmetric:
        assert (z == 0).all()


@pytest.mark.parametrize("symmetric", [False, True])
def test_int4_keeps_float32_scales_where_float16_would_lose_them(symmetric):
    """A weight with a scale below float16's normal range keeps the float32 scales and zeros it always
    had (the same numbers as before float16 rounding), so a layer of tiny weights loses nothing."""
    w = randw()
    w[5] *= 1e-5                                          # one row's steps below 2^-14
    q, s, z = quantize_int4(w, 32, symmetric)
    g = w.view(64, 4, 32)
    lo, hi = g.amin(-1), g.amax(-1)
    want = g.abs().amax(-1) / 7.5 if symmetric else (hi - lo) / 15
    assert torch.equal(s, want.clamp(min=1e-12))
    assert not torch.equal(s.half().float(), s)
    assert torch.equal(z, torch.zeros_like(s) if symmetric else lo + 8 * s)
    err = (dequantize_int4(q, s, z) - w).abs().view(64, 4, 32)
    assert (err <= s[..., None] / 2 + 1e-5 * w.abs().amax()).all()
    assert (err[5] <= s[5][..., None] * 0.5001).all()


def test_nibbles_round_trip():
    q = torch.randint(0, 16, (16, 64), dtype=torch.uint8)
    assert torch.equal(unpack_nibbles(pack_nibbles(q)), q)
    assert pack_nibbles(q).shape == (16, 32)


def reference(x, module):
    y = x.float() @ module.dense_weight().t()
    return y + module.bias if module.bias is not None else y


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 33])           # both sides of the small-M switch
@pytest.mark.parametrize("make", [
    lambda: Int8Linear(128, 96, bias=True),
    lambda: Int4Linear(128, 96, bias=True, group_size=32),
    lambda: Int4Linear(128, 96, bias=False, group_size=64, symmetric=True),
    lambda: W8A8Linear(128, 96, bias=True),
])
def test_quantized_linear_matches_its_dequantized_weight(make, rows):
    m = make()
    m.load_weight(randw(96, 128))
    if m.bias is not None:
        m.bias = torch.randn(96)
    m.prepare()
    x = torch.randn(2, rows, 128, generator=torch.Generator().manual_seed(rows))
    y = m(x)
    assert y.shape == (2, rows, 96) and y.dtype == torch.float32
    ref = reference(x.view(-1, 128), m).view(2, rows, 96)
    # Rounding x (bf16 or int8) and the kernels' bf16 weights errs in proportion to sum_k |x_k w_k|,
    # not to the (possibly cancelling) output itself.
    scale = (x.view(-1, 128).abs() @ m.dense_weight().abs().t()).max()
    tol = (0.02 if isinstance(m, W8A8Linear) else 0.01) * scale
    assert (y - ref).abs().max() <= tol


def test_int4_rejects_a_group_size_that_does_not_divide_the_width():
    with pytest.raises(QuantizationError, match="group size 128"):
        Int4Linear(96, 64, group_size=128)
    with pytest.raises(QuantizationError):
        QuantSpec("int3")


def test_auto_head_is_resolved_per_method():
    assert [QuantSpec(m).head for m in ("none", "int8", "int4", "w8a8")] == ["float", "int8g", "int8g", "int8g"]
    assert QuantSpec("int8", head="w8a8").head == "w8a8"


SPECS = {"int8": (QuantSpec("int8"), 0.01), "int4": (QuantSpec("int4", group_size=32), 0.02),
         "int4-sym": (QuantSpec("int4", group_size=32, symmetric=True), 0.03),
         "w8a8": (QuantSpec("w8a8"), 0.01), "int8-int8g-head": (QuantSpec("int8", head="int8g"), 0.01), "int8-float-head": (QuantSpec("int8", head="float"), 0.003),
         "int8-int8-head": (QuantSpec("int8", head="int8"), 0.01)}


@pytest.fixture(scope="module")
def small_model_dir(model_factory):
    # std 0.02 as in real checkpoints: quantization error is then realistic, not swamped
    return model_factory("qsmall", hidden=128, intermediate=256, layers=2, std=0.02, tie=True)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_quantized_model_logits_close_to_float32(small_model_dir, name):
    spec, tol = SPECS[name]
    ids = torch.randint(0, 440, (2, 24), generator=torch.Generator().manual_seed(1))
    ref = load_model(small_model_dir)
    ref.prepare_for_inference()
    m = load_model(small_model_dir)
    quantize_model(m, spec)
    m.prepare_for_inference()
    prepare_quantized(m)
    with torch.no_grad():
        r = ref.forward_dense(ids)
        for batch in (ids, ids[:1, :3]):              # large and small row counts
            o = m.forward_dense(batch)
            rr = r[:batch.shape[0], :batch.shape[1]]
            assert (o - rr).abs().max() <= tol * rr.abs().max(), name
    assert (o.argmax(-1) == r[:1, :3].argmax(-1)).float().mean() >= 0.99


def test_tied_int8_head_is_also_the_embedding(small_model_dir):
    m = load_model(small_model_dir)
    emb = m.embed_tokens.weight.detach().clone()
    quantize_model(m, QuantSpec("int8", head="int8"))
    assert isinstance(m.embed_tokens, QuantEmbedding) and m.embed_tokens.table is m.lm_head
    ids = torch.tensor([0, 5, 439])
    q, s = quantize_int8(emb)
    assert torch.equal(m.embed_tokens(ids), dequantize_int8(q, s)[ids])
    names = [n for n, _ in m.named_buffers()]
    assert "lm_head.qweight" in names and not any(n.startswith("embed_tokens.") for n in names)


def test_tied_int4_head_is_also_the_embedding(small_model_dir):
    from pathlib import Path
    with pytest.raises(QuantizationError, match="divisible by 16"):     # this model's vocabulary is 446
        quantize_model(load_model(small_model_dir), QuantSpec("int4", group_size=64, head="int4"))
    target = Path(__file__).resolve().parents[2] / "models" / "code-target"       # vocabulary 8192
    m = load_model(target, "float32")
    emb = m.embed_tokens.weight.detach().clone()
    quantize_model(m, QuantSpec("int4", head="int4"))
    assert isinstance(m.lm_head, Int4Linear) and m.embed_tokens.table is m.lm_head
    ids = torch.tensor([0, 5, 8191])
    q, s, z = quantize_int4(emb, 128)
    assert torch.equal(m.embed_tokens(ids), dequantize_int4(q, s, z)[ids])
    m.prepare_for_inference()
    prepare_quantized(m)
    x = torch.randn(2, emb.shape[1])
    ref = x.double() @ dequantize_int4(q, s, z).double().t()
    assert (m.compute_logits(x).double() - ref).abs().max() < 0.02 * ref.abs().max()


def test_float_head_keeps_tied_embedding_float(small_model_dir):
    m = load_model(small_model_dir)
    quantize_model(m, QuantSpec("int4", group_size=32, head="float"))
    assert m.lm_head is None and isinstance(m.layers[0].mlp.down_proj, Int4Linear)


# ---- int8 KV cache -------------------------------------------------------------------------------

def test_kv_int8_round_trip_per_block_per_head_scales():
    bs, blocks, heads, d = 4, 3, 2, 8
    pool = torch.zeros(blocks * bs, heads, d, dtype=torch.int8)
    scales = torch.zeros(blocks, heads)
    g = torch.Generator().manual_seed(0)
    values = torch.randn(blocks * bs, heads, d, generator=g)
    values[:, 1] *= 20                                           # heads of different ranges
    slots = torch.tensor([4, 5, 6, 7, 8, 9, 10, 11, 0, 1, 2, 3])   # any order of blocks
    write_kv_int8(pool, scales, slots, values[slots], bs)
    back = read_kv_int8(pool, scales, torch.arange(blocks * bs), bs)
    per_slot_scale = scales.repeat_interleave(bs, 0)[:, :, None]
    assert ((back - values).abs() <= per_slot_scale / 2 + 1e-6).all()
    assert torch.allclose(scales, values.abs().view(blocks, bs, heads, d).amax((1, 3)) / 127)


def test_kv_int8_growing_scale_requantizes_earlier_entries():
    bs, heads, d = 4, 1, 4
    pool = torch.zeros(bs, heads, d, dtype=torch.int8)
    scales = torch.zeros(1, heads)
    small = torch.full((1, heads, d), 0.5)
    big = torch.full((1, heads, d), 10.0)
    write_kv_int8(pool, scales, torch.tensor([0]), small, bs)       # a decode step at a time
    write_kv_int8(pool, scales, torch.tensor([1]), big, bs)
    assert scales[0, 0] == pytest.approx(10 / 127)
    back = read_kv_int8(pool, scales, torch.tensor([0, 1]), bs)
    assert torch.allclose(back[1], big[0])
    assert (back[0] - 0.5).abs().max() <= scales[0, 0] / 2 * 2 + 1e-6   # at most two roundings


def test_misaligned_weights_from_a_file_are_realigned():
    m = Int8Linear(64, 96)
    m.load_weight(randw(96, 64))
    q = m.qweight
    raw = torch.empty(q.numel() + 8, dtype=torch.int8)
    raw[8:] = q.flatten()
    m.qweight = raw[8:].view(96, 64)                  # as a tensor inside a safetensors file may sit
    assert m.qweight.data_ptr() % 64
    m.prepare()
    assert m.qweight.data_ptr() % 64 == 0 and torch.equal(m.qweight, q)
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(5))
    ref = reference(x, m)
    # the same error model as test_quantized_linear_matches_its_dequantized_weight: rounding errs in
    # proportion to sum_k |x_k w_k| (an unseeded x once gave 1.2% of the largest output)
    scale = (x.abs() @ m.dense_weight().abs().t()).max()
    assert (m(x) - ref).abs().max() <= 0.01 * scale


def test_column_equalization_keeps_the_float_function_and_refines_int8(small_model_dir):
    """Moving input-column size into the RMSNorm weights leaves float logits unchanged and, with a few
    large columns (as trained models have), shrinks the int8 rounding error of the projections."""
    from llmd.runtime.formats.quantized import dequantize_int8, equalize_columns, quantize_int8
    ref = load_model(small_model_dir)
    m = load_model(small_model_dir)
    with torch.no_grad():
        for model in (ref, m):        # the same outlier columns in both copies
            for layer in model.layers:
                layer.self_attn.qkv_proj.weight[:, :4] *= 8
                layer.mlp.gate_up_proj.weight[:, 4:8] *= 8
    equalize_columns(m)
    ids = torch.randint(0, 440, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        r, o = ref.forward_dense(ids), m.forward_dense(ids)
    assert (o - r).abs().max() <= 1e-4 * r.abs().max()

    def int8_error(model, x):         # error of the projection outputs, as the norm feeds them
        err = 0.0
        for layer in model.layers:
            for norm, proj in ((layer.input_layernorm, layer.self_attn.qkv_proj),
                               (layer.post_attention_layernorm, layer.mlp.gate_up_proj)):
                w = proj.weight.detach() * norm.weight.detach()          # the function the pair computes
                q, s = quantize_int8(proj.weight.detach())
                wq = dequantize_int8(q, s) * norm.weight.detach()
                err += ((x @ w.t() - x @ wq.t()) ** 2).sum().item()
        return err
    x = torch.randn(64, m.config.hidden_size, generator=torch.Generator().manual_seed(3))
    assert int8_error(m, x) < 0.7 * int8_error(ref, x)
