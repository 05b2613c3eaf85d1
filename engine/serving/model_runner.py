"""The model runner: one scheduled step in, logits out. It owns the KV cache and the CUDA graphs, builds each
step's flat inputs (token ids, positions, slot mapping, block tables) from the scheduled chunks, and warms the
model up before the first request."""

from __future__ import annotations

import hashlib
import logging
import os
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from llamaterm.engine.serving.cuda_graph import StepGraphs
from llamaterm.engine.serving.model import Model, StepInput, StepLists, take_pending
from llamaterm.engine.serving.scheduler import ScheduledChunk
from llamaterm.kernels.dispatch import use_triton

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self, model: Model, num_blocks: int, block_size: int, max_batch: int, max_tokens: int, cuda_graphs: bool
    ):
        self.model, self.block_size = model, block_size
        self.startup_s: dict[str, float] = {}  # where start-up time went, for `llamaterm bench`
        with self._timed("KV cache"):
            self.kv_cache = model.allocate_kv_cache(num_blocks, block_size)
        with self._timed("warm-up"):
            self._warm_up()
        pinned = model.device.type == "cuda"
        self._host_tokens = [torch.empty(max_batch, dtype=torch.int64, pin_memory=pinned) for _ in range(2)]
        self._host_turn = 0
        self.graphs = None
        if cuda_graphs and use_triton(self.kv_cache):  # the torch references sync with the host: no capture
            # a first start compiles every kernel variant a step can launch, before the first request
            marker = compiled_marker(model, max_batch, max_tokens)
            first = not marker.exists()
            if first:
                log.warning("compiling kernels for this GPU and model, once (later starts reuse them)")
            max_blocks = -(-model.config.context_length // block_size)
            with self._timed("CUDA graphs"):
                self.graphs = StepGraphs(model, self.kv_cache, max_batch, max_tokens, max_blocks, first)
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()

    def run(
        self,
        chunks: list[ScheduledChunk],
        pending: torch.Tensor | None = None,
        pending_rows: dict[int, int] | None = None,
    ) -> torch.Tensor:
        """Logits for every chunk that samples, in chunk order. A sequence's last token may still be on the
        device: `pending` holds the sampled tokens of the step in flight and pending_rows maps a sequence id to
        its row there."""
        step = step_lists(chunks, self.block_size, pending_rows or {})
        if self.graphs and self.graphs.fits(step):
            return self.graphs.forward(step, pending)
        return self.model.forward(step_input(step, self.model.device, pending), self.kv_cache)

    def to_host(self, tokens: torch.Tensor) -> HostTokens:
        """Start copying a step's sampled tokens to the host; two pinned buffers in turn, since a step's tokens are
        read before the step after next is launched."""
        self._host_turn ^= 1
        return HostTokens(tokens, self._host_tokens[self._host_turn] if tokens.is_cuda else None)

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


def compiled_marker(model: Model, max_batch: int, max_tokens: int) -> Path:
    """A file in Triton's cache that says these kernels were compiled for this GPU, model shape and batch limits
    (Triton keys its cache the same way: source, versions, device, constants); clearing the cache clears it."""
    import triton

    import llamaterm.kernels

    sources = sorted(Path(llamaterm.kernels.__path__[0]).glob("*.py"))
    key = hashlib.sha256(
        repr(
            (
                torch.__version__,
                triton.__version__,
                torch.cuda.get_device_name(model.device),
                model.config,
                model.dtype,
                max_batch,
                max_tokens,
            )
        ).encode()
    )
    for path in sources:
        key.update(path.read_bytes())
    cache = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    return cache / f"llamaterm-{key.hexdigest()[:32]}"


class HostTokens:
    """A step's sampled token ids on their way to the host: on CUDA a copy into pinned memory that does not block
    the caller, and the event that marks it done."""

    def __init__(self, tokens: torch.Tensor, buffer: torch.Tensor | None):
        self.device_tokens = tokens  # read by the next step's inputs (ModelRunner.run's `pending`)
        self.ready = None
        if buffer is None:
            self.host = tokens
        else:
            self.host = buffer[: tokens.numel()]
            self.host.copy_(tokens, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record()

    def wait(self) -> list[int]:
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()


def step_lists(chunks: list[ScheduledChunk], block_size: int, pending_rows: dict[int, int]) -> StepLists:
    """The step as flat lists. On the host path of every step, so locals rather than attribute lookups."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    qsl, rows, pending, pending_from = [0], [], [], []
    for c in chunks:
        seq, start, end = c.seq, c.start, c.start + c.length
        table, known = seq.table.block_ids, len(seq.token_ids)
        ids += seq.token_ids[start:end]
        if seq.num_pending and end == known:  # its last token is the step in flight's sample
            ids[-1] = 0
            pending.append(len(ids) - 1)
            pending_from.append(pending_rows[seq.id])
        positions += range(start, end)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(start, end)]
        qsl.append(qsl[-1] + c.length)
        if end == known:  # the chunk samples (ScheduledChunk.samples)
            rows.append(qsl[-1] - 1)
    return StepLists(
        ids,
        positions,
        slots,
        [c.seq.table.block_ids for c in chunks],
        [c.start + c.length for c in chunks],
        qsl,
        rows,
        pending,
        pending_from,
    )


def step_input(step: StepLists, device: torch.device, pending: torch.Tensor | None = None) -> StepInput:
    """Tensors of exactly the step's size, for the eager forward pass."""
    width = max(len(t) for t in step.block_tables)
    tables = [t + [0] * (width - len(t)) for t in step.block_tables]
    as_tensor = lambda x, dtype=torch.int64: torch.tensor(x, dtype=dtype, device=device)
    input_ids = as_tensor(step.input_ids)
    if step.pending_rows:  # no index tensors to build (and copy to the device) for a step with none
        take_pending(input_ids, as_tensor(step.pending_rows), pending, as_tensor(step.pending_from))
    return StepInput(
        input_ids=input_ids,
        positions=as_tensor(step.positions),
        slot_mapping=as_tensor(step.slot_mapping),
        block_tables=as_tensor(tables, torch.int32),
        context_lens=as_tensor(step.context_lens),
        query_start_loc=as_tensor(step.query_start_loc),
        logits_indices=as_tensor(step.logits_indices),
    )
