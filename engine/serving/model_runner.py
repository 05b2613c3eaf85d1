"""The model runner: one scheduled step in, logits out. It owns the KV cache and the CUDA graphs, builds each
step's flat inputs (token ids, positions, slot mapping, block tables) from the scheduled chunks, and warms the
model up before the first request."""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from llamaterm.engine.serving.cuda_graph import DecodeGraphs
from llamaterm.engine.serving.model import Model, StepInput
from llamaterm.engine.serving.scheduler import ScheduledChunk
from llamaterm.kernels.dispatch import use_triton


class ModelRunner:
    def __init__(self, model: Model, num_blocks: int, block_size: int, max_batch: int, cuda_graphs: bool):
        self.model, self.block_size = model, block_size
        self.startup_s: dict[str, float] = {}  # where start-up time went, for `llamaterm bench`
        with self._timed("KV cache"):
            self.kv_cache = model.allocate_kv_cache(num_blocks, block_size)
        with self._timed("warm-up"):
            self._warm_up()
        self.graphs = None
        if cuda_graphs and use_triton(self.kv_cache):  # the torch references sync with the host: no capture
            max_blocks = -(-model.config.context_length // block_size)
            with self._timed("CUDA graphs"):
                self.graphs = DecodeGraphs(model, self.kv_cache, max_batch, max_blocks)

    def run(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Logits for every chunk that samples, in chunk order."""
        step = build_step_input(chunks, self.block_size, self.model.device)
        if self.graphs and self.graphs.fits(step):
            return self.graphs.forward(step)
        return self.model.forward(step, self.kv_cache)

    @contextmanager
    def _timed(self, part: str):
        t = time.perf_counter()
        yield
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)
        self.startup_s[part] = time.perf_counter() - t

    def _warm_up(self) -> None:
        """One token through the model before serving, so weight preparation and kernel compilation are paid at
        load time rather than by the first request's TTFT. It writes slot 0 of a free block: no one reads it."""
        one = lambda *v, dtype=torch.int64: torch.tensor(v, dtype=dtype, device=self.model.device)
        step = StepInput(one(0), one(0), one(0), one([0], dtype=torch.int32), one(1), one(0, 1), one(0))
        self.model.forward(step, self.kv_cache)


def build_step_input(chunks: list[ScheduledChunk], block_size: int, device: torch.device) -> StepInput:
    ids, positions, slots, context_lens, starts, logits_indices = [], [], [], [], [0], []
    for c in chunks:
        seq, end = c.seq, c.start + c.length
        table = seq.table.block_ids
        ids += seq.token_ids[c.start : end]
        positions += range(c.start, end)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(c.start, end)]
        context_lens.append(end)
        starts.append(starts[-1] + c.length)
        if c.samples:
            logits_indices.append(starts[-1] - 1)
    width = max(len(c.seq.table.block_ids) for c in chunks)
    tables = [c.seq.table.block_ids + [0] * (width - len(c.seq.table.block_ids)) for c in chunks]
    as_tensor = lambda x: torch.tensor(x, dtype=torch.int32 if x is tables else torch.int64, device=device)
    return StepInput(
        input_ids=as_tensor(ids),
        positions=as_tensor(positions),
        slot_mapping=as_tensor(slots),
        block_tables=as_tensor(tables),
        context_lens=as_tensor(context_lens),
        query_start_loc=as_tensor(starts),
        logits_indices=as_tensor(logits_indices),
    )
