"""Every step replayed from a CUDA graph: decodes, prefill chunks, and steps that mix them.

A step of a small model is hundreds of kernel launches that each take microseconds on the GPU, so Python and the
launches, not the GPU, would set its time. The forward pass is captured once per token-count bucket and replayed:
a bucket of T tokens holds up to B = min(T, max_batch) sequences. The step's metadata is written into one pinned
host buffer and copied with two transfers into fixed device buffers the graphs read, padded up to the bucket:
- padding tokens write no KV (slot -1) and belong to no sequence: the padding sequences have no query tokens
  (query_start_loc stays at the real token count), so the attention kernel skips them; their rows are computed
  and dropped;
- logits rows past the step's sampled sequences are dropped.
The block-table buffer is as wide as the model's context, so one graph serves every context length (the
attention kernel sizes its KV splits from each sequence's own length, kernels/attention_triton.py).
Buckets: powers of two up to max_batch (pure decode steps), then coarser steps up to the step token budget
(token_buckets). Decode buckets, every session's steady state, are captured at start-up; a larger bucket runs
eagerly over the same padded buffers the first time a step needs it and is captured the second time, so start-up
captures a few graphs and a one-shot command never captures a prefill. Padded to its bucket, an eager step
launches the kernel variants its graph would: on a first start (compile_all) a forward pass over every bucket
compiles them all before the first request, and later starts find them in Triton's cache.
"""

import torch

from llamaterm.engine.serving.model import Model, StepInput, StepLists, take_pending


def token_buckets(max_batch: int, max_tokens: int) -> list[int]:
    """1, 2, 4 ... 64 and max_batch (decode steps); then steps of 64 up to 512, the quantized matmul's row tile
    (a step pays per started tile), and of 256 up to max_tokens: a mixed step pads less than a tile up to 512
    tokens and less than 256 tokens (under half its own) above."""
    out, t = [], 1
    while t < max_tokens:
        out.append(t)
        t = t * 2 if t < 64 else t + (64 if t < 512 else 256)
    return sorted({*out, min(max_batch, max_tokens), max_tokens})


class StepGraphs:
    def __init__(
        self, model: Model, kv_cache: torch.Tensor, max_batch: int, max_tokens: int, max_blocks: int, compile_all: bool
    ):
        self.model, self.kv_cache = model, kv_cache
        self.buckets = token_buckets(max_batch, max_tokens)
        self.max_batch = max_batch
        t, b, dev = self.buckets[-1], max_batch, model.device
        # one int64 buffer: ids, positions, slots [t each], context lens [b], query starts [b + 1], logits rows [b],
        # and (read before the replay) the rows whose token is the step in flight's sample, and its rows [b each]
        self.offsets = {
            "ids": 0,
            "pos": t,
            "slots": 2 * t,
            "ctx": 3 * t,
            "qsl": 3 * t + b,
            "rows": 3 * t + 2 * b + 1,
            "prow": 3 * t + 3 * b + 1,
            "pfrom": 3 * t + 4 * b + 1,
        }
        size = 3 * t + 5 * b + 1
        # two pinned host buffers in turn: with steps overlapped (engine.py), the next step's metadata is written
        # while this step's copy may still wait in the stream; the one before it was done when its tokens arrived
        self.host = [torch.zeros(size, dtype=torch.int64, pin_memory=True) for _ in range(2)]
        self.host_tables = [torch.zeros(b, max_blocks, dtype=torch.int32, pin_memory=True) for _ in range(2)]
        self._turn = 0
        self.flat = torch.zeros(size, dtype=torch.int64, device=dev)
        self.tables = torch.zeros(b, max_blocks, dtype=torch.int32, device=dev)
        self.flat[self.offsets["slots"] : self.offsets["ctx"]] = -1
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None  # the graphs share one memory pool: they never run at the same time
        self._stream = torch.cuda.Stream(dev)  # captures record on a side stream
        self._ran_eagerly: set[int] = set()
        if compile_all:
            for bucket in reversed(self.buckets):
                model.forward(self._step(bucket), kv_cache)
        for bucket in reversed(self.buckets):  # largest first: the smaller graphs reuse its memory
            if bucket <= max_batch:
                if not compile_all:  # a first run outside the capture: kernels load, scratch is allocated
                    model.forward(self._step(bucket), kv_cache)
                self._capture(bucket)

    def _capture(self, bucket: int) -> None:
        """Record the bucket's forward pass. Not through torch.cuda.graph, which first waits for the device and
        empties the allocator's cache: in the middle of serving that would stall every session."""
        graph = torch.cuda.CUDAGraph()
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                logits = self.model.forward(self._step(bucket), self.kv_cache)
            finally:
                graph.capture_end()
        torch.cuda.current_stream().wait_stream(self._stream)
        self._pool = graph.pool()
        self.graphs[bucket] = graph, logits

    def _seqs(self, bucket: int) -> int:
        return min(bucket, self.max_batch)

    def _view(self, buf: torch.Tensor, name: str, n: int) -> torch.Tensor:
        return buf[self.offsets[name] : self.offsets[name] + n]

    def _step(self, bucket: int) -> StepInput:
        t, b, f = bucket, self._seqs(bucket), self.flat
        return StepInput(
            self._view(f, "ids", t),
            self._view(f, "pos", t),
            self._view(f, "slots", t),
            self.tables[:b],
            self._view(f, "ctx", b),
            self._view(f, "qsl", b + 1),
            self._view(f, "rows", b),
        )

    def fits(self, step: StepLists) -> bool:
        return len(step.input_ids) <= self.buckets[-1] and len(step.context_lens) <= self.max_batch

    def forward(self, step: StepLists, pending: torch.Tensor | None = None) -> torch.Tensor:
        """The logits model.forward would return for this step (`pending`: see ModelRunner.run)."""
        n, s = len(step.input_ids), len(step.context_lens)
        bucket = next(x for x in self.buckets if x >= n and self._seqs(x) >= s)
        self._turn ^= 1
        host, host_tables = self.host[self._turn], self.host_tables[self._turn]
        t, b, h, h_tables = bucket, self._seqs(bucket), host.numpy(), host_tables.numpy()  # numpy views: same memory
        for name, values, size, fill in (
            ("ids", step.input_ids, t, 0),
            ("pos", step.positions, t, 0),
            ("slots", step.slot_mapping, t, -1),
            ("ctx", step.context_lens, b, 0),
            ("qsl", step.query_start_loc, b + 1, n),
            ("rows", step.logits_indices, b, 0),
            ("prow", step.pending_rows, 0, 0),
            ("pfrom", step.pending_from, 0, 0),
        ):
            at = self.offsets[name]
            h[at : at + len(values)] = values
            h[at + len(values) : at + size] = fill  # (size 0: only the values are read)
        width = 0
        for i, row in enumerate(step.block_tables):
            h_tables[i, : len(row)] = row
            width = max(width, len(row))
        self.flat.copy_(host, non_blocking=True)
        self.tables[:s, :width].copy_(host_tables[:s, :width], non_blocking=True)
        n_pending = len(step.pending_rows)
        take_pending(
            self._view(self.flat, "ids", t),
            self._view(self.flat, "prow", n_pending),
            pending,
            self._view(self.flat, "pfrom", n_pending),
        )
        if bucket not in self.graphs:
            if bucket not in self._ran_eagerly:
                self._ran_eagerly.add(bucket)
                return self.model.forward(self._step(bucket), self.kv_cache)[: len(step.logits_indices)]
            self._capture(bucket)
        graph, logits = self.graphs[bucket]
        graph.replay()
        return logits[: len(step.logits_indices)]
