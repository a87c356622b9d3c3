"""The CUDA backend's sampler (run here on CPU tensors) against llmd's CPU sampler: the same tokens
for greedy, temperature, top-k/p, min-p and penalised rows with per-request seeded generators."""
import pytest
import torch

from llmd.runtime.request import SamplingParams
from llmd.runtime.sampler import SamplingRow, make_generator, sample

pytest.importorskip("triton")
from llmd.runtime.execution.cuda.sampling import SamplingBatch, sample_tokens  # noqa: E402

PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.8, seed=1),
    SamplingParams(temperature=1.0, top_k=5, seed=2),
    SamplingParams(temperature=0.7, top_p=0.6, seed=3),
    SamplingParams(temperature=1.3, min_p=0.1, seed=4),
    SamplingParams(temperature=0.9, top_k=20, top_p=0.9, min_p=0.02, seed=5),
    SamplingParams(temperature=0.0, repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.3),
    SamplingParams(temperature=1.0, repetition_penalty=0.7, frequency_penalty=1.0, seed=6),
]


def rows_for(params, seed_offset=0):
    hist = [3, 5, 5, 9, 1, 3, 3, 7]
    return [SamplingRow(p, None if p.greedy else make_generator(p.seed + seed_offset), hist, 4) for p in params]


@pytest.mark.parametrize("trial", range(6))
def test_same_tokens_as_the_cpu_sampler(trial):
    g = torch.Generator().manual_seed(trial)
    logits = torch.randn(len(PARAMS), 50, generator=g) * 3
    want = sample(logits, rows_for(PARAMS, trial)).token_ids
    got = sample_tokens(logits, SamplingBatch.build(rows_for(PARAMS, trial), "cpu"))
    assert got.tolist() == want.tolist()


def test_greedy_batch_is_the_argmax_and_draws_nothing():
    logits = torch.randn(3, 40)
    rows = rows_for([SamplingParams(temperature=0.0)] * 3)
    batch = SamplingBatch.build(rows, "cpu")
    assert batch.greedy_only and not batch.penalties
    assert sample_tokens(logits, batch).tolist() == logits.argmax(-1).tolist()


def test_seeded_draws_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(2, 64, generator=g)
    p = SamplingParams(temperature=1.0, seed=42)
    alone = sample_tokens(logits[1:], SamplingBatch.build(rows_for([p]), "cpu"))
    both = sample_tokens(logits, SamplingBatch.build(rows_for([SamplingParams(temperature=0.5, seed=7), p]), "cpu"))
    assert alone.item() == both[1].item()
