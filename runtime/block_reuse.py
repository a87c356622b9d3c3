"""BlockReuse: the block manager's reuse policy past the exact prefix hit, by copies.

Partial blocks: a prompt's tokens past its last cached full block are looked for among the blocks
that follow the same parent in the prefix index: cached full blocks, and the partly filled last
blocks that requests leave behind (their computed tokens are listed when the request lets them go,
``remember_tail``). The one sharing the most leading tokens is copied: the request gets a fresh block,
and the engine copies those slots' keys and values into it before the step runs (``take_copies``).
So a prompt that extends a finished or prefilled one, or repeats one, computes only its new tokens,
and no block is ever written by two requests.

Shifted reuse (opt-in per request, by ``reuse_key``; approximate): when a request lets its blocks go,
the tokens it computed and its block table are remembered under its reuse key, with each block's epoch
(``remember_table``). A later request with the same key whose tokens past its prefix hit contain a
run of at least ``SHIFT_MIN_RUN`` of the remembered tokens at another position (the text after an
edit, e.g. the suffix of a fill-in-the-middle prompt after a keystroke in the prefix) takes that
run's keys and values instead of computing them: the engine copies them to the new positions, the
keys rotated by the position change (``take_shifts``). The run's keys and values were computed under
the old text before it, so everything from the run on is approximate: the request counts the tokens
its run missed (``stale``, inserted plus removed tokens, added up over chained reuses), a run is not
taken when that count would exceed ``max_stale``, and a request's blocks from its first approximate
position on are never keyed into the prefix cache, so no exact request reads them.

BlockReuse is the only writer of the remembered tables, the queued copies and runs, and the list of
run sources held until copied (the block manager holds and lets go of them in the pool). It reads
epochs and reference counts from the pool and lists partial blocks in the prefix index.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Sequence

from .block_pool import BlockPool
from .prefix_index import ROOT_KEY, PrefixIndex
from .request import Request

SHIFT_MIN_RUN = 8           # shorter runs are computed: copying them saves little
SHIFT_KEYS = 64             # reuse keys remembered (least recently used dropped)
SHIFT_PER_KEY = 2           # tables per key: the last request, and the one before (a replaced
                            # request may have computed less than the one it replaced)
SHIFT_PROBE = 4             # tokens a run's first position is indexed by


@dataclass(frozen=True)
class Shift:
    """A run of remembered keys and values a request takes at other positions: ``length`` tokens
    from ``src_start`` of a remembered table to ``start`` of the request."""

    start: int
    length: int
    src_start: int
    src_blocks: tuple[int, ...]         # the remembered table (the run's blocks are held until copied)
    stale: int                          # tokens of changed text the run's keys and values did not see

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass(frozen=True)
class Remembered:
    """A finished request's computed tokens and block table, under its reuse key."""

    tokens: tuple[int, ...]
    block_ids: tuple[int, ...]
    epochs: tuple[int, ...]
    stale_from: Optional[int]           # first position whose keys and values are approximate
    stale: int


def common_start(a: Sequence[int], b: Sequence[int]) -> int:
    """How many tokens ``a`` and ``b`` share from the start."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class BlockReuse:
    def __init__(self, pool: BlockPool, prefix: PrefixIndex, block_size: int):
        self.pool = pool
        self.prefix = prefix
        self.block_size = block_size
        self.partial_blocks = True                # copy partly matching blocks (off: full blocks only, to compare)
        self.max_stale = 0                        # shifted reuse: most missed tokens a run may carry (0: off)
        self.remembered: OrderedDict[str, list[Remembered]] = OrderedDict()
        self._copies: list[tuple[int, int, int]] = []  # (source, destination, slots) for the engine to copy
        self._shifts: list[tuple[list[int], list[int], int]] = []   # (source slots, destination slots, delta)
        self._held: list[int] = []                # source blocks held until their run is copied
        self.shift_requests = 0
        self.shift_tokens = 0

    # ---- partial blocks ------------------------------------------------------------------
    def best_follower(self, request: Request, parent: int, start: int, limit: int) -> tuple[int, int]:
        """The cached block after ``parent`` sharing the most leading tokens (at most ``limit``) with
        the request's tokens from ``start``, and how many it shares."""
        best, best_m = -1, 0
        if limit <= 0 or not self.partial_blocks:
            return best, 0
        for block_id, tokens in self.prefix.followers(parent, request.cache_salt):
            m = common_start(tokens, request.token_ids[start:start + min(limit, len(tokens))])
            if m > best_m:
                best, best_m = block_id, m
        return best, best_m

    def queue_copy(self, source: int, destination: int, slots: int) -> None:
        self._copies.append((source, destination, slots))

    def take_copies(self) -> list[tuple[int, int, int]]:
        """The (source block, destination block, slots) copies allocations asked for since the last
        call; the engine makes them before the step's forward, while every source is still intact."""
        copies, self._copies = self._copies, []
        return copies

    def remember_tail(self, request: Request) -> None:
        """List the request's last block by its computed tokens when it is partly filled and only
        this request holds it (so it will be free), its parent being keyed."""
        bs = self.block_size
        n = min(request.num_computed_tokens, request.num_tokens)
        if request.stale_from is not None:
            n = min(n, request.stale_from)
        index = n // bs
        if n % bs == 0 or index >= len(request.block_ids):
            return
        block_id = request.block_ids[index]
        parent = ROOT_KEY if index == 0 else self.prefix.key(request.block_ids[index - 1])
        if parent is None or self.pool.ref_count(block_id) != 1 or self.prefix.key(block_id) is not None:
            return
        self.prefix.key_partial(block_id, parent, tuple(request.token_ids[index * bs:n]), request.cache_salt)

    # ---- shifted runs --------------------------------------------------------------------
    def find_shift(self, request: Request, hit: int) -> Optional[Shift]:
        """The longest run of a table remembered under the request's reuse key that the request's
        tokens past ``hit`` (its last one aside) repeat at the first position they repeat any, within
        the staleness limit."""
        key = request.reuse_key
        if key is None or self.max_stale <= 0 or key not in self.remembered:
            return None
        self.remembered.move_to_end(key)
        best: Optional[Shift] = None
        for rec in self.remembered[key]:
            run = self._first_run(rec, request.token_ids, request.num_tokens - 1, hit)
            if run is not None and run.stale <= self.max_stale and (best is None or run.length > best.length):
                best = run
        return best

    def _first_run(self, rec: Remembered, new: Sequence[int], last: int, hit: int) -> Optional[Shift]:
        """The longest run of ``rec``'s valid tokens that ``new[hit:last]`` repeats at the first
        position it repeats one of at least SHIFT_MIN_RUN tokens, with its staleness."""
        old = rec.tokens
        valid = self._valid_tokens(rec)
        if valid < SHIFT_MIN_RUN:
            return None
        common = common_start(old, new)
        index: dict[tuple, list[int]] = {}
        for j in range(min(common, hit), valid - SHIFT_MIN_RUN + 1):
            index.setdefault(tuple(old[j:j + SHIFT_PROBE]), []).append(j)
        for k in range(hit, last - SHIFT_MIN_RUN + 1):
            run, src = 0, -1
            for j in index.get(tuple(new[k:k + SHIFT_PROBE]), ()):
                n = 0
                while k + n < last and j + n < valid and old[j + n] == new[k + n]:
                    n += 1
                if n > run:
                    run, src = n, j
            if run >= SHIFT_MIN_RUN:
                return Shift(k, run, src, rec.block_ids, self._staleness(rec, common, k, src, run))
        return None

    @staticmethod
    def _staleness(rec: Remembered, common: int, start: int, src: int, run: int) -> int:
        """The changed tokens a run from ``src`` taken at ``start`` did not see (both texts share
        their first ``common`` tokens)."""
        if src == start and start <= common:
            stale = 0                            # the same tokens after the same text: exact
        else:
            stale = max(0, start - common) + max(0, src - common)
        if rec.stale_from is not None and src + run > rec.stale_from:
            stale += rec.stale
        return stale

    def _valid_tokens(self, rec: Remembered) -> int:
        """How many of a remembered table's tokens still have their keys and values (its blocks not
        handed out since)."""
        for i, (b, epoch) in enumerate(zip(rec.block_ids, rec.epochs)):
            if self.pool.epoch(b) != epoch:
                return min(len(rec.tokens), i * self.block_size)
        return len(rec.tokens)

    def shift_sources(self, shift: Optional[Shift]) -> list[int]:
        """The blocks a run is copied from, in order, each once."""
        if shift is None:
            return []
        bs = self.block_size
        return list(dict.fromkeys(s // bs for s in self._slots(shift.src_blocks, shift.src_start, shift.length)))

    def _slots(self, table: Sequence[int], start: int, n: int) -> list[int]:
        """The pool slots of positions ``start`` .. ``start + n - 1`` in block table ``table``."""
        bs = self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, start + n)]

    def hold(self, block_ids: list[int]) -> None:
        """Note run sources the block manager took in the pool, to let go after their copy."""
        self._held.extend(block_ids)

    def start_request(self, request: Request, shift: Optional[Shift]) -> None:
        """Queue the request's run (its blocks allocated), and set how approximate it is."""
        request.stale_from, request.stale = None, 0
        if shift is None:
            return
        src = self._slots(shift.src_blocks, shift.src_start, shift.length)
        dst = self._slots(request.block_ids, shift.start, shift.length)
        self._shifts.append((src, dst, shift.start - shift.src_start))
        if shift.stale:
            request.stale_from, request.stale = shift.start, shift.stale
        self.shift_requests += 1
        self.shift_tokens += shift.length

    def take_shifts(self) -> list[tuple[list[int], list[int], int]]:
        """The (source slots, destination slots, position change) runs allocations asked for since the
        last call, for the engine to copy (keys rotated) after ``take_copies``' copies."""
        shifts, self._shifts = self._shifts, []
        return shifts

    def take_held(self) -> list[int]:
        """The run sources held since the last call (their runs are copied): the caller lets them go."""
        held, self._held = self._held, []
        return held

    def remember_table(self, request: Request) -> bool:
        """Remember the request's computed tokens and block table under its reuse key; True when it
        did (its blocks should then wait at the free list's kept end)."""
        key = request.reuse_key
        if key is None or self.max_stale <= 0:
            return False
        n = min(request.num_computed_tokens, request.num_tokens)
        if n < SHIFT_MIN_RUN:
            return False
        ids = tuple(request.block_ids[:-(-n // self.block_size)])
        rec = Remembered(tuple(request.token_ids[:n]), ids, tuple(self.pool.epoch(b) for b in ids),
                         request.stale_from, request.stale)
        tables = self.remembered.pop(key, [])
        self.remembered[key] = ([rec] + tables)[:SHIFT_PER_KEY]
        while len(self.remembered) > SHIFT_KEYS:
            self.remembered.popitem(last=False)
        return True

    def reset(self) -> None:
        self.remembered.clear()
