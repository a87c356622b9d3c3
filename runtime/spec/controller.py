"""Adaptive speculation depth: how many tokens each request proposes this step, if any.

With acceptance rate a and k proposals, a step yields E(a, k) = (1 - a^(k+1)) / (1 - a) tokens on
average. It costs k draft forwards plus one target forward over (1 + k) tokens per speculating request.
Both costs are measured at run time (moving averages bucketed by rows), so the same rule switches
speculation off where verification is compute-bound (large batches) and on where it is memory-bound.
Each request's own acceptance (a moving average, starting from a prior) sets its own depth.
The model is then held to what whole decode steps measured (StepRates): where speculating steps
produced tokens more slowly than plain ones at this batch size, speculation stays off, and now and
then a step takes the other side so that both figures stay current.
"""
from __future__ import annotations

import collections
import statistics

from ..request import Request

PRIOR_ALPHA = 0.6
EMA = 0.2
MARGIN = 1.05          # speculate only when predicted at least 5% better than plain decoding
PROBE_EVERY = 64       # with speculation off this many steps, probe once to refresh the acceptance
PROBE_MAX = 1024       # ... doubling after each probe that leaves it off, up to this many
CHECK_EVERY = 16       # decode steps of a batch size between steps that take the measured-worse side
LEARN_EVERY = 4        # ... while one side is not yet measured there
CHECK_MAX = 1024       # ... and at most this many while speculating keeps measuring slower
SLOWER = 1.02          # speculating steps this much slower per token than plain ones: speculation off


def expected_tokens(alpha: float, k: int) -> float:
    if k == 0:
        return 1.0
    if alpha >= 0.999:
        return k + 1.0
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def _bucket(n: int) -> int:
    return max(1, n).bit_length()


class CostTable:
    """Seconds per forward, by the power-of-two bucket of its row count: the median of the last few
    samples, trusted after MIN_SAMPLES (a first call at a new shape is often slow). A bucket not
    measured in the last ``max_age`` observations counts as unknown, so choices are re-checked."""

    MIN_SAMPLES = 3
    KEEP = 9

    def __init__(self, max_age: int = 512):
        self.samples: dict[int, collections.deque] = {}
        self.seen: dict[int, int] = {}
        self.medians: dict[int, float] = {}     # per bucket, until its next sample (planning asks often)
        self.clock = 0
        self.max_age = max_age

    def observe(self, rows: int, seconds: float) -> None:
        self.clock += 1
        b = _bucket(rows)
        self.samples.setdefault(b, collections.deque(maxlen=self.KEEP)).append(seconds)
        self.seen[b] = self.clock
        self.medians.pop(b, None)

    def _median(self, b: int) -> float | None:
        got = self.samples.get(b)
        if not got or len(got) < self.MIN_SAMPLES or self.clock - self.seen[b] > self.max_age:
            return None
        if (m := self.medians.get(b)) is None:
            m = self.medians[b] = statistics.median(got)
        return m

    def estimate(self, rows: int) -> float | None:
        """The bucket's median, capped by any larger bucket's: more rows never cost less, and a
        rarely used bucket (one-row steps while speculating, which are mostly the first decode
        after a prompt) can hold unrepresentative samples."""
        b = _bucket(rows)
        own = self._median(b)
        if own is None:
            return None
        larger = [m for k in self.samples if k > b and (m := self._median(k)) is not None]
        return min([own, *larger])

    def snapshot(self) -> dict:
        return {f"<{2 ** b}": statistics.median(v) for b, v in sorted(self.samples.items())}


class StepRates:
    """Seconds per generated token of whole decode steps (no prompt rows), by the power-of-two bucket
    of the batch size, for steps that speculated and steps that did not: what the cost model
    predicts, measured after the fact, Python around the forward included. Each side is the sum of
    seconds over the sum of tokens of its last WINDOW steps (a step's own ratio swings 5x with how
    many proposals it accepted, so a median of ratios flickered)."""

    WINDOW, MIN_STEPS = 32, 4

    def __init__(self):
        self.steps: dict[tuple[int, bool], collections.deque] = {}

    def observe(self, batch: int, tokens: int, seconds: float, speculated: bool) -> None:
        key = (_bucket(batch), speculated)
        self.steps.setdefault(key, collections.deque(maxlen=self.WINDOW)).append((tokens, seconds))

    def per_token(self, batch: int, speculated: bool) -> float | None:
        got = self.steps.get((_bucket(batch), speculated))
        if not got or len(got) < self.MIN_STEPS:
            return None
        tokens = sum(t for t, _ in got)
        return sum(s for _, s in got) / tokens if tokens else None

    def speculation_pays(self, batch: int) -> bool | None:
        """None until both sides are measured at this batch size."""
        on, off = self.per_token(batch, True), self.per_token(batch, False)
        return None if on is None or off is None else on <= off * SLOWER


class SpecController:
    def __init__(self, max_k: int, max_model_len: int, adaptive: bool = True, proposer_is_free: bool = False,
                 greedy_only: bool = False):
        self.max_k = max_k
        self.greedy_only = greedy_only            # sampled requests never speculate (n-gram lookup, draft "auto")
        self.max_model_len = max_model_len
        self.adaptive = adaptive
        self.proposer_is_free = proposer_is_free      # n-gram lookup costs no forward
        self.target = CostTable()
        self.draft = CostTable()
        self.alpha: dict[str, float] = {}
        self.global_alpha = PRIOR_ALPHA       # acceptance over all requests: the prior of a new one
        self.steps_off = 0                    # consecutive steps without speculation
        self.probe_every = PROBE_EVERY        # steps off before the next probe (backs off, see plan)
        self._probed = False                  # the last speculating step was a probe
        self._off_for = None                  # (other-token bucket, request ids) the last "off" plan was for
        self._compared = False
        self.rates = StepRates()
        self._since: dict[int, int] = {}      # decode steps since the last check, by batch-size bucket
        self._check_every: dict[int, int] = {}
        self._step = (0, 1)                   # (decoding requests, other tokens) of the step planned last
        self.enabled_steps = 0
        self.disabled_steps = 0
        self.last_plan: dict = {}

    def may_speculate(self, r: Request) -> bool:
        """Greedy requests always: their output cannot change. A sampled one keeps the target's
        distribution under speculation, but which text a seed gives would then depend on how deep each
        step speculated, which follows the batch; so a request with its own seed never speculates (its
        seed gives the same text alone or in any batch), nor any sampled one where ``greedy_only``."""
        p = r.params
        return p.greedy or (not self.greedy_only and p.seed is None)

    def plan(self, decoding: list[Request], other_tokens: int) -> None:
        """Set ``spec_k`` on each decoding request (0 = no speculation this step)."""
        held = [r for r in decoding if not self.may_speculate(r)]
        for r in held:
            r.spec_k = 0
        if held:            # they decode one row each, as prompt chunks add rows: planned as other tokens
            decoding = [r for r in decoding if self.may_speculate(r)]
            other_tokens += len(held)
        b = len(decoding)
        self._step = (b, other_tokens)
        # what an "off" choice rests on: the requests (no acceptance is observed while off) and the
        # cost buckets each depth's step falls in
        shape = (*(_bucket(b * (1 + k) + other_tokens) for k in range(self.max_k + 1)),
                 *(r.request_id for r in decoding))
        if (self.adaptive and b and self._off_for == shape
                and 0 < self.steps_off < min(self.probe_every, self.target.max_age)):
            # nothing it rests on has moved: keep it until the next probe, or until a verification cost
            # could have aged out (planning many streams costs a measurable part of a step)
            for r in decoding:
                r.spec_k = 0
            self.disabled_steps += 1
            self.steps_off += 1
            return
        ks = {r.request_id: self._cap(r, self.max_k) for r in decoding}
        if self.adaptive and b:
            k_star, probing = self._best_depth(decoding, other_tokens)
            if k_star and not probing and not other_tokens:
                k_star = self._held_to_measure(b, k_star)
            ks = {rid: min(k, k_star) for rid, k in ks.items()}
            if probing:
                # one request refreshes the acceptance estimate; probing all of them would make the
                # draft catch up on every request's context at once, a prompt-sized step
                first = decoding[0].request_id
                ks = {rid: (k if rid == first else 0) for rid, k in ks.items()}
            if k_star and not self.proposer_is_free:
                # a draft forward per proposal: a request stops where its next token is unlikely to pay
                # for one. A free proposer (n-gram) costs only verification rows, which k_star weighs.
                for r in decoding:
                    ks[r.request_id] = min(ks[r.request_id], self._own_depth(self.alpha.get(r.request_id, self.global_alpha), b))
            # a probe that leaves speculation off doubles the wait for the next one: each probe costs
            # a draft catch-up on one request's context, which a steady large batch never repays (an
            # n-gram probe costs no catch-up, and one answered by a guess observes nothing: no back-off)
            if any(ks.values()) and not probing:
                self.probe_every = PROBE_EVERY
            elif not any(ks.values()) and self._probed and not self.proposer_is_free:
                self.probe_every = min(2 * self.probe_every, PROBE_MAX)
            self._probed = probing
            self._off_for = shape if self._compared and not any(ks.values()) else None
        for r in decoding:
            r.spec_k = ks[r.request_id]
        if b:
            if any(ks.values()):
                self.enabled_steps += 1
                self.steps_off = 0
            else:
                self.disabled_steps += 1
                self.steps_off += 1

    def _held_to_measure(self, b: int, k: int) -> int:
        """The model's depth, held to what whole decode steps measured at this batch size. Every
        CHECK_EVERY-th such step takes the other side (plain while speculating, speculating while
        plain wins), so both stay measured; where speculating steps produced tokens more slowly than
        plain ones, speculation stays off (n-gram lookup over many streams measured slower than off
        while the model predicted a gain)."""
        pays = self.rates.speculation_pays(b)
        key = _bucket(b)
        every = LEARN_EVERY if pays is None else self._check_every.get(key, CHECK_EVERY)
        self._since[key] = self._since.get(key, 0) + 1
        flip = self._since[key] >= every
        if flip:
            self._since[key] = 0
        if pays is False:
            # each check that finds it still slower doubles the wait for the next: a speculating step
            # of 16 streams can cost several plain ones
            if flip:
                self._check_every[key] = min(2 * every, CHECK_MAX)
            k = k if flip else 0
        else:
            if pays:
                self._check_every[key] = CHECK_EVERY
            k = 0 if flip else k
        if not k:
            self._compared = False            # an off from the measure or its schedule: planned each step
        return k

    def observe_step(self, tokens: int, seconds: float, speculated: bool) -> None:
        """The whole step just planned: its generated tokens and wall time."""
        b, other = self._step
        if b and not other:
            self.rates.observe(b, tokens, seconds, speculated)

    def _cap(self, r: Request, k: int) -> int:
        room = min(r.params.max_tokens - r.num_output_tokens - 1, self.max_model_len - r.num_tokens - 1)
        return max(0, min(k, room))

    def _step_cost(self, k: int, b: int, other_tokens: int) -> float | None:
        t = self.target.estimate(b * (1 + k) + other_tokens)
        if t is None:
            return None
        if k and not self.proposer_is_free:
            d = self.draft.estimate(b)
            if d is None:
                return None
            t += k * d
        return t

    def _best_depth(self, decoding: list[Request], other_tokens: int) -> tuple[int, bool]:
        """(depth for this step, whether it is a probe). ``_compared`` says whether the depth came
        from comparing known costs (not from a measurement still missing)."""
        self._compared = False
        b = len(decoding)
        plain = self._step_cost(0, b, other_tokens)
        if plain is None:
            return 0, False              # measure plain decoding at this size first: the safe choice
        if not self.proposer_is_free and self.draft.estimate(b) is None:
            return min(2, self.max_k), False   # measure the draft's single-token forward (needs depth >= 2)
        if self.steps_off >= self.probe_every:
            return 1, True               # a cheap probe now and then keeps the acceptance estimate current
        alphas = [self.alpha.get(r.request_id, self.global_alpha) for r in decoding]
        best_k, best_rate = 0, b / plain
        for k in range(1, self.max_k + 1):
            cost = self._step_cost(k, b, other_tokens)
            if cost is None:
                if k == 1:
                    return 1, False      # measure one verification step; deeper ones are extrapolated
                if b == 1 and not other_tokens and self._worth_exploring(k, alphas, best_rate):
                    return k, False      # one stream: measuring a deeper verification is cheap
                cost = self._extrapolated_cost(k, b, other_tokens)
            rate = sum(expected_tokens(a, k) for a in alphas) / cost
            if rate > best_rate * MARGIN:
                best_k, best_rate = k, rate
        self.last_plan = {"k": best_k, "predicted_speedup": best_rate / (b / plain)}
        self._compared = True
        return best_k, False

    def _worth_exploring(self, k: int, alphas: list[float], best_rate: float) -> bool:
        """Would depth k win if its extra verification rows cost no more than depth 1's? Costs are not
        linear in rows (one row runs a matrix-vector product, several rows a matrix product), so the
        linear extrapolation from depth 1 can hide a depth that pays."""
        optimistic = self._step_cost(1, 1, 0) + (0.0 if self.proposer_is_free else (k - 1) * self.draft.estimate(1))
        return sum(expected_tokens(a, k) for a in alphas) / optimistic > best_rate * MARGIN

    def _extrapolated_cost(self, k: int, b: int, other_tokens: int) -> float:
        """Cost of depth k from plain and depth-1 measurements, linear in the rows verified (exploring
        every depth at a large batch would itself cost a few slow steps)."""
        t0 = self.target.estimate(b + other_tokens)
        t1 = self.target.estimate(2 * b + other_tokens)
        t = t0 + k * max(0.0, t1 - t0)
        if not self.proposer_is_free:
            t += k * self.draft.estimate(b)
        return t

    def _own_depth(self, alpha: float, b: int) -> int:
        """Deepest k whose marginal expected token is still likely enough to pay for a draft step."""
        k = 1
        while k < self.max_k and alpha ** (k + 1) > 0.15:
            k += 1
        return k

    def observe_target(self, rows: int, seconds: float) -> None:
        self.target.observe(rows, seconds)

    def observe_draft(self, rows: int, seconds_per_forward: float) -> None:
        self.draft.observe(rows, seconds_per_forward)

    def observe_acceptance(self, request_id: str, proposed: int, accepted: int) -> None:
        if proposed:
            a = self.alpha.get(request_id, self.global_alpha)
            # per-token acceptance: each accepted proposal is a success, the first rejection a failure
            rate = accepted / (accepted + (1 if accepted < proposed else 0))
            self.alpha[request_id] = (1 - EMA) * a + EMA * rate
            self.global_alpha = (1 - EMA / 4) * self.global_alpha + EMA / 4 * rate

    def forget(self, request_id: str) -> None:
        self.alpha.pop(request_id, None)
        self._off_for = None        # an id may come back (callers choose them): plan it afresh
