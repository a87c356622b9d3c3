"""Sampling the next token from a batch of logits: penalties, filters, seeded draws, logprobs.

All functions take float32 logits ``[N, V]`` on the CPU, one row per sampled position, and a list of
``N`` ``SamplingRow``s. The order of operations, and so the distribution drawn from, is:

    logits -> grammar mask -> penalties -> (greedy rows: one-hot at the argmax)
           -> / temperature -> top-k -> typical -> top-p -> min-p -> softmax

The parameters, their bounds and their off values are declared in llmd.sampling_fields; each filter
here is a no-op for a row that leaves it off.

``processed_probs`` returns exactly that distribution and ``sample`` draws from it, so speculative
decoding can use ``processed_probs`` for both the target and the draft model.

Reproducibility: each random row draws from its own ``torch.Generator`` and consumes exactly one
uniform number per draw, so a seeded request gets the same tokens whatever else is in the batch.

Penalty semantics:
  * repetition_penalty (multiplicative, over prompt + output): a seen token's logit is divided by
    the penalty when positive and multiplied by it when negative;
  * presence_penalty and frequency_penalty (additive, over the output only): subtract
    ``presence * [count > 0] + frequency * count``, where count is the token's number of occurrences
    in the output (``history[num_prompt:]``).

Grammar masks: a constrained row carries ``allowed``, a bool row of the vocabulary (runtime.grammar);
its logits are ``-inf`` where it is false before anything else, in a copy. Rows without one keep
their logits bit for bit, and every later operation is per row, so a row's token depends on its own
logits, parameters and generator only, whatever mix of constrained and free rows shares the step.

Logprobs are those of the model's distribution after the mask and penalties and before temperature
and the filters (``log_softmax`` of the penalized logits), like common servers report them.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from .kernels.ops import argmax
from .request import SamplingParams

_TOP_P_HEAD = 1024   # candidates tried before a full sort for top-p


@dataclass
class SamplingRow:
    """One sampled position: its parameters, random stream and token history."""

    params: SamplingParams
    generator: Optional[torch.Generator] = None  # per request; None when greedy
    history: Optional[list[int]] = None          # prompt + output ids; needed when params.needs_penalties
    num_prompt: int = 0                          # how many of ``history`` are prompt tokens
    allowed: Optional[torch.Tensor] = None       # [V] bool: the grammar's mask; None when unconstrained


@dataclass
class SampleResult:
    token_ids: torch.Tensor                      # [N] int64
    logprobs: Optional[list[Optional[dict]]]     # per row: {"token_id", "logprob", "top": [(id, lp)]}


def make_generator(seed: Optional[int]) -> torch.Generator:
    """A CPU generator seeded with ``seed``, or with a fresh random seed when None."""
    g = torch.Generator(device="cpu")
    g.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)
    return g


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Logits with each row's grammar mask and penalties applied. Returns ``logits`` itself when no
    row has any; otherwise a new tensor (the input is never modified)."""
    penalized = [i for i, r in enumerate(rows) if r.params.needs_penalties]
    masked = [i for i, r in enumerate(rows) if r.allowed is not None]
    if not penalized and not masked:
        return logits
    out = logits.clone()
    for i in masked:
        allowed = rows[i].allowed
        if allowed.shape != out[i].shape:
            raise ValueError(f"row {i}: a mask of {tuple(allowed.shape)} for logits of {tuple(out[i].shape)}")
        out[i].masked_fill_(~allowed, float("-inf"))
    for i in penalized:
        row = rows[i]
        if row.history is None:
            raise ValueError(f"row {i} has penalties but no history")
        _penalize_row(out[i], row)
    return out


def _penalize_row(logits: torch.Tensor, row: SamplingRow) -> None:
    p = row.params
    history = torch.from_numpy(np.array(row.history, dtype=np.int64))     # faster than torch.tensor on a list
    if p.repetition_penalty != 1.0 and history.numel():
        seen = history.unique()
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    output = history[row.num_prompt:]
    if (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0) and output.numel():
        ids, counts = output.unique(return_counts=True)
        logits[ids] -= p.presence_penalty + p.frequency_penalty * counts.to(logits.dtype)


def processed_probs(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The distribution ``sample`` draws from, ``[N, V]``; greedy rows are one-hot at the argmax."""
    return _probs(apply_penalties(logits, rows), rows)


def _probs(penalized: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    greedy = [i for i, r in enumerate(rows) if r.params.greedy]
    if len(greedy) == len(rows):
        return torch.zeros_like(penalized).scatter_(1, penalized.argmax(-1, keepdim=True), 1.0)
    probs = _filtered_probs(penalized, rows)
    if greedy:
        index = torch.tensor(greedy, dtype=torch.long)
        probs[index] = 0.0
        probs[index, penalized[index].argmax(-1)] = 1.0
    return probs


def _filtered_probs(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Temperature, then top-k, typical, top-p and min-p, batched with per-row parameters. Greedy
    rows are computed at temperature 1 and discarded by the caller."""
    params = [r.params for r in rows]
    temp = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], dtype=logits.dtype)
    x = logits / temp[:, None] if bool((temp != 1.0).any()) else logits
    top_k = torch.tensor([p.top_k for p in params], dtype=torch.long)
    typical_p = torch.tensor([p.typical_p for p in params], dtype=logits.dtype)
    top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype)
    min_p = torch.tensor([p.min_p for p in params], dtype=logits.dtype)
    if bool((top_k > 0).any()):
        x = _top_k(x, top_k)
    if bool((typical_p < 1.0).any()):
        x = _typical(x, typical_p)
    if bool((top_p < 1.0).any()):
        x = _top_p(x, top_p)
    probs = torch.softmax(x, dim=-1)
    if bool((min_p > 0).any()):
        keep = probs >= min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = torch.where(keep, probs, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def _top_k(x: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep logits >= the k-th largest (ties at the boundary are all kept); k = 0 keeps all."""
    on = top_k > 0
    k = torch.where(on, top_k.clamp(max=x.shape[-1]), 1)
    kth = x.topk(int(k.max()), dim=-1).values.gather(1, (k - 1)[:, None])
    kth = torch.where(on[:, None], kth, float("-inf"))
    return x.masked_fill(x < kth, float("-inf"))


def _typical(x: torch.Tensor, typical_p: torch.Tensor) -> torch.Tensor:
    """Locally typical sampling (Meister et al., 2022): keep the tokens whose surprise ``-log p`` is
    nearest the row's entropy, most typical first (ties by token id), until their probability reaches
    typical_p (at least one). Tokens already at ``-inf`` have infinite surprise and come last."""
    logp = torch.log_softmax(x, dim=-1)
    probs = logp.exp()
    entropy = -torch.where(probs > 0, probs * logp, 0.0).sum(dim=-1, keepdim=True)   # 0 * -inf would be nan
    order = (-logp - entropy).abs().argsort(dim=-1, stable=True)
    sorted_p = probs.gather(1, order)
    mass_before = sorted_p.cumsum(dim=-1) - sorted_p
    keep = torch.zeros_like(x, dtype=torch.bool).scatter_(1, order, mass_before < typical_p[:, None])
    keep |= (typical_p >= 1.0)[:, None]
    return x.masked_fill(~keep, float("-inf"))


def _top_p(x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches top_p (at least one).

    Sorting the whole vocabulary is slow, so the most likely ``_TOP_P_HEAD`` tokens are tried first;
    the full sort runs only when they do not reach top_p in some row.
    """
    probs = torch.softmax(x, dim=-1)
    head = min(_TOP_P_HEAD, probs.shape[-1])
    sorted_p, order = probs.topk(head, dim=-1)
    mass_before = sorted_p.cumsum(dim=-1) - sorted_p
    active = top_p < 1.0
    if head < probs.shape[-1] and not bool((mass_before[active, -1] + sorted_p[active, -1] >= top_p[active]).all()):
        sorted_p, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_p.cumsum(dim=-1) - sorted_p
    keep = torch.zeros_like(x, dtype=torch.bool).scatter_(1, order, mass_before < top_p[:, None])
    keep |= ~active[:, None]
    return x.masked_fill(~keep, float("-inf"))


def sample_from_probs(probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """One token per row: the argmax for greedy rows, a draw with the row's generator otherwise.

    A draw inverts the row's CDF at one uniform number ``u`` from the row's generator: the token
    ``i`` with ``cdf[i-1] <= u * cdf[-1] < cdf[i]``, so a token of probability zero is never drawn.
    """
    random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
    tokens = argmax(probs) if len(random_rows) < len(rows) else None
    if not random_rows:
        return tokens
    u = torch.empty(len(random_rows), 1, dtype=torch.float64)
    for j, i in enumerate(random_rows):
        g = rows[i].generator
        if g is None:
            raise ValueError(f"row {i} samples at temperature {rows[i].params.temperature} but has no generator")
        u[j] = torch.rand(1, dtype=torch.float64, generator=g)
    chosen = probs if len(random_rows) == len(rows) else probs[torch.tensor(random_rows, dtype=torch.long)]
    cdf = chosen.cumsum(dim=-1, dtype=torch.float64)   # float64: tail tokens keep their probability
    drawn = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)
    if len(random_rows) == len(rows):
        return drawn
    tokens[torch.tensor(random_rows, dtype=torch.long)] = drawn
    return tokens


def sample(logits: torch.Tensor, rows: list[SamplingRow], num_logprobs: Optional[int] = None) -> SampleResult:
    """Pick one token per row, with logprobs when asked.

    ``num_logprobs``: None uses each row's ``params.logprobs`` (rows without get None, and
    ``logprobs`` is None when no row asks); an int gives every row that many top alternatives.
    """
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} rows")
    tops = [num_logprobs for _ in rows] if num_logprobs is not None else [r.params.logprobs for r in rows]
    want_logprobs = any(t is not None for t in tops)
    if not want_logprobs and all(r.params.greedy and not r.params.needs_penalties and r.allowed is None for r in rows):
        return SampleResult(argmax(logits), None)
    penalized = apply_penalties(logits, rows)
    if all(r.params.greedy for r in rows):
        tokens = argmax(penalized)
    else:
        tokens = sample_from_probs(_probs(penalized, rows), rows)
    return SampleResult(tokens, logprobs_for(penalized, tokens, tops) if want_logprobs else None)


def logprobs_for(penalized: torch.Tensor, token_ids: torch.Tensor,
                 tops: list[Optional[int]]) -> list[Optional[dict]]:
    """Per row: the chosen token's logprob and the ``tops[i]`` most likely alternatives, under
    ``log_softmax(penalized)``; None where ``tops[i]`` is None. Also used for verified tokens in
    speculative decoding."""
    logp = torch.log_softmax(penalized, dim=-1)
    chosen = logp.gather(1, token_ids[:, None]).squeeze(1).tolist()
    width = max((t for t in tops if t), default=0)
    top_lp, top_ids = logp.topk(width, dim=-1) if width else (None, None)
    top_lp = top_lp.tolist() if width else None
    top_ids = top_ids.tolist() if width else None
    out: list[Optional[dict]] = []
    for i, (tid, n) in enumerate(zip(token_ids.tolist(), tops)):
        if n is None:
            out.append(None)
            continue
        top = list(zip(top_ids[i][:n], top_lp[i][:n])) if n else []
        out.append({"token_id": tid, "logprob": chosen[i], "top": top})
    return out
