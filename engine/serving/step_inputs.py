"""A step's inputs: the scheduled chunks as flat lists (token ids, positions, slot mapping, block tables, the
sampler's rows), and those lists as tensors of exactly the step's size for an eager forward pass (a CUDA graph's
step copies them into its buffers instead: cuda_graph.py)."""

import torch

from llamaterm.engine.serving.model import DeviceStep, StepInput, StepLists
from llamaterm.engine.serving.scheduler import ScheduledChunk


def step_lists(chunks: list[ScheduledChunk], block_size: int, last_rows: dict[int, int]) -> StepLists:
    """The step as flat lists; last_rows maps a sequence id to its row in the last launched step. On the host path
    of every step, so locals rather than attribute lookups."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    qsl, sampler_slots, pending, pending_from = [0], [], [], []
    rows: list[int] = []
    sample_positions: list[int] = []
    for c in chunks:
        seq, start, end = c.seq, c.start, c.start + c.length
        table, known = seq.table.block_ids, seq.num_tokens
        ids += seq.tokens(start, end)
        if seq.num_inflight and start <= (at := seq.num_known) < end:  # the step in flight's sample (its last token,
            pending.append(len(ids) - end + at)  # or before a run its grammar forced)
            ids[pending[-1]] = 0
            pending_from.append(last_rows[seq.id])
        positions += range(start, end)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(start, end)]
        qsl.append(qsl[-1] + c.length)
        if end == known:  # the chunk samples (ScheduledChunk.samples): its last token, and each draft; a fork's (no
            # tokens) the chunk before's row
            assert seq.sampler_slot is not None  # admitted
            drafts = seq.num_drafts
            rows += range(qsl[-1] - 1 - drafts, qsl[-1])
            sampler_slots += [seq.sampler_slot] * (1 + drafts)
            sample_positions += range(end - drafts, end + 1)
    return StepLists(
        ids,
        positions,
        slots,
        [c.seq.table.block_ids for c in chunks],
        [c.start + c.length for c in chunks],
        qsl,
        rows,
        sampler_slots,
        sample_positions,
        pending,
        pending_from,
    )


def device_tensors(step: StepLists, device: torch.device) -> DeviceStep:
    """Tensors of exactly the step's size, for the eager forward pass."""
    width = max(len(t) for t in step.block_tables)
    tables = [t + [0] * (width - len(t)) for t in step.block_tables]
    as_tensor = lambda x, dtype=torch.int64: torch.tensor(x, dtype=dtype, device=device)
    inputs = StepInput(
        input_ids=as_tensor(step.input_ids),
        positions=as_tensor(step.positions),
        slot_mapping=as_tensor(step.slot_mapping),
        block_tables=as_tensor(tables, torch.int32),
        context_lens=as_tensor(step.context_lens),
        query_start_loc=as_tensor(step.query_start_loc),
        logits_indices=as_tensor(step.logits_indices),
    )
    # no index tensors to build (and copy to the device) for a step with no pending inputs
    pending = (as_tensor(step.pending_rows), as_tensor(step.pending_from)) if step.pending_rows else (None, None)
    return DeviceStep(inputs, as_tensor(step.sampler_slots), as_tensor(step.sample_positions), *pending)
