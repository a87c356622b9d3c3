"""The CUDA backend's sampler (run here on CPU tensors) against llmd's CPU sampler: the same tokens
for greedy, temperature, top-k/p, min-p and penalised rows with per-request seeded generators."""
import pytest
import torch

from llmd.runtime.request import SamplingParams
from llmd.runtime.sampler import SamplingRow, make_generator, sample

pytest.importorskip("triton")
from llmd.runtime.execution.cuda.sampling import DEVICE_KNOBS, SamplingBatch, draw, sample_tokens  # noqa: E402
from llmd.sampling_fields import KNOBS  # noqa: E402

pytestmark = pytest.mark.heavy          # Triton kernels on the interpreter

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


def test_a_knob_the_device_lacks_is_drawn_by_the_cpu_sampler():
    assert DEVICE_KNOBS <= {p.name for p in KNOBS} and all(p.knobs_on <= DEVICE_KNOBS for p in PARAMS)
    # typical_p 0.25 keeps the 0.30 token alone: its surprise is the nearest the entropy, 1.39 nats
    logits = torch.tensor([0.05, 0.40, 0.10, 0.30, 0.15]).log().expand(6, -1).contiguous()
    typical = [SamplingParams(temperature=1.0, typical_p=0.25, seed=s) for s in range(6)]
    assert draw(logits, rows_for(typical)) == [3] * 6
    plain = [SamplingParams(temperature=1.0, seed=s) for s in range(6)]
    drawn = draw(logits, rows_for(plain))                   # on the device's path
    assert drawn == sample(logits, rows_for(plain)).token_ids.tolist() and drawn != [3] * 6
