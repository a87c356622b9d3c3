"""A screen in front of an output head: a greedy row's token from fewer bytes, the same token.

The output head is the largest matrix of a small model (151936 x 896 in Qwen2.5-0.5B: 40 % of an
int4 export's bytes per step; SmolLM2-135M's tied head is a fifth of its float32 bytes), and a greedy
row needs only its argmax. The screen is a second, smaller copy of the head, made at load from the
head's values: over most input columns M, int4 (groups of 32, float16 scales) for an 8-bit head, or
int8 (a scale per row) for a float32 or bfloat16 head; over the ``OUTLIERS`` columns O whose
final-norm weights are the largest, where the hidden state carries most of its size, int8 with a scale
per row of its own. For each row n it bounds how far the screen's score can be from the head's logit,
from norms computed once per row and norms of x:

    |l[n] - screen[n]| <= R[n] = E_M[n] |x_M| + E_O[n] |x_O| + F_M[n] e4(x) + G[n] d(x)

    E_M, E_O   the norm of the head's row minus the screen's row, over the columns M and O
               (Cauchy-Schwarz bounds the product of that difference with x)
    F_M e4     an int4 part's rounding of x to 8 bits per block of 128: |x_hat - x| <= 0.505 sx a value
               (an int8 part rounds x to 16 bits: F_M is 0 and the rounding falls under G d)
    G d        everything smaller: the int8 kernels' 16-bit rounding of x and every float32 sum, the
               head's own included (G: row norms of every part; d: the 16-bit step and float32's
               roundoff times the chains' lengths: a float head's chain is as long as its row)

A token whose upper bound ``screen + R`` is below the best lower bound ``max(screen - R)`` cannot be
the argmax. The bound presumes finite sums: rows whose ``max G |x|`` nears float32's largest value read
the whole head. It is relative, so a row of subnormal weights can miss it by the subnormal steps of its
sums, but such a row screens to 0 (``quantize_int8`` holds scales to 1e-12 or more), so only a floor
of 1e-24 or more can rule it out, and that floor is above its logit: the token is the same.

The rest (tens to hundreds of the vocabulary) are scored by the head's own kernel on their rows alone,
which gives each row the numbers the whole product gives it (the kernel's outputs are computed lane by
lane, whatever block holds them). So the token is the head's argmax, first index on a tie, and no other
row or step changes it. Rows with a non-finite value, and rows whose candidates are too many to be worth
it, take the whole head. Whether the screen pays is measured, not assumed: some of its first calls also
time the whole head on the same rows (``TRIALS``), and it turns itself off where it was not faster
(SmolLM2-135M's 8-bit head under a 4-bit screen: small, and loosely bounded).

Built at load (llmd.runtime.loading, setting ``head_screen``) for a tied or untied head on llmd's kernels
(int8 / int8g, or float32 / bfloat16 blocks without a bias), run by the execution backend's
``run_greedy`` for steps whose every row is greedy; sampled rows, logprobs and penalties read the
head's full logits as before. A float head's exact scores come from its blocked kernel, which takes at
most ``ops.F32_MAX_ROWS`` rows (more go to another product), so larger steps read the whole head.
"""
from __future__ import annotations

import math
import logging
import statistics
import time
from dataclasses import dataclass, field

import torch

from llmd.runtime import kernels
from llmd.runtime.kernels import ops
from llmd.runtime.models.layers import Linear

from .quantized import FLOAT16_NORMAL, Int8Linear, dequantize_int4, dequantize_int8, quantize_int4, quantize_int8

log = logging.getLogger("llmd.head_screen")

OUTLIERS = 64           # input columns kept at 8 bits in the screen: those of the largest final-norm weights
GROUP = 32              # the screen's int4 group
MIN_ROWS = 4096         # smaller heads are read quickly enough whole
CHUNK = 8192            # rows built at a time (a multiple of 16: packed blocks concatenate)
MAX_SHARE = 0.25        # candidates beyond this share of the vocabulary: the whole head is read instead
ROUNDING = 2.0 ** -24   # float32's unit roundoff
FINITE = 2.0 ** 120     # rows with G |x| past this read the whole head: no sum may overflow unseen
# Whether the screen pays is measured on the calls it serves: every TRIAL_EVERY-th of its first calls
# (with any that read the whole head after the screen) also reads the whole head, timed back to back on
# the same rows and checked for the same tokens; after TRIALS such pairs the screen stays on only if
# the median pair's time came to under KEEP_BELOW of the head's (a median, so that a few pairs caught
# by another process's spell do not decide).
TRIALS = 16
TRIAL_EVERY = 4
KEEP_BELOW = 0.95


@dataclass
class ScreenStats:
    rows: int = 0            # greedy rows served through the screen
    candidates: int = 0      # rows of the head scored exactly for them
    whole: int = 0           # rows that read the whole head instead (non-finite values, too many candidates)
    on: bool = True          # False once the trial found the screen no faster than the head
    calls: int = 0
    ratios: list = field(default_factory=list)     # the trial's (screen, whole head) seconds, call by call


class HeadScreen:
    """The screen of one head: its packed parts over the columns M (``main``: int4 for an int8 / int8g
    head, int8 for a float head) and O (``int8``), and per-row bound norms."""

    def __init__(self, head: Int8Linear | Linear, cols: torch.Tensor, outliers: torch.Tensor, main: ops.Packed,
                 int8: ops.Packed, norms: torch.Tensor):
        self.head, self.cols, self.outliers = head, cols, outliers
        self.order = torch.cat((cols, outliers))      # x's columns as the two parts read them
        self.main, self.int8 = main, int8
        self.float_head = not isinstance(head, Int8Linear)
        self.norms = norms                      # [V, 4] float32, rounded up: E_M, E_O, F_M, G
        self.widest = float(norms[:, 3].max())  # the largest G: with |x| it bounds every partial sum
        self.norms_by_kind = norms.t().contiguous()     # [4, V], as the selection kernel reads them
        # the kernels' float32 sums (int4: a rounding per group in two chains; int8g: one per group; a
        # float head: one per column) and this module's own, relative to |W| |x|: each chain's count of
        # roundings, with room to spare
        k = head.in_features
        self.margin = (4 * k // GROUP + 64 + (k if self.float_head else 0)) * ROUNDING
        self.stats = ScreenStats()

    @classmethod
    def build(cls, head, norm_weight: torch.Tensor | None) -> "HeadScreen | None":
        """The screen of ``head`` (its input is the final norm's output, weighted by ``norm_weight``), or
        None where it does not serve: another head form, no kernels, a small vocabulary, odd widths."""
        if (head is None or head.bias is not None or head.out_features < MIN_ROWS or norm_weight is None
                or head.in_features % 64 or head.in_features < 2 * OUTLIERS or not _serves(head)):
            return None
        floats = not isinstance(head, Int8Linear)
        k = head.in_features
        order = norm_weight.detach().float().abs().argsort(descending=True, stable=True)
        outliers = order[:OUTLIERS].sort().values
        keep = torch.ones(k, dtype=torch.bool)
        keep[outliers] = False
        cols = keep.nonzero().flatten()
        parts4, parts8, norms = [], [], []
        for lo in range(0, head.out_features, CHUNK):
            hi = min(lo + CHUNK, head.out_features)
            w = _exact_rows(head, lo, hi)
            wm, wo = w[:, cols], w[:, outliers]
            q8, s8 = quantize_int8(wo.float())
            p8 = ops.int8_pack(q8, s8)
            wq = q8.double() * s8.double()[:, None]
            if floats:           # int8 over M: x rounded to 16 bits (under G d), no int4 term
                qm, sm = quantize_int8(wm.float())
                pm = ops.int8_pack(qm, sm)
                wmq = qm.double() * sm.double()[:, None]
                g = w.norm(dim=1) + wmq.norm(dim=1) + wq.norm(dim=1)
                f = torch.zeros_like(g)
            else:
                q, s, z = _int4_half(wm.float())
                pm = ops.int4_pack(q, s, z, GROUP)
                if pm is not None and not pm.half:
                    return None
                wmq = dequantize_int4(q, s, z).double()
                offsets = (z.double() - 8 * s.double()).abs() + 15 * s.double().abs()
                g = (w.norm(dim=1) + wmq.norm(dim=1) + wq.norm(dim=1) + math.sqrt(GROUP) * offsets.norm(dim=1))
                f = wmq.norm(dim=1)
            if pm is None or p8 is None:
                return None
            norms.append(torch.stack(((wm - wmq).norm(dim=1), (wo - wq).norm(dim=1), f, g), 1))
            parts4.append(pm)
            parts8.append(p8)
        norms = torch.cat(norms).float()
        norms = torch.nextafter(norms, torch.full_like(norms, math.inf))      # float64 norms rounded up
        n = head.out_features
        main = ops.Packed(torch.cat([p.data for p in parts4]), n, k - OUTLIERS, 0 if floats else GROUP,
                          not floats, half=not floats)
        int8 = ops.Packed(torch.cat([p.data for p in parts8]), n, OUTLIERS, 0, False)
        return cls(head, cols, outliers, main, int8, norms.contiguous())

    def __deepcopy__(self, memo):
        return None           # a copied model has its own head: it reads it whole

    def head_bytes(self) -> int:
        """Bytes the whole head's product reads (its packed form, or its blocks)."""
        data = self.head.stored if self.float_head else self.head._kernel_form.data
        return data.numel() * data.element_size()

    def bytes_per_row(self) -> float:
        """Bytes a screened row has read on average: the screen's parts, and its exact rows as stored."""
        head, st = self.head, self.stats
        if self.float_head:
            row = head.in_features * head.stored.element_size()
        else:
            row = head.in_features + 4 * (head.scales.numel() // head.out_features)
        return self.nbytes() + (row * st.candidates / st.rows if st.rows else 0)

    def nbytes(self) -> int:
        """Bytes a screened row reads (the packed parts and the norms), not counting its candidates."""
        return sum(t.numel() * t.element_size() for t in (self.main.data, self.int8.data, self.norms))

    def scores(self, xm: torch.Tensor, xo: torch.Tensor) -> torch.Tensor | None:
        """The screen's scores [M, V] of float32 rows x [M, K] given as its columns M and O, or None where
        a kernel declines."""
        a = ops.packed_matvec(xm, self.main)
        b = ops.packed_matvec(xo, self.int8)
        return None if a is None or b is None else a.add_(b)

    def candidates(self, xp: torch.Tensor, s: torch.Tensor) -> torch.Tensor | None:
        """The rows of the head (int64, ascending) that some row of the screen's scores ``s`` [M, V] cannot
        rule out: those whose upper bound s + R reaches that row's floor, the lower bound s - R of its
        highest score (any row's lower bound is one; the highest score's is close to the best). ``xp``:
        x's rows with the int4 columns first. None where a score is not finite (or no kernel runs)."""
        return ops.screen_select(xp, self.main.k, self.margin, s, self.norms_by_kind)

    def argmax(self, x: torch.Tensor) -> list[int] | None:
        """Each row's first largest logit of the head, as the whole product finds it (rows the screen
        cannot serve read the whole head here); None once the screen is off (the caller reads the head)."""
        st = self.stats
        if not st.on:
            st.whole += x.shape[0]
            return None
        x = x.float().contiguous()
        t0 = time.perf_counter()
        ids = self._argmax(x)
        if ids is None:
            st.whole += x.shape[0]
            ids = self._whole(x)
        st.calls += 1
        if len(st.ratios) < TRIALS and st.calls % TRIAL_EVERY == 0:
            ids = self._trial(x, ids, time.perf_counter() - t0)
        return ids

    def _whole(self, x: torch.Tensor) -> list[int]:
        """The argmax of the whole head's logits, as the model computes them."""
        return ops.argmax(self.head(x)).tolist()

    def _argmax(self, x: torch.Tensor) -> list[int] | None:
        rows = x.shape[0]
        if (self.float_head and rows > ops.F32_MAX_ROWS) or not kernels.usable(x):
            return None              # the head's product for these rows is not the kernels'
        s = cand = None
        if float(x.norm(dim=1).max()) * self.widest < FINITE:      # False too for a NaN or an infinity
            xp = x.index_select(1, self.order)
            xm, xo = xp[:, :self.main.k], xp[:, self.main.k:]
            s = self.scores(xm, xo)
            cand = None if s is None else self.candidates(xp, s)
        head = self.head
        exact = None
        if cand is not None and cand.numel() <= MAX_SHARE * head.out_features:
            exact = (ops.f32_pick(x, head.stored, cand) if self.float_head
                     else ops.q8_pick(x, head.qweight, head.scales, cand))
        if exact is None:
            return None
        self.stats.rows += rows
        self.stats.candidates += cand.numel() * rows
        return cand[exact.argmax(1)].tolist()

    def _trial(self, x: torch.Tensor, ids: list[int], seconds: float) -> list[int]:
        """Time the whole head on the rows just screened; after TRIALS of these, keep the screen only
        where it was faster. A token that differs (which the bound rules out) turns the screen off, and
        the whole head's tokens are the ones returned."""
        st = self.stats
        t0 = time.perf_counter()
        whole = self._whole(x)
        st.ratios.append((seconds, time.perf_counter() - t0))
        if whole != ids:
            log.error("the head screen chose tokens %s where the whole head chose %s: screen turned off", ids, whole)
            st.on = False
        elif len(st.ratios) == TRIALS:
            share = median_share(st.ratios)
            st.on = share < KEEP_BELOW
            log.info("head screen %s: it took %.2f of the whole head's time", "kept" if st.on else "off", share)
        return whole

def median_share(pairs: list) -> float:
    """The trial's verdict: the median of the screen's time over the whole head's, pair by pair."""
    return statistics.median(a / max(b, 1e-9) for a, b in pairs)


def _serves(head) -> bool:
    """An int8 / int8g head on the packed kernels, or a float head in float32 or bfloat16 blocks."""
    if isinstance(head, Int8Linear):
        return getattr(head, "_kernel_form", None) is not None and getattr(head, "method", "") in ("int8", "int8g")
    return (isinstance(head, Linear) and head.plan.layout == "blocked" and head.stored is not None
            and head.stored.dtype in (torch.float32, torch.bfloat16))


def _exact_rows(head: Int8Linear | Linear, lo: int, hi: int) -> torch.Tensor:
    """Rows lo..hi of the head as float64: an int8 / int8g head's products of integers and scales, a float
    head's values, exactly."""
    if not isinstance(head, Int8Linear):
        return head.rows(torch.arange(lo, hi)).double()
    return dequantize_int8(head.qweight[lo:hi], head.scales[lo:hi], torch.float64)


def _int4_half(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The screen's int4 form of float32 rows: ``quantize_int4``'s, with scales and zeros held to float16
    values even where a group is (nearly) constant, so that every chunk packs at 5 bits a weight. Any
    values will do: the bound norms are taken from what is packed."""
    q, s, z = quantize_int4(w, GROUP)
    if ops.as_float16(s) is not None and ops.as_float16(z) is not None:
        return q, s, z
    s = s.clamp(min=FLOAT16_NORMAL).half().float()
    z = z.clamp(-60000, 60000).half().float()
    g = w.view(w.shape[0], -1, GROUP)
    q = torch.round((g - (z - 8 * s)[..., None]) / s[..., None]).clamp(0, 15).to(torch.uint8).view_as(w)
    return q, s, z
