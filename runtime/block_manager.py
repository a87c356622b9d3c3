"""BlockManager: the paged KV pool's bookkeeping, its prefix cache and its free list.

    pool:   | b0 | b1 | b2 | ... | bN-1 |        each block holds `block_size` token slots
    request.block_ids = [b7, b2, b9]            its tokens 0..15 live in b7, 16..31 in b2, ...

A full block is keyed by a 128-bit BLAKE2b digest chained over its parent's key, its token ids and
the request's cache salt, and stays keyed after it is freed. The free list *is* the LRU: a block whose reference count
drops to zero joins the free list (unkeyed blocks at the evict-first end, keyed ones at the other end,
a request's tail before its head), and a keyed block is only forgotten when it is handed out again.
A lookup also compares the stored tokens and parent key. The digest is cryptographic so that
nobody can make two keys meet on purpose: a request can only hit blocks written under its own salt.

A prompt's tokens past its last cached full block are looked for too, among the blocks that follow
the same parent (found under an anchor key: the parent's key and the salt, no tokens): cached full
blocks, and the partly filled last blocks that requests leave behind (their computed tokens are
remembered when the request lets them go). The one sharing the most leading tokens is copied: the
request gets a fresh block, and the engine copies those slots' keys and values into it before the
step runs (``take_copies``). So a prompt that extends a finished or prefilled one, or repeats one,
computes only its new tokens, and no block is ever written by two requests.

Shifted reuse (opt-in per request, by ``reuse_key``; approximate): when a request lets its blocks go,
the tokens it computed and its block table are remembered under its reuse key, with each block's epoch
(how often it was handed out). A later request with the same key whose tokens past its prefix hit
contain a run of at least ``SHIFT_MIN_RUN`` of the remembered tokens at another position (the text
after an edit, e.g. the suffix of a fill-in-the-middle prompt after a keystroke in the prefix) takes
that run's keys and values instead of computing them: the engine copies them to the new positions,
the keys rotated by the position change (``take_shifts``). The run's keys and values were computed
under the old text before it, so everything from the run on is approximate: the request counts the
tokens its run missed (``stale``, inserted plus removed tokens, added up over chained reuses), a run
is not taken when that count would exceed ``max_stale``, and a request's blocks from its first
approximate position on are never keyed into the prefix cache, so no exact request reads them.

The disk tier (llmd.runtime.kv_tier, when on): an evicted full block is recorded for the engine to
copy out before anything overwrites it (``take_evicted``), and ``restore`` keys free blocks for blocks
read back from disk, as cached blocks at the kept end of the free list, where lookups find them.

The block manager is the only writer of reference counts, keys, the free list and request.block_ids.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterator, Optional

from .kv_disk import BlockRecord
from .request import Request


class Block:
    __slots__ = ("block_id", "ref_count", "key", "parent_key", "tokens", "anchor", "epoch")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.epoch = 0                           # times handed out: a remembered table checks it
        self.key: Optional[int] = None           # a full block's key
        self.parent_key: Optional[int] = None
        self.tokens: Optional[tuple] = None      # a full block's tokens, or a partial block's computed ones
        self.anchor: Optional[int] = None        # where lookups find it as a follower of its parent

    def forget(self) -> None:
        self.key = self.parent_key = self.tokens = self.anchor = None


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
class PrefixHit:
    """What the prefix cache holds for the start of a request (a narrow view for the scheduler)."""

    block_ids: tuple[int, ...]
    num_tokens: int
    copy_from: Optional[int] = None     # a block whose first (num_tokens - full blocks) slots are copied
    shift: Optional[Shift] = None       # a run further on taken from a remembered table (approximate)


@dataclass(frozen=True)
class Remembered:
    """A finished request's computed tokens and block table, under its reuse key."""

    tokens: tuple[int, ...]
    block_ids: tuple[int, ...]
    epochs: tuple[int, ...]
    stale_from: Optional[int]           # first position whose keys and values are approximate
    stale: int


SHIFT_MIN_RUN = 8           # shorter runs are computed: copying them saves little
SHIFT_KEYS = 64             # reuse keys remembered (least recently used dropped)
SHIFT_PER_KEY = 2           # tables per key: the last request, and the one before (a replaced
                            # request may have computed less than the one it replaced)


ROOT_KEY = 0


def follower_anchor(parent_key: int, salt: Optional[str]) -> int:
    """The key the blocks after ``parent_key`` are found under (a full block's key hashes tokens)."""
    return block_key(parent_key, (), salt)


def block_key(parent_key: int, tokens: tuple, salt: Optional[str]) -> int:
    h = hashlib.blake2b(parent_key.to_bytes(16, "little"), digest_size=16)
    s = b"" if salt is None else salt.encode("utf-8", "surrogatepass")
    h.update((0 if salt is None else len(s) + 1).to_bytes(8, "little") + s)    # no salt differs from ""
    h.update(array("q", tokens).tobytes())
    return int.from_bytes(h.digest(), "little")


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = True):
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self.reuse_partial_blocks = True          # copy partly matching blocks (off: full blocks only, to compare)
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # left = evict first
        self.cached: dict[int, int] = {}          # key -> block id
        self.followers: dict[int, list[int]] = {}  # anchor -> cached blocks (full or partial) after that parent
        self._copies: list[tuple[int, int, int]] = []  # (source, destination, slots) for the engine to copy
        self.max_stale = 0                        # shifted reuse: most missed tokens a run may carry (0: off)
        self.remembered: OrderedDict[str, list[Remembered]] = OrderedDict()
        self._shifts: list[tuple[list[int], list[int], int]] = []   # (source slots, destination slots, delta)
        self._held: list[int] = []                # source blocks held until their shift is copied
        self.shift_requests = 0
        self.shift_tokens = 0
        self.prompt_tokens_queried = 0
        self.prompt_tokens_hit = 0
        self.evictions = 0
        self.spill = False                        # record evicted full blocks for the disk tier
        self._evicted: list[tuple[int, BlockRecord]] = []

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def lookup_prefix(self, request: Request) -> PrefixHit:
        """Longest run of cached full blocks at the start of the request. At least one token is
        always left to compute, so the last position's logits exist."""
        if not self.enable_prefix_cache:
            return PrefixHit((), 0)
        ids, parent = [], ROOT_KEY
        bs = self.block_size
        for start in range(0, request.num_tokens - 1 - bs + 1, bs):
            tokens = tuple(request.token_ids[start:start + bs])
            block_id = self.cached.get(block_key(parent, tokens, request.cache_salt))
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.tokens != tokens or block.parent_key != parent:
                break
            ids.append(block_id)
            parent = block.key
        start = len(ids) * bs
        block_id, m = self._best_follower(request, parent, start, min(bs - 1, request.num_tokens - 1 - start))
        copy_from = block_id if m else None
        shift = self._find_shift(request, start + m)
        return PrefixHit(tuple(ids), start + m, copy_from=copy_from, shift=shift)

    def _find_shift(self, request: Request, hit: int) -> Optional[Shift]:
        """The longest run of a table remembered under the request's reuse key that the request's
        tokens past ``hit`` (its last one aside) repeat at the first position they repeat any, within
        the staleness limit."""
        key = request.reuse_key
        if key is None or self.max_stale <= 0 or key not in self.remembered:
            return None
        self.remembered.move_to_end(key)
        new = request.token_ids
        last = request.num_tokens - 1            # the last token is always computed
        best: Optional[Shift] = None
        for rec in self.remembered[key]:
            old = rec.tokens
            valid = self._valid_tokens(rec)
            if valid < SHIFT_MIN_RUN:
                continue
            common = 0                           # tokens both share from the start
            for a, b in zip(old, new):
                if a != b:
                    break
                common += 1
            index: dict[tuple, list[int]] = {}
            for j in range(min(common, hit), valid - SHIFT_MIN_RUN + 1):
                index.setdefault(tuple(old[j:j + 4]), []).append(j)
            for k in range(hit, last - SHIFT_MIN_RUN + 1):
                run, src = 0, -1
                for j in index.get(tuple(new[k:k + 4]), ()):
                    n = 0
                    while k + n < last and j + n < valid and old[j + n] == new[k + n]:
                        n += 1
                    if n > run:
                        run, src = n, j
                if run < SHIFT_MIN_RUN:
                    continue
                if src == k and k <= common:
                    stale = 0                    # the same tokens after the same text: exact
                else:
                    stale = max(0, k - common) + max(0, src - common)
                if rec.stale_from is not None and src + run > rec.stale_from:
                    stale += rec.stale
                if stale <= self.max_stale and (best is None or run > best.length):
                    best = Shift(k, run, src, rec.block_ids, stale)
                break
        return best

    def _valid_tokens(self, rec: Remembered) -> int:
        """How many of a remembered table's tokens still have their keys and values (its blocks not
        handed out since)."""
        for i, (b, epoch) in enumerate(zip(rec.block_ids, rec.epochs)):
            if self.blocks[b].epoch != epoch:
                return min(len(rec.tokens), i * self.block_size)
        return len(rec.tokens)

    def _best_follower(self, request: Request, parent: int, start: int, limit: int) -> tuple[int, int]:
        """The cached block after ``parent`` sharing the most leading tokens (at most ``limit``) with
        the request's tokens from ``start``, and how many it shares."""
        best, best_m = -1, 0
        if limit <= 0 or not self.reuse_partial_blocks:
            return best, 0
        for block_id in self.followers.get(follower_anchor(parent, request.cache_salt), ()):
            block = self.blocks[block_id]
            if block.parent_key != parent:
                continue
            want = request.token_ids[start:start + min(limit, len(block.tokens))]
            m = 0
            for a, b in zip(block.tokens, want):
                if a != b:
                    break
                m += 1
            if m > best_m:
                best, best_m = block_id, m
        return best, best_m

    def can_allocate(self, hit: PrefixHit, num_tokens: int) -> bool:
        """Could a new request hold `num_tokens` slots, reusing `hit`?"""
        taken = set(hit.block_ids) | set(self._shift_sources(hit.shift))
        reused_free = sum(1 for b in taken if self.blocks[b].ref_count == 0)
        return self.blocks_needed(num_tokens) - len(hit.block_ids) <= len(self.free) - reused_free

    def _shift_sources(self, shift: Optional[Shift]) -> list[int]:
        if shift is None:
            return []
        bs = self.block_size
        return list(dict.fromkeys(s // bs for s in self._slots(shift.src_blocks, shift.src_start, shift.length)))

    def _slots(self, table, start: int, n: int) -> list[int]:
        """The pool slots of positions ``start`` .. ``start + n - 1`` in block table ``table``."""
        bs = self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, start + n)]

    def can_append(self, request: Request, num_tokens: int) -> bool:
        """Could the request grow to `num_tokens` slots?"""
        return self.blocks_needed(num_tokens) - len(request.block_ids) <= len(self.free)

    # ---- changes -------------------------------------------------------------------------
    def allocate(self, request: Request, hit: PrefixHit, num_tokens: int, count_hit: bool = True) -> None:
        assert not request.block_ids, "allocate is for requests that hold no blocks"
        for b in hit.block_ids:
            self._take(self.blocks[b])
        request.block_ids = list(hit.block_ids)
        if count_hit:
            self.prompt_tokens_queried += request.num_prompt_tokens
            self.prompt_tokens_hit += min(hit.num_tokens, request.num_prompt_tokens)
        shift = hit.shift
        held = self._shift_sources(shift)
        for b in held:                  # held before any block is handed out: no destination is a source
            self._take(self.blocks[b])
        self._held.extend(held)
        self.append(request, max(num_tokens, shift.end if shift else 0))
        if hit.copy_from is not None:
            slots = hit.num_tokens - len(hit.block_ids) * self.block_size
            self._copies.append((hit.copy_from, request.block_ids[len(hit.block_ids)], slots))
        request.stale_from, request.stale = None, 0
        if shift is not None:
            src = self._slots(shift.src_blocks, shift.src_start, shift.length)
            dst = self._slots(request.block_ids, shift.start, shift.length)
            self._shifts.append((src, dst, shift.start - shift.src_start))
            if shift.stale:
                request.stale_from, request.stale = shift.start, shift.stale
            self.shift_requests += 1
            self.shift_tokens += shift.length

    def take_shifts(self) -> list[tuple[list[int], list[int], int]]:
        """The (source slots, destination slots, position change) runs allocations asked for since the
        last call, for the engine to copy (keys rotated) after ``take_copies``' copies; then call
        ``release_held``."""
        shifts, self._shifts = self._shifts, []
        return shifts

    def release_held(self) -> None:
        """Let the shifted runs' source blocks go (their runs are copied)."""
        for b in self._held:
            self._release(self.blocks[b])
        self._held = []

    def take_copies(self) -> list[tuple[int, int, int]]:
        """The (source block, destination block, slots) copies allocations asked for since the last
        call; the engine makes them before the step's forward, while every source is still intact."""
        copies, self._copies = self._copies, []
        return copies

    def append(self, request: Request, num_tokens: int) -> None:
        """Grow the request's block table to hold `num_tokens` slots."""
        need = self.blocks_needed(num_tokens) - len(request.block_ids)
        assert need <= len(self.free), "call can_append first"
        for _ in range(need):
            block = self._pop_free()
            block.ref_count = 1
            request.block_ids.append(block.block_id)

    def _pop_free(self) -> Block:
        """The least recently used free block, its cached contents forgotten (and recorded for the
        disk tier), handed out."""
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.key is not None or block.anchor is not None:
            if block.key is not None and self.cached.get(block.key) == block_id:
                del self.cached[block.key]
                if self.spill:
                    self._evicted.append((block_id, BlockRecord(block.key, block.parent_key, block.tokens)))
            self._unfollow(block)
            block.forget()
            self.evictions += 1
        block.epoch += 1
        return block

    # ---- the disk tier ---------------------------------------------------------------------
    def take_evicted(self) -> list[tuple[int, BlockRecord]]:
        """The (block id, record) of full blocks evicted since the last call: their keys and values
        are intact until the step's copies and forward."""
        evicted, self._evicted = self._evicted, []
        return evicted

    def cached_records(self) -> Iterator[tuple[int, BlockRecord]]:
        for key, block_id in self.cached.items():
            block = self.blocks[block_id]
            yield block_id, BlockRecord(key, block.parent_key, block.tokens)

    def restore(self, records: list[BlockRecord], salt: Optional[str], keep: list[int]) -> list[Optional[int]]:
        """Key a free block for each record read back from the disk tier (None: memory has it by now),
        cached and free at the kept end of the list. The blocks ``keep`` (the rest of the request's
        prefix) move there first, and no restore evicts them or an earlier restore."""
        kept = 0
        for b in keep:
            if b in self.free:
                self.free.move_to_end(b)
                kept += 1
        room = len(self.free) - kept
        out: list[Optional[int]] = []
        for rec in records:
            if rec.key in self.cached:
                out.append(None)
                continue
            if room <= 0:
                break
            block = self._pop_free()
            block.key, block.parent_key, block.tokens = rec.key, rec.parent_key, rec.tokens
            self.cached[rec.key] = block.block_id
            self._follow(block, salt)
            self.free[block.block_id] = None
            room -= 1
            out.append(block.block_id)
        return out

    def free_request(self, request: Request) -> None:
        """Release every block of the request, tail first, remembering a partly computed tail block
        (and, with a reuse key, the table: its blocks then wait at the kept end of the free list)."""
        self._remember_tail(request)
        keep = self._remember_table(request)
        for block_id in reversed(request.block_ids):
            self._release(self.blocks[block_id], keep)
        request.block_ids = []

    def _remember_table(self, request: Request) -> bool:
        key = request.reuse_key
        if key is None or self.max_stale <= 0:
            return False
        n = min(request.num_computed_tokens, request.num_tokens)
        if n < SHIFT_MIN_RUN:
            return False
        ids = tuple(request.block_ids[:self.blocks_needed(n)])
        rec = Remembered(tuple(request.token_ids[:n]), ids, tuple(self.blocks[b].epoch for b in ids),
                         request.stale_from, request.stale)
        tables = self.remembered.pop(key, [])
        self.remembered[key] = ([rec] + tables)[:SHIFT_PER_KEY]
        while len(self.remembered) > SHIFT_KEYS:
            self.remembered.popitem(last=False)
        return True

    def trim(self, request: Request, num_tokens: int) -> None:
        """Drop blocks past the first `num_tokens` slots (rolled-back speculative positions)."""
        keep = self.blocks_needed(num_tokens)
        while len(request.block_ids) > keep:
            self._release(self.blocks[request.block_ids.pop()])

    def cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Key every full block among the first `num_tokens` verified tokens."""
        if not self.enable_prefix_cache:
            return
        bs = self.block_size
        exact = num_tokens if request.stale_from is None else min(num_tokens, request.stale_from)
        full = min(exact // bs, len(request.block_ids))
        # blocks are keyed in table order (or came keyed from the cache), so when the last full block
        # has its key every earlier one has too: most steps of a decode end here
        if full == 0 or self.blocks[request.block_ids[full - 1]].key is not None:
            return
        parent = ROOT_KEY
        for i in range(full):
            block = self.blocks[request.block_ids[i]]
            if block.key is None:
                tokens = tuple(request.token_ids[i * bs:(i + 1) * bs])
                key = block_key(parent, tokens, request.cache_salt)
                block.key, block.parent_key, block.tokens = key, parent, tokens
                if self.cached.setdefault(key, block.block_id) == block.block_id:
                    self._follow(block, request.cache_salt)
            parent = block.key

    def reset_prefix_cache(self) -> None:
        for block_id in list(self.cached.values()):
            self.blocks[block_id].forget()
        for ids in self.followers.values():
            for block_id in ids:
                self.blocks[block_id].forget()
        self.cached.clear()
        self.followers.clear()
        self.remembered.clear()

    # ---- internals -----------------------------------------------------------------------
    def _remember_tail(self, request: Request) -> None:
        """Key the request's last block by its computed tokens when it is partly filled and only
        this request holds it (so it will be free), its parent being keyed."""
        if not self.enable_prefix_cache:
            return
        bs = self.block_size
        n = min(request.num_computed_tokens, request.num_tokens)
        if request.stale_from is not None:
            n = min(n, request.stale_from)
        index = n // bs
        if n % bs == 0 or index >= len(request.block_ids):
            return
        block = self.blocks[request.block_ids[index]]
        parent = ROOT_KEY if index == 0 else self.blocks[request.block_ids[index - 1]].key
        if parent is None or block.ref_count != 1 or block.key is not None:
            return
        self._unfollow(block)
        block.tokens, block.parent_key = tuple(request.token_ids[index * bs:n]), parent
        self._follow(block, request.cache_salt)

    def _follow(self, block: Block, salt: Optional[str]) -> None:
        block.anchor = follower_anchor(block.parent_key, salt)
        self.followers.setdefault(block.anchor, []).append(block.block_id)

    def _unfollow(self, block: Block) -> None:
        """Drop a block from the follower lookup (evicted)."""
        if block.anchor is None:
            return
        ids = self.followers.get(block.anchor)
        if ids is not None and block.block_id in ids:
            ids.remove(block.block_id)
            if not ids:
                del self.followers[block.anchor]
        block.anchor = None

    def _take(self, block: Block) -> None:
        if block.ref_count == 0:
            del self.free[block.block_id]
        block.ref_count += 1

    def _release(self, block: Block, keep: bool = False) -> None:
        block.ref_count -= 1
        assert block.ref_count >= 0
        if block.ref_count == 0:
            self.free[block.block_id] = None
            if block.key is None and block.anchor is None and not keep:
                self.free.move_to_end(block.block_id, last=False)

    def stats(self) -> dict:
        return {
            "kv_blocks_total": self.num_blocks,
            "kv_blocks_used": self.num_used_blocks,
            "kv_blocks_free": self.num_free_blocks,
            "kv_blocks_cached": len(self.cached),
            "kv_blocks_partial": sum(1 for ids in self.followers.values() for b in ids if self.blocks[b].key is None),
            "kv_usage": self.num_used_blocks / self.num_blocks,
            "prefix_hit_rate": self.prompt_tokens_hit / self.prompt_tokens_queried if self.prompt_tokens_queried else 0.0,
            "prefix_tokens_hit": self.prompt_tokens_hit,
            "prefix_tokens_queried": self.prompt_tokens_queried,
            "prefix_evictions": self.evictions,
            "shift_requests": self.shift_requests,
            "shift_tokens": self.shift_tokens,
        }
