"""The prefix index on its own: the hash chain, the longest exact prefix, followers, forgetting."""
from llmd.runtime.kv_disk import BlockRecord
from llmd.runtime.prefix_index import ROOT_KEY, PrefixIndex, block_key, follower_anchor

BS = 4


def keyed(tokens, block_ids, salt=None):
    index = PrefixIndex(BS)
    index.key_full_blocks(block_ids, list(tokens), len(tokens) // BS, salt)
    return index


def test_keys_chain_over_parent_salt_and_tokens():
    k = block_key(ROOT_KEY, (1, 2, 3, 4), None)
    assert k == block_key(ROOT_KEY, (1, 2, 3, 4), None)
    others = [block_key(ROOT_KEY, (1, 2, 3, 5), None), block_key(k, (1, 2, 3, 4), None),
              block_key(ROOT_KEY, (1, 2, 3, 4), ""), block_key(ROOT_KEY, (1, 2, 3, 4), "a")]
    assert len({k, *others}) == 5                           # no salt differs from an empty one
    assert follower_anchor(k, "a") == block_key(k, (), "a") != follower_anchor(k, None)


def test_full_blocks_are_keyed_in_a_chain_and_found_leaving_the_last_token():
    index = keyed(range(12), [5, 3, 7])
    k0 = block_key(ROOT_KEY, (0, 1, 2, 3), None)
    k1 = block_key(k0, (4, 5, 6, 7), None)
    assert [index.key(b) for b in (5, 3)] == [k0, k1] and index.num_cached == 3
    assert index.longest_prefix(list(range(12)), 12, None) == ([5, 3], k1)      # block 7 holds the last token
    assert index.longest_prefix(list(range(13)), 13, None)[0] == [5, 3, 7]
    assert index.longest_prefix([0, 1, 2, 3, 9, 5, 6, 7, 8], 9, None) == ([5], k0)
    assert index.longest_prefix(list(range(12)), 12, "salt") == ([], ROOT_KEY)
    assert index.cached_block(k1, (4, 5, 6, 7)) == 3 and index.cached_block(k1, (4, 5, 6, 8)) is None


def test_a_second_block_with_the_same_contents_is_keyed_but_not_cached():
    index = keyed(range(4), [0])
    index.key_full_blocks([1], list(range(4)), 1, None)
    assert index.key(1) == index.key(0) and index.holds(1)
    assert index.num_cached == 1 and index.longest_prefix(list(range(5)), 5, None)[0] == [0]
    assert list(index.followers(ROOT_KEY, None)) == [(0, (0, 1, 2, 3))]


def test_followers_list_full_and_partial_blocks_after_a_parent():
    index = keyed(range(8), [0, 1])
    k0 = index.key(0)
    index.key_partial(2, k0, (4, 5), None)
    index.key_partial(3, k0, (9,), "s")                   # another salt: another list
    assert list(index.followers(k0, None)) == [(1, (4, 5, 6, 7)), (2, (4, 5))]
    assert list(index.followers(k0, "s")) == [(3, (9,))]
    assert index.num_partial == 2 and index.key(2) is None and index.holds(2)
    index.key_partial(2, k0, (4, 5, 6), None)             # listed again with more tokens: once
    assert list(index.followers(k0, None)) == [(1, (4, 5, 6, 7)), (2, (4, 5, 6))]


def test_forgetting_a_block_drops_it_everywhere_and_records_full_ones_for_the_disk_tier():
    index = keyed(range(8), [0, 1])
    index.spill = True
    k0, k1 = index.key(0), index.key(1)
    index.key_partial(2, k1, (8,), None)
    index.forget(1)
    index.forget(2)
    index.forget(3)                                       # held nothing: not an eviction
    assert index.evictions == 2 and index.num_cached == 1 and index.num_partial == 0
    assert not index.holds(1) and list(index.followers(k0, None)) == []
    assert index.take_evicted() == [(1, BlockRecord(k1, k0, (4, 5, 6, 7)))] and index.take_evicted() == []
    assert list(index.cached_records()) == [(0, BlockRecord(k0, ROOT_KEY, (0, 1, 2, 3)))]


def test_a_restored_block_is_found_like_a_computed_one():
    source = keyed(range(8), [0, 1])
    records = [record for _, record in source.cached_records()]
    index = PrefixIndex(BS)
    for block_id, record in zip((6, 4), records):
        index.key_restored(block_id, record, None)
    assert index.has_key(records[1].key)
    assert index.longest_prefix(list(range(9)), 9, None) == ([6, 4], records[1].key)


def test_reset_forgets_cached_and_listed_blocks():
    index = keyed(range(8), [0, 1])
    index.key_partial(2, index.key(1), (8,), None)
    index.reset()
    assert index.num_cached == 0 and index.num_partial == 0
    assert not any(index.holds(b) for b in range(3)) and index.evictions == 0
    assert index.longest_prefix(list(range(9)), 9, None) == ([], ROOT_KEY)
