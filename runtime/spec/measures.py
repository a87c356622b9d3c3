"""What the speculation controller measures: forward costs by rows and whole-step times by depth
(medians of the last few: the odd slow sample does not move them), and the acceptance (ageing by
the step, so that it follows the text)."""
from __future__ import annotations

import collections
import math
import statistics


def bucket(n: int) -> int:
    """The power-of-two bucket of a count (1, 2-3, 4-7, ...)."""
    return max(1, n).bit_length()


class CostTable:
    """Seconds per forward, by the power-of-two bucket of its row count: the median of the last few
    samples, trusted after MIN_SAMPLES (a first call at a new shape is often slow)."""

    MIN_SAMPLES = 3
    KEEP = 9

    def __init__(self):
        self.samples: dict[int, collections.deque] = {}
        self.medians: dict[int, float] = {}     # per bucket, until its next sample (planning asks often)
        self.answers: dict[tuple, float | None] = {}    # estimate and floor, until the next sample

    def observe(self, rows: int, seconds: float) -> None:
        b = bucket(rows)
        self.samples.setdefault(b, collections.deque(maxlen=self.KEEP)).append(seconds)
        self.medians.pop(b, None)
        self.answers.clear()

    def _median(self, b: int) -> float | None:
        got = self.samples.get(b)
        if not got or len(got) < self.MIN_SAMPLES:
            return None
        if (m := self.medians.get(b)) is None:
            m = self.medians[b] = statistics.median(got)
        return m

    def estimate(self, rows: int) -> float | None:
        """The bucket's median, capped by any larger bucket's: more rows never cost less, and a
        rarely used bucket (one-row steps while speculating, which are mostly the first decode
        after a prompt) can hold unrepresentative samples."""
        b = bucket(rows)
        if ("estimate", b) in self.answers:
            return self.answers[("estimate", b)]
        own = self._median(b)
        if own is not None:
            own = min([own, *(m for k in self.samples if k > b and (m := self._median(k)) is not None)])
        self.answers[("estimate", b)] = own
        return own

    def floor(self, rows: int) -> float:
        """A lower bound on a forward over ``rows``: the dearest bucket measured at or below it (0 if none)."""
        b = bucket(rows)
        if (got := self.answers.get(("floor", b))) is None:
            got = self.answers[("floor", b)] = max(
                [m for k in self.samples if k <= b and (m := self.estimate(1 << (k - 1))) is not None], default=0.0)
        return got

    def snapshot(self) -> dict:
        return {f"<{2 ** b}": statistics.median(v) for b, v in sorted(self.samples.items())}


class Acceptance:
    """Per-token acceptance from verified proposals: each accepted proposal a success, a rejection a
    failure (the proposals after it were never tested), beside a prior worth ``weight`` proposals.
    Counts age by the step, not by the observation, so evidence from before a pause counts little
    (the ageing is applied when the counts are next read or added to: a step costs a counter)."""

    def __init__(self, prior: float, weight: float, decay: float):
        self.accepted = self.rejected = 0.0
        self.prior, self.weight, self.decay = prior, weight, decay
        self.pending = 0

    def age(self) -> None:
        self.pending += 1

    def _aged(self) -> None:
        if self.pending:
            f = self.decay ** self.pending
            self.accepted *= f
            self.rejected *= f
            self.pending = 0

    def observe(self, proposed: int, accepted: int) -> None:
        self._aged()
        self.accepted += accepted
        self.rejected += 1 if accepted < proposed else 0

    def rate(self) -> float:
        self._aged()
        return (self.accepted + self.prior * self.weight) / (self.accepted + self.rejected + self.weight)

    def bound(self, side: int) -> float:
        """Two standard errors above (side 1) or below (side -1) the estimate: how good or how poor
        it could still be."""
        a, n = self.rate(), self.accepted + self.rejected + self.weight
        return min(0.999, max(0.0, a + side * 2 * math.sqrt(a * (1 - a) / n)))


class DepthTimes:
    """Wall seconds of whole decode steps at one batch size, by depth: the median of the last KEEP,
    trusted after MIN_SAMPLES (worked out when next asked: a sample comes every step, a question
    every few)."""

    MIN_SAMPLES = 3
    KEEP = 7

    def __init__(self):
        self.samples: dict[int, collections.deque] = {}
        self.medians: dict[int, float] = {}       # the trusted ones
        self.stale: set = set()                   # depths sampled since their median was worked out
        self.clock = 0                            # samples taken, all depths
        self.last: dict[int, int] = {}            # the clock at each depth's latest sample

    def observe(self, k: int, seconds: float) -> None:
        got = self.samples.setdefault(k, collections.deque(maxlen=self.KEEP))
        got.append(seconds)
        self.clock += 1
        self.last[k] = self.clock
        if len(got) >= self.MIN_SAMPLES:
            self.stale.add(k)

    def oldest(self, depths) -> int:
        """Of ``depths`` (sampled ones), the one sampled longest ago."""
        return min(depths, key=lambda k: self.last.get(k, 0))

    def count(self, k: int) -> int:
        return len(self.samples.get(k, ()))

    def forget(self, k: int) -> None:
        """Drop depth k's samples: it is measured anew."""
        self.samples.pop(k, None)
        self.medians.pop(k, None)
        self.stale.discard(k)

    def measured(self) -> dict[int, float]:
        while self.stale:
            k = self.stale.pop()
            self.medians[k] = statistics.median(self.samples[k])
        return self.medians
