"""Continuous batching: which tokens of which sequences run in the next step, under a token budget: decodes first,
prompt chunks paced beside them (`Pace`), the newest sequence preempted when blocks run out, prompts that share a
prefix being computed made to wait for it, and n choices of one prompt forked from its last chunk (README's How it
works).
"""

import os
from collections import deque
from dataclasses import dataclass

from llamaterm.engine.serving.block_manager import BlockManager
from llamaterm.engine.serving.sequence import FORCED_MOST, Sequence, Status


@dataclass
class ScheduledChunk:
    seq: Sequence
    start: int  # first token index computed in this step
    length: int  # 0: a fork, which samples from the logits of the chunk before it (the same prompt's last chunk)
    block_copy: tuple[int, int] | None = None  # a fork's last partial block: (source, destination) to copy once
    # the chunk before it has written the source

    @property
    def samples(self) -> bool:
        """The chunk reaches the end of the known tokens, so its last logits pick the next token."""
        return self.start + self.length == self.seq.num_tokens


PACE = 2.0  # a step that carries prefill tokens takes at most this many times a decode step of every session
MIN_PREFILL = 32  # the smallest chunk, so a prompt always moves on
EWMA = 0.1  # weight of the newest step in the running averages


class Pace:
    """How many prefill tokens may ride in a step, from the step times the engine measured: a decode step's time
    per row (its recent average) and a prefill token's share of a mixed step's time. The step may take PACE times
    the decode step of every session there is, decoding or waiting (scaled by rows from the decode steps seen: no
    less than it will take, as a step's fixed costs shrink per row when rows are added), so a batch that is filling
    up fills fast and a full one keeps its pace. Until both are known, no limit."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.row_s: float | None = None  # a decode step's time over its rows
        self.token_s: float | None = None

    def observe(self, decode_rows: int, prefill_tokens: int, seconds: float) -> None:
        average = lambda old, new: new if old is None else old + EWMA * (new - old)
        if prefill_tokens == 0 and decode_rows:
            self.row_s = average(self.row_s, seconds / decode_rows)
        elif self.row_s is not None and prefill_tokens >= MIN_PREFILL:
            share = max(seconds - self.row_s * decode_rows, 0.0) / prefill_tokens
            self.token_s = average(self.token_s, share)

    def prefill_tokens(self, decode_rows: int, sessions: int) -> int:
        if self.row_s is None or not self.token_s:
            return self.max_tokens
        room = self.row_s * (PACE * sessions - decode_rows)
        return int(min(self.max_tokens, max(MIN_PREFILL, room / self.token_s)))


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_batch_tokens: int,
        max_running: int,
        speculate_tokens: int = 0,
    ):
        self.blocks = block_manager
        self.max_batch_tokens = max_batch_tokens
        self.max_running = max_running
        # drafts ride only while the step's sampled rows (a row per sequence, one per draft) stay within this
        self.speculate_tokens = speculate_tokens
        self.pace = Pace(max_batch_tokens)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # oldest first; the newest is the one preempted
        self.free_slots = list(range(max_running - 1, -1, -1))

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledChunk]:
        chunks, prefill = self._schedule_running()
        self._admit_waiting(chunks, prefill)
        return chunks

    def _schedule_running(self) -> tuple[list[ScheduledChunk], int | None]:
        """Running sequences first, decodes before prefill chunks, so no session waits on a new prompt. Returns
        their chunks and the prefill tokens the step has left (None: no prefill chunk placed yet)."""
        budget = self.max_batch_tokens
        prefill: int | None = None  # prefill tokens left for this step; set when the first chunk is placed
        chunks: list[ScheduledChunk] = []
        for seq in sorted(self.running, key=is_prefilling):
            if seq.status is not Status.RUNNING or seq.done_sampling:  # preempted earlier in this loop, or its
                continue  # last token is sampled and only waits to reach the host (engine_core.py: steps overlap)
            n = min(seq.num_to_compute, budget)
            prefilling = is_prefilling(seq)
            if seq.num_drafts:
                n = self._fit_drafts(seq, n)
            if prefilling:
                prefill = self._prefill_left(prefill, chunks)
                n = min(n, prefill)
            if n == 0:
                break
            chunks = self._make_room(seq, n, chunks)
            if seq.status is not Status.RUNNING:
                continue
            self.blocks.allocate(seq.table, seq.num_computed + n)
            chunks.append(ScheduledChunk(seq, seq.num_computed, n))
            budget -= n
            if prefilling:
                prefill = self._prefill_left(prefill, chunks) - n
        return chunks, prefill

    def _fit_drafts(self, seq: Sequence, n: int) -> int:
        """A decoding sequence's chunk of n tokens within the step's budget, with the drafts proposed for it
        (engine/serving/proposer.py) that it leaves room for and the free blocks hold, no one preempted for them;
        the rest go. Returns its length."""
        if n > 1 and not self.blocks.can_allocate(seq.table, seq.num_computed + n):
            n = 1
        if n <= seq.num_drafts:
            seq.drop(keep_drafts=max(0, n - 1))
        return n

    def draft_rows(self) -> int:
        """The rows of speculate_tokens a step leaves for drafts: every running and admitted sequence samples one."""
        return self.speculate_tokens - min(self.max_running, len(self.running) + len(self.waiting))

    def drop_rejected(self, seq: Sequence) -> None:
        """After a step verified a sequence's drafts (its tokens hold the kept ones and the target's next token):
        the cache keeps the K/V of the tokens before that next token, and the blocks past them go back; a draft
        model's cache keeps no more (its K/V of refused drafts is stale, whether or not the next step drafts)."""
        seq.num_computed = min(seq.num_computed, seq.num_tokens - 1)
        self.blocks.truncate(seq.table, seq.num_computed)
        if seq.speculation is not None:
            seq.speculation.draft_computed = min(seq.speculation.draft_computed, seq.num_computed)

    def _make_room(self, seq: Sequence, n: int, chunks: list[ScheduledChunk]) -> list[ScheduledChunk]:
        """Preempts the newest running sequences until seq's next n tokens fit, or seq itself was the newest;
        returns the chunks without those of the preempted."""
        while not self.blocks.can_allocate(seq.table, seq.num_computed + n):
            victim = self.running[-1]
            if victim.num_drafts:  # proposed for this step (no step in flight holds drafts: engine_core.py)
                victim.drop()
            self.preempt(victim)
            chunks = [c for c in chunks if c.seq is not victim]
            if victim is seq:
                break
        return chunks

    def _admit_waiting(self, chunks: list[ScheduledChunk], prefill: int | None) -> None:
        """Admit waiting sequences, oldest first, while tokens, blocks and sampler slots remain (a preempted one has
        its own); one whose prompt is being computed by another waits for it, and the next is considered."""
        budget = self.max_batch_tokens - sum(c.length for c in chunks)
        for seq in list(self.waiting):
            if seq.done_sampling:  # preempted while its last token is in flight: it finishes when that arrives
                break
            if seq.sampler_slot is None and not self.free_slots:
                break
            if self._fork(seq, chunks):  # (takes no tokens of the budget)
                continue
            if budget <= 0:
                break
            if self._computing_its_prefix(seq):
                continue
            prefill = self._prefill_left(prefill, chunks)
            if prefill <= 0:
                break
            self._take_cached_prefix(seq)
            n = min(seq.num_to_compute, budget, prefill)
            # The engine rejects requests larger than the pool, so a sequence always fits once others finish.
            if not self.blocks.can_allocate(seq.table, seq.num_computed + n):
                # give the matched prefix back (it stays cached): waiting sequences that hold blocks could
                # otherwise fill the pool with nothing running
                self.blocks.release(seq.table)
                seq.num_computed = 0
                break
            self.waiting.remove(seq)
            self._admit(seq, n)
            chunks.append(ScheduledChunk(seq, seq.num_computed, n))
            budget -= n
            prefill -= n

    def _fork(self, seq: Sequence, chunks: list[ScheduledChunk]) -> bool:
        """Fork a fresh sequence from one in the step whose chunk ends its prompt, the same tokens as seq's: a
        chunk of no tokens placed after that chunk (step_lists gives it the same logits row)."""
        if seq.table.block_ids or seq.num_computed or seq.num_generated:
            return False
        n = seq.num_tokens
        # not from drafts: their blocks are written again where they are rejected
        same = lambda c: (
            c.length
            and c.samples
            and not c.seq.num_inflight
            and not c.seq.num_drafts
            and c.seq.token_ids == seq.token_ids
        )
        i = next((i for i, c in enumerate(chunks) if same(c)), None)
        if i is None or not self.blocks.can_fork(n):
            return False
        self.waiting.remove(seq)
        copy = self.blocks.fork(chunks[i].seq.table, seq.table, n)
        seq.num_computed = seq.num_cached = n
        self._admit(seq, 0)
        while i + 1 < len(chunks) and chunks[i + 1].length == 0:  # after the parent's earlier forks
            i += 1
        chunks.insert(i + 1, ScheduledChunk(seq, n, 0, copy))
        return True

    def _computing_its_prefix(self, seq: Sequence) -> bool:
        """A running sequence is computing at least a block of seq's prompt that seq would otherwise compute
        again (seq holds no blocks yet; what is computed is in the prefix cache once its blocks are full)."""
        if seq.table.block_ids:
            return False
        bs, prompt = self.blocks.block_size, seq.prompt_token_ids
        for other in self.running:
            if other.num_computed >= other.num_prompt_tokens or other.token_ids[:bs] != prompt[:bs]:
                continue
            common = len(os.path.commonprefix([prompt, other.prompt_token_ids]))
            if other.num_computed // bs < common // bs:
                return True
        return False

    def _take_cached_prefix(self, seq: Sequence) -> None:
        """A sequence that holds no blocks starts after the longest prefix of it the cache holds."""
        if seq.num_computed == 0 and not seq.table.block_ids:
            cached = self.blocks.match_prefix(seq.tokens(0, seq.num_tokens), seq.table)
            seq.num_computed = cached
            if seq.num_known == seq.num_prompt_tokens:  # its first admission, or one before its first token
                seq.num_cached = cached

    def _admit(self, seq: Sequence, n: int) -> None:
        self.blocks.allocate(seq.table, seq.num_computed + n)
        if seq.sampler_slot is None:
            seq.sampler_slot = self.free_slots.pop()
        seq.status = Status.RUNNING
        self.running.append(seq)

    def _prefill_left(self, prefill: int | None, chunks: list[ScheduledChunk]) -> int:
        """The step's prefill allowance: paced beside decode rows (chunks placed so far), whole without them."""
        if prefill is not None:
            return prefill
        if not chunks:
            return self.max_batch_tokens
        sessions = min(self.max_running, len(self.running) + len(self.waiting))
        return self.pace.prefill_tokens(len(chunks), sessions)

    def advance(self, chunks: list[ScheduledChunk]) -> None:
        """After a step's launch: its tokens are computed, and the blocks they fill hold known tokens once the
        tokens still pending (sampled in flight, not yet on the host) are not among them."""
        for c in chunks:
            seq = c.seq
            seq.num_computed += c.length
            self.blocks.commit_full_blocks(seq.table, seq.token_ids, min(seq.num_computed, seq.num_known))
            # drafts may be rejected: no block their window would need goes back
            self.blocks.slide(seq.table, seq.num_computed - seq.num_drafts)

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.release(seq.table)
        seq.num_computed = 0
        if seq.speculation is not None:  # its blocks are gone from the draft model's cache too
            seq.speculation.draft_computed = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a sequence (done or cancelled) wherever it is, freeing its blocks at once."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.release(seq.table)
        if seq.sampler_slot is not None:
            self.free_slots.append(seq.sampler_slot)
            seq.sampler_slot = None
        seq.status = Status.FINISHED


def is_prefilling(seq: Sequence) -> bool:
    """Its next chunk computes its prompt (or, preempted, its tokens again), paced beside the decodes; a decode
    computes its last token, and any drafts or run its grammar forced after it (model_runner.py: fast-forward)."""
    n = seq.num_to_compute - seq.num_drafts
    return n > 1 and (seq.num_computed < seq.num_prompt_tokens or n > 1 + FORCED_MOST)
