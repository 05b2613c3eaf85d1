"""Every step replayed from CUDA graphs: decodes, prefill chunks and steps that mix them, two graphs a token-count
bucket (the forward pass, then the sampler), padded up to the bucket; served first, captured later, a few pieces at a
time between steps (README's How it works).
"""

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import torch

from llamaterm.engine.serving.model import DeviceStep, Pieces, StepInput, StepLists, run_through

log = logging.getLogger(__name__)


def token_buckets(max_running: int, max_batch_tokens: int) -> list[int]:
    """1, 2, 4 ... 64 and max_running (decode steps); then steps of 64 up to 512, the quantized matmul's row tile
    (a step pays per started tile), and of 256 up to max_batch_tokens: a mixed step pads less than a tile up to 512
    tokens and less than 256 tokens (under half its own) above."""
    out, t = [], 1
    while t < max_batch_tokens:
        out.append(t)
        t = t * 2 if t < 64 else t + (64 if t < 512 else 256)
    return sorted({*out, min(max_running, max_batch_tokens), max_batch_tokens})


Forward = Callable[[DeviceStep], Pieces]  # the step's inputs -> its logits rows, a piece a half layer
Sample = Callable[[DeviceStep, torch.Tensor], torch.Tensor]  # the step and its logits -> its tokens
# A bucket's warm-up or capture, a piece a `next`; a piece that yields WAITING has handed work to a thread of its
# own, and the turn ends there (nothing to do but look again next turn)
Job = Generator[bool | None, None, None]
WAITING = True


def on_a_thread(work: Callable[[], None]) -> Generator[bool | None, None, None]:
    """Work on a thread of its own (a daemon: a command's exit never waits for it), WAITING until it is done; its
    error is raised here."""
    failed: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as e:  # (raised in the job, which makes the bucket eager)
            failed.append(e)

    thread = threading.Thread(target=run, name="llamaterm-graph", daemon=True)
    thread.start()
    while thread.is_alive():
        yield WAITING
    if failed:
        raise failed[0]


def one_piece(work: Callable[[], torch.Tensor]) -> Pieces:
    """Work that runs as a single piece."""
    return work()
    yield  # (a generator: its first `next` runs the work)


@dataclass
class Staged:
    """A step's metadata in a pinned host buffer (StepGraphs.stage), not yet copied to the device."""

    bucket: int
    turn: int  # which of the two pinned buffers
    seqs: int  # the block tables' rows and width to copy
    width: int
    pending: int  # rows whose token is the step in flight's sample


@dataclass
class BucketGraphs:
    forward: torch.cuda.CUDAGraph
    logits: torch.Tensor  # the forward graph's output, the sampler graph's input
    sample: torch.cuda.CUDAGraph
    tokens: torch.Tensor


class StepGraphs:
    def __init__(
        self,
        forward: Forward,
        sample: Sample,
        device: torch.device,
        max_running: int,
        max_batch_tokens: int,
        max_blocks: int,
    ):
        self.forward, self.sample = forward, sample
        self.buckets = token_buckets(max_running, max_batch_tokens)
        self.max_running = max_running
        t, b = self.buckets[-1], max_running
        # one int64 buffer: ids, positions, slots [t each], context lens [b], query starts [b + 1], and per logits
        # row [b each] its step row, sampler slot and sampled position; then (read before the replay) the rows whose
        # token is the step in flight's sample, and its rows there [b each]
        sizes = {
            "ids": t,
            "pos": t,
            "slots": t,
            "ctx": b,
            "qsl": b + 1,
            "rows": b,
            "sampler": b,
            "spos": b,
            "prow": b,
            "pfrom": b,
        }
        self.offsets, size = {}, 0
        for name, n in sizes.items():
            self.offsets[name], size = size, size + n
        # two pinned host buffers in turn: with steps overlapped (engine_core.py), the next step's metadata is written
        # while this step's copy may still wait in the stream; the one before it was done when its tokens arrived
        pinned = device.type == "cuda"  # (on the CPU, tests run the padded steps with the captures stubbed)
        self.host = [torch.zeros(size, dtype=torch.int64, pin_memory=pinned) for _ in range(2)]
        self.host_tables = [torch.zeros(b, max_blocks, dtype=torch.int32, pin_memory=pinned) for _ in range(2)]
        self._turn = 0
        # each buffer's last copy to the device, which its next stage waits for: done long before on the steps'
        # path (the step after it received its tokens), but not after a launch that failed between stage and load
        self._copied = [torch.cuda.Event() for _ in range(2)] if pinned else None
        self.flat, self.tables = self._buffers(size, b, max_blocks, device)  # the live steps'
        # a step of padding alone, for eager runs between live steps that load a bucket's kernels (warm): it
        # writes no KV and samples nothing. Views at the same offsets, so its pointers' alignment (which Triton
        # specializes on) is the live step's
        self._padding = self._buffers(size, b, max_blocks, device)
        self.graphs: dict[int, BucketGraphs] = {}
        self.warmed: set[int] = set()  # buckets whose kernel variants have run (loaded, compiled if need be)
        self.uses: Counter[int] = Counter()  # live steps per bucket
        self.eager_only: set[int] = set()  # buckets whose warm-up or capture failed
        self.ready_at: dict[int, float] = {}  # when each bucket's graph was captured (perf_counter), for benchmarks
        self._pool: Any = None  # the graphs share one memory pool: they never run at the same time
        self._stream = torch.cuda.Stream(device) if pinned else None  # captures record on a side stream
        self._job: Job | None = None  # the bucket's warm-up or capture under way (background), a piece at a time
        self._job_bucket, self._job_name, self._job_pieces = 0, "", 0
        self.slowest_piece = (0.0, "")  # (seconds, which) of the background work beside steps, for benchmarks
        self._eager_now = False  # this step's forward pass ran eagerly: so does its sampler

    def _buffers(self, size: int, b: int, max_blocks: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The flat metadata buffer and the block tables on the device, holding a step of padding alone."""
        flat = torch.zeros(size, dtype=torch.int64, device=device)
        flat[self.offsets["slots"] : self.offsets["ctx"]] = -1
        flat[self.offsets["sampler"] : self.offsets["spos"]] = -1
        return flat, torch.zeros(b, max_blocks, dtype=torch.int32, device=device)

    def warm(self, bucket: int) -> None:
        """Run the bucket's step eagerly over padding alone: its kernel variants load (or compile, on a first start)
        and its scratch is allocated, so a capture records launches only. Safe between live steps."""
        run_through(self._warm(bucket))

    def capture(self, bucket: int) -> None:
        """Record the bucket's halves (after warm)."""
        run_through(self._capture(bucket))

    def _warm(self, bucket: int) -> Job:
        step = self._step(bucket, 0, self._padding)
        logits = yield from self.forward(step)
        yield None
        self.sample(step, logits)
        self.warmed.add(bucket)

    def _capture(self, bucket: int) -> Job:
        step = self._step(bucket)
        forward, logits = yield from self._record(lambda: self.forward(step))
        yield None
        sample, tokens = yield from self._record(lambda: one_piece(lambda: self.sample(step, logits)))
        self.graphs[bucket] = BucketGraphs(forward, logits, sample, tokens)
        self.ready_at[bucket] = time.perf_counter()

    def wanted(self, idle: bool = True) -> list[int]:
        """The buckets still to capture, most used first: a decode bucket once a step has needed it, or any while
        the engine is idle (ties: smallest first, as sessions start one by one), and a larger bucket once two steps
        have needed it. So a one-shot command's steps make way for its own decode bucket alone."""
        todo = [
            b
            for b in self.buckets
            if b not in self.graphs
            and b not in self.eager_only
            and self.uses[b] >= (2 if b > self.max_running else 0 if idle else 1)
        ]
        return sorted(todo, key=lambda b: (-self.uses[b], b))

    def pending(self, idle: bool) -> bool:
        """Whether background work is left: a bucket's warm-up or capture under way, or a bucket wanted."""
        return self._job is not None or bool(self.wanted(idle))

    def background(self, budget_s: float = 0.0, idle: bool = True) -> bool:
        """Pieces of the work left within budget_s (one at least; no other once one more like the last would run
        over), each short enough to sit between two steps (half a layer's kernels, recorded or run): warm the most
        wanted bucket (`wanted(idle)`), then capture it. A bucket that fails stays eager (a warning says why). Returns
        whether the turn ended waiting for a thread."""
        start = time.perf_counter()
        while True:
            if self._job is None:
                todo = self.wanted(idle)
                if not todo:
                    return False
                bucket, warm = todo[0], todo[0] not in self.warmed
                self._job = self._warm(bucket) if warm else self._capture(bucket)
                self._job_bucket, self._job_name, self._job_pieces = bucket, "warm-up" if warm else "capture", 0
            t, waiting = time.perf_counter(), False
            try:
                waiting = next(self._job) is WAITING
            except StopIteration:
                self._job = None
            except Exception as e:  # (torch raises RuntimeError; anything else would be as fatal to the bucket)
                log.warning(
                    "the steps of %d tokens stay without a CUDA graph: %s: %s", self._job_bucket, type(e).__name__, e
                )
                self.eager_only.add(self._job_bucket)
                self._job = None
                self._pool = None  # a failed capture can leave its memory pool taking allocations: the next starts anew
            now, self._job_pieces = time.perf_counter(), self._job_pieces + 1
            if not idle and now - t > self.slowest_piece[0]:
                self.slowest_piece = (now - t, f"{self._job_name} of {self._job_bucket}, piece {self._job_pieces}")
            if waiting or now - start + (now - t) > budget_s:  # (another piece like this one would overrun)
                return waiting

    def close(self) -> None:
        """Abandon the background work under way (the engine is shutting down): a capture left open keeps the side
        stream capturing, and the next synchronization with the device, in any later engine of this process, fails
        ("operation not permitted when stream is capturing"). Closing the job ends its capture (_record's finally)."""
        job, self._job = self._job, None
        if job is not None:
            try:
                job.close()
            except RuntimeError as e:  # (a capture already invalidated: ending it says so, and nothing is left open)
                log.debug("ending an unfinished capture: %s", e)

    def _record(
        self, work: Callable[[], Pieces]
    ) -> Generator[bool | None, None, tuple[torch.cuda.CUDAGraph, torch.Tensor]]:
        """Record the work's kernels into a graph, a piece at a time: the capture stays open on the side stream
        between pieces while live steps run on the engine's stream (so the capture mode is relaxed: the same thread
        synchronizes with the device for their tokens). Then the graph is instantiated on a thread of its own (1-2.5
        ms in the driver for a step's 300 kernels), off the engine's. Not through torch.cuda.graph, which first
        waits for the device and empties the allocator's cache: in the middle of serving that would stall every
        session."""
        stream = self._stream
        assert stream is not None, "CUDA graphs are captured on CUDA only"
        graph, pieces = torch.cuda.CUDAGraph(keep_graph=True), work()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=self._pool, capture_error_mode="relaxed")
        try:
            yield None  # a piece of its own: with the first graph's, its pool is made
            while True:
                with torch.cuda.stream(stream):
                    try:
                        next(pieces)
                    except StopIteration as done:
                        out = done.value
                        break
                yield None
        finally:
            with torch.cuda.stream(stream):
                graph.capture_end()
        torch.cuda.current_stream().wait_stream(stream)
        self._pool = graph.pool()
        yield from on_a_thread(graph.instantiate)
        return graph, out

    def _seqs(self, bucket: int) -> int:
        return min(bucket, self.max_running)

    def _step(
        self, bucket: int, n_pending: int = 0, buffers: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> DeviceStep:
        """Views of the bucket's size into the live buffers (or the given ones)."""
        t, b = bucket, self._seqs(bucket)
        flat, tables = buffers or (self.flat, self.tables)
        view = lambda name, n: flat[self.offsets[name] : self.offsets[name] + n]
        inputs = StepInput(
            view("ids", t),
            view("pos", t),
            view("slots", t),
            tables[:b],
            view("ctx", b),
            view("qsl", b + 1),
            view("rows", b),
        )
        return DeviceStep(
            inputs,
            view("sampler", b),
            view("spos", b),
            view("prow", n_pending),
            view("pfrom", n_pending),
        )

    def fits(self, step: StepLists) -> bool:
        # a sequence with drafts samples more rows than it has sequences, and a fork has a row and no token: the
        # largest bucket must hold both
        rows = max(len(step.context_lens), len(step.logits_indices))
        return len(step.input_ids) <= self.buckets[-1] and rows <= self._seqs(self.buckets[-1])

    def prepare(self, step: StepLists) -> tuple[int, DeviceStep]:
        """Copy the step's metadata into the buffers of the smallest bucket that holds it (the copies are queued,
        not waited for); returns the bucket and the buffers' views."""
        return self.load(self.stage(step))

    def stage(self, step: StepLists) -> Staged:
        """The host's half of prepare: the step's metadata, padded to the smallest bucket that holds it, written
        into the next pinned buffer. Nothing reaches the device, so a step may be staged before the step in
        flight's sampler is queued (whose inputs the buffers on the device still hold)."""
        n, s = len(step.input_ids), max(len(step.context_lens), len(step.logits_indices))
        bucket = next(x for x in self.buckets if x >= n and self._seqs(x) >= s)
        self.uses[bucket] += 1
        self._turn ^= 1
        if self._copied is not None:
            self._copied[self._turn].synchronize()
        host, host_tables = self.host[self._turn], self.host_tables[self._turn]
        t, b, h, h_tables = bucket, self._seqs(bucket), host.numpy(), host_tables.numpy()  # numpy views: same memory
        for name, values, size, fill in (
            ("ids", step.input_ids, t, 0),
            ("pos", step.positions, t, 0),
            ("slots", step.slot_mapping, t, -1),
            ("ctx", step.context_lens, b, 0),
            ("qsl", step.query_start_loc, b + 1, n),
            ("rows", step.logits_indices, b, 0),
            ("sampler", step.sampler_slots, b, -1),
            ("spos", step.sample_positions, b, 0),
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
        return Staged(bucket, self._turn, s, width, len(step.pending_rows))

    def load(self, staged: Staged) -> tuple[int, DeviceStep]:
        """The device's half: queue the staged buffer's copies to the buffers the graphs read."""
        host, host_tables = self.host[staged.turn], self.host_tables[staged.turn]
        self.flat.copy_(host, non_blocking=True)
        self.tables[: staged.seqs, : staged.width].copy_(host_tables[: staged.seqs, : staged.width], non_blocking=True)
        if self._copied is not None:
            self._copied[staged.turn].record()
        return staged.bucket, self._step(staged.bucket, staged.pending)

    def run_forward(self, bucket: int, step: DeviceStep) -> torch.Tensor:
        """The bucket's logits [its rows]: replayed from its graph, or run eagerly over the same buffers until it
        has one. run_sample must follow, before the next step."""
        graphs = self.graphs.get(bucket)
        self._eager_now = graphs is None
        if graphs is None:
            self.warmed.add(bucket)  # its kernels load in this step, if they had not
            return run_through(self.forward(step))
        graphs.forward.replay()
        return graphs.logits

    def run_sample(self, bucket: int, step: DeviceStep, logits: torch.Tensor) -> torch.Tensor:
        """The bucket's sampled tokens [its rows], the same way its forward pass ran."""
        if self._eager_now:
            return self.sample(step, logits)
        self.graphs[bucket].sample.replay()
        return self.graphs[bucket].tokens
