"""Verification of speculative proposals: a pure function of probabilities and one random stream.

Terms, for one request verifying k proposals x_1..x_k with target distributions p_1..p_{k+1} and
draft distributions q_1..q_k:
- accepted: x_i is kept with probability min(1, p_i(x_i) / q_i(x_i)), in order, until one is rejected;
- recovered: at the first rejection, a token drawn from norm(max(p_i - q_i, 0)) replaces x_i;
- bonus: when all k are accepted, one more token is drawn from p_{k+1}.
The output then has exactly the target's distribution (Leviathan et al. 2023, "Fast Inference from
Transformers via Speculative Decoding"; Chen et al. 2023). Greedy requests accept while x_i equals the
target's argmax. A proposer without a distribution (n-gram lookup) is a draft concentrated on x_i:
q_i = one-hot(x_i), so x_i is accepted with probability p_i(x_i) and the residual is p_i without x_i.
"""
from __future__ import annotations

from typing import Optional

import torch


def verify_greedy(target_argmax: list[int], proposals: list[int]) -> list[int]:
    """Accepted proposals followed by the target's own next token."""
    out = []
    for i, x in enumerate(proposals):
        if x != target_argmax[i]:
            break
        out.append(x)
    out.append(target_argmax[len(out)])
    return out


def verify_sampled(p: torch.Tensor, q: Optional[torch.Tensor], proposals: list[int],
                   generator: torch.Generator) -> list[int]:
    """p: [k+1, V] target probabilities; q: [k, V] draft probabilities, or None for a one-hot draft."""
    k = len(proposals)
    if k == 0:
        return [_draw(p[0], generator)]
    x = torch.tensor(proposals)
    px = p[:k].gather(1, x[:, None]).squeeze(1)
    qx = q[:k].gather(1, x[:, None]).squeeze(1) if q is not None else torch.ones(k)
    u = torch.rand(k, generator=generator)
    accept = u * qx < px                       # u < p/q without dividing by q = 0
    n = int(accept.long().cumprod(0).sum())
    if n == k:
        return proposals + [_draw(p[k], generator)]
    residual = p[n].clone()
    if q is not None:
        residual = (residual - q[n]).clamp_min_(0)
    else:
        residual[proposals[n]] = 0
    if residual.sum() <= 0:                    # p == q exactly: any draw from p is correct
        residual = p[n]
    return proposals[:n] + [_draw(residual, generator)]


def _draw(weights: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(weights / weights.sum(), 1, generator=generator))
