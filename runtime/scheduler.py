"""Scheduler: who runs this step and how many tokens each gets.

One rule instead of phases: each request's ``num_computed_tokens`` chases ``num_tokens`` (plus its
speculative tokens), within a per-step token budget. Running requests go first, in priority order, and
every decoding stream keeps one token of the budget (up to half of it) whatever comes before it, so a
prompt, however important, never stalls a running stream; waiting requests then take what budget is
left, a prompt possibly split into chunks across steps. A waiting request more important than some running one is
admitted first, before the running requests take the budget, preempting less important running ones
when it needs their blocks or their sequence slot. While a request computes part of its prompt, the
prompts of less important ones wait, and a batch request's prompt waits while any more important
request runs or waits, and for ``batch_quiet_s`` after (decodes go on): an interactive request's
steps are not lengthened by background prefill, which runs in the pauses between them, and a batch request's prompt chunks are cut to
``batch_prompt_chunk`` tokens, so a request arriving during a background prefill's step waits little. When the pool runs out, the least important running
request (lowest priority, latest arrival) is preempted: its blocks are freed and it is recomputed later
from its tokens, which gives the same output.

The scheduler is the only writer of the queues, of ``status`` and of ``num_computed_tokens``. Its two
calls bracket the runner's (llmd.runtime.runner): ``schedule`` makes the step's plan, ``update``
takes the runner's result: tokens appended and checked for a stop (runtime.output), blocks cached,
slots of rejected proposals trimmed, the speculation controller told what the step measured.
"""
from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from .block_manager import BlockManager
from .output import accept
from .request import FinishReason, Priority, Request, Status

if TYPE_CHECKING:
    from .runner import StepResult
    from .spec.controller import SpecController


def _decoding(r: Request) -> bool:
    """Past its prompt: one token to feed this step (its proposals aside)."""
    return r.num_tokens - r.num_computed_tokens == 1


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int            # tokens fed to the model this step, speculative ones included
    num_spec_tokens: int = 0       # of which proposals being verified

    @property
    def samples(self) -> bool:
        """Does this step reach the end of the request's tokens, so its last positions are sampled?"""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens == r.num_tokens + self.num_spec_tokens


@dataclass
class StepPlan:
    """One step's decisions, for the runner to execute: the requests it runs and their token counts,
    the block copies to make before the forward (partly cached blocks; runs shifted from other
    positions), and the requests preempted or ended since the last plan (their proposer state goes)."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    finished_out_of_memory: list[Request] = field(default_factory=list)
    copies: list[tuple[int, int, int]] = field(default_factory=list)          # (src block, dst block, slots)
    shifts: list[tuple[list[int], list[int], int]] = field(default_factory=list)   # (src slots, dst slots, delta)
    finished_ids: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_batch_tokens: int, max_num_seqs: int,
                 batch_prompt_chunk: int = 0, batch_quiet_s: float = 0.0, max_model_len: int = 1 << 62,
                 spec: Optional["SpecController"] = None):
        self.bm = block_manager
        self.max_model_len = max_model_len
        self.spec = spec                                 # plans each step's speculative depths (None: never)
        self._finished_ids: list[str] = []               # ended since the last plan
        self.max_batch_tokens = max_batch_tokens
        self.batch_prompt_chunk = batch_prompt_chunk     # most prompt tokens of a batch request per step (0: any)
        self.batch_quiet_s = batch_quiet_s               # batch prompts wait this long after more important work
        self._important_s = float("-inf")                # when a more important request last ran
        self._now = 0.0                                  # this step's clock, read once per schedule()
        self.max_num_seqs = max_num_seqs
        self.waiting: dict[Priority, deque[Request]] = {p: deque() for p in Priority}
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self.num_preemptions = 0

    # ---- queue changes -------------------------------------------------------------------
    def add(self, request: Request) -> None:
        request.arrival_seq = next(self._arrivals)
        request.status = Status.WAITING
        self.requests[request.request_id] = request
        self.waiting[request.priority].append(request)

    def finish(self, request: Request, reason: FinishReason) -> None:
        """End a request in any state and free its blocks at once."""
        if request.status is Status.FINISHED:
            return
        if request.status is Status.RUNNING:
            self.running.remove(request)
        else:
            self.waiting[request.priority].remove(request)
        self.bm.free_request(request)
        request.spec_token_ids = []
        request.status = Status.FINISHED
        request.finish_reason = reason
        request.metrics.finished_s = time.monotonic()
        del self.requests[request.request_id]
        self._finished_ids.append(request.request_id)

    @property
    def num_waiting(self) -> int:
        return sum(len(q) for q in self.waiting.values())

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- the decision --------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        if self.spec is not None:
            self._plan_speculation()
        out = self._schedule()
        out.copies = self.bm.take_copies()
        out.shifts = self.bm.take_shifts()
        out.finished_ids, self._finished_ids = self._finished_ids, []
        return out

    def _plan_speculation(self) -> None:
        """Each decoding request's proposal depth for this step (``spec_k``), from the controller."""
        decoding, other = [], 0
        for r in self.running:
            if r.params.grammar is not None:
                continue           # constrained rows never speculate: each token needs the mask after the last
            if _decoding(r):
                decoding.append(r)
            else:
                other += r.num_tokens - r.num_computed_tokens
        self.spec.plan(decoding, min(other, self.max_batch_tokens))

    def _schedule(self) -> StepPlan:
        out = StepPlan()
        budget = self.max_batch_tokens
        self._now = time.monotonic()
        if any(r.priority < Priority.BATCH for r in self.running) or \
                any(q for p, q in self.waiting.items() if p < Priority.BATCH):
            self._important_s = self._now
        self.running.sort(key=lambda r: (r.priority, r.arrival_seq))
        # Each decoding stream keeps one token of the budget (up to half of it), so that no prompt, however
        # important, stalls running streams: a prompt chunk takes what the decodes leave.
        reserve = min(sum(1 for r in self.running if _decoding(r)), budget // 2)
        if self.running:              # more important than some running request: admitted first
            budget = self._admit(out, budget - reserve, more_important_than=self.running[-1].priority) + reserve
        admitted = {id(s.request) for s in out.scheduled}
        candidates = [r for r in self.running if id(r) not in admitted]
        while candidates and budget > 0:
            req = candidates.pop(0)
            if _decoding(req) and reserve:
                reserve -= 1          # its own token comes out of the reserve
            if budget - reserve <= 0:
                continue              # a prompt chunk waits: the rest of the budget is the decodes'
            if not _decoding(req) and self._prompt_ahead(out, req.priority):
                continue              # a more important request's step stays short
            n, spec = self._wanted(req, budget - reserve)
            while not self.bm.can_append(req, req.num_computed_tokens + n):
                if spec:                  # proposal slots are optional: dropped before anyone is preempted
                    n, spec = n - spec, 0
                    continue
                victim = candidates.pop() if candidates else req
                if victim is req and not out.scheduled and not out.preempted:
                    # Alone and still out of blocks: the pool cannot hold this request any longer.
                    self.finish(req, FinishReason.LENGTH)
                    out.finished_out_of_memory.append(req)
                    break
                self._preempt(victim, out)
                if victim is req:
                    break
            if req.status is not Status.RUNNING:
                continue
            self.bm.append(req, req.num_computed_tokens + n)
            out.scheduled.append(ScheduledRequest(req, n, spec))
            budget -= n
        if not out.preempted:
            budget = self._admit(out, budget)
        return out

    def _wanted(self, req: Request, budget: int) -> tuple[int, int]:
        """Tokens to feed this step and how many of them are speculative: a decoding request asks
        for ``spec_k`` proposal slots (filled by the proposer after scheduling), cut by the budget."""
        if req.hole is not None:                 # compute up to the copied run, then past it
            return self._chunk(req, min(req.hole[0] - req.num_computed_tokens, budget)), 0
        base = req.num_tokens - req.num_computed_tokens
        if base > 1:
            return self._chunk(req, min(base, budget)), 0
        want = req.spec_k if base == 1 else 0
        n = min(base + want, budget)
        return n, max(0, n - base)

    def deferred_s(self) -> float:
        """Seconds the next step may wait: all that is left is batch prompts held back by the quiet
        window (0: step now)."""
        held = sum(1 for r in self.running if r.priority is Priority.BATCH and not _decoding(r))
        if held < len(self.running) or any(q for p, q in self.waiting.items() if p is not Priority.BATCH) or \
                not (held or self.waiting[Priority.BATCH]):
            return 0.0
        return max(0.0, self._important_s + self.batch_quiet_s - time.monotonic())

    def _chunk(self, req: Request, n: int) -> int:
        """A prompt chunk of ``n`` tokens, cut for a batch request: a step in flight is what a request
        arriving meanwhile waits for, so background prefill keeps steps short."""
        if req.priority is Priority.BATCH and self.batch_prompt_chunk and n > 1:
            return min(n, self.batch_prompt_chunk)
        return n

    def _prompt_ahead(self, out: StepPlan, priority: Priority) -> bool:
        """Would a prompt chunk of ``priority`` lengthen a more important request's step? A batch
        prompt waits while any more important request runs (or is admitted this step); another
        prompt waits while a more important one computes part of its prompt in this step."""
        if priority is Priority.BATCH:
            return self._now - self._important_s < self.batch_quiet_s or \
                any(r.priority < priority for r in self.running) or \
                any(s.request.priority < priority for s in out.scheduled)
        return any(s.request.priority < priority and not _decoding(s.request) for s in out.scheduled)

    def _admit(self, out: StepPlan, budget: int, more_important_than: Priority | None = None) -> int:
        for priority in Priority:
            if more_important_than is not None and priority >= more_important_than:
                return budget
            if self._prompt_ahead(out, priority):
                return budget
            queue = self.waiting[priority]
            while queue and budget > 0:
                if len(self.running) >= self.max_num_seqs:
                    victim = self._lowest_running_below(priority, out)
                    if victim is None:
                        return budget
                    self._preempt(victim, out)
                    continue
                req = queue[0]
                if self.bm.blocks_needed(req.num_tokens + 1) > self.bm.num_blocks:
                    # Even an empty pool could not hold it: end it rather than wait forever.
                    self.finish(req, FinishReason.LENGTH)
                    out.finished_out_of_memory.append(req)
                    continue
                hit = self.bm.lookup_prefix(req)
                shift = hit.shift
                start = shift.end if shift is not None and shift.start <= hit.num_tokens else hit.num_tokens
                stop = shift.start if shift is not None and start < shift.start else req.num_tokens
                n = self._chunk(req, min(stop - start, budget))
                slots = max(start + n, shift.end if shift is not None else 0)
                if not self.bm.can_allocate(hit, slots):
                    victim = self._lowest_running_below(priority, out)
                    if victim is None:
                        return budget
                    self._preempt(victim, out)
                    continue
                queue.popleft()
                first = req.metrics.first_scheduled_s is None
                self.bm.allocate(req, hit, slots, count_hit=first)
                shifted = shift.length if shift is not None else 0
                if first:
                    req.metrics.first_scheduled_s = time.monotonic()
                    req.metrics.cached_tokens = hit.num_tokens + shifted
                    req.metrics.shifted_tokens = shifted
                req.num_computed_tokens = start
                req.num_cached_tokens = hit.num_tokens + shifted
                req.hole = (shift.start, shift.end) if shift is not None and start < shift.start else None
                req.status = Status.RUNNING
                self.running.append(req)
                out.scheduled.append(ScheduledRequest(req, n, 0))
                budget -= n
        return budget

    def _lowest_running_below(self, priority: Priority, out: StepPlan) -> Request | None:
        """A running request less important than `priority` and not scheduled this step."""
        scheduled = {id(s.request) for s in out.scheduled}
        pool = [r for r in self.running if r.priority > priority and id(r) not in scheduled]
        return max(pool, key=lambda r: (r.priority, r.arrival_seq), default=None)

    def _preempt(self, req: Request, out: StepPlan) -> None:
        self.running.remove(req)
        self.bm.free_request(req)
        req.num_computed_tokens = 0
        req.hole = None
        req.spec_token_ids = []
        req.status = Status.WAITING
        req.metrics.preemptions += 1
        self.num_preemptions += 1
        self.waiting[req.priority].appendleft(req)
        out.preempted.append(req)

    # ---- after the model ran -------------------------------------------------------------
    def update(self, plan: StepPlan, result: "StepResult") -> list[Request]:
        """Take the runner's result of ``plan``: each scheduled request's tokens counted as computed
        (less rejected proposals) and appended up to its first stop, its full blocks cached, its
        unused proposal slots trimmed. Returns the requests with news for their callers (tokens, or
        their end)."""
        self.bm.release_held()             # the shifted runs are copied: their source blocks may go
        if result.error is not None:
            for s in plan.scheduled:
                s.request.error = result.error
                self.finish(s.request, FinishReason.ERROR)
            return [s.request for s in plan.scheduled]
        touched = []
        for s, tokens, verified in zip(plan.scheduled, result.tokens, result.verified):
            req = s.request
            self._advance(s, s.num_spec_tokens - verified.accepted if verified is not None else 0)
            if verified is not None:
                self._observe_verified(req, verified)
            if req.params.prompt_only:
                if tokens:        # the whole prompt is in the cache: nothing is generated
                    self.finish(req, FinishReason.LENGTH)
                    touched.append(req)
            elif tokens:
                reason = accept(req, tokens, self.max_model_len)
                if reason is not None:
                    self.finish(req, reason)
                touched.append(req)
            if not req.is_finished:
                # slots reserved for proposals that were rejected or never made go back to the pool
                self.bm.trim(req, req.num_tokens)
        if self.spec is not None and plan.scheduled:
            self._observe(plan, result)
        return touched

    def _advance(self, sched: ScheduledRequest, num_rejected: int) -> None:
        """Count the step's tokens as computed, less the rejected speculative ones, and key the
        full blocks of verified tokens for the prefix cache."""
        req = sched.request
        req.num_computed_tokens += sched.num_new_tokens - num_rejected
        if req.hole is not None and req.num_computed_tokens == req.hole[0]:
            req.num_computed_tokens, req.hole = req.hole[1], None     # the copied run counts as computed
        self.bm.cache_full_blocks(req, min(req.num_computed_tokens, req.num_tokens))

    def _observe_verified(self, req: Request, verified) -> None:
        req.spec_token_ids = []
        m = req.metrics
        m.spec_proposed += verified.proposed
        m.spec_accepted += verified.accepted
        m.spec_steps += 1
        if self.spec is not None and not verified.guess:
            self.spec.observe_acceptance(req.request_id, verified.proposed, verified.accepted)

    def _observe(self, plan: StepPlan, result: "StepResult") -> None:
        """What the step measured, for the controller's next plans."""
        spec = self.spec
        if result.proposals_asked:
            spec.observe_proposals(result.proposals_asked, result.proposals_made)
            if result.draft_forward_s is not None and not spec.proposer_is_free:
                spec.observe_draft(result.proposals_asked, result.draft_forward_s)
        spec.observe_target(plan.num_tokens, result.verify_s)
