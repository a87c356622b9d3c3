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


def test_plan_is_one_of_the_candidates_and_respects_divisibility():
    plan = matvec_plan(63, 96, torch.float32, 2)          # 63 is odd: no split of the reduction
    assert plan.layout in ("out_in", "in_out")
    assert not (plan.splits > 1 and plan.layout == "in_out")
    one = matvec_plan(64, 96, torch.float32, 1)
    assert one.splits == 1 and one.split_max_rows in (0, 1, 4, 16)
    head = matvec_plan(64, 96, torch.float32, 2, layouts=("in_out",))
    assert head.layout == "in_out"                      # 96 outputs: not a multiple of 64, no kernel


@needs_kernels
def test_plans_offer_the_float32_kernel_where_it_fits():
    """Which plan wins is timed (and may differ between runs); which plans compete is not."""
    from llmd.runtime.models.layers import can_block
    assert can_block(256, 1024, torch.float32)
    assert not can_block(256, 1000, torch.float32)         # outputs not in whole blocks of 64
    assert not can_block(256, 1024, torch.bfloat16)
    plan = matvec_plan(256, 1024, torch.float32, 2)
    if plan.layout == "blocked":                              # a blocked weight always keeps the packed copy
        assert plan.packed and plan.split_max_rows in (1, 4, 16)
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
    assert m(torch.randn(40, 256)).shape == (40, 192)          # many rows: the packed copy
    assert torch.equal(m.dense_weight(), exact)
    ids = torch.tensor([0, 191, 64, 5])
    assert torch.equal(m.rows(ids), exact[ids])
    noisy = exact.clone()
    noisy[3, 7] += 1e-6                                  # one value that is not a bfloat16: float32 blocks
    assert ops.f32_blocks(noisy).dtype == torch.float32
