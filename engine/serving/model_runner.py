"""The model runner owns the step: scheduled chunks in, sampled token ids out. It builds the step's inputs, runs the
forward pass and the batched sampler (replayed from CUDA graphs where they fit), overlaps a step with the next,
fills grammar masks beside the GPU and takes the runs grammars force, and calls the proposer for drafts; it owns the
KV cache, the graphs, the sampler's tables and the draft model. README's How it works says how steps overlap.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import torch

from llamaterm.engine.api import TokenLogprob
from llamaterm.engine.serving.cuda_graph import StepGraphs
from llamaterm.engine.serving.draft_model import DraftModel
from llamaterm.engine.serving.grammar import GrammarMatcher, accept_tokens, fill_bitmasks, force_token
from llamaterm.engine.serving.logprobs import StepLogprobs
from llamaterm.engine.serving.model import DeviceStep, Model, Pieces, StepInput, StepLists, run_through
from llamaterm.engine.serving.proposer import Proposer
from llamaterm.engine.serving.sampling import Sampler, penalised
from llamaterm.engine.serving.scheduler import ScheduledChunk, is_prefilling
from llamaterm.engine.serving.sequence import FORCED_MOST, Sequence, Status
from llamaterm.engine.serving.step_inputs import device_tensors, step_lists
from llamaterm.kernels.dispatch import use_triton
from llamaterm.kernels.sampling_tables import bitmask_words

log = logging.getLogger(__name__)
# the prompt the warm-up readies a step for, besides a decode: a one-line question in a chat template
FIRST_PROMPT = 64

# What `complete` gives for a token the sequence's grammar refused (the sampler keeps to the grammar's mask, so
# only a fault gets here); -1 is a row whose logits were not finite (kernels/sampling.py)
REFUSED = -2
MASK_SWITCH_S = 1e-4  # the GIL switch interval while the masks' thread starts (_start_masks)
Masks = tuple[int, int, torch.Tensor]  # grammar masks: the sampler slots lo..hi - 1 they span, the host rows by slot
# A step's outcome for one sequence still under way: its token, and the token's log-probability if it asked
Sampled = tuple[Sequence, int, TokenLogprob | None]


@dataclass
class MaskTimes:
    """Where the steps under a grammar spent their time on the host, summed (`llamaterm bench` shows it per step):
    the masks on their thread, from the start of their fill until that thread has the GIL back (at most until the
    engine's thread waits for them), the engine's thread waiting for the tokens they start from (and advancing the
    grammars), and waiting for the masks."""

    steps: int = 0
    fill_s: float = 0.0
    tokens_s: float = 0.0
    wait_s: float = 0.0
    forced_tokens: int = 0  # tokens the grammars forced, taken without sampling (_take_runs)


@dataclass
class LaunchedStep:
    """A step on its way: the sequences it samples for, in row order, and their tokens on the way to the host. A
    sequence with drafts samples a row per draft and one after them (engine/serving/speculation.py)."""

    sampling: list[Sequence]
    drafts: list[list[int]]  # each sampling sequence's drafts, as launched
    start: float  # when it was scheduled
    decode_rows: int  # its decode chunks (a token, and any drafts or forced run after it), and
    prefill_tokens: int  # the tokens of its prompts' chunks (Scheduler.pace learns what they cost)
    sample: Callable[[], torch.Tensor] | None  # its sampler, until queued (after its masks, if it has a grammar)
    graphed: bool  # replayed from its bucket's CUDA graphs (else run eagerly)
    launch_s: float = 0.0  # its launch's time on the host: an eager step's Python, most of its time
    masks: Future[Masks] | None = None  # grammar masks being filled
    logprobs: StepLogprobs | None = None
    tokens: HostTokens | None = None  # once its sampler is queued
    received: tuple[list[int], set[int]] | None = None  # its tokens on the host, and the rows refused (receive)
    runs_taken: bool = False  # the runs its grammars force next are found (_take_runs)
    outcome: list[Sampled] | None = None  # complete()'s answer, kept
    # grammar fast-forward (_take_runs), by row: the token its mask forces, which its grammar has consumed already
    forced_first: dict[int, int] = field(default_factory=dict)
    verified: int = 0  # drafts verified by complete(), and of them those kept
    kept: int = 0

    @property
    def has_drafts(self) -> bool:
        return any(self.drafts)

    def row_starts(self) -> list[int]:
        """Each sequence's first row (at its last known token, then one a draft), and one past the last row."""
        return list(itertools.accumulate((1 + len(d) for d in self.drafts), initial=0))

    def last_rows(self) -> dict[int, int]:
        """Each sequence's last row (its token after any drafts), by sequence id."""
        return {seq.id: end - 1 for seq, end in zip(self.sampling, self.row_starts()[1:], strict=True)}


class ModelRunner:
    def __init__(
        self,
        model: Model,
        num_blocks: int,
        block_size: int,
        max_running: int,
        max_batch_tokens: int,
        cuda_graphs: bool,
        max_rows: int | None = None,
        max_drafts: int = 0,
        fast_forward: bool = True,
        draft: Model | None = None,
    ):
        """max_rows: the most rows a step samples (a row per sequence, one per draft; None: max_running);
        max_drafts: the most drafts a step holds; fast_forward: tokens a grammar forces skip the sampler; draft: the
        model that drafts (None: prompt lookup), on a cache of its own with the pool's blocks."""
        rows = max_rows or max_running
        self.model, self.block_size = model, block_size
        self.startup_s: dict[str, float] = {}  # where start-up time went, for `llamaterm bench`
        with self._timed("KV cache"):
            self.kv_cache = model.allocate_kv_cache(num_blocks, block_size)
            self.sampler = Sampler(max_running, model.config.vocab_size, model.device, max_drafts)
        drafter = None
        if draft is not None:
            limits = max_running, max_batch_tokens, cuda_graphs
            drafter = DraftModel(draft, num_blocks, block_size, self.sampler, *limits)
        self.proposer = Proposer(drafter)
        pinned = model.device.type == "cuda"
        self._host_tokens = [torch.empty(rows, dtype=torch.int64, pin_memory=pinned) for _ in range(2)]
        # the grammars' masks on their way to the sampler's tables, two buffers in turn: a step's copy from one may
        # still wait in the stream while the next step's masks fill the other; the step before it has completed
        self._host_bitmasks = [torch.zeros(0, 0, dtype=torch.int32)] * 2
        self._mask_filler = ThreadPoolExecutor(1, thread_name_prefix="llamaterm-masks")
        self._switch_interval = sys.getswitchinterval()  # Python's, which a fill lowers until it starts (_fill)
        self._fills_lock, self._fills_waiting = threading.Lock(), 0
        self.mask_times = MaskTimes()
        self.fast_forward = fast_forward
        self._forced_next: dict[int, list[int]] = {}  # by sequence id: a run forced after the launching step's token
        self._host_turn = 0
        self._last: LaunchedStep | None = None  # the step launched last, whose tokens the next one may need
        self.graphs = None
        if not (cuda_graphs and use_triton(self.kv_cache)):  # the torch references sync with the host: no capture
            with self._timed("warm-up"):
                self._warm_up()
            return
        marker = compiled_marker(model, rows, max_batch_tokens)
        max_blocks = -(-model.config.context_length // block_size)
        graphs = self.graphs = StepGraphs(self._forward, self._sample, model.device, rows, max_batch_tokens, max_blocks)
        if marker.exists():  # the kernels of the first steps, a decode and a short prompt; the rest in the background
            first_steps = [1, next((b for b in graphs.buckets if b >= FIRST_PROMPT), graphs.buckets[-1])]
        else:  # a first start compiles every kernel variant a step can launch, before the first request
            log.warning(
                "compiling the kernels of %d step sizes for this GPU and model, once (later starts reuse them)",
                len(graphs.buckets),
            )
            first_steps = graphs.buckets
        with self._timed("warm-up"):
            for bucket in first_steps:
                graphs.warm(bucket)
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()

    def background_pending(self, idle: bool) -> bool:
        """Whether CUDA graphs are still to be captured: while serving, of the step sizes in use; idle, of any
        (the engine's loop calls `background`, a few pieces at a time, until not)."""
        return self.graphs is not None and self.graphs.pending(idle)

    def background(self, budget_s: float, idle: bool) -> bool:
        """Pieces of the graphs' background work (cuda_graph.py) for about budget_s: between steps, with the device
        busy, or idle. Returns whether it waits for a thread of its own."""
        return self.graphs is not None and self.graphs.background(budget_s, idle)

    def close(self) -> None:
        """End the graphs' background work under way, the model's and the draft model's (cuda_graph.py's close)."""
        draft = self.proposer.draft
        for graphs in (self.graphs, draft.graphs if draft is not None else None):
            if graphs is not None:
                graphs.close()

    def propose(self, running: list[Sequence], rows: int) -> None:
        """Drafts for the next step from the running sequences' tokens on the host (proposer.py), in `rows`."""
        self.proposer.propose(running, rows)

    def launch(self, chunks: list[ScheduledChunk], start: float) -> LaunchedStep:
        """Run one step's forward pass on the device, and its sampler unless that waits for grammar masks (the
        next launch or `complete` queues it then); nothing here waits for the device, but for the step in flight's
        masks and tokens where a grammar needs them. Each sampling sequence gets a PENDING token."""
        sampling = [c.seq for c in chunks if c.samples]
        self.proposer.fill(sampling)
        # as the scheduler paces them: a decode with drafts or a forced run is a row, a prompt's chunk its tokens
        paced = [is_prefilling(c.seq) for c in chunks]
        prefill = sum(c.length for c, p in zip(chunks, paced, strict=True) if p)
        decode_rows = sum(c.length > 0 and not p for c, p in zip(chunks, paced, strict=True))
        self._forced_next.clear()  # filled and taken within a launch: what a failed one left is stale
        last = self._last
        rows = last.last_rows() if last else {}
        step = step_lists(chunks, self.block_size, rows)
        draft_slots = self._draft_slots(sampling, step)
        graphs = self.graphs if self.graphs and self.graphs.fits(step) else None
        staged = graphs.stage(step) if graphs else None  # the inputs' host half, while the last step's masks fill
        if last is not None:
            self._queue_sampler(last)  # where it waited for masks, the host's work since hid their time
        for seq in sampling:  # after the step in flight's sampler: it may read a slot's last owner
            self.sampler.join(seq)
        for seq, tokens, slots in draft_slots:
            self.sampler.write_draft_rows(seq, tokens, slots)
        if graphs and staged:
            bucket, device_step = graphs.load(staged)
            graphed = bucket in graphs.graphs
            take_pending(device_step, step, last)
            logits, run_sample = graphs.run_forward(bucket, device_step), graphs.run_sample
            sample = lambda: run_sample(bucket, device_step, logits)[: len(step.logits_indices)]
        else:
            device_step, graphed = device_tensors(step, self.model.device), False
            take_pending(device_step, step, last)
            logits = run_through(self._forward(device_step))
            sample = lambda: self._sample(device_step, logits)
        constrained = [seq for seq in sampling if seq.grammar is not None]
        # with the forward pass queued (the device goes on to it from the step in flight's sampler)
        masks = self._start_masks(constrained, last) if constrained else None
        self._copy_blocks([c.block_copy for c in chunks if c.block_copy])  # after the forward pass wrote them
        for seq in sampling:
            seq.launch()
        drafts = [list(seq.drafts) for seq in sampling]
        launched = self._last = LaunchedStep(sampling, drafts, start, decode_rows, prefill, sample, graphed)
        if self._forced_next:  # runs forced after the tokens this step samples: its masks force their first token
            runs = {i: self._forced_next.pop(seq.id) for i, seq in enumerate(sampling) if seq.id in self._forced_next}
            launched.forced_first = {i: forced[0] for i, forced in runs.items()}
            self._place_forced(launched, {i: forced[1:] for i, forced in runs.items() if len(forced) > 1})
        row_seqs = [seq for seq, d in zip(sampling, drafts, strict=True) for _ in range(1 + len(d))]
        asked = [(i, seq.params.logprobs) for i, seq in enumerate(row_seqs) if seq.params.logprobs is not None]
        if asked:  # the raw logits' rows, before the sampler changes them
            launched.logprobs = StepLogprobs(logits, *map(list, zip(*asked, strict=True)))
        launched.masks = masks
        if masks is None:
            self._queue_sampler(launched)
        launched.launch_s = time.perf_counter() - start
        return launched

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy KV blocks (source, destination) in every layer: forks' last partial blocks."""
        if copies:
            source, destination = (torch.tensor(x, device=self.model.device) for x in zip(*copies, strict=True))
            self.kv_cache.index_copy_(2, destination, self.kv_cache.index_select(2, source))

    def _draft_slots(self, sampling: list[Sequence], step: StepLists) -> list[tuple[Sequence, list[int], list[int]]]:
        """The rows at a penalised sequence's drafts sample from slots of their own (Sampler.write_draft_rows),
        whose counts hold the drafts before them: set in the step's sampler slots here, on the host; returns
        (sequence, drafts, their slots) to write once the step in flight's sampler is queued."""
        row, used, out = 0, 0, []
        for seq in sampling:
            if seq.num_drafts and penalised(seq.params):
                drafts = list(seq.drafts)
                first = self.sampler.first_draft_slot + used
                slots = list(range(first, first + len(drafts)))
                step.sampler_slots[row + 1 : row + 1 + len(drafts)] = slots
                out.append((seq, drafts, slots))
                used += len(drafts)
            row += 1 + seq.num_drafts
        return out

    def _start_masks(self, constrained: list[Sequence], last: LaunchedStep | None) -> Future[Masks]:
        """Start filling the next token's masks of the sequences under a grammar, on the masks' thread (the GIL
        released), while the engine's thread goes on; the future gives the sampler slots they span and the buffer
        filled (a row per slot). A sequence whose last token is the step in flight's needs it on the host first:
        that step's tokens are received here (its sampler and then this step's forward pass are queued), and
        handed out by complete() once the masks have started. The masks of sequences whose grammars force what
        follows start after their runs are found (_take_runs), the others' before."""
        times, t = self.mask_times, time.perf_counter()
        ahead: set[int] = set()  # sequences whose grammars force bytes next
        if last is not None and any(seq.num_inflight for seq in constrained):
            self._receive(last)
            if self.fast_forward:
                ahead = {seq.id for seq in constrained if cast(GrammarMatcher, seq.grammar).forces_next()}
        self._host_bitmasks.reverse()
        if self._host_bitmasks[0].numel() == 0:  # a row per sampler slot
            words = bitmask_words(self.model.config.vocab_size)
            pinned = self.model.device.type == "cuda"
            rows = len(self.sampler.tables.ints)
            self._host_bitmasks[0] = torch.zeros(rows, words, dtype=torch.int32, pin_memory=pinned)
        bitmask = self._host_bitmasks[0]
        slots = [cast(int, seq.sampler_slot) for seq in constrained]
        span = min(slots), max(slots) + 1
        masks = self._fill([seq for seq in constrained if seq.id not in ahead], bitmask, span, None)
        if last is not None and last.received is not None:
            ids = {seq.id for seq in constrained}
            self._take_runs(last, ids, ids - ahead)
        times.steps, times.tokens_s = times.steps + 1, times.tokens_s + time.perf_counter() - t
        host_rows = bitmask.numpy()  # (a view: a tensor's row by row writes cost microseconds each)
        rest = []  # a forced run's first token is the only one its row allows
        for seq in constrained:
            if (forced := self._forced_next.get(seq.id)) is not None:
                force_token(host_rows[cast(int, seq.sampler_slot)], forced[0])
            elif seq.id in ahead:
                rest.append(seq)
        return self._fill(rest, bitmask, span, masks) if rest else masks

    def _fill(
        self, seqs: list[Sequence], bitmask: torch.Tensor, span: tuple[int, int], before: Future[Masks] | None
    ) -> Future[Masks]:
        """Fill the masks of `seqs` into their sampler slots' rows of `bitmask` on the masks' thread; the future
        gives `span` (the sampler slots of the step's masks) and the buffer, once this fill and the step's fill
        `before` it (which the masks' thread, one at a time, has done then) are done, or either's failure."""
        matchers = [cast(GrammarMatcher, seq.grammar) for seq in seqs]
        slots = [cast(int, seq.sampler_slot) for seq in seqs]
        times = self.mask_times
        # The masks' thread needs the GIL for a moment to start llguidance (which then releases it); with Python's
        # switch interval it would wait for the engine's thread to block instead of filling beside it. The last fill
        # waiting to start sets the interval back: at MASK_SWITCH_S the engine's thread would hand the GIL to every
        # thread that waits for it (the engine process's forwarder) in the midst of its own work, which slows it
        with self._fills_lock:
            self._fills_waiting += 1
            sys.setswitchinterval(MASK_SWITCH_S)

        def fill() -> Masks:
            with self._fills_lock:
                self._fills_waiting -= 1
                if not self._fills_waiting:
                    sys.setswitchinterval(self._switch_interval)
            if before is not None:
                before.result()  # its failure is this step's
            t = time.perf_counter()
            if matchers:
                fill_bitmasks(matchers, bitmask, slots)
            times.fill_s += time.perf_counter() - t
            return *span, bitmask

        return self._mask_filler.submit(fill)

    def _queue_sampler(self, step: LaunchedStep) -> None:
        """Queue a launched step's sampler (once its masks are in the sampler's tables), the log-probabilities'
        last part, and its tokens' copy to the host; once."""
        if step.sample is None:
            return
        if step.masks is not None:
            t = time.perf_counter()
            try:
                masks = step.masks.result()
            except Exception:
                step.sample = None  # it never samples: complete() raises the failure to the step's requests
                raise
            finally:
                self.mask_times.wait_s += time.perf_counter() - t
            self.sampler.write_bitmasks(*masks)
        tokens = step.sample()
        step.sample = None
        if step.logprobs is not None:
            step.logprobs.gather(tokens)
        self._host_turn ^= 1
        step.tokens = HostTokens(tokens, self._host_tokens[self._host_turn])

    def complete(self, step: LaunchedStep) -> list[Sampled]:
        """Wait for a step's tokens and put them in place of its sequences' PENDING tokens, and advance their
        grammars; returns (sequence, token, its logprob or None) for those still under way (token -1: the row's
        logits were not finite; REFUSED: the grammar refused it). Asked again, the same answer."""
        if step.outcome is not None:
            return step.outcome
        tokens, refused = self._receive(step)
        self._take_runs(step)
        logprobs = step.logprobs.read(tokens) if step.logprobs is not None else {}
        first_rows = step.row_starts()
        step.outcome = []
        for i, (seq, drafts) in enumerate(zip(step.sampling, step.drafts, strict=True)):
            if seq.status is Status.FINISHED:  # stopped or cancelled while the step ran
                continue
            first = first_rows[i]
            if drafts:  # the drafts the target confirms and its token after them
                new = seq.settle(tokens[first : first_rows[i + 1]])
                kept = len(new) - 1
                assert seq.speculation is not None
                seq.speculation.observe(len(drafts), kept, seq.num_generated)
                if penalised(seq.params):
                    self.sampler.count_tokens([(seq, new[1:])])  # (the first: its own row counted it)
                step.verified, step.kept = step.verified + len(drafts), step.kept + kept
            else:  # its token, and any run its grammar forced after it
                new = seq.settle([REFUSED if i in refused else tokens[first]])
            step.outcome += [
                (seq, token, logprobs.get(first + j) if j <= len(drafts) else None) for j, token in enumerate(new)
            ]
        return step.outcome

    def _receive(self, step: LaunchedStep) -> tuple[list[int], set[int]]:
        """Wait for a step's tokens on the host and advance its sequences' grammars past them (once): what the next
        masks start from, before complete() hands the tokens out. Returns the tokens and the rows refused."""
        if step.received is None:
            self._queue_sampler(step)
            if step.tokens is None:  # its masks failed
                assert step.masks is not None
                step.masks.result()
            assert step.tokens is not None
            tokens = step.tokens.wait()
            step.received = tokens, self._advance_grammars(step, [tokens[row] for row in step.row_starts()[:-1]])
        return step.received

    @staticmethod
    def _advance_grammars(step: LaunchedStep, tokens: list[int]) -> set[int]:
        """Each grammar past its sequence's new token (never drafted), one after another (grammar.accept_tokens),
        but where the token was forced (consumed already); the sequences refused, by index."""
        rows = [
            i
            for i, (seq, token) in enumerate(zip(step.sampling, tokens, strict=True))
            if seq.grammar is not None and token >= 0 and seq.status is not Status.FINISHED
        ]
        refused = {i for i in rows if i in step.forced_first and tokens[i] != step.forced_first[i]}
        rows = [i for i in rows if i not in step.forced_first]
        if rows:
            matchers = [cast(GrammarMatcher, step.sampling[i].grammar) for i in rows]
            accepted = accept_tokens(matchers, [tokens[i] for i in rows])
            refused |= {i for i, ok in zip(rows, accepted, strict=True) if not ok}
        return refused

    def _take_runs(self, step: LaunchedStep, launching: Collection[int] = (), filling: Collection[int] = ()) -> None:
        """Once a step's tokens are received: where a grammar forces the tokens after a sequence's new one
        (GrammarMatcher.fast_forward), take them unsampled, and the next step computes them in one chunk and samples
        after them. A sequence that samples in the step being launched (its id in `launching`) has its token there
        forced to the run's first, the rest placed after it; another has the run after this step's token. Not where
        a request asks for log-probabilities (a forced token has none), never past max_tokens (a sampled token
        follows), and not for sequences whose masks are filling (`filling`: their grammars force nothing next)."""
        if step.runs_taken or not self.fast_forward:
            return
        step.runs_taken = True
        assert step.received is not None
        tokens, refused = step.received
        after: dict[int, list[int]] = {}  # runs after this step's tokens, by row
        for i, (seq, row) in enumerate(zip(step.sampling, step.row_starts()[:-1], strict=True)):
            grammar, token = seq.grammar, tokens[row]
            asks_logprobs = seq.params.logprobs is not None
            if grammar is None or token < 0 or i in refused or seq.status is Status.FINISHED or asks_logprobs:
                continue
            if seq.id in filling:  # (its mask is being filled from its grammar, which forces nothing next)
                continue
            if forced := grammar.fast_forward(min(FORCED_MOST, seq.max_tokens - seq.num_generated - 1)):
                self.mask_times.forced_tokens += len(forced)
                if seq.id in launching:
                    self._forced_next[seq.id] = forced
                else:
                    after[i] = forced
        self._place_forced(step, after)

    def _place_forced(self, step: LaunchedStep, runs: dict[int, list[int]]) -> None:
        """Forced runs at the end of the sequences of rows of `step`, by row: after the row's PENDING token and any
        run placed after it already (a chunk cut short by the step's budget did not sample in the step after), in
        their tails and penalties' counts, handed out with that token by complete() (Sequence.settle)."""
        for i, forced in runs.items():
            step.sampling[i].force(forced)
        self.sampler.count_tokens(
            [(step.sampling[i], f) for i, f in runs.items() if penalised(step.sampling[i].params)]
        )

    def _forward(self, step: DeviceStep) -> Pieces:
        """The first half of a step (one CUDA graph): the forward pass, to the logits of the rows that sample, a
        piece a half layer (model.py)."""
        return self.model.forward_pieces(step.inputs, self.kv_cache)

    @torch.inference_mode()
    def _sample(self, step: DeviceStep, logits: torch.Tensor) -> torch.Tensor:
        """The second half (another graph): the sampler, which changes the logits in place."""
        return self.sampler.sample(logits, step.sampler_slots, step.sample_positions)

    @contextmanager
    def _timed(self, part: str):
        t = time.perf_counter()
        yield
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)
        self.startup_s[part] = time.perf_counter() - t

    def _warm_up(self) -> None:
        """One token through the model and the sampler before serving, so weight preparation and kernel
        compilation are paid at load time rather than by the first request's TTFT. It writes slot 0 of a free
        block (no one reads it) and samples a padding row."""
        one = lambda *v, dtype=torch.int64: torch.tensor(v, dtype=dtype, device=self.model.device)
        inputs = StepInput(one(0), one(0), one(0), one([0], dtype=torch.int32), one(1), one(0, 1), one(0))
        step = DeviceStep(inputs, one(-1), one(0), one(), one())
        self._sample(step, run_through(self._forward(step)))


def take_pending(device_step: DeviceStep, step: StepLists, last: LaunchedStep | None) -> None:
    """Write the tokens the last launched step sampled into this step's inputs that wait for them, on the device.
    A row that sampled -1 (not finite) feeds token 0: its request is ended when that -1 reaches the host."""
    rows, source = device_step.pending_rows, device_step.pending_from
    if step.pending_rows:
        assert last is not None and last.tokens is not None and rows is not None and source is not None
        tokens = last.tokens.device_tokens.index_select(0, source).clamp_(min=0)
        device_step.inputs.input_ids.index_copy_(0, rows, tokens)


def compiled_marker(model: Model, max_running: int, max_batch_tokens: int) -> Path:
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
                max_running,
                max_batch_tokens,
            )
        ).encode()
    )
    for path in sources:
        key.update(path.read_bytes())
    cache = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    return cache / f"llamaterm-{key.hexdigest()[:32]}"


class HostTokens:
    """A step's sampled token ids on their way to the host: on CUDA a copy into pinned memory that does not block
    the caller, and the event that marks it done. Two pinned buffers serve in turn, since a step's tokens are read
    before the step after next is launched."""

    def __init__(self, tokens: torch.Tensor, buffer: torch.Tensor):
        self.device_tokens = tokens  # read by the next step's inputs (take_pending)
        self.ready = None
        if not tokens.is_cuda:
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
