"""Sampling on the device, without a host sync: the distribution and the draws of llmd.runtime.sampler.

Which filters run is decided on the host from the rows' parameters (the host knows them; asking the
device would wait for it). Every per-row value, including one uniform number per random row drawn
from the request's own CPU generator exactly as the CPU sampler draws it, goes to the device in one
copy; the chosen ids come back in one copy, by the caller. Same order of operations as the CPU sampler:

    logits -> penalties -> (greedy rows: argmax) -> / temperature -> top-k -> top-p -> min-p -> softmax -> draw

It applies the knobs in DEVICE_KNOBS; ``draw`` gives a batch with a row that sets another (a knob
declared in llmd.sampling_fields and written only in the CPU sampler so far) to the CPU sampler.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from llmd.runtime.sampler import SamplingRow, sample

DEVICE_KNOBS = frozenset({"top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"})


@dataclass
class SamplingBatch:
    """The rows' parameters as device tensors, and which steps any row needs."""

    values: torch.Tensor           # [7, N] float64: temperature, top_k, top_p, min_p, u, repetition, greedy
    seen: torch.Tensor             # [2, S] (row, token) of each distinct token in a penalised history
    output: torch.Tensor           # [3, O] (row, token, count) of each distinct output token
    presence: torch.Tensor         # [2, N] presence and frequency penalties
    greedy_only: bool
    top_k: bool
    top_p: bool
    min_p: bool
    penalties: bool

    @classmethod
    def build(cls, rows: list[SamplingRow], device) -> "SamplingBatch":
        return cls.from_host(*host_values(rows), device)

    @classmethod
    def from_host(cls, flat: np.ndarray, rows: list[SamplingRow], num_seen: int, device) -> "SamplingBatch":
        """One copy of ``host_values``' array to ``device``, and views of it."""
        n = len(rows)
        dev = torch.from_numpy(flat).to(device, non_blocking=True)
        v, rest = dev[:7 * n].view(7, n), dev[9 * n:].long()
        s = 2 * num_seen
        params = [r.params for r in rows]
        return cls(v, rest[:s].view(-1, 2).t(), rest[s:].view(-1, 3).t(), dev[7 * n:9 * n].view(2, n),
                   greedy_only=all(p.greedy for p in params), top_k=any(p.top_k > 0 for p in params),
                   top_p=any(p.top_p < 1.0 for p in params), min_p=any(p.min_p > 0 for p in params),
                   penalties=any(p.needs_penalties for p in params))


def host_values(rows: list[SamplingRow]) -> tuple[np.ndarray, list[SamplingRow], int]:
    """Every per-row value in one float64 array (the layout SamplingBatch views), drawing each random
    row's uniform number from its generator; and the number of (row, token) pairs seen."""
    n = len(rows)
    vals = np.zeros((9, n))
    seen: list[tuple[int, int]] = []
    output: list[tuple[int, int, int]] = []
    for i, r in enumerate(rows):
        p = r.params
        vals[:, i] = (1.0 if p.greedy else p.temperature, p.top_k, p.top_p, p.min_p, _uniform(r),
                      p.repetition_penalty, float(p.greedy), p.presence_penalty, p.frequency_penalty)
        if p.needs_penalties:
            if r.history is None:
                raise ValueError(f"row {i} has penalties but no history")
            if p.repetition_penalty != 1.0:
                seen += [(i, t) for t in sorted(set(r.history))]
            ids, counts = np.unique(np.asarray(r.history[r.num_prompt:], dtype=np.int64), return_counts=True)
            output += [(i, int(t), int(c)) for t, c in zip(ids, counts)]
    ints = np.array([x for pair in seen for x in pair] + [x for tri in output for x in tri], dtype=np.float64)
    return np.concatenate([vals.ravel(), ints]), rows, len(seen)


def _uniform(row: SamplingRow) -> float:
    """The row's one uniform number for this draw, from its own generator (none for greedy rows)."""
    if row.params.greedy:
        return 0.0
    if row.generator is None:
        raise ValueError(f"a row samples at temperature {row.params.temperature} but has no generator")
    return float(torch.rand(1, dtype=torch.float64, generator=row.generator))


def draw(logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
    """One token id per row: drawn on the logits' device, or by the CPU sampler where a row sets a
    knob the device lacks (the same distribution and the same one uniform number per random row)."""
    if all(r.params.knobs_on <= DEVICE_KNOBS for r in rows):
        return sample_tokens(logits, SamplingBatch.build(rows, logits.device)).tolist()
    return sample(logits.float().cpu(), rows).token_ids.tolist()


def sample_tokens(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """One token id per row of float32 ``logits`` [N, V], on their device."""
    x = penalize(logits, batch) if batch.penalties else logits
    best = x.argmax(-1)
    if batch.greedy_only:
        return best
    probs = filtered_probs(x, batch)
    u = batch.values[4]
    cdf = probs.cumsum(-1, dtype=torch.float64)          # float64: tail tokens keep their probability
    drawn = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    drawn = drawn.clamp_(max=logits.shape[-1] - 1)
    return torch.where(batch.values[6] > 0, best, drawn)


def penalize(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Repetition (over prompt and output), presence and frequency (over the output) penalties."""
    out = logits.clone()
    rows, toks = batch.seen
    vals = out[rows, toks]
    rep = batch.values[5].float()[rows]
    out[rows, toks] = torch.where(vals > 0, vals / rep, vals * rep)
    rows, toks, counts = batch.output
    pres, freq = batch.presence.float()
    out.index_put_((rows, toks), -(pres[rows] + freq[rows] * counts.float()), accumulate=True)
    return out


def filtered_probs(x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p with per-row parameters (each a no-op for rows without it)."""
    v = batch.values
    x = x / v[0].float().unsqueeze(1)
    if batch.top_k or batch.top_p:
        ordered, order = x.sort(-1, descending=True)
    if batch.top_k:
        k = v[1].long()
        kth = ordered.gather(1, (k.clamp(1, x.shape[-1]) - 1).unsqueeze(1))
        kth = torch.where((k > 0).unsqueeze(1), kth, float("-inf"))
        x = x.masked_fill(x < kth, float("-inf"))
        ordered = ordered.masked_fill(ordered < kth, float("-inf"))
    if batch.top_p:
        p = torch.softmax(ordered, -1)
        before = p.cumsum(-1) - p
        keep = (before < v[2].float().unsqueeze(1)) | (v[2] >= 1.0).unsqueeze(1)
        x = x.masked_fill(~torch.zeros_like(keep).scatter_(1, order, keep), float("-inf"))
    probs = torch.softmax(x, -1)
    if batch.min_p:
        limit = v[3].float().unsqueeze(1) * probs.max(-1, keepdim=True).values
        probs = torch.where(probs >= limit, probs, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs
