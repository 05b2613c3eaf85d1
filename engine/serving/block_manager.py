"""Block manager for the paged KV cache: fixed-size blocks, ref counts, and prefix caching by a hash chained over
a block's tokens and its parent's. Freed blocks keep their contents until reused (the free queue is the prefix
cache's LRU list); with a sliding window in every layer a sequence gives back the blocks behind it (`slide`).
"""

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from llamaterm.engine.errors import LlamatermError

FREED = -1  # the table entry of a block given back because no window reaches it any more (never read)


@dataclass(slots=True)
class Block:
    id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = ()


def pool_blocks(kv_tokens: int, block_size: int, bytes_per_token: int, free_bytes: int) -> int:
    """The number of blocks of a KV pool of kv_tokens tokens; a pool that cannot fit the free memory is refused
    here, before the block list or the cache tensor is allocated."""
    need = kv_tokens * bytes_per_token
    if need > free_bytes:
        raise LlamatermError(
            f"a KV cache of {kv_tokens} tokens needs {need / 1e9:.3g} GB, but only "
            f"{free_bytes / 1e9:.3g} GB are free: give a smaller --kv-tokens (or leave it out)"
        )
    return max(1, kv_tokens // block_size)


def chain_hash(parent: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent, token_ids))


@dataclass
class BlockTable:
    """A sequence's block table: the ids of the blocks it owns, in order, and how many of the leading ones are hashed
    (full and cached)."""

    block_ids: list[int] = field(default_factory=list)
    num_hashed: int = 0
    last_hash: int | None = None
    num_freed: int = 0  # leading entries that are FREED


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, window: int | None = None):
        self.block_size = block_size
        self.window = window  # keys every layer reads back from a query (ModelConfig.kv_window); None: all
        self.num_blocks = num_blocks
        self.blocks: dict[int, Block] = {}  # the blocks used so far
        # used blocks with ref_count == 0: those that cache nothing at the front (reused first), then the cached
        # ones, least recently freed first (popping from the front evicts the LRU cached block)
        self.free: OrderedDict[int, None] = OrderedDict()
        self.never_used = num_blocks  # blocks never used: ids num_blocks - never_used .. num_blocks - 1
        self.cached: dict[int, int] = {}  # chain hash -> block id

    @property
    def num_free(self) -> int:
        return len(self.free) + self.never_used

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, token_ids: list[int], table: BlockTable) -> int:
        """Take cached blocks for the longest run of full leading blocks; returns the tokens they cover. With a
        window, the run need only hold the blocks the window of the first token left to compute reaches.

        At least one token is always left to compute: the step that computes it produces the next-token logits.
        """
        bs = self.block_size
        hashes, found = [], []  # chain hash and cached block (or None) of every full block before the last token
        parent = None
        for start in range(0, len(token_ids) - 1 - (len(token_ids) - 1) % bs, bs):
            chunk = tuple(token_ids[start : start + bs])
            parent = chain_hash(parent, chunk)
            block_id = self.cached.get(parent)
            hit = block_id is not None and self.blocks[block_id].token_ids == chunk
            if not hit and self.window is None:
                break
            hashes.append(parent)
            found.append(block_id if hit else None)
        matched, run_start = 0, 0  # blocks matched; where the run of found blocks ending at block i starts
        for i, block_id in enumerate(found):
            if block_id is None:
                run_start = i + 1
            elif run_start <= self.first_needed_block((i + 1) * bs):
                matched = i + 1
        table.num_freed = self.first_needed_block(matched * bs)
        table.block_ids.extend([FREED] * table.num_freed)
        for block_id in found[table.num_freed : matched]:
            assert block_id is not None  # found up to `matched`
            self._ref(block_id)
            table.block_ids.append(block_id)
        table.num_hashed = matched
        table.last_hash = hashes[matched - 1] if matched else None
        return matched * bs

    def first_needed_block(self, num_computed: int) -> int:
        """The first block the window of the token at position num_computed reaches (0 without a window)."""
        if self.window is None:
            return 0
        return max(0, num_computed - self.window + 1) // self.block_size

    def slide(self, table: BlockTable, num_computed: int) -> None:
        """Give back the blocks that no window reaches once num_computed tokens are in the cache (after
        commit_full_blocks, so that they stay in the prefix cache)."""
        keep = min(self.first_needed_block(num_computed), len(table.block_ids))
        for i in range(table.num_freed, keep):
            self._unref(table.block_ids[i])
            table.block_ids[i] = FREED
        table.num_freed = max(table.num_freed, keep)

    def can_allocate(self, table: BlockTable, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) - len(table.block_ids) <= self.num_free

    def allocate(self, table: BlockTable, num_tokens: int) -> None:
        """Grow the table to hold num_tokens tokens (the caller checked can_allocate)."""
        for _ in range(self.blocks_needed(num_tokens) - len(table.block_ids)):
            block = self._take_free()
            if block.hash is not None:  # evict it from the prefix cache
                if self.cached.get(block.hash) == block.id:
                    del self.cached[block.hash]
                block.hash, block.token_ids = None, ()
            block.ref_count = 1
            table.block_ids.append(block.id)

    def _take_free(self) -> Block:
        """The next free block: one that caches nothing, else one never used, else the LRU cached one."""
        front = next(iter(self.free), None)
        if self.never_used and (front is None or self.blocks[front].hash is not None):
            block_id = self.num_blocks - self.never_used
            self.never_used -= 1
            block = self.blocks[block_id] = Block(block_id)
            return block
        block_id, _ = self.free.popitem(last=False)
        return self.blocks[block_id]

    def fork(self, parent: BlockTable, child: BlockTable, num_tokens: int) -> tuple[int, int] | None:
        """Give an empty table the parent's first num_tokens tokens: their full blocks shared, and a partial last
        block as a new block of the child's own, which the caller fills with a copy of the parent's (returned as
        (source, destination)); the caller checked can_fork."""
        bs, full = self.block_size, num_tokens // self.block_size
        child.block_ids.extend(parent.block_ids[:full])
        for block_id in child.block_ids[parent.num_freed :]:
            self._ref(block_id)
        child.num_freed = min(parent.num_freed, full)
        assert parent.num_hashed <= full, "a fork takes every token the parent has hashed"
        child.num_hashed, child.last_hash = parent.num_hashed, parent.last_hash
        if num_tokens % bs == 0:
            return None
        self.allocate(child, num_tokens)
        return parent.block_ids[full], child.block_ids[full]

    def can_fork(self, num_tokens: int) -> bool:
        return num_tokens % self.block_size == 0 or self.num_free >= 1

    def commit_full_blocks(self, table: BlockTable, token_ids: Sequence[int], num_computed: int) -> None:
        """Publish blocks whose tokens are all computed, so later sequences can share them."""
        bs = self.block_size
        while table.num_hashed < min(num_computed // bs, len(table.block_ids)):
            i = table.num_hashed
            chunk = tuple(token_ids[i * bs : (i + 1) * bs])
            h = chain_hash(table.last_hash, chunk)
            block = self.blocks[table.block_ids[i]]  # never FREED: blocks are freed after they were hashed
            if block.hash is None and h not in self.cached:
                block.hash, block.token_ids = h, chunk
                self.cached[h] = block.id
            table.num_hashed += 1
            table.last_hash = h

    def truncate(self, table: BlockTable, num_tokens: int) -> None:
        """Shrink the table to the blocks that hold its first num_tokens tokens: the blocks after them held only
        rejected drafts (engine/serving/speculation.py), never hashed, so they go back to be reused first."""
        keep = max(self.blocks_needed(num_tokens), table.num_freed)
        assert table.num_hashed <= keep, "a hashed block held rejected drafts"
        for block_id in reversed(table.block_ids[keep:]):
            self._unref(block_id)
        del table.block_ids[keep:]

    def release(self, table: BlockTable) -> None:
        """Drop the sequence's references. Tail blocks go to the front of the LRU so they are evicted first."""
        for block_id in reversed(table.block_ids[table.num_freed :]):
            self._unref(block_id)
        table.block_ids.clear()
        table.num_hashed = table.num_freed = 0
        table.last_hash = None

    def _unref(self, block_id: int) -> None:
        """One reference fewer; a block left unowned joins the free queue at its most recent end, or, when it is
        not in the prefix cache, at the front (reused first)."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free[block_id] = None
            if block.hash is None:
                self.free.move_to_end(block_id, last=False)

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1
