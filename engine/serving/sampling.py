"""The model runner's sampler: per-slot sampling tables on the device, written when a sequence first takes part in
a step, and the batched kernel over every row of a step (kernels/sampling.py). A sequence keeps its slot for its
whole life, preemptions included (scheduler.py), so its token counts stay valid while it waits."""

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
    def __init__(self, slots: int, vocab: int, device: torch.device):
        self.tables = SamplingTables.allocate(slots, vocab, device)
        self.device = device
        self._owner: list[int | None] = [None] * slots  # the sequence each slot's rows were written for

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
            prompt = self._staged(seq.token_ids[: seq.num_prompt_tokens], torch.int64)
            t.in_prompt[slot].index_fill_(0, prompt.to(self.device, non_blocking=True), 1)

    def _staged(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        """Values to copy to the device without waiting: from pinned memory on CUDA (a copy from pageable memory
        may wait for the step in flight), which torch's host allocator keeps until the copy is done."""
        host = torch.tensor(values, dtype=dtype)
        return host.pin_memory() if self.device.type == "cuda" else host

    def write_bitmasks(self, slots: list[int], bitmask: torch.Tensor) -> None:
        """The next token's bitmasks of constrained slots, rows of `bitmask` (on the host) in the order of `slots`.
        The host rows may be refilled once the step that reads them has sampled (its tokens reached the host)."""
        rows = self._staged(slots, torch.int64).to(self.device, non_blocking=True)
        source = bitmask[: len(slots)]
        self.tables.bitmask.index_copy_(0, rows, source.to(self.device, non_blocking=True))

    def sample(self, logits: torch.Tensor, sampler_slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return sample(logits, sampler_slots, positions, self.tables)
