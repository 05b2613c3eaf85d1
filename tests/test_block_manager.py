"""Block manager: allocation, ref counts, prefix caching and LRU eviction."""

from llamaterm.engine.serving.block_manager import BlockManager, BlockTableEntry


def test_allocate_and_release_returns_every_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    t = BlockTableEntry()
    assert bm.can_allocate(t, 10)
    bm.allocate(t, 10)
    assert len(t.block_ids) == 3 and bm.num_free == 5
    bm.allocate(t, 12)  # still fits in 3 blocks
    assert len(t.block_ids) == 3
    assert not bm.can_allocate(t, 4 * 9)
    bm.release(t)
    assert bm.num_free == 8 and t.block_ids == []


def test_prefix_is_shared_and_token_ids_are_compared():
    bm = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(100, 111))  # 11 tokens: two full blocks, then three more
    a = BlockTableEntry()
    assert bm.match_prefix(prompt, a) == 0
    bm.allocate(a, len(prompt))
    bm.commit_full_blocks(a, prompt, len(prompt))
    b = BlockTableEntry()
    assert bm.match_prefix(prompt + [7, 8], b) == 8  # both full blocks are reused
    assert b.block_ids == a.block_ids[:2]
    assert bm.blocks[a.block_ids[0]].ref_count == 2
    c = BlockTableEntry()
    assert bm.match_prefix([999] + prompt[1:], c) == 0  # a different first block breaks the chain


def test_match_leaves_one_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=4)
    prompt = list(range(8))
    a = BlockTableEntry()
    bm.allocate(a, 8)
    bm.commit_full_blocks(a, prompt, 8)
    b = BlockTableEntry()
    assert bm.match_prefix(prompt, b) == 4


def test_freed_cached_blocks_are_evicted_least_recent_first():
    bm = BlockManager(num_blocks=4, block_size=2)
    old, new = [1, 2, 3], [5, 6, 7]
    for prompt in (old, new):
        t = BlockTableEntry()
        bm.allocate(t, 3)
        bm.commit_full_blocks(t, prompt, 3)
        bm.release(t)
    assert bm.num_free == 4
    t = BlockTableEntry()
    bm.allocate(t, 6)  # three blocks: the two never-cached partial ones first, then the oldest cached one
    probe = BlockTableEntry()
    assert bm.match_prefix(old, probe) == 0  # evicted
    assert bm.match_prefix(new, probe) == 2  # the most recently freed prefix survives
    bm.release(probe)
    bm.release(t)
    assert bm.num_free == 4
