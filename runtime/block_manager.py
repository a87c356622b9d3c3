"""BlockManager: the paged KV pool's bookkeeping, its prefix cache and its free list.

    pool:   | b0 | b1 | b2 | ... | bN-1 |        each block holds `block_size` token slots
    request.block_ids = [b7, b2, b9]            its tokens 0..15 live in b7, 16..31 in b2, ...

A full block is keyed by a 128-bit BLAKE2b digest chained over its parent's key, its token ids and
the request's cache salt, and stays keyed after it is freed. The free list *is* the LRU: a block whose reference count
drops to zero joins the free list (unkeyed blocks at the evict-first end, keyed ones at the other end,
a request's tail before its head), and a keyed block is only forgotten when it is handed out again.
A lookup also compares the stored tokens and parent key. The digest is cryptographic so that
nobody can make two keys meet on purpose: a request can only hit blocks written under its own salt.

The block manager is the only writer of reference counts, keys, the free list and request.block_ids.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

from .request import Request


class Block:
    __slots__ = ("block_id", "ref_count", "key", "parent_key", "tokens")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.key: Optional[int] = None
        self.parent_key: Optional[int] = None
        self.tokens: Optional[tuple] = None

    def forget(self) -> None:
        self.key = self.parent_key = self.tokens = None


@dataclass(frozen=True)
class PrefixHit:
    """What the prefix cache holds for the start of a request (a narrow view for the scheduler)."""

    block_ids: tuple[int, ...]
    num_tokens: int


ROOT_KEY = 0


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
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # left = evict first
        self.cached: dict[int, int] = {}          # key -> block id
        self.prompt_tokens_queried = 0
        self.prompt_tokens_hit = 0
        self.evictions = 0

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
        return PrefixHit(tuple(ids), len(ids) * bs)

    def can_allocate(self, hit: PrefixHit, num_tokens: int) -> bool:
        """Could a new request hold `num_tokens` slots, reusing `hit`?"""
        reused_free = sum(1 for b in hit.block_ids if self.blocks[b].ref_count == 0)
        return self.blocks_needed(num_tokens) - len(hit.block_ids) <= len(self.free) - reused_free

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
        self.append(request, num_tokens)

    def append(self, request: Request, num_tokens: int) -> None:
        """Grow the request's block table to hold `num_tokens` slots."""
        need = self.blocks_needed(num_tokens) - len(request.block_ids)
        assert need <= len(self.free), "call can_append first"
        for _ in range(need):
            block_id, _ = self.free.popitem(last=False)
            block = self.blocks[block_id]
            if block.key is not None:
                if self.cached.get(block.key) == block_id:
                    del self.cached[block.key]
                block.forget()
                self.evictions += 1
            block.ref_count = 1
            request.block_ids.append(block_id)

    def free_request(self, request: Request) -> None:
        """Release every block of the request, tail first."""
        for block_id in reversed(request.block_ids):
            self._release(self.blocks[block_id])
        request.block_ids = []

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
        full = min(num_tokens // bs, len(request.block_ids))
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
                self.cached.setdefault(key, block.block_id)
            parent = block.key

    def reset_prefix_cache(self) -> None:
        for block_id in list(self.cached.values()):
            self.blocks[block_id].forget()
        self.cached.clear()

    # ---- internals -----------------------------------------------------------------------
    def _take(self, block: Block) -> None:
        if block.ref_count == 0:
            del self.free[block.block_id]
        block.ref_count += 1

    def _release(self, block: Block) -> None:
        block.ref_count -= 1
        assert block.ref_count >= 0
        if block.ref_count == 0:
            self.free[block.block_id] = None
            if block.key is None:
                self.free.move_to_end(block.block_id, last=False)

    def stats(self) -> dict:
        return {
            "kv_blocks_total": self.num_blocks,
            "kv_blocks_used": self.num_used_blocks,
            "kv_blocks_free": self.num_free_blocks,
            "kv_blocks_cached": len(self.cached),
            "kv_usage": self.num_used_blocks / self.num_blocks,
            "prefix_hit_rate": self.prompt_tokens_hit / self.prompt_tokens_queried if self.prompt_tokens_queried else 0.0,
            "prefix_tokens_hit": self.prompt_tokens_hit,
            "prefix_tokens_queried": self.prompt_tokens_queried,
            "prefix_evictions": self.evictions,
        }
