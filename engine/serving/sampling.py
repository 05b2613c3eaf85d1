"""The model runner's sampler: per-slot sampling tables on the device, written when a sequence first takes part in
a step, and the batched kernel over every row of a step (kernels/sampling.py). A sequence keeps its slot for its
whole life, preemptions included (scheduler.py), so its token counts stay valid while it waits."""

from typing import cast

import torch

from llamaterm.engine.sampling_params import SamplingParams
from llamaterm.engine.serving.sequence import Sequence
from llamaterm.kernels.sampling import sample
from llamaterm.kernels.sampling_tables import BIASED, CONSTRAINED, SamplingTables


def penalised(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def as_int64(seed: int) -> int:
    """A 64-bit seed as the int64 that holds its bit pattern."""
    return seed - (1 << 64) if seed >= 1 << 63 else seed


class Sampler:
    def __init__(self, slots: int, vocab: int, device: torch.device, draft_slots: int = 0):
        """draft_slots: slots past the sequences' own for the rows of penalised sequences' drafts (write_draft_rows)."""
        self.tables = SamplingTables.allocate(slots + draft_slots, vocab, device)
        self.device = device
        self._owner: list[int | None] = [None] * slots  # the sequence each slot's rows were written for
        self.first_draft_slot = slots

    def join(self, seq: Sequence) -> None:
        """Write a sequence's parameters into its slot once; with penalties, its prompt tokens and zero counts.
        Stream order keeps this behind the step in flight, which may still read the slot's last owner."""
        slot = seq.sampler_slot
        assert slot is not None
        if self._owner[slot] == seq.id:
            return
        self._owner[slot] = seq.id
        p, t = seq.params, self.tables
        floats = [p.temperature, p.top_p, p.min_p, p.repetition_penalty, p.presence_penalty, p.frequency_penalty]
        t.floats[slot].copy_(self._staged(floats, torch.float32), non_blocking=True)
        flags = (BIASED if p.logit_bias else 0) | (CONSTRAINED if seq.grammar is not None else 0)
        t.ints[slot].copy_(self._staged([p.top_k, as_int64(seq.seed), flags], torch.int64), non_blocking=True)
        if p.logit_bias:
            ids, biases = zip(*p.logit_bias, strict=True)
            t.bias[slot].zero_()
            t.bias[slot].index_put_(
                (self._staged(list(ids), torch.int64).to(self.device, non_blocking=True),),
                self._staged(list(biases), torch.float32).to(self.device, non_blocking=True),
            )
        if penalised(p):
            t.counts[slot].zero_()
            t.in_prompt[slot].zero_()
            prompt = self._staged(seq.prompt_token_ids, torch.int64)
            t.in_prompt[slot].index_fill_(0, prompt.to(self.device, non_blocking=True), 1)

    def _staged(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        """Values to copy to the device without waiting: from pinned memory on CUDA (a copy from pageable memory
        may wait for the step in flight), which torch's host allocator keeps until the copy is done."""
        host = torch.tensor(values, dtype=dtype)
        return host.pin_memory() if self.device.type == "cuda" else host

    def write_bitmasks(self, lo: int, hi: int, bitmask: torch.Tensor) -> None:
        """The next token's bitmasks of the constrained slots among lo..hi - 1: rows lo..hi - 1 of `bitmask` (on the
        host, a row per slot), in one copy. The span's other rows are stale; their slots' are not read before they
        are written again: a slot's row is read only where its flags say constrained, and every constrained slot
        that samples in a step has its row filled for that step (sequences under a grammar never draft, so no draft
        slot copies a constrained slot's flags). The host rows may be refilled once the step that reads them has
        sampled (its tokens reached the host)."""
        self.tables.bitmask[lo:hi].copy_(bitmask[lo:hi], non_blocking=True)

    def write_draft_rows(self, seq: Sequence, drafts: list[int], slots: list[int]) -> None:
        """Draft slots (past the sequences' own) for a penalised sequence's rows at its drafts: row i samples after
        drafts[:i + 1], so its penalties count them too, as decoding would have. Each is a copy of the sequence's
        slot with those drafts counted; the sampler's count-up in them is dropped (count_tokens counts the drafts
        kept in the sequence's own slot)."""
        t, own = self.tables, seq.sampler_slot
        assert own is not None and len(slots) == len(drafts) and min(slots) >= self.first_draft_slot
        at = self._staged(slots, torch.int64).to(self.device, non_blocking=True)
        for table in (t.floats, t.ints, t.in_prompt, t.bias, t.counts):
            table.index_copy_(0, at, table[own].repeat(len(slots), 1))  # (a copy: the rows share no memory)
        # the slot of draft row i counts drafts 0 .. i
        rows = [s for i, s in enumerate(slots) for _ in range(i + 1)]
        self._count(rows, [d for i in range(len(drafts)) for d in drafts[: i + 1]])

    def count_tokens(self, runs: list[tuple[Sequence, list[int]]]) -> None:
        """Count tokens penalised sequences took without their own rows sampling them (kept drafts after the first,
        runs their grammars forced) in their penalties: (sequence, tokens) pairs, in one scatter."""
        self._count(
            [cast(int, seq.sampler_slot) for seq, tokens in runs for _ in tokens], [t for _, r in runs for t in r]
        )

    def _count(self, slots: list[int], tokens: list[int]) -> None:
        """counts[slots[i], tokens[i]] += 1 for each i, in one kernel: an index_add_ into the table's flat view
        (an accumulating index_put_ sorts its indices first: several kernels and host time each call)."""
        if slots:
            counts, vocab = self.tables.counts, self.tables.counts.shape[1]
            flat = self._staged([s * vocab + t for s, t in zip(slots, tokens, strict=True)], torch.int64)
            ones = torch.ones(len(slots), dtype=counts.dtype, device=self.device)
            counts.view(-1).index_add_(0, flat.to(self.device, non_blocking=True), ones)

    def sample(self, logits: torch.Tensor, sampler_slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return sample(logits, sampler_slots, positions, self.tables)
