"""Float32 weights: a row's logits do not depend on the other rows of its step. The blocked kernel sums
each row in one order at every row count (no oneDNN copy for many rows), so a decode row alone, among
forty, or beside a prompt chunk, and a prompt's rows whatever its chunks, get the same bits, and greedy
choices cannot part at a near tie."""
from __future__ import annotations

import random

import pytest
import torch

from llmd import LLM
from llmd.runtime import kernels
from llmd.runtime.kernels import ops
from llmd.runtime.model_runner import Feed
from llmd.runtime.models.layers import Linear

pytestmark = [pytest.mark.skipif(not kernels.available(), reason=f"llmd kernels unavailable: {kernels.why()}"),
              pytest.mark.usefixtures("no_grad")]


def runner_of(model_dir):
    runner = LLM(str(model_dir), kv_memory="64MiB", prefix_cache=False, draft="none").engine.runner
    blocked = [m for m in runner.model.modules() if type(m) is Linear and m.plan.layout == "blocked"]
    assert blocked and all(m.stored.dtype == torch.float32 and m.packed is None for m in blocked)
    return runner


class Blocks:
    """Consecutive block ids of the runner's pool, handed out in turn."""

    def __init__(self, runner):
        self.size, self.next = runner.block_size, 0

    def take(self, positions: int) -> list[int]:
        n = -(-positions // self.size)
        self.next += n
        return list(range(self.next - n, self.next))


def test_a_prompt_gets_the_same_logits_alone_and_beside_a_long_one(tiny_model_dir):
    """9 rows alone (the fused step) and beside a 300-row prompt (the Python forward, each product's
    rows shared out over the threads in slices): the same logits."""
    runner = runner_of(tiny_model_dir)
    blocks, rng = Blocks(runner), random.Random(3)
    first, other = [rng.randrange(20, 400) for _ in range(9)], [rng.randrange(20, 400) for _ in range(300)]
    alone = runner.run(runner.prepare_feeds([Feed(first, 0, blocks.take(9), 1)]))
    beside = runner.run(runner.prepare_feeds([Feed(first, 0, blocks.take(9), 1),
                                              Feed(other, 0, blocks.take(300), 1)]))
    assert torch.equal(alone[0], beside[0])
    half = runner.run(runner.prepare_feeds([Feed(other[:150], 0, (b := blocks.take(300)), 1)]))   # in two chunks
    rest = runner.run(runner.prepare_feeds([Feed(other[150:], 150, b, 1)]))
    whole = runner.run(runner.prepare_feeds([Feed(other, 0, blocks.take(300), 300)]))
    assert torch.equal(whole[149], half[0]) and torch.equal(whole[299], rest[0])


def test_a_decode_row_gets_the_same_logits_alone_and_among_forty(tiny_model_dir):
    runner = runner_of(tiny_model_dir)
    blocks, rng = Blocks(runner), random.Random(4)
    prompts = [[rng.randrange(20, 400) for _ in range(rng.randrange(3, 30))] for _ in range(40)]
    ids = [blocks.take(len(p) + 1) for p in prompts]
    for p, b in zip(prompts, ids):
        runner.run(runner.prepare_feeds([Feed(p, 0, b, 1)]))
    steps = [Feed([rng.randrange(20, 400)], len(p), b, 1) for p, b in zip(prompts, ids)]
    fused = runner.model.fused_decode
    before = fused.steps if fused is not None else 0
    together = runner.run(runner.prepare_feeds(steps))
    if fused is not None:
        assert fused.steps == before + 1 and fused.max_rows >= 40      # forty rows in one fused call
    for i in (0, 17, 39):
        assert torch.equal(runner.run(runner.prepare_feeds([steps[i]]))[0], together[i])


def test_float32_blocks_take_any_row_count_with_each_rows_own_sums():
    """The kernel itself: a row's bits alone, in 17, 40 and 600 rows (sliced over the threads), in any
    order; within float32 rounding of the exact product."""
    if ops.f32_rows() <= ops.F32_MAX_ROWS:
        pytest.skip("a kernel library that takes 16 rows of float32 blocks")
    g = torch.Generator().manual_seed(5)
    w, bias = torch.randn(192, 320, generator=g), torch.randn(192, generator=g)
    blocks = ops.f32_blocks(w)
    x = torch.randn(600, 320, generator=g)
    y = ops.f32_matvec(x, blocks, bias)
    exact = x.double() @ w.double().t() + bias.double()
    assert ((y.double() - exact).abs() / (x.double().abs() @ w.double().abs().t())).max() < 1e-6
    for lo, hi in ((0, 1), (5, 6), (0, 17), (0, 31), (0, 32), (100, 140), (599, 600)):
        assert torch.equal(ops.f32_matvec(x[lo:hi], blocks, bias), y[lo:hi]), (lo, hi)
    order = torch.randperm(600, generator=g)
    assert torch.equal(ops.f32_matvec(x[order], blocks, bias), y[order])
