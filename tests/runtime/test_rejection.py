"""Rejection sampling keeps the target's distribution exactly; the cases of verification are exact.

Statistical bound: with N = 20,000 seeded samples over a 6-token vocabulary, the total variation
distance between the empirical and exact distributions stays under 0.02 for first tokens and 0.04
for two-token sequences (expected sampling noise is about 0.01 and 0.02). The draft is chosen so that
TV(target, draft) > 0.2: an implementation that accepts every proposal fails the same bound.
"""
import bisect
import itertools
import random

import pytest
import torch

from llmd.runtime.request import SamplingParams
from llmd.runtime.sampler import SamplingRow, make_generator, processed_probs
from llmd.runtime.spec.rejection import verify_greedy, verify_sampled

V, K, N = 6, 2, 20_000


def logits_table(seed):
    g = torch.Generator().manual_seed(seed)
    table = {(): torch.randn(V, generator=g) * 1.5}
    for a in range(V):
        table[(a,)] = torch.randn(V, generator=g) * 1.5
        for b in range(V):
            table[(a, b)] = torch.randn(V, generator=g) * 1.5
    return table


_CACHE = {}


def dist(table, ctx, params):
    key = (id(table), ctx, params)
    if key not in _CACHE:
        _CACHE[key] = processed_probs(table[ctx][None], [SamplingRow(params, make_generator(0))])[0]
    return _CACHE[key]


def accept_always(p, q, proposals, g):
    return proposals + [int(torch.multinomial(p[len(proposals)], 1, generator=g))]


def propose(draft, ctx, params, rng):
    """A draft token drawn from its distribution after ``ctx``, from the draft's own random stream (a
    cumulative table and one uniform: the proposer's draw is not what this file tests)."""
    key = ("cum", id(draft), ctx, params)
    if key not in _CACHE:
        _CACHE[key] = list(itertools.accumulate(dist(draft, ctx, params).tolist()))
    cum = _CACHE[key]
    return min(bisect.bisect_right(cum, rng.random() * cum[-1]), V - 1)


def generate_two(target, draft, params, g, verify, rng):
    """Speculate (k=2) until two tokens exist; return them."""
    out = []
    while len(out) < 2:
        ctx = tuple(out)
        props = []
        for _ in range(K - len(ctx) if len(ctx) < K else 0):
            props.append(propose(draft, ctx + tuple(props), params, rng))
        got = verify(*stacked(target, draft, ctx, tuple(props), params), props, g)
        out.extend(got)
    return out[:2]


def stacked(target, draft, ctx, props, params):
    """The target's rows after ``ctx`` and each prefix of ``props``, and the draft's rows that drew
    them (None: no proposals), stacked once per distinct draw."""
    key = (id(target), id(draft), ctx, props, params)
    if key not in _CACHE:
        ps = [dist(target, ctx + props[:i], params) for i in range(len(props) + 1)]
        qs = [dist(draft, ctx + props[:i], params) for i in range(len(props))]
        _CACHE[key] = torch.stack(ps), torch.stack(qs) if qs else None
    return _CACHE[key]


def exact(target, params):
    p1 = dist(target, (), params)
    pairs = {(a, b): float(p1[a] * dist(target, (a,), params)[b]) for a, b in itertools.product(range(V), repeat=2)}
    return p1, pairs


def tv(emp: dict, ref: dict) -> float:
    keys = set(emp) | set(ref)
    return 0.5 * sum(abs(emp.get(k, 0.0) - ref.get(k, 0.0)) for k in keys)


TARGET, DRAFT = logits_table(11), logits_table(22)


def empirical(verify, params, seed=1):
    target, draft = TARGET, DRAFT
    g, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    firsts, pairs = {}, {}
    for _ in range(N):
        a, b = generate_two(target, draft, params, g, verify, rng)
        firsts[a] = firsts.get(a, 0) + 1 / N
        pairs[(a, b)] = pairs.get((a, b), 0) + 1 / N
    p1, ref_pairs = exact(target, params)
    return firsts, pairs, {i: float(p1[i]) for i in range(V)}, ref_pairs, dist(draft, (), params)


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_p=0.9)],
                         ids=["t1", "top_p0.9"])
@pytest.mark.heavy
def test_distribution_matches_target(params):
    firsts, pairs, ref1, ref2, q1 = empirical(verify_sampled, params)
    assert tv({i: float(q1[i]) for i in range(V)}, ref1) > 0.2, "draft must differ from target for the test to bite"
    assert tv(firsts, ref1) < 0.02
    assert tv(pairs, ref2) < 0.04


@pytest.mark.heavy
def test_accept_always_fails_the_same_test():
    firsts, pairs, ref1, ref2, _ = empirical(accept_always, SamplingParams(temperature=1.0))
    assert tv(firsts, ref1) > 0.02 or tv(pairs, ref2) > 0.04


def onehot(i):
    t = torch.zeros(V)
    t[i] = 1
    return t


def test_all_accepted_gives_bonus():
    g = make_generator(0)
    q = torch.stack([torch.full((V,), 1 / V)] * 2)
    p = torch.stack([torch.full((V,), 1 / V)] * 2 + [onehot(5)])
    assert verify_sampled(p, q, [1, 2], g) == [1, 2, 5]
    assert verify_greedy([1, 2, 5], [1, 2]) == [1, 2, 5]


def test_first_rejected_is_recovered_from_residual():
    g = make_generator(0)
    q = torch.stack([onehot(1), onehot(2)])
    p = torch.stack([onehot(3), onehot(2), onehot(4)])          # p gives x1 = 1 no mass
    assert verify_sampled(p, q, [1, 2], g) == [3]
    assert verify_greedy([3, 2, 4], [1, 2]) == [3]


def test_middle_rejected():
    g = make_generator(0)
    q = torch.stack([onehot(1), onehot(2), onehot(3)])
    p = torch.stack([onehot(1), onehot(4), onehot(3), onehot(0)])
    assert verify_sampled(p, q, [1, 2, 3], g) == [1, 4]
    assert verify_greedy([1, 4, 3, 0], [1, 2, 3]) == [1, 4]


def test_ngram_one_hot_draft_residual_excludes_proposal():
    g = make_generator(0)
    p = torch.stack([torch.tensor([0.5, 0.5, 0, 0, 0, 0]), onehot(0)])
    counts = {0: 0, 1: 0}
    for _ in range(2000):
        out = verify_sampled(p, None, [1], g)
        counts[out[0]] += 1
    # accepted with p(1) = 0.5; when rejected the residual is p without token 1: token 0
    assert 0.45 < counts[1] / 2000 < 0.55 and counts[0] + counts[1] == 2000
