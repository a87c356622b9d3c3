"""EngineStats: counters and recent latency distributions for `stats()` (written by the engine only)."""
from __future__ import annotations

import collections
import time

WINDOW = 1024


def percentiles(values, qs=(50, 95, 99)) -> dict:
    if not values:
        return {f"p{q}": None for q in qs}
    s = sorted(values)
    return {f"p{q}": s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))] for q in qs}


class EngineStats:
    def __init__(self):
        self.started = time.monotonic()
        self.steps = 0
        self.step_tokens = 0
        self.step_time_s = 0.0
        self.finished = collections.Counter()
        self.output_tokens = 0
        self.prompt_tokens = 0
        self.spec_proposed = 0
        self.spec_accepted = 0
        self.spec_steps = 0
        self.spec_draft_s = 0.0
        self.spec_verify_s = 0.0
        self.ttft = collections.deque(maxlen=WINDOW)
        self.itl = collections.deque(maxlen=WINDOW)
        self.e2e = collections.deque(maxlen=WINDOW)
        self.queued = collections.deque(maxlen=WINDOW)

    def record_step(self, num_tokens: int, num_seqs: int, seconds: float) -> None:
        self.steps += 1
        self.step_tokens += num_tokens
        self.step_time_s += seconds

    def record_spec(self, proposed: int, accepted: int, draft_s: float, verify_s: float) -> None:
        self.spec_proposed += proposed
        self.spec_accepted += accepted
        self.spec_steps += 1 if proposed else 0
        self.spec_draft_s += draft_s
        self.spec_verify_s += verify_s

    def record_finished(self, req, m: dict) -> None:
        self.finished[m.get("finish_reason") or req.finish_reason.value] += 1
        self.output_tokens += m["output_tokens"]
        self.prompt_tokens += m["prompt_tokens"]
        if m["ttft_s"] is not None:
            self.ttft.append(m["ttft_s"])
        if m["queued_s"] is not None:
            self.queued.append(m["queued_s"])
        if m["decode_s"] and m["output_tokens"] > 1:
            self.itl.append(m["decode_s"] / (m["output_tokens"] - 1))
        self.e2e.append(m["e2e_s"])

    def snapshot(self) -> dict:
        return {
            "uptime_s": time.monotonic() - self.started,
            "steps": self.steps,
            "step_tokens": self.step_tokens,
            "mean_step_ms": 1000 * self.step_time_s / self.steps if self.steps else None,
            "requests_finished": dict(self.finished),
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "spec_proposed": self.spec_proposed,
            "spec_accepted": self.spec_accepted,
            "spec_acceptance_rate": self.spec_accepted / self.spec_proposed if self.spec_proposed else None,
            "spec_mean_accepted_len": self.spec_accepted / self.spec_steps if self.spec_steps else None,
            "spec_draft_s": self.spec_draft_s,
            "spec_verify_s": self.spec_verify_s,
            "latency_ttft_s": percentiles(self.ttft),
            "latency_itl_s": percentiles(self.itl),
            "latency_e2e_s": percentiles(self.e2e),
            "latency_queued_s": percentiles(self.queued),
        }
