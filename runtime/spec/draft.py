"""A draft model proposer with its own paged KV pool, indexed by the target's block ids.

One allocation decision covers both pools: the draft writes position i of a request into the same slot
as the target. ``computed[request]`` counts the positions whose draft KV is valid; a proposal round first
feeds the tokens the draft has not seen (the whole prompt the first time, then usually one or two
verified tokens), then generates k tokens one forward at a time. Rejected positions are simply
overwritten later.

    positions:  0 .. n-1 verified (n = num_tokens)   n .. n+k-2 proposals fed back   n+k-1 last proposal (not fed)
"""
from __future__ import annotations

import time

import torch

from ..model_runner import Feed, ModelRunner
from ..request import Request
from ..sampler import processed_probs, sample_from_probs
from .proposer import Proposal, Proposer


class DraftProposer(Proposer):
    name = "draft"
    has_distribution = True

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.computed: dict[str, int] = {}

    def propose(self, items: list[tuple[Request, int]], rows_for) -> list[Proposal]:
        t0 = time.perf_counter()
        tokens: list[list[int]] = [[] for _ in items]
        probs: list[list[torch.Tensor]] = [[] for _ in items]
        feeds = []
        for req, _ in items:
            done = self.computed.get(req.request_id, 0)
            feeds.append(Feed(req.token_ids[done:], done, req.block_ids, 1))
        active = list(range(len(items)))
        step = 0
        decode_times = []
        fused = True          # greedy rounds: their forwards in one call while it serves them
        greedy = all(req.params.greedy for req, _ in items)
        while active:
            if greedy and fused:
                done = self._fused_steps(items, active, tokens, feeds, step, decode_times)
                if done:
                    step += done
                    active = [i for i in active if step < items[i][1]]
                    continue       # the requests that want more go on in another call
                fused = step == 0  # a catch-up too long for one call (a prompt): the loop's forward, then calls
            t_fwd = time.perf_counter()
            logits = self.runner.run(self.runner.prepare_feeds([feeds[i] for i in active]))
            if step:
                decode_times.append(time.perf_counter() - t_fwd)
            rows = [rows_for(items[i][0], tokens[i]) for i in active]
            greedy = all(r.params.greedy for r in rows)
            if greedy:
                picks = self.runner.execution.greedy(logits).tolist()
            else:
                logits = logits.cpu()          # a GPU runner's logits: the distribution is computed on the host
                q = processed_probs(logits, rows)
                picks = sample_from_probs(q, rows).tolist()
            for j, i in enumerate(active):
                tokens[i].append(picks[j])
                if not greedy:
                    probs[i].append(q[j])
            step += 1
            nxt = []
            for i in active:
                req, k = items[i]
                if step < k:
                    nxt.append(i)
                    feeds[i] = Feed([tokens[i][-1]], req.num_tokens + step - 1, req.block_ids, 1)
            active = nxt
        for req, _ in items:
            self.computed[req.request_id] = req.num_tokens
        # cost of one single-token draft forward (the catch-up forward over new prompt text is not one)
        self.forward_s = min(decode_times) if decode_times else None
        seconds = (time.perf_counter() - t0) / max(1, len(items))
        return [Proposal(tokens[i], torch.stack(probs[i]) if probs[i] else None, seconds) for i in range(len(items))]

    def _fused_steps(self, items, active, tokens, feeds, step, decode_times) -> int:
        """As many greedy forwards as every active request still wants, in one call where the backend
        has one (``greedy_rounds``: FusedDecode.draft_greedy on cpu), from each request's next feed (at
        step 0 its catch-up on the tokens the draft has not seen): the same tokens and KV as the loop's
        forwards. Returns the forwards it made (0: none, the loop goes on); ``feeds`` are set for the
        step after them."""
        # the catch-up forward alone first: like the loop, the controller weighs draft forwards by the
        # later, single-token ones (the catch-up also reloads the draft's weights into cache)
        want = 1 if step == 0 else min(items[i][1] - step for i in active)
        t0 = time.perf_counter()
        got = self.runner.execution.greedy_rounds(self.runner, [feeds[i].token_ids for i in active],
                                                  [feeds[i].start for i in active],
                                                  [items[i][0].block_ids for i in active], want)
        if not got or not got[0]:
            return 0
        if step:
            decode_times.append((time.perf_counter() - t0) / len(got[0]))
        for i, more in zip(active, got):
            tokens[i].extend(more)
            req = items[i][0]
            feeds[i] = Feed([tokens[i][-1]], req.num_tokens + step + len(more) - 1, req.block_ids, 1)
        return len(got[0])

    def on_verified(self, request: Request, num_proposed: int, num_accepted: int, old_num_tokens: int) -> None:
        # Proposals 1..k-1 were fed to the draft; those accepted keep valid KV.
        self.computed[request.request_id] = old_num_tokens + min(num_accepted, max(0, num_proposed - 1))

    def reset(self, request: Request) -> None:
        self.computed.pop(request.request_id, None)

    def forget(self, request_id: str) -> None:
        self.computed.pop(request_id, None)
