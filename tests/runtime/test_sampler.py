"""Sampler: exact checks of greedy, penalties and temperature; statistical checks of the filters."""
import math

import pytest
import torch

from llmd.runtime.request import SamplingParams
from llmd.runtime.sampler import (SamplingRow, apply_penalties, make_generator, processed_probs, sample,
                                  sample_from_probs)

torch.set_num_threads(1)
DRAWS = 20_000
TV_BOUND = 0.02     # for 20k draws over <= 8 tokens the expected total variation is below 0.01

# Probabilities chosen so that no filter boundary is a rounding question.
PROBS = torch.tensor([0.05, 0.40, 0.10, 0.30, 0.15, 0.0, 0.0, 0.0]) + torch.tensor([0, 0, 0, 0, 0, 1e-3, 2e-3, 3e-3])
LOGITS = PROBS.log()


def row(seed=0, **kw) -> SamplingRow:
    params = SamplingParams(**kw)
    return SamplingRow(params, None if params.greedy else make_generator(seed))


def empirical(params_kw, seed=7) -> torch.Tensor:
    """Token frequencies of DRAWS calls' worth of sampling, as one batch sharing one generator."""
    r = row(seed, **params_kw)
    tokens = sample(LOGITS.expand(DRAWS, -1).contiguous(), [r] * DRAWS).token_ids
    return torch.bincount(tokens, minlength=LOGITS.numel()).double() / DRAWS


def total_variation(p: torch.Tensor, q: torch.Tensor) -> float:
    return 0.5 * float((p.double() - q.double()).abs().sum())


def renormalized(probs: torch.Tensor, keep: list[int]) -> torch.Tensor:
    out = torch.zeros_like(probs)
    out[keep] = probs[keep] / probs[keep].sum()
    return out


def test_greedy_is_argmax():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    rows = [row() for _ in range(6)]
    assert torch.equal(sample(logits, rows).token_ids, logits.argmax(-1))
    assert torch.equal(sample(logits, rows, num_logprobs=2).token_ids, logits.argmax(-1))
    probs = processed_probs(logits, rows)
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), 50).float())


def test_greedy_with_penalty_uses_penalized_argmax():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    r = SamplingRow(SamplingParams(repetition_penalty=1.5), None, [0], 1)
    assert sample(logits, [r]).token_ids.tolist() == [1]


def draws(rows, target, steps=40):
    """The target row's tokens over ``steps`` calls; each step has fresh logits for every row."""
    g = torch.Generator().manual_seed(99)
    out = []
    for _ in range(steps):
        logits = torch.randn(len(rows), 32, generator=g)
        out.append(int(sample(logits, rows).token_ids[target]))
    return out


def test_neighbours_do_not_change_a_seeded_row():
    def target(seed=1234):
        return row(seed, temperature=0.9, top_p=0.95)
    together = draws([row(), row(5, temperature=1.3), target(), row(6, temperature=0.5, top_k=3), row()], 2)
    assert draws([row(), row(), target(), row(), row()], 2) == together
    assert len(set(together)) > 5                         # it really sampled
    assert draws([row(), row(), target(4321), row(), row()], 2) != together


def test_seeded_draws_identical_in_batch_of_one_and_five():
    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(3))
    solo = SamplingRow(SamplingParams(temperature=1.0, seed=42), make_generator(42))
    mates = [row(s, temperature=1.0) for s in (1, 2, 3, 4)]
    mixed = SamplingRow(SamplingParams(temperature=1.0, seed=42), make_generator(42))
    seq_solo, seq_mixed = [], []
    for step in range(30):
        seq_solo.append(int(sample(logits, [solo]).token_ids[0]))
        batch = mates[:2] + [mixed] + mates[2:]
        others = torch.randn(5, 64, generator=torch.Generator().manual_seed(step))
        others[2] = logits[0]
        seq_mixed.append(int(sample(others, batch).token_ids[2]))
    assert seq_solo == seq_mixed
    assert len(set(seq_solo)) > 5


def test_temperature_scaling_is_exact():
    for t in (0.5, 1.0, 2.0):
        probs = processed_probs(LOGITS[None], [row(1, temperature=t)])[0]
        assert torch.allclose(probs, torch.softmax(LOGITS / t, -1), atol=1e-6)
    emp = empirical({"temperature": 2.0})
    assert total_variation(emp, torch.softmax(LOGITS / 2.0, -1)) < TV_BOUND


def test_top_k_statistics():
    emp = empirical({"temperature": 1.0, "top_k": 3})
    keep = [1, 3, 4]
    assert emp[[0, 2, 5, 6, 7]].sum() == 0
    assert total_variation(emp, renormalized(PROBS, keep)) < TV_BOUND


def test_top_p_statistics():
    # Sorted: 0.40, 0.30, 0.15, 0.10 ... Mass before the 3rd is 0.70 < 0.75, before the 4th 0.85.
    emp = empirical({"temperature": 1.0, "top_p": 0.75})
    assert emp[[0, 2, 5, 6, 7]].sum() == 0
    assert total_variation(emp, renormalized(PROBS, [1, 3, 4])) < TV_BOUND
    assert emp[4] > 0.1                                   # the 0.15 token is kept


def test_min_p_statistics():
    # Threshold 0.3 * 0.40 = 0.12 keeps 0.40, 0.30, 0.15.
    emp = empirical({"temperature": 1.0, "min_p": 0.3})
    assert emp[[0, 2, 5, 6, 7]].sum() == 0
    assert total_variation(emp, renormalized(PROBS, [1, 3, 4])) < TV_BOUND


def test_filters_compose_and_differ_per_row():
    rows = [row(1, temperature=1.0, top_k=2), row(2, temperature=1.0, top_p=0.5), row(3, temperature=1.0),
            row(4, temperature=1.0, min_p=0.5), row()]
    probs = processed_probs(LOGITS.expand(5, -1), rows)
    assert torch.allclose(probs.sum(-1), torch.ones(5), atol=1e-6)
    assert torch.allclose(probs[0], renormalized(PROBS, [1, 3]), atol=1e-6)
    assert torch.allclose(probs[1], renormalized(PROBS, [1, 3]), atol=1e-6)   # 0.40 < 0.5 <= 0.70
    assert torch.allclose(probs[2], PROBS / PROBS.sum(), atol=1e-6)
    assert torch.allclose(probs[3], renormalized(PROBS, [1, 3]), atol=1e-6)   # >= 0.20
    assert probs[4].tolist() == [0, 1, 0, 0, 0, 0, 0, 0]


def test_sample_draws_from_processed_probs():
    kw = {"temperature": 0.8, "top_k": 4, "top_p": 0.9, "min_p": 0.1}
    target = processed_probs(LOGITS[None], [row(1, **kw)])[0]
    assert total_variation(empirical(kw), target) < TV_BOUND


def test_sample_from_probs_uses_each_rows_generator():
    probs = torch.full((3, 10), 0.1)
    a = sample_from_probs(probs, [row(5, temperature=1.0), row(), row(6, temperature=1.0)])
    b = sample_from_probs(probs, [row(5, temperature=1.0), row(), row(6, temperature=1.0)])
    assert torch.equal(a, b) and a[1] == 0
    with pytest.raises(ValueError, match="no generator"):
        sample_from_probs(probs, [SamplingRow(SamplingParams(temperature=1.0))] * 3)


def test_penalties_hand_computed():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0], [1.0, 1.0, 1.0, 1.0, 1.0]])
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    rows = [SamplingRow(params, None, history=[0, 1, 1, 3, 3], num_prompt=2), row()]
    before = logits.clone()
    out = apply_penalties(logits, rows)
    # repetition over {0, 1, 3}: 2/2, -1*2, 3/2; then output counts {1: 1, 3: 2}:
    # token 1: -2 - 0.5 - 0.25*1; token 3: 1.5 - 0.5 - 0.25*2.
    assert out[0].tolist() == [1.0, -2.75, 0.5, 0.5, -2.0]
    assert torch.equal(out[1], before[1]) and torch.equal(logits, before)


def test_presence_frequency_ignore_prompt_tokens():
    params = SamplingParams(presence_penalty=1.0, frequency_penalty=1.0)
    out = apply_penalties(torch.zeros(1, 4), [SamplingRow(params, None, [2, 2, 2], num_prompt=3)])
    assert out.tolist() == [[0.0, 0.0, 0.0, 0.0]]


def test_penalties_without_history_fail_clearly():
    with pytest.raises(ValueError, match="no history"):
        apply_penalties(torch.zeros(1, 4), [SamplingRow(SamplingParams(repetition_penalty=1.2))])


def test_logprobs():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 0.0]])
    rows = [row(logprobs=2), row(logprobs=None)]
    res = sample(logits, rows)
    lp = torch.log_softmax(logits, -1)
    first = res.logprobs[0]
    assert first["token_id"] == 1 and math.isclose(first["logprob"], float(lp[0, 1]), rel_tol=1e-6)
    assert [t for t, _ in first["top"]] == [1, 2]
    assert math.isclose(first["top"][1][1], float(lp[0, 2]), rel_tol=1e-6)
    assert res.logprobs[1] is None
    everyone = sample(logits, rows, num_logprobs=0).logprobs
    assert everyone[1]["token_id"] == 2 and everyone[1]["top"] == []
    assert sample(logits, [row(), row()]).logprobs is None


def test_logprobs_are_before_temperature():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    res = sample(logits, [row(3, temperature=0.3, logprobs=0)])
    tok = res.logprobs[0]["token_id"]
    assert math.isclose(res.logprobs[0]["logprob"], float(torch.log_softmax(logits, -1)[0, tok]), rel_tol=1e-6)


def test_make_generator():
    a, b = make_generator(9), make_generator(9)
    assert torch.equal(torch.rand(5, generator=a), torch.rand(5, generator=b))
    assert not torch.equal(torch.rand(5, generator=make_generator(None)), torch.rand(5, generator=make_generator(None)))


def test_shape_mismatch():
    with pytest.raises(ValueError, match="do not match"):
        sample(torch.zeros(3, 4), [row()])


def reference_top_p(probs: torch.Tensor, p: float) -> torch.Tensor:
    """The smallest most-likely set reaching mass p, by a plain full sort, renormalized."""
    order = sorted(range(len(probs)), key=lambda i: -float(probs[i]))
    keep, mass = [], 0.0
    for i in order:
        if mass >= p:
            break
        keep.append(i)
        mass += float(probs[i])
    return renormalized(probs, keep)


@pytest.mark.parametrize("scale", [8.0, 0.05])      # peaked: the head suffices; flat: full sort
def test_top_p_on_a_large_vocabulary(scale):
    vocab = 3000
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(1)) * scale
    rows = [row(1, temperature=1.0, top_p=0.8), row(2, temperature=1.0)]
    probs = processed_probs(logits, rows)
    full = torch.softmax(logits, -1)
    assert torch.allclose(probs[0], reference_top_p(full[0], 0.8), atol=1e-6)
    assert torch.allclose(probs[1], full[1], atol=1e-6)
    assert (probs[0] > 0).sum() > (1 if scale == 8.0 else 1024)


# Locally typical sampling on PROBS (normalized by their sum, 1.006): the entropy is 1.427 nats; the
# surprises -log p are 1.21 (0.30), 1.90 (0.15), 0.92 (0.40), 2.31 (0.10), 3.00 (0.05) ..., so the
# order of typicality is 0.30, 0.15, 0.40, 0.10, 0.05, then the tiny ones, with masses before them
# 0, 0.298, 0.447, 0.845, 0.944.
@pytest.mark.parametrize("typical_p, keep", [(0.25, [3]), (0.4, [3, 4]), (0.6, [1, 3, 4]), (0.9, [1, 2, 3, 4]),
                                             (1.0, list(range(8)))])
def test_typical_hand_computed(typical_p, keep):
    probs = processed_probs(LOGITS[None], [row(1, temperature=1.0, typical_p=typical_p)])[0]
    assert torch.allclose(probs, renormalized(PROBS, keep), atol=1e-6)


def test_typical_statistics_drop_the_most_likely_token():
    emp = empirical({"temperature": 1.0, "typical_p": 0.4})
    assert emp[[0, 1, 2, 5, 6, 7]].sum() == 0          # 0.40 is too predictable to be typical here
    assert total_variation(emp, renormalized(PROBS, [3, 4])) < TV_BOUND


def reference_typical(probs: list[float], mass: float) -> list[int]:
    """The kept ids, by the definition, in plain Python over the nonzero probabilities."""
    live = [i for i, p in enumerate(probs) if p > 0]
    entropy = -sum(probs[i] * math.log(probs[i]) for i in live)
    keep, before = [], 0.0
    for i in sorted(live, key=lambda i: (abs(-math.log(probs[i]) - entropy), i)):
        if before >= mass:
            break
        keep.append(i)
        before += probs[i]
    return keep


@pytest.mark.parametrize("scale", [4.0, 0.3])
def test_typical_against_a_reference_after_temperature_and_top_k(scale):
    vocab = 500
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(2)) * scale
    rows = [row(1, temperature=0.7, typical_p=0.5), row(2, temperature=1.0, top_k=40, typical_p=0.8),
            row(3, temperature=1.0)]
    probs = processed_probs(logits, rows).double()
    first = torch.softmax(logits[0].double() / 0.7, -1)
    assert torch.allclose(probs[0], renormalized(first, reference_typical(first.tolist(), 0.5)), atol=1e-6)
    top = torch.softmax(logits[1].double().masked_fill(logits[1] < logits[1].topk(40).values[-1], -math.inf), -1)
    assert torch.allclose(probs[1], renormalized(top, reference_typical(top.tolist(), 0.8)), atol=1e-6)
    assert torch.allclose(probs[2], torch.softmax(logits[2].double(), -1), atol=1e-6)
    assert 1 < int((probs[0] > 0).sum()) < vocab and int((probs[1] > 0).sum()) < 40


def test_typical_leaves_greedy_rows_alone():
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(3))
    rows = [row(typical_p=0.2), row(typical_p=0.2)]
    assert torch.equal(sample(logits, rows).token_ids, logits.argmax(-1))


def test_typical_after_a_grammar_mask_keeps_masked_tokens_out():
    allowed = torch.tensor([True, False, True, True, False, True, True, True])
    r = row(1, temperature=1.0, typical_p=0.99)
    r.allowed = allowed
    probs = processed_probs(LOGITS[None], [r])[0]
    masked = torch.where(allowed, PROBS, 0.0) / PROBS[allowed].sum()
    assert torch.allclose(probs, renormalized(masked, reference_typical(masked.tolist(), 0.99)), atol=1e-6)
    # in order 0.30, 0.10, 0.05, 0.003 (mass before it 0.987), 0.002 (0.993): 0.99 keeps the 0.003 token only
    assert probs[~allowed].sum() == 0 and probs[7] > 0 and probs[6] == 0
