"""A runner: one model's KV pools and the execution of a step plan, on one device.

The engine's step is three calls:

    plan = scheduler.schedule()        who runs, how many tokens each, which blocks to copy (StepPlan)
    result = runner.execute(plan)      block copies, proposals, the forward, sampling and verification
    scheduler.update(plan, result)     tokens appended, stop checks, blocks cached or trimmed

``Runner.execute`` is the same on every device: it asks the proposer for the step's proposals (a
draft model's forwards, or n-gram lookups), prepares the packed inputs, runs the forward, and turns the
sampled rows into tokens: through the head's screen where every row is plain greedy and the model
has one, else from the logits (argmax, the samplers, or the verification of proposals). A subclass
supplies the primitives below (``prepare``, ``run``, ``run_greedy``, ``sample``, the block copies,
``block_views``) and declares what it can do through capability flags, never through missing members.
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Optional

import torch

from .request import Request, SamplingParams
from .sampler import SamplingRow, apply_penalties, logprobs_for, processed_probs, sample
from .scheduler import ScheduledRequest, StepPlan
from .spec.proposer import Proposal, Proposer
from .spec.rejection import verify_greedy, verify_sampled

Token = tuple[int, Optional[dict]]        # a token id and its logprobs (None unless asked for)


@dataclass
class Verified:
    """One scheduled request's verification: proposals made, how many were accepted, and whether
    the proposal was a guess the speculation controller leaves out of its acceptance estimate."""

    proposed: int
    accepted: int
    guess: bool = False


@dataclass
class StepResult:
    """What a step produced, per scheduled request of its plan (same order)."""

    tokens: list[list[Token]]
    verified: list[Optional[Verified]] = field(default_factory=list)
    error: Optional[str] = None            # the forward failed: every scheduled request fails with this
    draft_s: float = 0.0                   # proposing (a draft model's forwards)
    verify_s: float = 0.0                  # the target's forward
    proposals_asked: int = 0               # requests asked for proposals, and how many got some
    proposals_made: int = 0
    draft_forward_s: Optional[float] = None   # one single-token draft forward, where the proposer ran one

    @classmethod
    def empty(cls, plan: StepPlan) -> "StepResult":
        return cls([[] for _ in plan.scheduled], [None] * len(plan.scheduled))

    @classmethod
    def failed(cls, plan: StepPlan, message: str) -> "StepResult":
        result = cls.empty(plan)
        result.error = message
        return result


def plain_greedy(params: SamplingParams) -> bool:
    """A row whose token is its logits' argmax: greedy, without penalties, logprobs or a grammar."""
    return params.greedy and not params.needs_penalties and params.logprobs is None and params.grammar is None


def sampling_row(req: Request, extra: list[int]) -> SamplingRow:
    """The row a request's next position is sampled with, ``extra`` tokens past its verified ones."""
    history = req.token_ids + extra if req.params.needs_penalties else None
    allowed = req.matcher.allowed() if req.matcher is not None else None
    return SamplingRow(req.params, req.generator, history, req.num_prompt_tokens, allowed)


class Runner(ABC):
    """One model's pools and steps. Subclasses set every name in execution.contract.RUNNER_ATTRIBUTES."""

    # how steps are replayed: None where a runner captures nothing (the CPU's), else the CUDA runner's
    # "captured", "standin" (the CPU stand-in), "off", or "failed: <error>" (steps run eagerly)
    step_graphs: Optional[str] = None
    proposer: Optional[Proposer] = None    # set by the engine where the step speculates

    # ---- the primitives a device supplies ----------------------------------------------------
    @abstractmethod
    def prepare(self, scheduled: list) -> object:
        """The step's inputs for the scheduler's requests (a batch ``run`` takes, with ``sample_counts``)."""

    @abstractmethod
    def prepare_feeds(self, feeds: list) -> object:
        """The step's inputs from model_runner.Feed items (the draft's own forwards)."""

    @abstractmethod
    def run(self, batch) -> torch.Tensor:
        """Float32 logits of the batch's sampled rows [rows, vocab] (on ``device``)."""

    @abstractmethod
    def run_greedy(self, batch) -> list[int]:
        """Each sampled row's greedy token, where every sampled row of the batch is greedy."""

    @abstractmethod
    def sample(self, logits: torch.Tensor, rows: list) -> list[int]:
        """One token per row of ``logits``, drawn with each sampler.SamplingRow's parameters."""

    @abstractmethod
    def copy_slots(self, src: int, dst: int, n: int) -> None:
        """Copy the first ``n`` slots of block ``src`` into block ``dst`` (partial-block prefix reuse)."""

    @abstractmethod
    def copy_shifted(self, src: list[int], dst: list[int], delta: int) -> None:
        """Copy slots ``src`` to ``dst`` with each key rotated by ``delta`` positions (``can_shift``)."""

    @abstractmethod
    def block_views(self, block_id: int) -> list[torch.Tensor]:
        """One block's keys and values in every layer, as views of the pools (the disk tier's unit)."""

    def stats(self) -> dict:
        """The runner's own counters for the engine's stats: its pools, and what its device adds."""
        return {"kv_bytes_total": self.k_pool.numel() * self.k_pool.element_size() * 2,
                "kv_pool_dtype": str(self.k_pool.dtype).removeprefix("torch.")}

    # ---- the step ------------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step of ``plan``: its block copies first, then, where it schedules requests, their
        proposals, the forward, and each request's tokens (sampled, or verified against proposals)."""
        for src, dst, n in plan.copies:           # partly cached blocks, before any write
            self.copy_slots(src, dst, n)
        for src, dst, delta in plan.shifts:       # runs taken at other positions
            self.copy_shifted(src, dst, delta)
        if self.proposer is not None:
            for request_id in plan.finished_ids:
                self.proposer.forget(request_id)
            for req in plan.preempted:
                self.proposer.reset(req)
        result = StepResult.empty(plan)
        if plan.empty:
            return result
        scheduled = plan.scheduled
        proposals = self._propose(scheduled, result)
        t0 = time.perf_counter()
        batch = self.prepare(scheduled)
        if self.screens_head and all(plain_greedy(s.request.params) for s in scheduled):
            picks = self.run_greedy(batch)        # the head's screen: the tokens, not the logits
            result.verify_s = time.perf_counter() - t0
            result.tokens = self._greedy(scheduled, batch.sample_counts, picks)
        else:
            logits = self.run(batch)
            result.verify_s = time.perf_counter() - t0
            result.tokens = self._sample(scheduled, batch.sample_counts, logits, proposals)
        for i, (s, tokens) in enumerate(zip(scheduled, result.tokens)):
            if s.num_spec_tokens:
                prop = proposals.get(id(s))
                result.verified[i] = Verified(s.num_spec_tokens, len(tokens) - 1, prop is not None and prop.guess)
                self.proposer.on_verified(s.request, s.num_spec_tokens, len(tokens) - 1, s.request.num_tokens)
        return result

    def _propose(self, scheduled: list[ScheduledRequest], result: StepResult) -> dict[int, Proposal]:
        """Fill the proposal slots the plan reserved; a request given fewer proposals than slots
        feeds fewer tokens."""
        items = [s for s in scheduled if s.num_spec_tokens]
        if not items:
            return {}
        t0 = time.perf_counter()
        props = self.proposer.propose([(s.request, s.num_spec_tokens) for s in items], sampling_row)
        result.draft_s = time.perf_counter() - t0
        out = {}
        for s, prop in zip(items, props):
            got = prop.token_ids[:s.num_spec_tokens]
            missing = s.num_spec_tokens - len(got)
            s.num_spec_tokens -= missing
            s.num_new_tokens -= missing
            s.request.spec_token_ids = got
            out[id(s)] = prop
        result.proposals_asked = len(items)
        result.proposals_made = sum(1 for s in items if s.num_spec_tokens)
        result.draft_forward_s = self.proposer.forward_s
        return out

    def _greedy(self, scheduled: list[ScheduledRequest], counts: list[int], picks: list[int]) -> list[list[Token]]:
        """Per scheduled request, its tokens from the argmax of each of its sampled rows."""
        out, offset = [], 0
        for s, k in zip(scheduled, counts):
            row = picks[offset:offset + k]
            tokens = verify_greedy(row, s.request.spec_token_ids) if s.num_spec_tokens else row
            out.append([(t, None) for t in tokens])
            offset += k
        return out

    def _sample(self, scheduled: list[ScheduledRequest], counts: list[int], logits: torch.Tensor,
                proposals: dict[int, Proposal]) -> list[list[Token]]:
        """Per scheduled request, the tokens it gains this step from its sampled rows' logits."""
        on_device = self.samples_on_device
        if on_device and any(s.request.params.logprobs is not None or s.num_spec_tokens
                             or s.request.params.grammar is not None for s in scheduled):
            if all(plain_greedy(s.request.params) for s in scheduled):
                return self._greedy(scheduled, counts, self.execution.greedy(logits).tolist())
            logits, on_device = logits.cpu(), False   # sampled verification and logprobs read them on the host
        out: list[list[Token]] = [[] for _ in scheduled]
        plain_rows, plain_idx, plain_at = [], [], []
        offset = 0
        for i, (s, k) in enumerate(zip(scheduled, counts)):
            if k == 1 and not s.num_spec_tokens:
                plain_rows.append(sampling_row(s.request, []))
                plain_idx.append(i)
                plain_at.append(offset)
            elif k:
                out[i] = self._verify(s, logits[offset:offset + k], proposals.get(id(s)))
            offset += k
        if plain_rows:
            rows_logits = logits if len(plain_at) == logits.shape[0] else logits[torch.tensor(plain_at)]
            if on_device:                         # drawn on the device, the ids back in one copy
                for i, tok in zip(plain_idx, self.sample(rows_logits, plain_rows)):
                    out[i] = [(tok, None)]
                return out
            drawn = sample(rows_logits, plain_rows)
            for j, (i, tok) in enumerate(zip(plain_idx, drawn.token_ids.tolist())):
                out[i] = [(tok, drawn.logprobs[j] if drawn.logprobs else None)]
        return out

    def _verify(self, s: ScheduledRequest, logits: torch.Tensor, prop: Optional[Proposal]) -> list[Token]:
        """The tokens a request's proposals and its target rows give: greedy, or by rejection sampling."""
        req = s.request
        x = req.spec_token_ids
        rows = [sampling_row(req, x[:j]) for j in range(len(x) + 1)]
        p = req.params
        if p.greedy and not p.needs_penalties:
            tokens = verify_greedy(self.execution.greedy(logits).tolist(), x)
        else:
            probs = processed_probs(logits, rows)
            if p.greedy:
                tokens = verify_greedy(self.execution.greedy(probs).tolist(), x)
            else:
                q = prop.probs if prop is not None else None
                tokens = verify_sampled(probs, q, x, req.generator)
        if p.logprobs is None:
            return [(t, None) for t in tokens]
        n = len(tokens)
        lps = logprobs_for(apply_penalties(logits[:n], rows[:n]), torch.tensor(tokens), [p.logprobs] * n)
        return list(zip(tokens, lps))
