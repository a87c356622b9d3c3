"""The head screen (llmd.runtime.formats.head_screen): its bound holds for every output, its exact scores
are the head's own, and greedy tokens are the same with it as without it, alone, in batches and under
speculation."""
import math
import random

import pytest
import torch

from llmd import LLM, SamplingParams
from llmd.export.cli import ExportOptions, export_engine
from llmd.runtime import kernels
from llmd.runtime.formats import head_screen
from llmd.runtime.formats.head_screen import HeadScreen
from llmd.runtime.formats.quantized import Int8GroupLinear, Int8Linear, dequantize_int4, quantize_int8
from llmd.runtime.kernels import ops
from llmd.runtime.models.layers import Linear

pytestmark = [pytest.mark.skipif(not kernels.available(), reason=f"llmd kernels unavailable: {kernels.why()}"),
              pytest.mark.usefixtures("no_grad")]


def make_head(n: int, k: int, seed: int, grouped: bool = True, duplicates: int = 0) -> Int8Linear:
    """An int8g (or int8) head of an embedding-like table: small rows, a few large ones, and
    ``duplicates`` pairs of rows one integer step apart (near ties the screen cannot tell apart)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    w[torch.randint(0, n, (n // 50,), generator=g)] *= 8
    head = Int8GroupLinear(k, n) if grouped else Int8Linear(k, n)
    head.load_weight(w)
    for i in range(duplicates):
        a, b = 2 * i + 1, n - 2 * i - 1
        head.qweight[b] = head.qweight[a]
        head.qweight[b, i % k] += 1 if head.qweight[b, i % k] < 127 else -1
        head.scales[b] = head.scales[a]
    head.prepare()
    return head


def hidden_rows(m: int, k: int, seed: int, gamma: torch.Tensor) -> torch.Tensor:
    """Final-norm outputs: unit-RMS rows times the norm weight (a few channels far larger than the rest)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x = x / x.pow(2).mean(1, keepdim=True).sqrt()
    return (x * gamma).float()


def outlier_gamma(k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    gamma = 1 + torch.rand(k, generator=g)
    gamma[torch.randperm(k, generator=g)[:24]] *= 12
    return gamma


def reference_radius(screen: HeadScreen, head: Int8Linear, x: torch.Tensor) -> torch.Tensor:
    """R [M, V] as the module's docstring states it, in float64, from norms recomputed here."""
    k = head.in_features
    w = (head.qweight.double().view(head.out_features, -1, k // head.scales.shape[-1] if head.scales.dim() == 2 else k)
         * head.scales.double().view(head.out_features, -1, 1)).view(head.out_features, k)
    cols, outl = screen.cols, screen.outliers
    q, s, z = head_screen._int4_half(w[:, cols].float())
    w4 = dequantize_int4(q, s, z).double()
    q8, s8 = quantize_int8(w[:, outl].float())
    wq = q8.double() * s8.double()[:, None]
    off = (z.double() - 8 * s.double()).abs() + 15 * s.double().abs()
    norms = torch.stack(((w[:, cols] - w4).norm(dim=1), (w[:, outl] - wq).norm(dim=1), w4.norm(dim=1),
                         w.norm(dim=1) + w4.norm(dim=1) + wq.norm(dim=1)
                         + math.sqrt(head_screen.GROUP) * off.norm(dim=1)), 1)
    assert torch.all(screen.norms.double() >= norms)          # the stored norms are these, rounded up
    assert torch.allclose(screen.norms.double(), norms, rtol=1e-6, atol=1e-12)
    xd = x.double()
    xm, xo = xd[:, cols], xd[:, outl]
    km = xm.shape[1]
    e = sum(min(128, km - c) * xm[:, c:c + 128].abs().amax(1) ** 2 for c in range(0, km, 128))
    d = 2 * 0.505 / 32767 * math.sqrt(k) * xd.abs().amax(1) + screen.margin * (xd.norm(dim=1) + 1)
    coeffs = torch.stack((xm.norm(dim=1), xo.norm(dim=1), 0.505 / 127 * e.sqrt(), d), 1)
    return coeffs @ norms.t()


@pytest.mark.parametrize("grouped", [True, False])
def test_picked_outputs_are_the_whole_products_own_values(grouped):
    head = make_head(700, 256, seed=1, grouped=grouped)
    full_form = head._kernel_form
    for m, scale in ((1, 1.0), (3, 1e-3), (9, 40.0)):
        x = torch.randn(m, 256) * scale
        x[:, 5] *= 50
        full = ops.packed_matvec(x, full_form)
        idx = torch.tensor(sorted(random.Random(m).sample(range(700), 97)))
        picked = ops.q8_pick(x, head.qweight, head.scales, idx)
        assert torch.equal(picked, full[:, idx])           # bit for bit: a row of the head alone


def test_the_bound_holds_for_every_output_and_the_kernel_keeps_every_candidate():
    k = 384
    head = make_head(6000, k, seed=2)
    gamma = outlier_gamma(k, seed=3)
    screen = HeadScreen.build(head, gamma)
    assert screen is not None
    assert set(screen.outliers.tolist()) >= set(gamma.argsort(descending=True)[:24].tolist())
    x = hidden_rows(6, k, seed=4, gamma=gamma)
    exact = ops.packed_matvec(x, head._kernel_form).double()
    xp = x.index_select(1, screen.order)
    s = screen.scores(xp[:, :screen.main.k], xp[:, screen.main.k:])
    r = reference_radius(screen, head, x)
    gap = (exact - s.double()).abs()
    assert torch.all(gap <= r)                     # the bound holds for every output of every row
    assert (gap / r).max() > 0.01                  # ... and is not vacuous
    floor = torch.stack([s.double()[i, j] - r[i, j] for i, j in enumerate(s.argmax(1).tolist())])
    needed = ((s.double() + r) >= floor[:, None]).any(0).nonzero().flatten()
    kept = screen.candidates(xp, s)
    assert set(needed.tolist()) <= set(kept.tolist())
    assert kept.numel() < 6000 * head_screen.MAX_SHARE      # and the screen leaves few to score exactly


@pytest.mark.parametrize("grouped", [True, False])
def test_screened_tokens_are_the_whole_heads_argmax_with_ties_at_the_first(grouped):
    k = 256
    head = make_head(5000, k, seed=5, grouped=grouped, duplicates=40)
    head.qweight[4000] = head.qweight[123]             # an exact tie: the first index wins
    head.scales[4000] = head.scales[123]
    head.prepare()
    gamma = outlier_gamma(k, seed=6)
    screen = HeadScreen.build(head, gamma)
    rows = [hidden_rows(m, k, seed=10 + m, gamma=gamma) for m in (1, 2, 5, 16)]
    rows.append(torch.stack([head.rows(torch.tensor([123]))[0] * 3, head.rows(torch.tensor([4999]))[0] * 5]))
    for x in rows:
        want = ops.argmax(ops.packed_matvec(x, head._kernel_form)).tolist()
        assert screen.argmax(x) == want
    assert screen.stats.rows == sum(x.shape[0] for x in rows) and screen.stats.whole == 0


def test_rows_that_are_not_finite_read_the_whole_head():
    head = make_head(5000, 256, seed=7)
    screen = HeadScreen.build(head, outlier_gamma(256, seed=8))
    x = torch.randn(2, 256)
    x[1, 3] = float("nan")
    assert screen.argmax(x) == ops.argmax(ops.packed_matvec(x, head._kernel_form)).tolist()
    assert screen.stats.whole == 2 and screen.stats.rows == 0


def test_heads_it_does_not_serve_get_no_screen():
    gamma = torch.ones(256)
    assert HeadScreen.build(make_head(head_screen.MIN_ROWS - 16, 256, seed=9), gamma) is None    # small
    assert HeadScreen.build(make_head(5000, 64, seed=9), torch.ones(64)) is None                 # narrow
    assert HeadScreen.build(make_head(5000, 256, seed=9), None) is None


def make_float_head(n: int, k: int, seed: int, bfloat16: bool = False) -> Linear:
    """A float head on llmd's blocked kernel (float32 blocks, or bfloat16 ones where every value is a
    bfloat16), of an embedding-like table, with an exact tie between rows 123 and n - 100."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    w[torch.randint(0, n, (n // 50,), generator=g)] *= 8
    w[n - 100] = w[123]
    if bfloat16:
        w = w.bfloat16().float()
    head = Linear(k, n)
    with torch.no_grad():
        head.weight.copy_(w)
    head.prepare()
    assert head.plan.layout == "blocked"
    assert head.stored.dtype == (torch.bfloat16 if bfloat16 else torch.float32)
    return head


def float_radius(screen: HeadScreen, head: Linear, x: torch.Tensor) -> torch.Tensor:
    """R [M, V] for a float head's int8 screen, as the module's docstring states it, in float64."""
    k = head.in_features
    w = head.dense_weight().double()
    cols, outl = screen.cols, screen.outliers
    qm, sm = quantize_int8(w[:, cols].float())
    wm = qm.double() * sm.double()[:, None]
    qo, so = quantize_int8(w[:, outl].float())
    wo = qo.double() * so.double()[:, None]
    norms = torch.stack(((w[:, cols] - wm).norm(dim=1), (w[:, outl] - wo).norm(dim=1), torch.zeros(w.shape[0]),
                         w.norm(dim=1) + wm.norm(dim=1) + wo.norm(dim=1)), 1)
    assert torch.all(screen.norms.double() >= norms)
    assert torch.allclose(screen.norms.double(), norms, rtol=1e-6, atol=1e-12)
    xd = x.double()
    d = 2 * 0.505 / 32767 * math.sqrt(k) * xd.abs().amax(1) + screen.margin * (xd.norm(dim=1) + 1)
    coeffs = torch.stack((xd[:, cols].norm(dim=1), xd[:, outl].norm(dim=1), torch.zeros(x.shape[0]), d), 1)
    return coeffs @ norms.t()


@pytest.mark.parametrize("bfloat16", [False, True])
def test_float_heads_picked_outputs_are_the_blocked_kernels_own_values(bfloat16):
    head = make_float_head(1024, 320, seed=20, bfloat16=bfloat16)
    for m, scale in ((1, 1.0), (5, 1e-3), (16, 40.0)):
        x = torch.randn(m, 320) * scale
        x[:, 7] *= 50
        full = ops.f32_matvec(x, head.stored, None)
        idx = torch.tensor(random.Random(m).sample(range(1024), 37) + [0, 1023, 5])      # any order, repeats
        assert torch.equal(ops.f32_pick(x, head.stored, idx), full[:, idx])
    assert ops.f32_pick(torch.randn(17, 320), head.stored, idx) is None        # more rows than the kernel takes
    assert ops.f32_pick(torch.randn(1, 320), head.stored, torch.tensor([1024])) is None      # past the last


@pytest.mark.parametrize("bfloat16", [False, True])
def test_a_float_heads_bound_holds_and_its_tokens_are_the_whole_heads(bfloat16):
    k, n = 384, 6016
    head = make_float_head(n, k, seed=21, bfloat16=bfloat16)
    gamma = outlier_gamma(k, seed=22)
    screen = HeadScreen.build(head, gamma)
    assert screen is not None and screen.float_head and not screen.main.nibbles
    assert screen.nbytes() < head.stored.numel() * head.stored.element_size() * 0.6
    x = hidden_rows(6, k, seed=23, gamma=gamma)
    exact = ops.f32_matvec(x, head.stored, None).double()
    xp = x.index_select(1, screen.order)
    s = screen.scores(xp[:, :screen.main.k], xp[:, screen.main.k:])
    r = float_radius(screen, head, x)
    gap = (exact - s.double()).abs()
    assert torch.all(gap <= r) and (gap / r).max() > 0.01
    kept = screen.candidates(xp, s)
    assert kept.numel() < n * head_screen.MAX_SHARE
    rows = [hidden_rows(m, k, seed=30 + m, gamma=gamma) for m in (1, 2, 7, 16)]
    rows.append(torch.stack([head.rows(torch.tensor([123]))[0] * 3, head.rows(torch.tensor([n - 1]))[0] * 5]))
    for x in rows:
        want = ops.argmax(ops.f32_matvec(x, head.stored, None)).tolist()
        assert screen.argmax(x) == want
    assert screen.argmax(rows[-1])[0] == 123          # the exact tie goes to the first
    assert screen.stats.rows == sum(x.shape[0] for x in rows) + 2 and screen.stats.whole == 0
    big = hidden_rows(17, k, seed=40, gamma=gamma)          # past the blocked kernel's rows: the whole head
    assert screen.argmax(big) == ops.argmax(head(big)).tolist() and screen.stats.whole == 17


def test_rows_whose_sums_could_overflow_read_the_whole_head():
    """The bound presumes finite sums: a row near float32's largest value reads the whole head, whose
    chain may overflow where the screen's scores do not (here output 7's sum is 0, but its float32 chain
    overflows to infinity: the whole head's token is 7, which the screen's scores alone rule out)."""
    k = 576
    w = torch.zeros(4096, k)
    w[7, :2] = torch.tensor([4e19, -4e19])
    w[9, 0] = 1.0
    head = Linear(k, 4096)
    with torch.no_grad():
        head.weight.copy_(w)
    head.prepare()
    screen = HeadScreen.build(head, torch.ones(k))
    x = torch.zeros(2, k)
    x[0, :2] = 1e19
    x[1, 0] = 1.0
    want = ops.argmax(ops.f32_matvec(x, head.stored, None)).tolist()
    assert want[0] == 7
    assert screen.argmax(x[:1]) == want[:1] and screen.stats.whole == 1 and screen.stats.rows == 0
    assert screen.argmax(x[1:]) == want[1:] and screen.stats.rows == 1


def test_float_heads_it_does_not_serve_get_no_screen():
    head = make_float_head(1024, 256, seed=24)
    assert HeadScreen.build(head, torch.ones(256)) is None                     # small
    biased = Linear(256, 5056, bias=True)
    biased.prepare()
    assert HeadScreen.build(biased, torch.ones(256)) is None                   # a bias


@pytest.fixture(scope="module")
def screened_engines(model_factory, tmp_path_factory):
    """An int4 export (its int8g head screened at 4 bits) and a float32 model (its tied head in float32
    blocks, screened at 8 bits; a vocabulary padded to a multiple of 64, as the blocks need)."""
    source = model_factory("screen-src", hidden=128, intermediate=256, layers=2)
    out = tmp_path_factory.mktemp("screen") / "int4"
    export_engine(ExportOptions(str(source), str(out), quant="int4", group_size=32, eval_windows=2, eval_tokens=64,
                                accept_loss=True))
    return {"int4": out, "float32": model_factory("screen-float", hidden=128, intermediate=256, layers=2,
                                                  vocab_size=512)}


@pytest.mark.parametrize("form", ["int4", "float32"])
@pytest.mark.heavy
def test_engine_tokens_are_the_same_with_and_without_the_screen(screened_engines, form, monkeypatch):
    """Greedy output of a batch, and under n-gram speculation (verification rows), with the screen
    and with the whole head; sampled requests in the same batch keep the full logits."""
    monkeypatch.setattr(head_screen, "MIN_ROWS", 16)        # the test model's vocabulary is small
    rng = random.Random(3)
    prompts = [[rng.randrange(20, 400) for _ in range(rng.randrange(3, 40))] for _ in range(6)]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for opts in ({}, {"draft": "ngram"}):
        runs = {}
        for screened in (True, False):
            llm = LLM(str(screened_engines[form]), kv_memory="8MiB", head_screen=screened, **opts)
            screen = llm.engine.runner.model.head_screen
            assert (screen is not None) == screened
            runs[screened] = [o.token_ids for o in llm.generate(prompts, greedy)]
            if screened:
                assert screen.float_head == (form == "float32") and screen.stats.rows > 0
                mixed = llm.generate(prompts[:2], [greedy, SamplingParams(max_tokens=8, temperature=0.8, seed=1)])
                assert mixed[0].token_ids == runs[True][0]
        assert runs[True] == runs[False]


def test_constant_rows_still_pack_at_five_bits_and_keep_the_bound():
    """Rows of zeros (a padded vocabulary) or of one value give float16-tiny int4 scales; the screen
    holds them to float16 values and its bound still covers them."""
    k = 256
    head = make_head(5000, k, seed=11)
    head.qweight[:40] = 0
    head.qweight[40:60] = 3
    head.prepare()
    gamma = outlier_gamma(k, seed=12)
    screen = HeadScreen.build(head, gamma)
    assert screen is not None and screen.main.half
    x = hidden_rows(3, k, seed=13, gamma=gamma)
    exact = ops.packed_matvec(x, head._kernel_form).double()
    xp = x.index_select(1, screen.order)
    s = screen.scores(xp[:, :screen.main.k], xp[:, screen.main.k:])
    assert torch.all((exact - s.double()).abs() <= reference_radius(screen, head, x))


def test_the_screen_turns_itself_off_where_it_is_not_faster_than_the_head(monkeypatch):
    k = 256
    head = make_head(5000, k, seed=14)
    gamma = outlier_gamma(k, seed=15)
    x = hidden_rows(8, k, seed=16, gamma=gamma)
    want = ops.argmax(ops.packed_matvec(x, head._kernel_form)).tolist()
    monkeypatch.setattr(head_screen, "TRIALS", 3)
    monkeypatch.setattr(head_screen, "TRIAL_EVERY", 2)
    kept, dropped = HeadScreen.build(head, gamma), HeadScreen.build(head, gamma)
    monkeypatch.setattr(head_screen, "KEEP_BELOW", 1e9)          # any time is fast enough
    for _ in range(8):
        assert kept.argmax(x) == want
    assert kept.stats.on and len(kept.stats.ratios) == 3
    monkeypatch.setattr(head_screen, "KEEP_BELOW", 0.0)          # no time is
    for _ in range(6):
        assert dropped.argmax(x) == want
    assert not dropped.stats.on and len(dropped.stats.ratios) == 3 and dropped.stats.rows == 48
    assert dropped.argmax(x) is None and dropped.stats.whole == 8          # the caller reads the whole head


def test_the_trial_is_decided_by_the_median_pair_not_by_one_slow_call():
    fast = [(0.7e-3, 1e-3)] * 15
    assert head_screen.median_share(fast + [(50e-3, 1e-3)]) < head_screen.KEEP_BELOW     # one stalled call
    assert head_screen.median_share([(1e-3, 1e-3)] * 16) >= head_screen.KEEP_BELOW
    assert head_screen.median_share(fast[:7] + [(2e-3, 1e-3)] * 9) >= head_screen.KEEP_BELOW


def test_a_token_the_whole_head_disagrees_with_turns_the_screen_off(monkeypatch, caplog):
    head = make_head(5000, 256, seed=17)
    gamma = outlier_gamma(256, seed=18)
    screen = HeadScreen.build(head, gamma)
    monkeypatch.setattr(head_screen, "TRIAL_EVERY", 1)
    monkeypatch.setattr(screen, "_argmax", lambda x: [7] * x.shape[0])      # a broken screen
    x = hidden_rows(1, 256, seed=19, gamma=gamma)
    want = ops.argmax(ops.packed_matvec(x, head._kernel_form)).tolist()
    assert want != [7] and screen.argmax(x) == want
    assert not screen.stats.on and "screen turned off" in caplog.text
