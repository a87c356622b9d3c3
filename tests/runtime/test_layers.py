"""Linear's storage plans: every plan computes x W^T + b, for every row count, as the plain product."""
import pytest
import torch
import torch.nn.functional as F

from llmd.runtime import kernels
from llmd.runtime.models.layers import Linear, MatvecPlan, can_pack, matvec_plan, split_product

PLANS = [MatvecPlan("out_in", 1, 0), MatvecPlan("in_out", 1, 0),
         MatvecPlan("in_out", 2, 4), MatvecPlan("out_in", 2, 4),
         MatvecPlan("in_out", 4, 16), MatvecPlan("out_in", 4, 16),
         MatvecPlan("blocked", 1, 1), MatvecPlan("blocked", 1, 4), MatvecPlan("blocked", 1, 16)]
pytestmark = pytest.mark.usefixtures("no_grad")      # kernels run only where no gradient is recorded
needs_kernels = pytest.mark.skipif(not kernels.available(), reason=f"llmd kernels unavailable: {kernels.why()}")


def linear_with(plan: MatvecPlan, in_f: int, out_f: int, bias: bool, packed: bool) -> tuple[Linear, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    m = Linear(in_f, out_f, bias)
    with torch.no_grad():
        m.weight.normal_()
        if bias:
            m.bias.normal_()
    w, b = m.weight.detach().clone(), (m.bias.detach().clone() if bias else None)
    m.requires_grad_(False)
    m.apply_plan(MatvecPlan(plan.layout, plan.splits, plan.split_max_rows, packed))
    return m, w, b


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: f"{p.layout}-s{p.splits}-r{p.split_max_rows}")
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_every_plan_gives_the_plain_product_for_every_row_count(plan, packed, bias):
    if packed and not can_pack(torch.float32):
        pytest.skip("oneDNN is not available in this torch build")
    if plan.layout == "blocked" and not kernels.available():
        pytest.skip(f"llmd kernels unavailable: {kernels.why()}")
    m, w, b = linear_with(plan, 64, 128, bias, packed)
    for rows in (1, 2, 3, 4, 5, 16, 17, 40):
        x = torch.randn(rows, 64)
        want = F.linear(x.double(), w.double(), None if b is None else b.double()).float()
        got = m(x.view(1, rows, 64))
        assert got.shape == (1, rows, 128)
        torch.testing.assert_close(got[0], want, rtol=1e-4, atol=1e-4)
    assert torch.equal(m.dense_weight(), w)
    ids = torch.tensor([0, 127, 64, 5, 5])
    assert torch.equal(m.rows(ids), w[ids])          # embedding lookups in a tied head's storage


def test_split_product_splits_the_reduction_or_the_outputs():
    x, w = torch.randn(3, 8), torch.randn(6, 8)
    want = x @ w.t()
    torch.testing.assert_close(split_product(x, w.t().contiguous(), MatvecPlan("in_out", 2, 3)), want)
    torch.testing.assert_close(split_product(x, w, MatvecPlan("out_in", 3, 3)), want)


def test_plans_follow_the_rule_without_timing_anything(monkeypatch):
    """A plan is a function of the shape, dtype, threads and machine: nothing is timed, so a restart
    under any load picks the same plans (and sums in the same order)."""
    import time

    def no_clock():
        raise AssertionError("matvec_plan timed something")
    monkeypatch.setattr(time, "perf_counter", no_clock)
    monkeypatch.setattr(time, "monotonic", no_clock)
    matvec_plan.cache_clear()
    small = matvec_plan(63, 96, torch.float32, 2)          # outputs not in blocks of 64: torch's product
    assert small.layout == "out_in" and small.splits == 1 and small.split_max_rows == 0
    big = matvec_plan(1024, 1000, torch.float32, 2)        # large enough to split a single row over threads
    assert big == MatvecPlan("out_in", 2, 1, packed=can_pack(torch.float32))
    assert matvec_plan(1024, 1001, torch.float32, 2).splits == 1      # 1001 outputs do not split in two
    assert matvec_plan(1024, 1000, torch.float32, 1).splits == 1
    assert matvec_plan(1024, 1000, torch.bfloat16, 2) == MatvecPlan("out_in", 1, 0, packed=False)
    matvec_plan.cache_clear()
    assert matvec_plan(1024, 1000, torch.float32, 2) == big


@needs_kernels
def test_plans_put_the_float32_kernel_wherever_it_serves_the_shape():
    from llmd.runtime.kernels import ops
    from llmd.runtime.models.layers import can_block
    assert can_block(256, 1024, torch.float32)
    assert not can_block(256, 1000, torch.float32)         # outputs not in whole blocks of 64
    assert not can_block(256, 1024, torch.bfloat16)
    assert matvec_plan(256, 1024, torch.float32, 2) == MatvecPlan("blocked", 1, ops.F32_MAX_ROWS, packed=True)
    assert matvec_plan(256, 1024, torch.bfloat16, 2).layout != "blocked"


@needs_kernels
@pytest.mark.parametrize("bias", [False, True])
def test_a_weight_of_bfloat16_values_is_stored_in_half_the_bytes_and_gives_the_same_bits(bias):
    """A checkpoint stored in bfloat16 and served in float32: the blocked weight keeps bfloat16 values,
    which the kernel widens exactly, so every product is the float32 one, bit for bit."""
    from llmd.runtime.kernels import ops
    m, w, b = linear_with(MatvecPlan("blocked", 1, 16), 256, 192, bias, packed=True)
    exact = w.to(torch.bfloat16).float()
    m.weight = torch.nn.Parameter(exact.clone(), requires_grad=False)
    m.stored = None
    m.apply_plan(MatvecPlan("blocked", 1, 16, True))
    assert m.stored.dtype == torch.bfloat16 and m.stored.shape == (3, 256, 64)
    wide = exact.t().reshape(256, 3, 64).transpose(0, 1).contiguous()      # the same blocks in float32
    for rows in (1, 3, 4, 7, 16):
        x = torch.randn(rows, 256)
        narrow_y = ops.f32_matvec(x, m.stored, b)
        assert torch.equal(narrow_y, ops.f32_matvec(x, wide, b))
        assert torch.equal(m(x), narrow_y)
    many = torch.randn(40, 256)          # the kernel takes many rows itself: no float32 copy kept
    assert m.packed is None and torch.equal(m(many), ops.f32_matvec(many, m.stored, b))
    want = many.double() @ exact.double().t() + (0 if b is None else b.double())
    assert torch.allclose(m(many).double(), want, rtol=0, atol=1e-4)
    assert torch.equal(m.dense_weight(), exact)
    ids = torch.tensor([0, 191, 64, 5])
    assert torch.equal(m.rows(ids), exact[ids])
    noisy = exact.clone()
    noisy[3, 7] += 1e-6                                  # one value that is not a bfloat16: float32 blocks
    assert ops.f32_blocks(noisy).dtype == torch.float32


@pytest.mark.skipif(not can_pack(torch.float32), reason="oneDNN is not available in this torch build")
def test_a_copy_of_a_layer_packs_its_own_onednn_copy():
    import copy
    m, w, b = linear_with(MatvecPlan("out_in", 1, 0), 64, 128, True, packed=True)
    twin = copy.deepcopy(m)
    assert twin.packed is not None and twin.packed is not m.packed
    x = torch.randn(40, 64)
    assert torch.equal(twin(x), m(x))
