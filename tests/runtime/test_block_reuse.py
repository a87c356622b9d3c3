"""The reuse policy on its own, over a real pool and prefix index: which partly matching block is
copied, which partial tails are listed, which remembered run is shifted and how stale it is."""
from llmd.runtime.block_pool import BlockPool
from llmd.runtime.block_reuse import SHIFT_KEYS, SHIFT_MIN_RUN, SHIFT_PER_KEY, BlockReuse, Shift
from llmd.runtime.prefix_index import PrefixIndex
from llmd.runtime.request import Request, SamplingParams

BS = 4


def parts(num_blocks=16):
    pool, prefix = BlockPool(num_blocks), PrefixIndex(BS)
    return pool, prefix, BlockReuse(pool, prefix, BS)


def holding(pool, rid, tokens, key=None):
    """A request holding fresh blocks for all its tokens, all of them computed."""
    r = Request(rid, list(tokens), SamplingParams(), reuse_key=key)
    for _ in range(-(-r.num_tokens // BS)):
        block_id = pool.pop_free()
        pool.hold(block_id)
        r.block_ids.append(block_id)
    r.num_computed_tokens = r.num_tokens
    return r


def let_go(pool, r):
    for block_id in reversed(r.block_ids):
        pool.release(block_id, True)


# ---- partial blocks ------------------------------------------------------------------------
def test_the_follower_sharing_the_most_tokens_is_chosen_within_the_limit():
    pool, prefix, reuse = parts()
    prefix.key_full_blocks([0, 1], list(range(8)), 2, None)
    prefix.key_partial(2, prefix.key(1), (8, 9), None)
    prefix.key_partial(3, prefix.key(1), (8,), None)
    r = Request("r", list(range(12)), SamplingParams())
    assert reuse.best_follower(r, prefix.key(1), 8, 3) == (2, 2)
    assert reuse.best_follower(r, prefix.key(1), 8, 1) == (2, 1)      # a tie: the first listed
    assert reuse.best_follower(r, prefix.key(0), 4, 3) == (1, 3)      # a full block's start
    assert reuse.best_follower(r, prefix.key(1), 8, 0) == (-1, 0)
    reuse.partial_blocks = False
    assert reuse.best_follower(r, prefix.key(1), 8, 3) == (-1, 0)


def test_a_partly_computed_tail_held_by_its_request_alone_is_listed():
    pool, prefix, reuse = parts()
    r = holding(pool, "r", range(11))
    reuse.remember_tail(r)
    assert prefix.num_partial == 0                        # its parent is not keyed yet
    prefix.key_full_blocks(r.block_ids, r.token_ids, 2, None)
    r.num_computed_tokens = 8
    reuse.remember_tail(r)
    assert prefix.num_partial == 0                        # nothing of the tail computed
    r.num_computed_tokens, r.stale_from = 10, 9
    pool.take(r.block_ids[2])
    reuse.remember_tail(r)
    assert prefix.num_partial == 0                        # shared: another request may write it
    pool.release(r.block_ids[2], False)
    reuse.remember_tail(r)
    assert list(prefix.followers(prefix.key(1), None)) == [(2, (8,))]     # up to its first stale position


def test_copies_are_handed_over_once():
    _, _, reuse = parts()
    reuse.queue_copy(3, 5, 2)
    assert reuse.take_copies() == [(3, 5, 2)] and reuse.take_copies() == []


# ---- shifted runs --------------------------------------------------------------------------
HEAD, TAIL = list(range(100, 108)), list(range(200, 216))


def test_a_run_is_found_after_an_edit_and_shrinks_as_its_blocks_are_handed_out():
    pool, _, reuse = parts()
    reuse.max_stale = 2
    old = holding(pool, "a", HEAD + TAIL, key="doc")     # blocks 0..5
    assert reuse.remember_table(old)
    assert reuse.remembered["doc"][0].epochs == (1,) * 6
    let_go(pool, old)
    new = Request("b", HEAD + [1, 2] + TAIL, SamplingParams(), reuse_key="doc")
    lengths = []
    for _ in range(4):
        shift = reuse.find_shift(new, len(HEAD))
        lengths.append(shift and (shift.start, shift.src_start, shift.length, shift.stale))
        while pool.free_order()[0] not in old.block_ids:   # hand out the unused blocks, then old's tail
            pool.pop_free()
        pool.pop_free()
    # the run ends before the last token (always computed), then where a block was handed out again
    assert lengths == [(10, 8, 15, 2), (10, 8, 12, 2), (10, 8, 8, 2), None]
    assert reuse.find_shift(Request("c", HEAD + [1, 2] + TAIL, SamplingParams(), reuse_key="x"), 8) is None


def test_staleness_is_limited_and_adds_up_over_chained_reuse():
    pool, _, reuse = parts()
    reuse.max_stale = 3
    old = holding(pool, "a", HEAD + TAIL, key="doc")
    old.stale_from, old.stale = 12, 1                     # itself took an approximate run from 12 on
    reuse.remember_table(old)
    assert reuse.find_shift(Request("b", HEAD + [1, 2] + TAIL, SamplingParams(), reuse_key="doc"), 8).stale == 3
    assert reuse.find_shift(Request("b", HEAD + [1, 2, 3] + TAIL, SamplingParams(), reuse_key="doc"), 8) is None
    typed = reuse.find_shift(Request("b", HEAD + TAIL[:2] + [7] + TAIL[2:], SamplingParams(), reuse_key="doc"), 8)
    assert (typed.start, typed.src_start, typed.length, typed.stale) == (11, 10, 13, 1 + 1)
    same = reuse.find_shift(Request("b", HEAD + TAIL + [5], SamplingParams(), reuse_key="doc"), 8)
    assert (same.start, same.src_start, same.length, same.stale) == (8, 8, 16, 0 + 1)


def test_tables_are_remembered_per_key_and_the_least_recently_used_keys_dropped():
    pool, _, reuse = parts(4)
    reuse.max_stale = 1
    assert not reuse.remember_table(holding(pool, "short", range(SHIFT_MIN_RUN - 1), key="doc"))
    assert not reuse.remember_table(holding(pool, "nokey", range(SHIFT_MIN_RUN)))
    pool = BlockPool(4)
    reuse = BlockReuse(pool, PrefixIndex(BS), BS)
    reuse.max_stale = 1
    for n in range(SHIFT_PER_KEY + 1):
        r = holding(pool, f"r{n}", range(n, n + 8), key="doc")
        reuse.remember_table(r)
        let_go(pool, r)
    assert [rec.tokens[0] for rec in reuse.remembered["doc"]] == list(range(SHIFT_PER_KEY, 0, -1))
    for n in range(1, SHIFT_KEYS):
        r = holding(pool, f"k{n}", range(8), key=f"k{n}")
        reuse.remember_table(r)
        let_go(pool, r)
    reuse.find_shift(Request("q", list(range(20)), SamplingParams(), reuse_key="doc"), 0)   # "doc" used last
    r = holding(pool, "new", range(8), key="new")
    reuse.remember_table(r)
    assert len(reuse.remembered) == SHIFT_KEYS and "doc" in reuse.remembered and "k1" not in reuse.remembered
    reuse.reset()
    assert not reuse.remembered


def test_a_started_request_queues_its_run_and_carries_its_staleness():
    pool, _, reuse = parts()
    r = holding(pool, "r", range(8))                      # blocks 0, 1
    r.stale_from, r.stale = 3, 9                          # from an earlier allocation: replaced
    shift = Shift(start=5, length=3, src_start=1, src_blocks=(7, 9), stale=2)
    assert reuse.shift_sources(shift) == [7]
    assert reuse.shift_sources(Shift(0, 4, 2, (7, 9), 0)) == [7, 9] and reuse.shift_sources(None) == []
    reuse.start_request(r, shift)
    assert reuse.take_shifts() == [([29, 30, 31], [5, 6, 7], 4)] and reuse.take_shifts() == []
    assert (r.stale_from, r.stale) == (5, 2)
    assert (reuse.shift_requests, reuse.shift_tokens) == (1, 3)
    reuse.start_request(r, Shift(4, 4, 4, (7, 9), 0))      # the same text at the same place: exact
    assert (r.stale_from, r.stale) == (None, 0)
    reuse.hold([7, 9])
    assert reuse.take_held() == [7, 9] and reuse.take_held() == []
