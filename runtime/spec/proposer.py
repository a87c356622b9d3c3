"""The proposer interface: something that guesses a request's next tokens for the target to verify."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..request import Request


@dataclass
class Proposal:
    token_ids: list[int]
    probs: Optional[torch.Tensor] = None    # [k, V] draft distributions; None = concentrated on token_ids
    seconds: float = 0.0
    # a short guess (n-gram: the last token alone matched) that the proposer capped itself; its
    # outcome stays out of the acceptance estimate the controller plans depths with
    guess: bool = False


class Proposer:
    """Subclasses fill ``propose``; the engine calls the hooks so proposer state follows requests."""

    name = "none"
    has_distribution = False
    forward_s: Optional[float] = None     # one single-token forward of a proposer that runs a model

    def propose(self, items: list[tuple[Request, int]], rows_for) -> list[Proposal]:
        """Up to k proposals for each (request, k). ``rows_for(request, proposals_so_far)`` gives the
        SamplingRow a draft distribution must be processed with (same parameters as the target)."""
        raise NotImplementedError

    def on_verified(self, request: Request, num_proposed: int, num_accepted: int, old_num_tokens: int) -> None:
        pass

    def reset(self, request: Request) -> None:
        """The request lost its KV (preempted): start over."""

    def forget(self, request_id: str) -> None:
        pass
