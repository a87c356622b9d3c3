"""The block pool on its own: reference counts, epochs and the free list's exact order (the LRU)."""
import pytest

from llmd.runtime.block_pool import BlockPool


def hand_out(pool):
    block_id = pool.pop_free()
    pool.hold(block_id)
    return block_id


def test_blocks_go_out_in_order_each_in_a_new_epoch():
    pool = BlockPool(4)
    assert pool.free_order() == [0, 1, 2, 3] and pool.num_free == 4 and pool.num_used == 0
    assert [hand_out(pool) for _ in range(3)] == [0, 1, 2]
    assert [pool.ref_count(i) for i in range(4)] == [1, 1, 1, 0]
    assert [pool.epoch(i) for i in range(4)] == [1, 1, 1, 0]
    assert pool.free_order() == [3] and pool.num_used == 3


def test_freed_blocks_wait_at_the_end_the_caller_asks_for():
    pool = BlockPool(5)
    ids = [hand_out(pool) for _ in range(4)]              # 0, 1, 2, 3; 4 never used
    for block_id, keep in zip(reversed(ids), (True, False, True, False)):   # a table's tail first
        pool.release(block_id, keep)
    # kept ones join the kept end in release order, unkept ones go to the front, the last freed first
    assert pool.free_order() == [0, 2, 4, 3, 1]
    assert hand_out(pool) == 0 and pool.epoch(0) == 2


def test_a_shared_block_is_freed_by_its_last_holder_only():
    pool = BlockPool(3)
    block_id = hand_out(pool)
    pool.take(block_id)
    pool.release(block_id, True)
    assert pool.ref_count(block_id) == 1 and block_id not in pool.free_order()
    pool.release(block_id, True)
    assert pool.ref_count(block_id) == 0 and pool.free_order() == [1, 2, 0]
    with pytest.raises(AssertionError):
        pool.release(block_id, True)


def test_taking_a_free_block_leaves_the_others_in_order():
    pool = BlockPool(4)
    pool.take(2)
    assert pool.free_order() == [0, 1, 3] and pool.ref_count(2) == 1 and pool.epoch(2) == 0
    pool.release(2, True)
    assert pool.free_order() == [0, 1, 3, 2]


def test_a_popped_block_can_go_back_unheld_to_the_kept_end():
    pool = BlockPool(3)
    block_id = pool.pop_free()
    assert block_id == 0 and pool.ref_count(0) == 0 and pool.free_order() == [1, 2]
    pool.put_back(block_id)
    assert pool.free_order() == [1, 2, 0] and pool.epoch(0) == 1


def test_keep_if_free_moves_free_blocks_only():
    pool = BlockPool(3)
    held = hand_out(pool)
    assert not pool.keep_if_free(held)
    assert pool.keep_if_free(1) and pool.free_order() == [2, 1]
