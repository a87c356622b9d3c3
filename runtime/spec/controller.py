"""Adaptive speculation depth: how many tokens the decoding requests propose this step, if any.

A step at depth k over b decoding requests yields, per request with per-token acceptance a,

    E(a, k) = (1 - a^(k+1)) / (1 - a)        tokens on average, and takes
    T(k) = overhead + verify(b (k+1) rows) + [k > 0] (draft catch-up + k draft forwards)

seconds. The controller picks the depth with the most expected tokens per second, b E(a, k) / T(k).

- T(k) is measured, not modelled: the median wall time of the last whole decode steps taken at depth k
  at this batch size (DepthTimes). The overhead, the draft round's catch-up (which reloads the draft's
  weights after each target step) and the Python around the forward are all in it. A step where a
  draft first catches up on text it missed while speculation was off is not a sample.
- A depth not yet measured is tried when even a lower bound on its cost would beat the best measured
  depth: the nearest shallower measured step, plus a draft forward per extra proposal (at least what
  one cost over fewer rows, and no more than the measured steps leave for one) and the cheapest
  verification its rows could cost (CostTable). Optimism
  bounded by the cost model: a depth that cannot win is never tried, not even the first, so where
  speculation never pays it costs a few steps or none, and where a deep depth wins it is reached (the
  first try is already half way down).
- Where a draft is off over several streams, depths are tried on 1, 2, 4, ... of the requests, not all
  at once (each new one costs a catch-up on its whole text: a probe keeps the requests whose draft
  has caught up and adds those with the least text), while the likely cost of the whole batch could
  still win; all speculate once the dearest reading of those steps wins (_estimates).
- The acceptance a is the maximum-likelihood estimate from accepted proposals and first rejections
  (Acceptance) over the last few hundred decode steps of all requests (one depth serves the whole
  batch), starting from a weak prior.
- Measurements stay current: every so often one step takes the runner-up depth, twice as rarely each
  time, unless either bound of the acceptance could still make the runner-up win or come within
  CLOSE (the medians' own noise) of the depth in force (then the interval stays). Where a draft is
  off over several streams that step speculates on one request. For a draft, every other refresh
  instead measures anew (its old samples dropped) a depth not sampled for STALE steps, and the depth
  left behind when another takes over is measured anew at once: the first steps at a shape run
  slow, and a median from them, or from a slow spell of the machine, would otherwise stand for good
  (the first depth tried, measured in the warm-up, lost to a deeper one measured after it, which
  then held one stream at 90 % of the best for a whole run).
- Speculation turns on at a batch size only where the steps that tried a depth there on the whole
  batch also yielded more tokens per second and request than the plain ones (their summed tokens
  over their summed seconds): the acceptance is pooled over all requests and overrates a batch whose
  requests differ (some copying their prompt and accepting all, others finding nothing), and a
  depth's median time can come from cheap steps and the acceptance from rich ones. For a lookup
  (no draft to keep in step) the same rule also turns it off, and every other refresh while a depth
  is in force is a plain step: a lookup's gain follows the text (copying spells come and go), and a
  plain time from before it turned on (the first, slower generations, say) would keep it on.
- Trying costs a bounded share (TRY_SHARE) of the time at a batch size. A trial is a step that
  explores or refreshes a depth other than the one in force; what it loses is its seconds less
  those the depth in force takes for as many tokens, at the rate planned for it. Losses add up
  (a trial that wins brings the sum back to zero at most), and a new trial starts only while the
  sum stays under TRY_SHARE of the seconds spent at that batch size plus one step's worth. Where a
  trial costs much more than it gains (a batch whose extra rows leave the backend's few-row path,
  say), the trials spread out instead of repeating; where one wins, its gains pay for the next.
  Probes (a draft off over several streams) get half the share (PROBE_SHARE): each pays a draft's
  catch-up on whole texts, and its few extra rows take the step off the backend's few-row path, so
  they are the dearest trials and the least likely to win.
- A settled depth holds for HOLD steps before the depths are weighed again (no trial due, the
  counters still ticking): planning runs in Python on every step. The unmeasured depths are looked
  at every EXPLORE_EVERY steps, twice as rarely each time none is worth a try (up to EXPLORE_MAX).

                     plan(): _choose -> spec_k per request
    engine step ->   observe_target / observe_draft / observe_proposals / observe_acceptance
                     observe_step: the step's wall time, a sample of (batch size, depth[, requests])
"""
from __future__ import annotations

import collections

from ..request import Request
from .measures import Acceptance, CostTable, DepthTimes, bucket

PRIOR_ALPHA = 0.6
PRIOR_WEIGHT = 2.0      # the prior counts as this many verified proposals (accepted or rejected)
DECAY = 0.995           # acceptance and proposal counts: weight of the past, per decode step
SWITCH = 1.02           # another measured depth must be this much faster to take over
SWITCH_ON = 1.10        # ... and speculation, where a draft is off over several streams (a catch-up to pay)
REFRESH_EVERY = 32      # steps of a batch size between refreshes of the runner-up depth ...
REFRESH_MAX = 1024      # ... doubling each time it stays the runner-up, up to this many
CLOSE = 0.05            # ... unless it comes within this share of the depth in force
STALE = 256             # a draft's depth last measured this many steps ago is measured anew at a refresh
EXPLORE_EVERY = 8       # steps of a batch size between looks at the depths not measured there ...
EXPLORE_MAX = 64        # ... doubling each time nothing is worth trying, up to this many
HOLD = 15               # steps a settled depth is kept without weighing the depths again (planning is Python)
TRY_SHARE = 0.015       # share of a batch size's seconds that trying depths other than the one in force may lose
PROBE_SHARE = 0.0075    # ... where the trials are probes (a draft off over several streams: the dearest trials)


def expected_tokens(alpha: float, k: int) -> float:
    if k == 0:
        return 1.0
    if alpha >= 0.999:
        return k + 1.0
    return (1 - alpha ** (k + 1)) / (1 - alpha)


class _Batch:
    """What the controller knows and intends at one batch-size bucket."""

    def __init__(self):
        self.times = DepthTimes()
        self.yields = DepthTimes()      # tokens of the same steps
        self.probe_times = DepthTimes()  # by (depth, requests): steps where some requests speculated
        self.best = 0                   # the depth in force
        self.exploring: tuple | None = None   # (depth, requests) being measured
        self.again: tuple | None = None  # (depth, requests) once more: a re-measure after its catch-up step
        self.since_refresh = 0
        self.refresh_every = REFRESH_EVERY
        self.plain_turn = False         # flips every refresh: a lookup's plain step, or a draft's stale depth
        self.explore_in = 0             # steps until unmeasured depths are weighed again
        self.explore_every = EXPLORE_EVERY
        self.hold = 0                   # steps the depth in force is kept before the depths are weighed again
        self.known = 0                  # depths measured when they last were
        self.elapsed = 0.0              # seconds of the steps planned at this batch size
        self.lost = 0.0                 # seconds the trials lost against the depth in force (at least 0)
        self.step_s = 0.0               # seconds of a step at the depth in force, as planned ...
        self.rate = 0.0                 # ... and its tokens per second

    def yielded(self, k: int) -> float:
        """Tokens per second and request of the last steps measured at depth k on the whole batch
        (infinite: none). Per request: a batch-size bucket holds steps of several sizes (9-16 streams,
        say), and once some requests finish early the plain steps run fewer than the speculating ones
        did, which per step would make plain decoding look the poorer."""
        seconds = sum(self.times.samples.get(k, ()))
        return sum(self.yields.samples[k]) / seconds if seconds else float("inf")

    def measure_anew(self, k: int, b: int) -> tuple[int, int]:
        """Drop depth k's samples and measure it again on all b requests, starting now."""
        self.times.forget(k)
        self.yields.forget(k)
        self.exploring = k, b
        return self.exploring

    def may_try(self, probing: bool = False) -> bool:
        """Whether a trial may start: the losses so far within the share of the time (PROBE_SHARE for
        probes, else TRY_SHARE), plus one step."""
        return self.lost < (PROBE_SHARE if probing else TRY_SHARE) * self.elapsed + self.step_s


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
        self.acceptance = Acceptance(PRIOR_ALPHA, PRIOR_WEIGHT, DECAY)
        self.found = Acceptance(1.0, 1.0, DECAY)      # share of asked requests that got any proposal
        self.batches: dict[tuple, _Batch] = {}
        self._step: tuple | None = None       # (batch key, depth) of the step planned last, if it measures one
        self._key: tuple | None = None        # batch key of the step planned last
        self._trial = False                   # whether it tries a depth other than the one in force
        self._plain_run = 0                   # consecutive steps without speculation, up to the last planned
        self._spec_m = 0                      # requests that speculated in the last step that did
        self._probe_ids: set[str] = set()     # the requests of the last probe
        self.enabled_steps = 0
        self.disabled_steps = 0
        self.depth_steps: collections.Counter = collections.Counter()
        self.last_plan: dict = {}

    @property
    def global_alpha(self) -> float:
        return self.acceptance.rate()

    def may_speculate(self, r: Request) -> bool:
        """Greedy requests always: their output cannot change. A sampled one keeps the target's
        distribution under speculation, but which text a seed gives would then depend on how deep each
        step speculated, which follows the batch; so a request with its own seed never speculates (its
        seed gives the same text alone or in any batch), nor any sampled one where ``greedy_only``."""
        p = r.params
        return p.greedy or (not self.greedy_only and p.seed is None)

    # ---- planning --------------------------------------------------------------------------
    def plan(self, decoding: list[Request], other_tokens: int) -> None:
        """Set ``spec_k`` on each decoding request (0 = no speculation this step)."""
        may = self.may_speculate
        held = [r for r in decoding if not may(r)]
        if held:            # they decode one row each, beside the speculating ones: measured apart
            for r in held:
                r.spec_k = 0
            decoding = [r for r in decoding if may(r)]
        self._step, self._key, self._trial = None, None, False
        b = len(decoding)
        if not b:
            return
        self.acceptance.age()
        self.found.age()
        key = ((b - 1).bit_length(), bucket(len(held)) if held else 0)   # 1, 2, 3-4, 5-8, 9-16, ... streams
        k, m = self._choose(decoding, key, len(held), other_tokens) if self.adaptive else (self.max_k, b)
        if self.adaptive:
            st = self.batches[key]
            self._key, self._trial = key, (k, m) != (st.best, b) and st.rate > 0 and not other_tokens
        for r in decoding:
            r.spec_k = 0
        depth, capped = 0, False
        if k:           # all of them, or in a probe m of them
            for r in (decoding if m >= b else self._probe_set(decoding, m)):
                r.spec_k = got = self._cap(r, k)
                depth, capped = max(depth, got), capped or got < k
        if self.adaptive and not other_tokens and not capped and self._measures(k, m):
            self._step = (key, k, m if m < b else 0, b + len(held))
        self._plain_run = 0 if depth else self._plain_run + 1
        if depth:
            self._spec_m = m
            self.enabled_steps += 1
        else:
            self.disabled_steps += 1
        self.depth_steps[depth] += 1

    def _probe_set(self, decoding: list[Request], m: int) -> list[Request]:
        """The m requests a probe speculates on: those of the last probe still decoding (their draft
        has caught up), then those with the least text (a draft's catch-up reads all of it)."""
        kept = [r for r in decoding if r.request_id in self._probe_ids][:m]
        if len(kept) < m:
            rest = sorted((r for r in decoding if r.request_id not in self._probe_ids), key=lambda r: r.num_tokens)
            kept += rest[:m - len(kept)]
        self._probe_ids = {r.request_id for r in kept}
        return kept

    def _measures(self, k: int, m: int) -> bool:
        """Whether a step at depth k over m requests shows its cost: not where a draft catches up on
        the text of more than one plain step first (the first speculating step after a pause, or the
        first for requests that did not speculate in the last one)."""
        return not k or self.proposer_is_free or (self._plain_run <= 1 and self._spec_m >= m)

    def _probing(self, b: int, st: _Batch) -> bool:
        """Whether speculating depths are tried on some requests only: where a draft is off over several
        streams (speculating all of them would make the draft catch up on all their text at once)."""
        return b > 1 and st.best == 0 and not self.proposer_is_free

    def _estimates(self, b: int, st: _Batch) -> tuple[dict[int, float], dict[int, tuple[float, int]]]:
        """Seconds of a whole step at each measured depth, and for the depths tried on m of b requests
        only, (a likely step's seconds, m) for the largest m. The first counts those requests' extra
        cost b / m times over: the dearest case (nothing of a draft round shared), which alone turns
        speculation on. The second, which decides whether to try more requests, is the cheapest case
        (the requests beyond m free) or, once two sizes are tried, each further request costing what
        one more cost there. Neither is taken below the cost floor of the whole batch (a probe that
        happened to run faster than plain steps does not make the whole batch's speculation free)."""
        measured = st.times.measured()
        levels: dict[int, list] = {}
        for (k, m), t in st.probe_times.measured().items():
            if k not in measured:
                levels.setdefault(k, []).append((m, t))
        if not levels or 0 not in measured:
            return measured, {}
        t0 = measured[0]
        dearest, likely = {}, {}
        for k, got in levels.items():
            got.sort()
            m, t = got[-1]
            extra = (t - got[-2][1]) / (m - got[-2][0]) if len(got) > 1 else 0.0
            floor = self._cost_floor(b, k, {0: t0})
            likely[k] = (max(floor, t + (b - m) * max(0.0, extra)), m)
            dearest[k] = max(floor, t0 + b / m * max(0.0, t - t0))
        return {**dearest, **measured}, likely

    def _choose(self, decoding: list[Request], key: tuple, held: int, other_tokens: int) -> tuple[int, int]:
        """(depth for this step, how many of the requests take it), beside ``held`` rows of requests
        that do not speculate and ``other_tokens`` prompt rows."""
        b = len(decoding)
        st = self.batches.get(key) or self.batches.setdefault(key, _Batch())
        if st.again is not None and not other_tokens:
            (k, m), st.again = st.again, None
            return k, m
        if st.hold and not other_tokens:        # settled, nothing due: the depth in force, its counters ticking
            st.hold -= 1
            st.since_refresh += 1
            st.explore_in -= 1
            return st.best, b
        measured, partial = self._estimates(b, st)
        if 0 not in measured:
            return 0, b                          # measure plain decoding at this size first: the safe choice
        gains = self._gains(decoding, measured, held=held)
        rates = {k: gains[k] / t for k, t in measured.items()}
        if other_tokens:                        # prompt rows ride along: no exploring, no measuring
            return self._with_other_tokens(b, held, other_tokens, measured, gains), b
        if st.exploring is not None:
            k, m = st.exploring
            if (st.times.count(k) if m >= b else st.probe_times.count((k, m))) < DepthTimes.MIN_SAMPLES:
                if st.may_try() or not self.proposer_is_free:    # a draft's catch-up, paid: not wasted
                    return k, m
                self._in_force(st, measured, rates)
                return st.best, b
        st.exploring = None
        probing = self._probing(b, st)
        left = None
        best = max(rates, key=rates.get)
        if best and (not st.best or self.proposer_is_free) and st.yielded(best) < st.yielded(0):
            # speculating only where what it yielded agrees (and, for a lookup, staying on)
            can = {k: r for k, r in rates.items() if st.yielded(k) >= st.yielded(0)}
            best = max(can, key=can.get)
        if st.best not in rates or rates[best] > rates[st.best] * (SWITCH_ON if probing else SWITCH):
            if best != st.best:
                st.refresh_every = REFRESH_EVERY
                # a draft's depth left behind is measured anew: its samples may be the engine's first
                # steps at their shapes, which run slow (the first depth tried looked dearer than it
                # is, and a deeper one measured after the warm-up took over for good). A lookup's
                # switches follow its text, and its plain refreshes keep 0 current.
                left = st.best if st.best in rates and not probing and not self.proposer_is_free else None
            st.best = best
        self._in_force(st, measured, rates)
        if left is not None:
            return st.measure_anew(left, b)
        probing = self._probing(b, st)
        st.explore_in -= 1
        # now and then the dear part, unless the trials so far lost more than their share of the time here
        if st.may_try(probing) and (st.explore_in <= 0 or st.known != len(measured) + len(partial)):
            st.explore_in, st.known = st.explore_every, len(measured) + len(partial)
            target = self._to_explore(b, st, measured, partial, self._gains(decoding, held=held), rates[st.best],
                                      probing)
            if target is not None:
                st.exploring, st.explore_every = target, EXPLORE_EVERY
                return target
            st.explore_every = min(2 * st.explore_every, EXPLORE_MAX)
        self.last_plan = {"batch": b, "k": st.best, "alpha": self.global_alpha,
                          "predicted_speedup": rates[st.best] / rates[0]}
        return self._refresh(decoding, st, rates, probing)

    @staticmethod
    def _in_force(st: _Batch, measured: dict[int, float], rates: dict[int, float]) -> None:
        """Note what a step at the depth in force takes and yields: what a trial's tokens would have cost."""
        st.step_s, st.rate = measured[st.best], rates[st.best]

    def _gains(self, decoding: list[Request], depths=None, bound: int = 0, held: int = 0) -> dict[int, float]:
        """Expected tokens of the step at each of ``depths`` (all by default), summed over the requests
        and ``held`` rows beside them; ``bound`` 1 or -1: at the acceptance's upper or lower bound."""
        b = len(decoding)
        a = self.acceptance.bound(bound) if bound else self.acceptance.rate()
        found = self.found.rate()
        return {k: held + (b * (found * expected_tokens(a, k) + (1 - found)) if k else float(b))
                for k in (range(self.max_k + 1) if depths is None else depths)}

    def _to_explore(self, b: int, st: _Batch, measured: dict[int, float], partial: dict, gains: dict[int, float],
                    best_rate: float, probing: bool) -> tuple[int, int] | None:
        """(depth, requests) to measure next: an unmeasured depth that could beat the best measured one,
        the most promising first (the first tried at a batch size goes half way down); where depths
        are tried on some requests only, one tried on m requests that could still win goes on to 2 m."""
        best = best_rate * (SWITCH_ON if probing else SWITCH)
        if len(measured) == 1 and not partial:
            k = self._first_depth(b)
            if gains[k] / self._cost_floor(b, k, measured) > best:
                return k, 1 if probing else b
        best_k = None
        for k in range(1, self.max_k + 1):
            if k in partial:                    # measured on m requests: the cheapest case could win?
                t, m = partial[k]
                rate = gains[k] / t
            elif k not in measured:
                rate = gains[k] / self._cost_floor(b, k, measured)
            else:
                continue
            if rate > best:
                best_k, best = k, rate
        if best_k is None:
            return None
        m = partial[best_k][1] * 2 if best_k in partial else (1 if probing else b)
        return best_k, min(m, b)

    def _first_depth(self, b: int) -> int:
        """The depth in force at the nearest batch size that speculates, else half the maximum."""
        near = sorted((abs(key[0] - (b - 1).bit_length()), st.best) for key, st in self.batches.items() if st.best)
        return near[0][1] if near else max(1, (self.max_k + 1) // 2)

    def _cost_floor(self, b: int, k: int, measured: dict[int, float]) -> float:
        """A lower bound on a step at depth k: a shallower measured step j, plus k - j draft forwards
        (and the catch-up, one forward or more, from j = 0) and at least what its verification rows
        cost beyond j's. Unknown forward costs count as free. A draft forward counts at most what the
        measured steps leave for one (a step at depth j > 0 holds j + 1 of them beyond a plain step):
        the draft's own timing of a forward carries its call's fixed costs, and a floor above a
        measured step's time would keep a deeper depth from ever being tried."""
        d = 0.0 if self.proposer_is_free else (self.draft.estimate(b) or self.draft.floor(b))
        rows = {j: self.target.estimate(b * (j + 1)) or 0.0 for j in measured}
        if d and 0 in measured:
            for j, t in measured.items():
                if j:
                    d = min(d, max(0.0, t - measured[0] - max(0.0, rows[j] - rows[0])) / (j + 1))
        floor = 0.0
        for j, t in measured.items():
            if j < k:
                extra = self.target.floor(b * (k + 1)) - rows[j]
                floor = max(floor, t + (k - j + (j == 0)) * d + max(0.0, extra))
        return floor

    def _with_other_tokens(self, b: int, held: int, other: int, measured: dict[int, float], gains: dict) -> int:
        """The best measured depth once each step also carries ``other`` prompt rows: their cost
        beside b (k + 1) verification rows and the held ones, from the forward costs (unknown: left out)."""
        def cost(k, t):
            rows = b * (k + 1) + held
            with_other, alone = self.target.estimate(rows + other), self.target.estimate(rows)
            return t + (with_other - alone if with_other is not None and alone is not None else 0.0)
        return max(measured, key=lambda k: gains[k] / cost(k, measured[k]))

    def _refresh(self, decoding: list[Request], st: _Batch, rates: dict[int, float],
                 probing: bool) -> tuple[int, int]:
        """The depth in force, or now and then the runner-up, so that its cost and the acceptance stay
        measured. Where a draft is off, a speculating step first catches up on the text since the last
        one: a second step measures."""
        st.since_refresh += 1
        others = {k: r for k, r in rates.items() if k != st.best}
        b = len(decoding)
        may = st.may_try(probing)
        if st.since_refresh < st.refresh_every or not others or not may:
            due = min(st.refresh_every - st.since_refresh, st.explore_in) - 1 if may else HOLD
            st.hold = max(0, min(HOLD, due))
            return st.best, b
        st.since_refresh = 0
        st.plain_turn = not st.plain_turn
        if self.proposer_is_free and st.best and st.plain_turn and 0 in others:   # plain decoding, the reference
            return 0, b
        k = max(others, key=others.get)
        if not self._could_win(decoding, st, k):
            st.refresh_every = min(2 * st.refresh_every, REFRESH_MAX)
        sampled = [j for j in others if j in st.times.last]      # not the depths tried on some requests only
        oldest = st.times.oldest(sampled) if sampled else k
        if (not self.proposer_is_free and not probing and st.plain_turn and oldest != k
                and st.times.clock - st.times.last[oldest] > STALE):
            # every other refresh of a draft's depths: one not measured for STALE steps is measured
            # anew (a median from a slow spell of the machine, or from the first steps at its
            # shapes, would otherwise stand for good where that depth is not the runner-up)
            return st.measure_anew(oldest, b)
        m = 1 if probing else b
        if k and not self._measures(k, m):
            st.again = k, m
        return k, m

    def _could_win(self, decoding: list[Request], st: _Batch, k: int) -> bool:
        """Whether depth k would beat the one in force, or come within CLOSE of it, were the acceptance
        at either of its bounds (a high one favours the deeper depth, a low one the shallower): a
        close call keeps its refreshes frequent, a clear one spaces them out."""
        times = self._estimates(len(decoding), st)[0]
        for side in (1, -1):
            gains = self._gains(decoding, times, bound=side)
            if gains[k] / times[k] * (1 + CLOSE) > gains[st.best] / times[st.best]:
                return True
        return False

    def _cap(self, r: Request, k: int) -> int:
        room = min(r.params.max_tokens - r.num_output_tokens - 1, self.max_model_len - r.num_tokens - 1)
        return max(0, min(k, room))

    # ---- measurements ----------------------------------------------------------------------
    def observe_step(self, tokens: int, seconds: float, speculated: bool, cpu_seconds: float | None = None) -> None:
        """The whole step just planned: its generated tokens, wall time and the process's CPU time in
        it. Its cost is the lesser: where other processes hold the cores the wall time mostly measures
        them (and changes with their load, so depths measured at different moments would not compare);
        where torch runs several threads the CPU time counts each."""
        if cpu_seconds is not None:
            seconds = min(seconds, cpu_seconds)
        if self._key is not None:
            st = self.batches[self._key]
            st.elapsed += seconds
            if self._trial:
                st.lost = max(0.0, st.lost + seconds - tokens / st.rate)
        if self._step is not None:
            key, k, m, rows = self._step
            st = self.batches[key]
            if m:
                st.probe_times.observe((k, m), seconds)
            else:
                st.times.observe(k, seconds)
                st.yields.observe(k, tokens / rows)

    def observe_target(self, rows: int, seconds: float) -> None:
        self.target.observe(rows, seconds)

    def observe_draft(self, rows: int, seconds_per_forward: float) -> None:
        self.draft.observe(rows, seconds_per_forward)

    def observe_proposals(self, asked: int, made: int) -> None:
        """Of ``asked`` requests planned to speculate, ``made`` got proposals (a lookup can find none)."""
        for i in range(asked):
            self.found.observe(1, 1 if i < made else 0)

    def observe_acceptance(self, request_id: str, proposed: int, accepted: int) -> None:
        if proposed:
            self.acceptance.observe(proposed, accepted)
