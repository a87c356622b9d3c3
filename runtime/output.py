"""What a request has produced and the caller has not been sent yet, and the stop checks that decide,
token by token, where its output ends.

The scheduler's ``update`` appends each step's tokens through ``accept``: one token at a time, so a
step that verified several proposals stops at the first token that ends the request (an end-of-sequence
or stop token id, a stop string, the grammar's end, ``max_tokens``, the context window) and drops the
tokens after it.
"""
from __future__ import annotations

import time
from typing import Optional

from .detokenizer import IncrementalDetokenizer
from .request import FinishReason, Request


class RequestOutput:
    """The ids, text and logprobs gained since the caller last took them, and the detokenizer that
    turns ids into text and finds stop strings."""

    __slots__ = ("detok", "new_ids", "text", "logprobs")

    def __init__(self, detok: IncrementalDetokenizer):
        self.detok = detok
        self.new_ids: list[int] = []
        self.text = ""
        self.logprobs: list = []

    def take(self) -> tuple[list[int], str, list]:
        """What was gained since the last call, which then starts afresh."""
        out = self.new_ids, self.text, self.logprobs
        self.new_ids, self.text, self.logprobs = [], "", []
        return out


def accept(req: Request, tokens: list[tuple[int, Optional[dict]]], max_model_len: int) -> Optional[FinishReason]:
    """Append verified tokens one by one; the reason the request ends at the first that ends it, or None."""
    out = req.output
    if req.metrics.first_token_s is None:
        req.metrics.first_token_s = time.monotonic()
    for tok, lp in tokens:
        req.token_ids.append(tok)
        out.new_ids.append(tok)
        if lp is not None:
            out.logprobs.append(lp)
        reason = _stop_reason(req, tok, max_model_len)
        if reason is not None:
            return reason
    return None


def _stop_reason(req: Request, tok: int, max_model_len: int) -> Optional[FinishReason]:
    p = req.params
    if tok in req.eos_token_ids or tok in p.stop_token_ids:
        req.stop_reason = tok
        return FinishReason.STOP
    matcher = req.matcher
    if matcher is not None and not matcher.advance(tok):
        req.error = f"the output left its grammar: {matcher.error}"
        return FinishReason.ERROR
    out = req.output
    delta, hit = out.detok.add([tok])
    out.text += delta
    if hit is not None:
        req.stop_reason = hit
        return FinishReason.STOP
    if matcher is not None and matcher.stopped:
        return FinishReason.STOP
    if req.num_output_tokens >= p.max_tokens or req.num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None
