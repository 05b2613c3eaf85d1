"""Decode steps replayed from CUDA graphs.

A decode step of a small model is a few hundred kernel launches that each take microseconds on the GPU, so
Python and the launches, not the GPU, set its time. For steps in which every sequence adds one token and
samples, the whole forward pass is captured once per batch-size bucket and replayed: the step's inputs are
copied into fixed buffers, padded up to the bucket. Padding rows write no KV (slot -1) and read one key of
block 0; their logits are dropped. The block-table buffer is as wide as the model's context, so one graph
serves every context length (the attention kernel splits each sequence's own keys, kernels/attention_triton.py).
"""

import torch

from llamaterm.engine.serving.model import Model, StepInput

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class DecodeGraphs:
    def __init__(self, model: Model, kv_cache: torch.Tensor, max_batch: int, max_blocks: int):
        self.model, self.kv_cache = model, kv_cache
        self.buckets = [b for b in BUCKETS if b < max_batch] + [min(max_batch, BUCKETS[-1])]
        n, dev = self.buckets[-1], model.device
        ids = lambda fill, dtype=torch.int64: torch.full((n,), fill, dtype=dtype, device=dev)
        self.input_ids, self.positions, self.slot_mapping, self.context_lens = ids(0), ids(0), ids(-1), ids(1)
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(n + 1, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        pool = None
        for b in reversed(self.buckets):  # largest first: the smaller graphs reuse its memory pool
            step = self._step(b)
            model.forward(step, kv_cache)  # compile kernels and allocate their scratch outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = model.forward(step, kv_cache)
            pool = graph.pool()
            self.graphs[b] = graph, logits

    def _step(self, b: int) -> StepInput:
        return StepInput(self.input_ids[:b], self.positions[:b], self.slot_mapping[:b], self.block_tables[:b],
                         self.context_lens[:b], self.query_start_loc[: b + 1], self.query_start_loc[:b])

    def fits(self, step: StepInput) -> bool:
        """A decode step: one token per sequence, every one sampled, within the largest bucket and table."""
        b = step.input_ids.shape[0]
        return (b <= self.buckets[-1] and step.context_lens.shape[0] == b == step.logits_indices.shape[0]
                and step.block_tables.shape[1] <= self.block_tables.shape[1])

    def forward(self, step: StepInput) -> torch.Tensor:
        """The logits model.forward would return for a step that `fits`."""
        b, width = step.input_ids.shape[0], step.block_tables.shape[1]
        bucket = next(x for x in self.buckets if x >= b)
        self.input_ids[:b].copy_(step.input_ids)
        self.positions[:b].copy_(step.positions)
        self.slot_mapping[:b].copy_(step.slot_mapping)
        self.slot_mapping[b:bucket].fill_(-1)
        self.context_lens[:b].copy_(step.context_lens)
        self.context_lens[b:bucket].fill_(1)
        self.block_tables[:b, :width].copy_(step.block_tables)
        graph, logits = self.graphs[bucket]
        graph.replay()
        return logits[:b]
