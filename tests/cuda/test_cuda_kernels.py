"""The CUDA backend's Triton kernels on Triton's interpreter (CPU tensors), on small shapes, against
llmd's float32 reference attention and FlexAttention's paged form. The interpreter runs programs one
after another and reads out of bounds silently: bounds and races are checked on a GPU only
(tests/cuda/test_cuda_gpu.py)."""
import os

import pytest
import torch

from cuda_cases import BS, flex_reference, make_case, reference

pytestmark = [pytest.mark.heavy,
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="interpreted kernels only")]
ops = pytest.importorskip("llmd.runtime.execution.cuda.ops")
from llmd.runtime.execution.cuda.metadata import StepShape  # noqa: E402

MIXED = [(20, 37), (1, 50), (4, 33), (1, 1)]        # a prompt chunk, decode rows, verification rows (k=3)


def attend(q, kc, vc, meta, splits=1):
    return torch.ops.llmd.paged_attention(q, kc, vc, meta.query_start, meta.seq_lens, meta.block_table,
                                          meta.shape.max_query_len, splits, q.shape[-1] ** -0.5)


@pytest.mark.parametrize("heads,kv_heads,dtype", [(7, 1, torch.float32), (4, 2, torch.float32), (7, 1, torch.bfloat16)])
def test_attention_matches_float32_reference(heads, kv_heads, dtype):
    q, kc, vc, meta, spans = make_case(MIXED, heads, kv_heads, 16, dtype)
    got = attend(q, kc, vc, meta).float()
    want = reference(q, kc, vc, spans, meta.shape.num_rows)
    tol = 1e-5 if dtype == torch.float32 else 2e-2       # bfloat16 output rounding
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_attention_matches_flex_attention_paged():
    q, kc, vc, meta, spans = make_case(MIXED, 7, 1, 16)
    got = attend(q, kc, vc, meta)
    for s, want in zip(spans, flex_reference(q, kc, vc, spans)):
        torch.testing.assert_close(got[s.start:s.start + s.num_q], want, atol=1e-5, rtol=1e-5)


def test_head_size_not_a_power_of_two():
    q, kc, vc, meta, spans = make_case([(3, 21), (1, 9)], 4, 2, 24)
    torch.testing.assert_close(attend(q, kc, vc, meta), reference(q, kc, vc, spans, meta.shape.num_rows),
                               atol=1e-5, rtol=1e-5)


def test_split_kv_matches_single_pass():
    lens = [(1, 70), (1, 3), (4, 66)]
    q, kc, vc, meta, spans = make_case(lens, 7, 1, 16)
    one = attend(q, kc, vc, meta, 1)
    for splits in (2, 4):
        torch.testing.assert_close(attend(q, kc, vc, meta, splits), one, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(one, reference(q, kc, vc, spans, meta.shape.num_rows), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("splits", [1, 4])
def test_padding_rows_attend_to_nothing(splits):
    """A graph bucket of 4 requests, 12 rows for a step of 2 verification requests: the unused rows
    and padding requests give zeros, the real rows what they give unpadded."""
    lens = [(3, 40), (2, 17)]
    bucket = StepShape(num_rows=12, num_seqs=4, width=6, max_query_len=3)
    q, kc, vc, meta, spans = make_case(lens, 4, 2, 16, pad_to=bucket)
    got = attend(q, kc, vc, meta, splits)
    assert got[5:].abs().max() == 0
    assert (meta.slot_mapping[5:] == -1).all() and (meta.seq_lens[2:] == 0).all()
    torch.testing.assert_close(got, reference(q, kc, vc, spans, 12), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_slots_and_skips_padding(dtype):
    g = torch.Generator().manual_seed(1)
    kc = torch.randn(8 * BS, 2, 16, generator=g).to(dtype)
    vc = torch.randn(8 * BS, 2, 16, generator=g).to(dtype)
    qkv = torch.randn(5, (4 + 2 + 2) * 16, generator=g)            # q/k/v views of one projection, as in a layer
    k = qkv[:, 64:96].unflatten(-1, (2, 16))
    v = qkv[:, 96:].unflatten(-1, (2, 16))
    slots = torch.tensor([33, -1, 7, 120, -1])
    want_k, want_v = kc.clone(), vc.clone()
    real = slots >= 0
    want_k[slots[real]] = k[real].to(dtype)
    want_v[slots[real]] = v[real].to(dtype)
    torch.ops.llmd.store_kv(k, v, kc, vc, slots)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


def test_fake_implementations_give_shapes_without_running():
    from torch._subclasses.fake_tensor import FakeTensorMode
    q, kc, vc, meta, _ = make_case(MIXED, 7, 1, 16)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fq = mode.from_tensor(q)
        out = attend(fq, mode.from_tensor(kc), mode.from_tensor(vc), meta)
        assert out.shape == q.shape and out.dtype == q.dtype
        torch.ops.llmd.store_kv(fq[:, :1], fq[:, :1], mode.from_tensor(kc), mode.from_tensor(vc), meta.slot_mapping)


def test_decode_splits_fill_the_gpu_and_stay_powers_of_two():
    assert ops.decode_splits(64, 8, 64) == 1
    for b in (1, 2, 4, 8):
        s = ops.decode_splits(b, 2, 64)
        assert s > 1 and s & (s - 1) == 0 and s <= ops.MAX_SPLITS
    assert ops.decode_splits(1, 2, 2) == 2          # never more splits than blocks


def test_split_ranges_follow_each_request_length():
    """Keys split by each request's own length, not the block table's width (a graph bucket's table is
    as wide as the longest context): with q = 0 every visible key weighs exactly 1, so a split's sum is
    the count of keys it covered. Share s of n blocks in S splits covers blocks [s * ceil(n / S), ...)."""
    lens = [1, 16, 17, 40, 100, 250]
    splits, width = 4, 16
    bucket = StepShape(len(lens), len(lens), width, 1)
    q, kc, vc, meta, spans = make_case([(1, n) for n in lens], 4, 2, 16, pad_to=bucket)
    out, _, stats = ops.launch_attention(torch.zeros_like(q), kc, vc, meta.query_start, meta.seq_lens,
                                         meta.block_table, 1, splits, 0.25)
    for row, n in enumerate(lens):
        per = -(-(-(-n // BS)) // splits) * BS                        # keys per share
        want = [max(0, min(n, (s + 1) * per) - s * per) for s in range(splits)]
        got = stats[row, :, :, 1]                                     # every head: keys summed per split
        assert got.tolist() == [want] * q.shape[1], (n, got[0].tolist(), want)
    assert stats[lens.index(40), 0, :, 1].tolist() == [16, 16, 8, 0]  # not all in split 0 of a 16-block width
    torch.testing.assert_close(out, reference(torch.zeros_like(q), kc, vc, spans, len(lens)), atol=1e-5, rtol=1e-5)
