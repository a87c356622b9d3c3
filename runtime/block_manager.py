"""BlockManager: the paged KV pool's bookkeeping for the scheduler, composed of three parts.

    pool:   | b0 | b1 | b2 | ... | bN-1 |        each block holds `block_size` token slots
    request.block_ids = [b7, b2, b9]            its tokens 0..15 live in b7, 16..31 in b2, ...

    BlockManager ──▶ BlockPool    (block_pool.py)    reference counts, epochs, the free list (the LRU)
                 ──▶ PrefixIndex  (prefix_index.py)  keys of the hash chain -> blocks, followers of a parent
                 ──▶ BlockReuse   (block_reuse.py)   partial blocks copied, shifted runs (approximate)

A request's lookup is the longest exact run of cached full blocks (the index), then the block after
them sharing the most tokens, copied, and a run further on taken from a remembered table (the reuse
policy). Handing a block out of the pool makes the index forget it (``_pop_free``); a freed block
waits at the free list's kept end when the index holds something in it or its table is remembered.

The block manager is the only writer of request.block_ids; each part is the only writer of its own
state.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional

from .block_pool import BlockPool
from .block_reuse import SHIFT_MIN_RUN, BlockReuse, Shift
from .kv_disk import BlockRecord
from .prefix_index import ROOT_KEY, PrefixIndex, block_key
from .request import Request

__all__ = ["BlockManager", "PrefixHit", "Shift", "ROOT_KEY", "SHIFT_MIN_RUN", "block_key"]


@dataclass(frozen=True)
class PrefixHit:
    """What the prefix cache holds for the start of a request (a narrow view for the scheduler)."""

    block_ids: tuple[int, ...]
    num_tokens: int
    copy_from: Optional[int] = None     # a block whose first (num_tokens - full blocks) slots are copied
    shift: Optional[Shift] = None       # a run further on taken from a remembered table (approximate)


def _setting(part: str, name: str, doc: str) -> property:
    """A setting of the manager that one of its parts keeps (``part`` names the attribute)."""
    return property(lambda self: getattr(getattr(self, part), name),
                    lambda self, value: setattr(getattr(self, part), name, value), doc=doc)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = True):
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self.pool = BlockPool(num_blocks)
        self.prefix = PrefixIndex(block_size)
        self.reuse = BlockReuse(self.pool, self.prefix, block_size)
        self.prompt_tokens_queried = 0
        self.prompt_tokens_hit = 0

    # ---- settings, kept by the parts -------------------------------------------------------
    max_stale = _setting("reuse", "max_stale", "Shifted reuse: the most missed tokens a run may carry (0: off).")
    reuse_partial_blocks = _setting("reuse", "partial_blocks", "Copy partly matching blocks (off: full blocks "
                                    "only, to compare).")
    spill = _setting("prefix", "spill", "Record evicted full blocks for the disk tier (``take_evicted``).")

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def lookup_prefix(self, request: Request) -> PrefixHit:
        """Longest run of cached full blocks at the start of the request. At least one token is
        always left to compute, so the last position's logits exist."""
        if not self.enable_prefix_cache:
            return PrefixHit((), 0)
        bs = self.block_size
        ids, parent = self.prefix.longest_prefix(request.token_ids, request.num_tokens, request.cache_salt)
        start = len(ids) * bs
        block_id, m = self.reuse.best_follower(request, parent, start, min(bs - 1, request.num_tokens - 1 - start))
        shift = self.reuse.find_shift(request, start + m)
        return PrefixHit(tuple(ids), start + m, copy_from=block_id if m else None, shift=shift)

    def can_allocate(self, hit: PrefixHit, num_tokens: int) -> bool:
        """Could a new request hold `num_tokens` slots, reusing `hit`?"""
        taken = set(hit.block_ids) | set(self.reuse.shift_sources(hit.shift))
        reused_free = sum(1 for b in taken if self.pool.ref_count(b) == 0)
        return self.blocks_needed(num_tokens) - len(hit.block_ids) <= self.pool.num_free - reused_free

    def can_append(self, request: Request, num_tokens: int) -> bool:
        """Could the request grow to `num_tokens` slots?"""
        return self.blocks_needed(num_tokens) - len(request.block_ids) <= self.pool.num_free

    # ---- changes -------------------------------------------------------------------------
    def allocate(self, request: Request, hit: PrefixHit, num_tokens: int, count_hit: bool = True) -> None:
        assert not request.block_ids, "allocate is for requests that hold no blocks"
        for b in hit.block_ids:
            self.pool.take(b)
        request.block_ids = list(hit.block_ids)
        if count_hit:
            self.prompt_tokens_queried += request.num_prompt_tokens
            self.prompt_tokens_hit += min(hit.num_tokens, request.num_prompt_tokens)
        shift = hit.shift
        held = self.reuse.shift_sources(shift)
        for b in held:                  # held before any block is handed out: no destination is a source
            self.pool.take(b)
        self.reuse.hold(held)
        self.append(request, max(num_tokens, shift.end if shift else 0))
        if hit.copy_from is not None:
            full = len(hit.block_ids)
            self.reuse.queue_copy(hit.copy_from, request.block_ids[full], hit.num_tokens - full * self.block_size)
        self.reuse.start_request(request, shift)

    def append(self, request: Request, num_tokens: int) -> None:
        """Grow the request's block table to hold `num_tokens` slots."""
        need = self.blocks_needed(num_tokens) - len(request.block_ids)
        assert need <= self.pool.num_free, "call can_append first"
        for _ in range(need):
            block_id = self._pop_free()
            self.pool.hold(block_id)
            request.block_ids.append(block_id)

    def take_copies(self) -> list[tuple[int, int, int]]:
        """The (source block, destination block, slots) copies allocations asked for since the last
        call; the engine makes them before the step's forward, while every source is still intact."""
        return self.reuse.take_copies()

    def take_shifts(self) -> list[tuple[list[int], list[int], int]]:
        """The (source slots, destination slots, position change) runs allocations asked for since the
        last call, for the engine to copy (keys rotated) after ``take_copies``' copies; then call
        ``release_held``."""
        return self.reuse.take_shifts()

    def release_held(self) -> None:
        """Let the shifted runs' source blocks go (their runs are copied)."""
        for b in self.reuse.take_held():
            self._release(b)

    def free_request(self, request: Request) -> None:
        """Release every block of the request, tail first, remembering a partly computed tail block
        (and, with a reuse key, the table: its blocks then wait at the kept end of the free list)."""
        if self.enable_prefix_cache:
            self.reuse.remember_tail(request)
        keep = self.reuse.remember_table(request)
        for block_id in reversed(request.block_ids):
            self._release(block_id, keep)
        request.block_ids = []

    def trim(self, request: Request, num_tokens: int) -> None:
        """Drop blocks past the first `num_tokens` slots (rolled-back speculative positions)."""
        keep = self.blocks_needed(num_tokens)
        while len(request.block_ids) > keep:
            self._release(request.block_ids.pop())

    def cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Key every full block among the first `num_tokens` verified tokens (none from the request's
        first approximate position on)."""
        if not self.enable_prefix_cache:
            return
        exact = num_tokens if request.stale_from is None else min(num_tokens, request.stale_from)
        full = min(exact // self.block_size, len(request.block_ids))
        self.prefix.key_full_blocks(request.block_ids, request.token_ids, full, request.cache_salt)

    def reset_prefix_cache(self) -> None:
        self.prefix.reset()
        self.reuse.reset()

    # ---- the disk tier ---------------------------------------------------------------------
    def take_evicted(self) -> list[tuple[int, BlockRecord]]:
        """The (block id, record) of full blocks evicted since the last call: their keys and values
        are intact until the step's copies and forward."""
        return self.prefix.take_evicted()

    def cached_records(self) -> Iterator[tuple[int, BlockRecord]]:
        return self.prefix.cached_records()

    def restore(self, records: list[BlockRecord], salt: Optional[str], keep: list[int]) -> list[Optional[int]]:
        """Key a free block for each record read back from the disk tier (None: memory has it by now),
        cached and free at the kept end of the list. The blocks ``keep`` (the rest of the request's
        prefix) move there first, and no restore evicts them or an earlier restore."""
        kept = sum(1 for b in keep if self.pool.keep_if_free(b))
        room = self.pool.num_free - kept
        out: list[Optional[int]] = []
        for rec in records:
            if self.prefix.has_key(rec.key):
                out.append(None)
                continue
            if room <= 0:
                break
            block_id = self._pop_free()
            self.prefix.key_restored(block_id, rec, salt)
            self.pool.put_back(block_id)
            room -= 1
            out.append(block_id)
        return out

    # ---- internals -----------------------------------------------------------------------
    def _pop_free(self) -> int:
        """The least recently used free block, what it held forgotten (and recorded for the disk tier)."""
        block_id = self.pool.pop_free()
        self.prefix.forget(block_id)
        return block_id

    def _release(self, block_id: int, keep: bool = False) -> None:
        self.pool.release(block_id, keep or self.prefix.holds(block_id))

    def stats(self) -> dict:
        return {
            "kv_blocks_total": self.num_blocks,
            "kv_blocks_used": self.num_used_blocks,
            "kv_blocks_free": self.num_free_blocks,
            "kv_blocks_cached": self.prefix.num_cached,
            "kv_blocks_partial": self.prefix.num_partial,
            "kv_usage": self.num_used_blocks / self.num_blocks,
            "prefix_hit_rate": self.prompt_tokens_hit / self.prompt_tokens_queried if self.prompt_tokens_queried else 0.0,
            "prefix_tokens_hit": self.prompt_tokens_hit,
            "prefix_tokens_queried": self.prompt_tokens_queried,
            "prefix_evictions": self.prefix.evictions,
            "shift_requests": self.reuse.shift_requests,
            "shift_tokens": self.reuse.shift_tokens,
        }
