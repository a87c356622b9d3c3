"""PrefixIndex: what the pool's blocks hold, found by the hash chain of the prompts that wrote them.

    key(block 0) = H(ROOT_KEY,     salt, tokens 0 .. bs-1)        H: 128-bit BLAKE2b
    key(block i) = H(key(block i-1), salt, tokens of block i)
    anchor(parent) = H(parent,     salt, no tokens)                the blocks that follow a parent

A full block is keyed by its digest and stays keyed after it is freed; it is only forgotten when the
pool hands it out again (``forget``). A lookup also compares the stored tokens and parent key. The
digest is cryptographic so that nobody can make two keys meet on purpose: a request can only hit
blocks written under its own salt.

Besides the key -> block map, every cached full block and every partly filled block the reuse policy
keeps (``key_partial``: its computed tokens, no key) is listed under its parent's anchor, so the
blocks that follow a parent can be compared with a prompt's next tokens (``followers``).

The disk tier (llmd.runtime.kv_tier, when on): a forgotten full block is recorded for the engine to
copy out before anything overwrites it (``spill``, ``take_evicted``), and ``key_restored`` keys a block
for one read back from disk.

The index is the only writer of keys, the key -> block map and the follower lists.
"""
from __future__ import annotations

import hashlib
from array import array
from typing import Iterator, Optional, Sequence

from .kv_disk import BlockRecord

ROOT_KEY = 0


def block_key(parent_key: int, tokens: tuple, salt: Optional[str]) -> int:
    h = hashlib.blake2b(parent_key.to_bytes(16, "little"), digest_size=16)
    s = b"" if salt is None else salt.encode("utf-8", "surrogatepass")
    h.update((0 if salt is None else len(s) + 1).to_bytes(8, "little") + s)    # no salt differs from ""
    h.update(array("q", tokens).tobytes())
    return int.from_bytes(h.digest(), "little")


def follower_anchor(parent_key: int, salt: Optional[str]) -> int:
    """The key the blocks after ``parent_key`` are found under (a full block's key hashes tokens)."""
    return block_key(parent_key, (), salt)


class _Entry:
    """What one block holds: a full block's key, or (key None) a partly filled block's tokens."""

    __slots__ = ("key", "parent_key", "tokens", "anchor")

    def __init__(self):
        self.key: Optional[int] = None
        self.parent_key: Optional[int] = None
        self.tokens: Optional[tuple] = None      # a full block's tokens, or a partial block's computed ones
        self.anchor: Optional[int] = None        # where ``followers`` finds it


class PrefixIndex:
    def __init__(self, block_size: int):
        assert block_size > 0
        self.block_size = block_size
        self._entries: dict[int, _Entry] = {}     # block id -> what it holds (absent: nothing worth keeping)
        self._cached: dict[int, int] = {}         # key -> block id
        self._followers: dict[int, list[int]] = {}  # anchor -> cached blocks (full or partial) after that parent
        self.evictions = 0                        # blocks forgotten because the pool handed them out
        self.spill = False                        # record forgotten full blocks for the disk tier
        self._evicted: list[tuple[int, BlockRecord]] = []

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_partial(self) -> int:
        return sum(1 for ids in self._followers.values() for b in ids if self._entries[b].key is None)

    def holds(self, block_id: int) -> bool:
        """Whether the block holds anything a lookup may find (a key, or a partial block's tokens)."""
        return block_id in self._entries

    def key(self, block_id: int) -> Optional[int]:
        entry = self._entries.get(block_id)
        return None if entry is None else entry.key

    def tokens(self, block_id: int) -> Optional[tuple]:
        entry = self._entries.get(block_id)
        return None if entry is None else entry.tokens

    def has_key(self, key: int) -> bool:
        return key in self._cached

    def cached_block(self, key: int, tokens: tuple) -> Optional[int]:
        """The cached block under ``key`` when it holds ``tokens``."""
        block_id = self._cached.get(key)
        if block_id is None or self._entries[block_id].tokens != tokens:
            return None
        return block_id

    def longest_prefix(self, token_ids: Sequence[int], num_tokens: int, salt: Optional[str]) \
            -> tuple[list[int], int]:
        """The cached full blocks at the start of ``token_ids`` (their last token aside), and the key
        of the last one (ROOT_KEY when none)."""
        ids, parent = [], ROOT_KEY
        bs = self.block_size
        for start in range(0, num_tokens - 1 - bs + 1, bs):
            tokens = tuple(token_ids[start:start + bs])
            block_id = self._cached.get(block_key(parent, tokens, salt))
            if block_id is None:
                break
            entry = self._entries[block_id]
            if entry.tokens != tokens or entry.parent_key != parent:
                break
            ids.append(block_id)
            parent = entry.key
        return ids, parent

    def followers(self, parent: int, salt: Optional[str]) -> Iterator[tuple[int, tuple]]:
        """The (block id, tokens) of the blocks listed after ``parent`` under ``salt``."""
        for block_id in self._followers.get(follower_anchor(parent, salt), ()):
            entry = self._entries[block_id]
            if entry.parent_key == parent:
                yield block_id, entry.tokens

    def cached_records(self) -> Iterator[tuple[int, BlockRecord]]:
        for key, block_id in self._cached.items():
            entry = self._entries[block_id]
            yield block_id, BlockRecord(key, entry.parent_key, entry.tokens)

    # ---- changes -------------------------------------------------------------------------
    def key_full_blocks(self, block_ids: Sequence[int], token_ids: Sequence[int], full: int,
                        salt: Optional[str]) -> None:
        """Key the first ``full`` blocks of a block table, which hold ``token_ids``."""
        # blocks are keyed in table order (or came keyed from the cache), so when the last full block
        # has its key every earlier one has too: most steps of a decode end here
        if full == 0 or self.key(block_ids[full - 1]) is not None:
            return
        bs = self.block_size
        parent = ROOT_KEY
        for i in range(full):
            block_id = block_ids[i]
            entry = self._entries.get(block_id)
            if entry is None or entry.key is None:
                entry = self._entries.setdefault(block_id, _Entry())
                tokens = tuple(token_ids[i * bs:(i + 1) * bs])
                key = block_key(parent, tokens, salt)
                entry.key, entry.parent_key, entry.tokens = key, parent, tokens
                if self._cached.setdefault(key, block_id) == block_id:
                    self._follow(block_id, entry, salt)
            parent = entry.key

    def key_partial(self, block_id: int, parent: int, tokens: tuple, salt: Optional[str]) -> None:
        """List a partly filled block, holding ``tokens``, after ``parent``."""
        entry = self._entries.setdefault(block_id, _Entry())
        self._unfollow(block_id, entry)
        entry.tokens, entry.parent_key = tokens, parent
        self._follow(block_id, entry, salt)

    def key_restored(self, block_id: int, record: BlockRecord, salt: Optional[str]) -> None:
        """Key a block (holding nothing) for a block read back from the disk tier."""
        assert block_id not in self._entries
        entry = self._entries[block_id] = _Entry()
        entry.key, entry.parent_key, entry.tokens = record.key, record.parent_key, record.tokens
        self._cached[record.key] = block_id
        self._follow(block_id, entry, salt)

    def forget(self, block_id: int) -> None:
        """The pool hands the block out: forget what it holds (recorded for the disk tier)."""
        entry = self._entries.pop(block_id, None)
        if entry is None:
            return
        if entry.key is not None and self._cached.get(entry.key) == block_id:
            del self._cached[entry.key]
            if self.spill:
                self._evicted.append((block_id, BlockRecord(entry.key, entry.parent_key, entry.tokens)))
        self._unfollow(block_id, entry)
        self.evictions += 1

    def take_evicted(self) -> list[tuple[int, BlockRecord]]:
        """The (block id, record) of full blocks forgotten since the last call."""
        evicted, self._evicted = self._evicted, []
        return evicted

    def reset(self) -> None:
        """Forget every cached and listed block."""
        for block_id in self._cached.values():
            self._entries.pop(block_id, None)
        for ids in self._followers.values():
            for block_id in ids:
                self._entries.pop(block_id, None)
        self._cached.clear()
        self._followers.clear()

    # ---- internals -----------------------------------------------------------------------
    def _follow(self, block_id: int, entry: _Entry, salt: Optional[str]) -> None:
        entry.anchor = follower_anchor(entry.parent_key, salt)
        self._followers.setdefault(entry.anchor, []).append(block_id)

    def _unfollow(self, block_id: int, entry: _Entry) -> None:
        if entry.anchor is None:
            return
        ids = self._followers.get(entry.anchor)
        if ids is not None and block_id in ids:
            ids.remove(block_id)
            if not ids:
                del self._followers[entry.anchor]
        entry.anchor = None
