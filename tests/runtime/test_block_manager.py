"""Exact behaviour of the block manager: block ids, reference counts, keys and eviction order."""
from llmd.runtime.block_manager import BlockManager, PrefixHit
from llmd.runtime.request import Request, SamplingParams

BS = 4


def req(rid, tokens, salt=None):
    return Request(rid, list(tokens), SamplingParams(), cache_salt=salt)


def admit(bm, r):
    hit = bm.lookup_prefix(r)
    assert bm.can_allocate(hit, r.num_tokens)
    bm.allocate(r, hit, r.num_tokens)
    r.num_computed_tokens = r.num_tokens
    bm.cache_full_blocks(r, r.num_tokens)
    return hit


def test_allocation_order_and_free_count():
    bm = BlockManager(8, BS)
    a = req("a", range(10))                       # 3 blocks
    admit(bm, a)
    assert a.block_ids == [0, 1, 2]
    assert [bm.pool.ref_count(i) for i in range(4)] == [1, 1, 1, 0]
    assert bm.num_free_blocks == 5
    bm.free_request(a)
    assert bm.num_free_blocks == 8 and a.block_ids == []


def test_prefix_hit_shares_blocks_and_counts_refs():
    bm = BlockManager(8, BS)
    a = req("a", range(10))
    admit(bm, a)
    b = req("b", list(range(8)) + [99, 98, 97])  # shares two full blocks
    hit = admit(bm, b)
    assert hit == PrefixHit((0, 1), 8)
    assert b.block_ids == [0, 1, 3]
    assert bm.pool.ref_count(0) == 2 and bm.pool.ref_count(1) == 2
    assert bm.stats()["prefix_tokens_hit"] == 8
    bm.free_request(a)
    bm.free_request(b)
    assert bm.num_free_blocks == 8


def test_last_token_is_never_served_from_cache():
    bm = BlockManager(8, BS)
    a = req("a", range(8))
    admit(bm, a)
    bm.free_request(a)
    again = req("a2", range(8))                   # exactly two full blocks: only the first may hit whole,
    assert bm.lookup_prefix(again) == PrefixHit((0,), 7, copy_from=1)   # the second's first 3 slots are copied


def test_salt_separates_caches():
    bm = BlockManager(8, BS)
    admit(bm, req("a", range(9), salt="alice"))
    assert bm.lookup_prefix(req("b", range(9), salt="bob")).num_tokens == 0
    assert bm.lookup_prefix(req("c", range(9), salt="alice")).num_tokens == 8


def test_eviction_is_lru_and_tail_first():
    bm = BlockManager(6, BS)
    a = req("a", range(12))                       # blocks 0,1,2 all full and keyed
    admit(bm, a)
    bm.free_request(a)
    # Free list: 3,4,5 never used (unkeyed) first, then a's blocks tail first: 2,1,0.
    assert bm.pool.free_order() == [3, 4, 5, 2, 1, 0]
    b = req("b", [50 + i for i in range(16)])     # needs 4 blocks: takes 3,4,5 then evicts a's tail (2)
    admit(bm, b)
    assert b.block_ids == [3, 4, 5, 2]
    assert bm.stats()["prefix_evictions"] == 1
    # a's first two blocks are still cached
    assert bm.lookup_prefix(req("a2", range(12))).block_ids == (0, 1)
    bm.free_request(b)
    assert bm.num_free_blocks == 6


def test_unkeyed_blocks_are_evicted_before_keyed_ones():
    bm = BlockManager(4, BS)
    a = req("a", range(6))                        # block 0 full (keyed), block 1 partial
    admit(bm, a)
    a.num_computed_tokens = 4                     # nothing of block 1 computed: not remembered
    bm.free_request(a)
    assert bm.pool.free_order()[:3] == [1, 2, 3] and bm.pool.free_order()[-1] == 0


def test_reused_free_block_counts_against_capacity():
    bm = BlockManager(3, BS)
    a = req("a", range(9))
    admit(bm, a)
    bm.free_request(a)                            # 2 keyed free blocks + 1 partial
    b = req("b", list(range(8)) + [7] * 5)         # hits 2 blocks, needs 2 more: 4 > 3
    hit = bm.lookup_prefix(b)
    assert hit.num_tokens == 8
    assert not bm.can_allocate(hit, b.num_tokens)
    assert bm.can_allocate(hit, 12)


def test_trim_releases_tail_blocks():
    bm = BlockManager(8, BS)
    a = req("a", range(5))
    admit(bm, a)
    bm.append(a, 13)                              # room for 8 speculative slots
    assert len(a.block_ids) == 4
    bm.trim(a, 6)
    assert a.block_ids == [0, 1]
    assert bm.num_free_blocks == 6
    bm.free_request(a)
    assert bm.num_free_blocks == 8


# ---- partial-block reuse -------------------------------------------------------------------
def test_partial_tail_is_copied_for_an_extending_request():
    bm = BlockManager(8, BS)
    a = req("a", range(10))                       # blocks 0,1 full; block 2 holds tokens 8,9
    admit(bm, a)
    bm.free_request(a)
    assert bm.stats()["kv_blocks_partial"] == 1
    b = req("b", list(range(10)) + [70, 71, 72])  # extends a by three tokens
    hit = admit(bm, b)
    assert hit == PrefixHit((0, 1), 10, copy_from=2)
    assert b.block_ids == [0, 1, 3, 4]            # a fresh block for the copy: nobody writes into block 2
    assert bm.take_copies() == [(2, 3, 2)] and bm.take_copies() == []
    assert bm.pool.ref_count(2) == 0 and bm.stats()["prefix_tokens_hit"] == 10
    assert bm.lookup_prefix(req("c", range(10))) == PrefixHit((0, 1), 9, copy_from=2)


def test_partial_reuse_leaves_the_last_token_and_stops_where_tokens_differ():
    bm = BlockManager(8, BS)
    a = req("a", range(11))                       # block 2 holds 8,9,10
    admit(bm, a)
    bm.free_request(a)
    assert bm.lookup_prefix(req("same", range(11))) == PrefixHit((0, 1), 10, copy_from=2)
    assert bm.lookup_prefix(req("fork", list(range(9)) + [55, 10, 11])) == PrefixHit((0, 1), 9, copy_from=2)
    assert bm.lookup_prefix(req("none", list(range(8)) + [55, 9])) == PrefixHit((0, 1), 8)
    assert bm.lookup_prefix(req("salt", range(11), salt="s")).num_tokens == 0


def test_a_repeated_prompt_copies_the_start_of_a_full_block():
    bm = BlockManager(8, BS)
    a = req("a", range(12))                       # three full keyed blocks
    admit(bm, a)
    bm.free_request(a)
    # the last full block cannot hit (one token must be computed), but its first three slots are copied
    assert bm.lookup_prefix(req("again", range(12))) == PrefixHit((0, 1), 11, copy_from=2)
    assert bm.lookup_prefix(req("short", range(10))) == PrefixHit((0, 1), 9, copy_from=2)


def test_partial_tail_counts_only_computed_tokens_and_is_evicted_like_a_keyed_block():
    bm = BlockManager(4, BS)
    a = req("a", range(7))
    admit(bm, a)
    a.num_computed_tokens = 6                     # the last sampled token was never fed
    bm.free_request(a)
    assert bm.prefix.tokens(1) == (4, 5)
    assert bm.pool.free_order() == [2, 3, 1, 0]   # unkeyed first, then the partial tail before its parent
    b = req("b", [90 + i for i in range(12)])     # takes 2, 3, then evicts the partial block 1
    admit(bm, b)
    assert b.block_ids == [2, 3, 1] and bm.stats()["prefix_evictions"] == 1
    assert bm.stats()["kv_blocks_partial"] == 0
    assert bm.lookup_prefix(req("a2", range(7))) == PrefixHit((0,), 4)


def test_partial_reuse_is_off_with_the_prefix_cache():
    bm = BlockManager(8, BS, enable_prefix_cache=False)
    a = req("a", range(10))
    admit(bm, a)
    bm.free_request(a)
    assert bm.lookup_prefix(req("b", range(12))) == PrefixHit((), 0)
