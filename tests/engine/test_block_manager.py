"""Block manager: allocation, ref counts, prefix caching and LRU eviction."""

import tracemalloc

from llamaterm.engine.serving.block_manager import FREED, BlockManager, BlockTable, chain_hash


def test_allocate_and_release_returns_every_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    t = BlockTable()
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
    a = BlockTable()
    assert bm.match_prefix(prompt, a) == 0
    bm.allocate(a, len(prompt))
    bm.commit_full_blocks(a, prompt, len(prompt))
    b = BlockTable()
    assert bm.match_prefix(prompt + [7, 8], b) == 8  # both full blocks are reused
    assert b.block_ids == a.block_ids[:2]
    assert bm.blocks[a.block_ids[0]].ref_count == 2
    c = BlockTable()
    assert bm.match_prefix([999] + prompt[1:], c) == 0  # a different first block breaks the chain


def test_match_leaves_one_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=4)
    prompt = list(range(8))
    a = BlockTable()
    bm.allocate(a, 8)
    bm.commit_full_blocks(a, prompt, 8)
    b = BlockTable()
    assert bm.match_prefix(prompt, b) == 4


def test_freed_cached_blocks_are_evicted_least_recent_first():
    bm = BlockManager(num_blocks=4, block_size=2)
    old, new = [1, 2, 3], [5, 6, 7]
    for prompt in (old, new):
        t = BlockTable()
        bm.allocate(t, 3)
        bm.commit_full_blocks(t, prompt, 3)
        bm.release(t)
    assert bm.num_free == 4
    t = BlockTable()
    bm.allocate(t, 6)  # three blocks: the two never-cached partial ones first, then the oldest cached one
    probe = BlockTable()
    assert bm.match_prefix(old, probe) == 0  # evicted
    assert bm.match_prefix(new, probe) == 2  # the most recently freed prefix survives
    bm.release(probe)
    bm.release(t)
    assert bm.num_free == 4


# --- sliding windows: blocks no window reaches are given back ----------------------------------------------


def held(table: BlockTable) -> list[int]:
    return [b for b in table.block_ids if b != FREED]


def assert_window_is_held(bm: BlockManager, table: BlockTable, token_ids: list[int], num_computed: int):
    """Every key the next token (at position num_computed) sees is in a held block that holds it."""
    bs, window = bm.block_size, bm.window
    for p in range(max(0, num_computed - window + 1), num_computed):
        block_id = table.block_ids[p // bs]
        assert block_id != FREED, f"key {p} of the window of {num_computed} was freed"
        block = bm.blocks[block_id]
        assert block.ref_count >= 1 and block_id not in bm.free
        if block.hash is not None:  # a published block holds exactly the sequence's tokens
            assert block.token_ids == tuple(token_ids[p // bs * bs : (p // bs + 1) * bs])


def run_sequence(bm: BlockManager, token_ids: list[int], table: BlockTable, start: int, chunk: int):
    """Prefill in chunks up to token 20, then decode one token at a time, as the engine does: allocate, compute,
    commit, slide. Returns the most blocks held at once while decoding."""
    most, done = 0, start
    while done < len(token_ids):
        n = min(chunk, len(token_ids) - done) if done < 20 else 1
        assert bm.can_allocate(table, done + n)
        bm.allocate(table, done + n)
        if n == 1:
            most = max(most, len(held(table)))
        else:  # a chunk's own tokens come on top of its first query's window
            assert len(held(table)) <= -(-(bm.window + n) // bm.block_size) + 1
        done += n
        bm.commit_full_blocks(table, token_ids, done)
        bm.slide(table, done)
        assert_window_is_held(bm, table, token_ids, done)
    return most


def test_a_long_sequence_holds_at_most_the_window_plus_one_block():
    window, bs = 10, 4
    bm = BlockManager(num_blocks=64, block_size=bs, window=window)
    tokens = list(range(1000, 1200))  # 200 tokens: 50 blocks, far more than the window's 3
    t = BlockTable()
    assert run_sequence(bm, tokens, t, 0, chunk=7) <= -(-window // bs) + 1
    assert bm.num_free == 64 - len(held(t))
    bm.release(t)
    assert bm.num_free == 64 and t.block_ids == [] and t.num_freed == 0


def test_without_a_window_nothing_is_freed():
    bm = BlockManager(num_blocks=64, block_size=4)
    t = BlockTable()
    bm.allocate(t, 100)
    bm.commit_full_blocks(t, list(range(100)), 100)
    bm.slide(t, 100)
    assert FREED not in t.block_ids and bm.num_free == 64 - 25


def test_window_prefix_match_takes_only_the_blocks_its_window_reaches():
    window, bs = 10, 4
    bm = BlockManager(num_blocks=64, block_size=bs, window=window)
    first_turn = list(range(500, 560))  # 60 tokens
    a = BlockTable()
    run_sequence(bm, first_turn, a, 0, chunk=16)
    bm.release(a)
    second_turn = first_turn + [7, 8, 9, 10, 11, 12]  # the next turn of the chat resends everything
    b = BlockTable()
    cached = bm.match_prefix(second_turn, b)
    assert cached == 60  # every full block up to the new tokens, though most were freed during the first turn
    assert_window_is_held(bm, b, second_turn, cached)
    assert len(held(b)) <= -(-window // bs) + 1 and b.block_ids[: b.num_freed] == [FREED] * b.num_freed
    run_sequence(bm, second_turn, b, cached, chunk=16)  # continues from there


def test_window_prefix_match_stops_before_an_evicted_block_inside_the_window():
    window, bs = 10, 4
    bm = BlockManager(num_blocks=10, block_size=bs, window=window)
    prompt = list(range(300, 340))  # 40 tokens: 10 blocks, the whole pool (a block never used goes first)
    a = BlockTable()
    run_sequence(bm, prompt, a, 0, chunk=40)
    bm.release(a)
    # evict block 7 (inside the window of position 36, the first token a full match leaves to compute): make it
    # the least recently used free block, then take one block
    victim = bm.cached[hash_of(prompt, 8, bs)]
    bm.free.move_to_end(victim, last=False)
    grab = BlockTable()
    bm.allocate(grab, 1)
    assert grab.block_ids == [victim] and hash_of(prompt, 8, bs) not in bm.cached
    b = BlockTable()
    cached = bm.match_prefix(prompt, b)
    assert cached == 7 * bs  # blocks 0..6: the window of position 28 reaches back to block 4, all cached
    assert_window_is_held(bm, b, prompt, cached)
    assert b.num_freed == 4 and len(held(b)) == 3


def hash_of(token_ids: list[int], n_blocks: int, bs: int) -> int:
    """The chain hash of the first n_blocks blocks, as the block manager keys them."""
    h = None
    for i in range(n_blocks):
        h = chain_hash(h, tuple(token_ids[i * bs : (i + 1) * bs]))
    return h


def test_set_up_makes_nothing_per_block():
    """A pool of ten million blocks (a small model's KV pool on an H200 is about 300,000) is set up in memory that
    does not grow with it; a block gets its record when first used, and every block is free until then."""
    tracemalloc.start()
    bm = BlockManager(num_blocks=10_000_000, block_size=16)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 100_000
    assert bm.num_free == bm.num_blocks == 10_000_000 and not bm.blocks
    t = BlockTable()
    bm.allocate(t, 40)
    assert t.block_ids == [0, 1, 2] and sorted(bm.blocks) == [0, 1, 2] and bm.num_free == 10_000_000 - 3


def test_blocks_never_used_go_before_any_cached_block_is_evicted():
    bm = BlockManager(num_blocks=6, block_size=2)
    prompt = [1, 2, 3, 4, 5]
    a = BlockTable()
    bm.allocate(a, 5)
    bm.commit_full_blocks(a, prompt, 5)
    bm.release(a)  # blocks 0 and 1 cache the prompt's two full blocks; block 2 caches nothing
    b = BlockTable()
    bm.allocate(b, 8)  # block 2 first, then the never used 3, 4, 5; then the least recent cached one
    assert b.block_ids == [2, 3, 4, 5]
    probe = BlockTable()
    assert bm.match_prefix(prompt, probe) == 4
    bm.release(probe)
    c = BlockTable()
    bm.allocate(c, 2)
    assert c.block_ids == [1] and bm.match_prefix(prompt, BlockTable()) == 2  # the tail block went first
