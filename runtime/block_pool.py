"""BlockPool: the paged KV pool's blocks, their reference counts and the free list, which is the LRU.

    free list:  | evict first ..................................................... kept end |
                  never used, or freed holding nothing         freed holding cached contents,
                  worth keeping                                a request's tail before its head

A block whose reference count drops to zero joins the free list, at the kept end when what it holds
is worth keeping (the caller says), else at the evict-first end. Handing a block out takes the
evict-first end and starts a new epoch for it (how often it was handed out), so that a table of
block ids remembered earlier can tell whether a block still holds what it held. Removal from the
middle of the list (a free block taken again) is O(1).

The pool is the only writer of reference counts, epochs and the free list. It knows nothing of what
the blocks hold: the prefix index forgets a block's contents when it is handed out.
"""
from __future__ import annotations

from collections import OrderedDict


class BlockPool:
    def __init__(self, num_blocks: int):
        assert num_blocks > 0
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._epochs = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def epoch(self, block_id: int) -> int:
        """How often the block was handed out."""
        return self._epochs[block_id]

    def free_order(self) -> list[int]:
        """The free blocks, the next one handed out first."""
        return list(self._free)

    # ---- changes -------------------------------------------------------------------------
    def pop_free(self) -> int:
        """The least recently used free block, off the free list, in a new epoch, its reference count
        still 0: ``hold`` it, or ``put_back`` it."""
        block_id, _ = self._free.popitem(last=False)
        self._epochs[block_id] += 1
        return block_id

    def hold(self, block_id: int) -> None:
        """Hand out a block ``pop_free`` returned."""
        assert self._ref_counts[block_id] == 0 and block_id not in self._free
        self._ref_counts[block_id] = 1

    def put_back(self, block_id: int) -> None:
        """Return a block ``pop_free`` returned to the free list's kept end, unheld."""
        assert self._ref_counts[block_id] == 0
        self._free[block_id] = None

    def take(self, block_id: int) -> None:
        """One more holder of a block (a free one leaves the free list where it is)."""
        if self._ref_counts[block_id] == 0:
            del self._free[block_id]
        self._ref_counts[block_id] += 1

    def release(self, block_id: int, keep: bool) -> None:
        """One holder fewer; the last one frees the block, at the kept end when ``keep``."""
        self._ref_counts[block_id] -= 1
        assert self._ref_counts[block_id] >= 0
        if self._ref_counts[block_id] == 0:
            self._free[block_id] = None
            if not keep:
                self._free.move_to_end(block_id, last=False)

    def keep_if_free(self, block_id: int) -> bool:
        """Move a free block to the kept end; False when it is held."""
        if block_id not in self._free:
            return False
        self._free.move_to_end(block_id)
        return True
