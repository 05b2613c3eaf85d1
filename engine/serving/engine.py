"""The engine: one loop thread that owns the model, the KV cache and the scheduler; callers submit requests
from any thread and read each request's events from its own queue.

The loop never waits on consumers (events go to unbounded queues) and consumers never block the loop (submit and
cancel only enqueue). A failure while serving one request fails that request alone.

With a sink (the engine in a child process, engine/serving/process.py), the loop hands each step's outcome to it as
one list of plain records, token ids without text: the parent detokenizes and checks stop strings.
"""

from __future__ import annotations

import itertools
import queue
import secrets
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from llamaterm.engine.api import (
    EngineConfig,
    EngineStats,
    Event,
    EventStream,
    RequestStats,
    RequestStream,
    TokenLogprob,
    decode_rate,
)
from llamaterm.engine.checkpoints.sampling_defaults import LLAMA_CPP_DEFAULTS, model_sampling_defaults
from llamaterm.engine.checkpoints.tokenizer import Tokenizer
from llamaterm.engine.errors import LlamatermError, RequestError
from llamaterm.engine.sampling_params import Grammar, SamplingParams
from llamaterm.engine.serving.block_manager import BlockManager, pool_blocks
from llamaterm.engine.serving.device import free_memory, memory_budget, resolve_device
from llamaterm.engine.serving.draft_model import DraftModel, check_vocabulary
from llamaterm.engine.serving.grammar import Vocabulary, vocabulary
from llamaterm.engine.serving.model import Model
from llamaterm.engine.serving.model_runner import LaunchedStep, ModelRunner, drop_pending
from llamaterm.engine.serving.output import OutputState
from llamaterm.engine.serving.prompt import PromptEncoder, check_prompt
from llamaterm.engine.serving.sampling import penalised
from llamaterm.engine.serving.scheduler import Scheduler
from llamaterm.engine.serving.sequence import Sequence, Status
from llamaterm.engine.serving.speculation import MAX_DRAFT, SPECULATE, Speculation
from llamaterm.engine.thinking import OPEN as THINK_OPEN
from llamaterm.kernels.cpu_native import use_threads
from llamaterm.kernels.dispatch import REFERENCES_ONLY

RATE_WINDOW_S = 2.0  # sliding window for the aggregate tokens/s
# What a sink receives per step: (request id, token or -1, finish reason or None, error or None, the token's
# logprob if asked) per event, and (request id, prompt tokens served from the prefix cache) for each request whose
# first token is among them
Record = tuple[int, int, str | None, str | None, TokenLogprob | None]
Sink = Callable[[list[Record], list[tuple[int, int]]], None]
NOT_FINITE = (
    "the model's next-token scores for this request were NaN or infinite (the weights may be corrupt, or "
    "fp16 overflowed): try another file of the model, or --device cpu"
)
# how long the loop stays idle before the CUDA graphs' background work, so that a request that comes at once (`run`
# after start-up) goes first; then its pieces follow one another for IDLE_PIECE_S a turn until a request comes
IDLE_S = 0.05
IDLE_PIECE_S = 0.002
IDLE_WAITING_S = 0.0005  # idle, while the work waits for a thread of its own (a graph's instantiation)
# beside a step, the background work takes this share of the step's own time: of a graph step's usual time, or of
# an eager step's launch (its Python is most of the step); so no step's tokens wait for it more than a step's time
PIECE_SHARE = 0.5
NOT_ALLOWED = "the reply's grammar allows no next token here: the schema or grammar may be unsatisfiable"


@dataclass(eq=False)
class RequestHandle(EventStream):
    """The caller's side of a request: its event queue and live stats."""

    id: int
    seq: Sequence
    engine: Engine
    events_queue: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    finished: bool = False
    finish_time: float | None = None
    opens_thinking: bool = False  # the chat template opened a thinking block: the reply's text starts with its tag
    num_tokens: int = 0  # tokens handed out
    num_read: int = 0  # tokens of the reply read (handed out, or ending it): the reply's, however many a step brought

    def stats(self) -> RequestStats:
        seq = self.seq
        end = self.finish_time or time.perf_counter()
        return RequestStats(
            prompt_tokens=seq.num_prompt_tokens,
            cached_tokens=seq.num_cached,
            generated_tokens=seq.num_known - seq.num_prompt_tokens,
            ttft_s=None if seq.first_token_time is None else seq.first_token_time - seq.arrival,
            tokens_per_s=decode_rate(list(seq.token_times)),
            elapsed_s=end - seq.arrival,
            context_tokens=seq.num_known,
            max_context=self.engine.max_context,
            finished=self.finished,
        )


class Engine:
    """Satisfies engine.api.EngineClient in the caller's process."""

    def __init__(
        self,
        model: Model,
        tokenizer: Tokenizer,
        config: EngineConfig = EngineConfig(),
        name: str = "",
        sink: Sink | None = None,
        draft: Model | None = None,
    ):
        """draft: the draft model of config.speculate "draft" (from_model loads it and checks its vocabulary)."""
        self.model, self.tokenizer, self.model_name = model, tokenizer, name
        self.prompts = PromptEncoder(tokenizer)
        self.sampling_defaults = LLAMA_CPP_DEFAULTS  # from_model reads the model's
        self.sink = sink
        self._records: list[Record] = []  # this step's, for the sink
        self._cached: list[tuple[int, int]] = []
        self.device = str(model.device)
        self.max_context = context_limit(model.config.context_length, config.context_length)
        c = config
        if c.threads:  # --threads, for the CPU's kernels and torch's own
            use_threads(c.threads)
            torch.set_num_threads(c.threads)
        t = time.perf_counter()
        # prefill-sized steps on the GPU run cuBLAS on dense copies if they take at most a quarter of this engine's
        # share of the memory left (engines on one device split it, as they split the KV pool)
        self.dense_weight_bytes = 0
        if model.device.type == "cuda":
            budget = memory_budget(model.device, c.gpu_memory)
            self.dense_weight_bytes = model.keep_dense_weights(int(budget * c.kv_share) // 4)
            torch.cuda.synchronize(model.device)  # so the start-up figure holds the copies' time
        dense_s = time.perf_counter() - t
        check_speculation(c, model, draft)
        # a draft model's cache has the pool's blocks too (draft_model.py)
        kv_bytes = model.kv_bytes_per_token() + (draft.kv_bytes_per_token() if draft else 0)
        free = memory_budget(model.device, c.gpu_memory)
        kv_tokens = c.kv_tokens or default_kv_tokens(model, c.kv_share, kv_bytes, free)
        if c.context_length:  # the pool holds one sequence of --ctx tokens, at least
            kv_tokens = context_pool(c, kv_tokens, kv_bytes, free)
        num_blocks = pool_blocks(kv_tokens, c.block_size, kv_bytes, free)
        self.block_manager = BlockManager(num_blocks, c.block_size, model.config.kv_window())
        max_batch_tokens = c.max_batch_tokens or (2048 if model.device.type == "cuda" else 256)
        self.speculate = c.speculate
        # a step samples a row per sequence and one per draft: drafts ride while a step has at most speculate_tokens
        # rows, no more than every sequence drafting the most could use
        spec_rows = 0 if c.speculate == "off" else min(c.speculate_tokens, c.max_running * (1 + MAX_DRAFT))
        self.scheduler = Scheduler(self.block_manager, max_batch_tokens, c.max_running, spec_rows, draft is not None)
        # steps overlap on CUDA (engine/serving/engine.py _loop); on the CPU a launch computes the whole step, so
        # overlapping would only hold each token back by one step
        self.overlap = c.overlap if c.overlap is not None else model.device.type == "cuda"
        with out_of_memory(
            f"preparing a KV cache of {kv_tokens} tokens and the CUDA graphs",
            f"give a smaller --kv-tokens (e.g. {max(16, kv_tokens // 2)})",
        ):
            self.runner = ModelRunner(
                model,
                num_blocks,
                c.block_size,
                c.max_running,
                max_batch_tokens,
                c.cuda_graphs,
                max(c.max_running, spec_rows),
                max(0, spec_rows - 1),
                c.fast_forward,
            )
        self.draft = None
        if draft is not None:
            with out_of_memory("preparing the draft model's KV cache", "give a smaller --kv-tokens"):
                self.draft = DraftModel(
                    draft, num_blocks, c.block_size, self.runner.sampler, c.max_running, max_batch_tokens, c.cuda_graphs
                )
        # where start-up time went; from_model adds the loading
        self.startup_s = {"dense prefill weights": dense_s, **self.runner.startup_s}
        self.num_steps = 0  # steps run so far, for per-step figures in benchmarks
        self.drafted = self.kept = 0  # draft tokens verified, and kept, so far
        # steps that verified drafts, and steps completed before the next was scheduled for drafting's sake
        self.draft_steps = self.serial_steps = 0
        self.host_s = 0.0  # the loop's time outside waits for the device or for work, for per-step figures
        self._wait_s = 0.0  # this loop turn's wait for the device
        # the longest step so far, from its scheduling (or the end of the step it queued behind) to its sampled
        # tokens on the host; benchmarks reset it
        self.max_step_s = 0.0
        self._last_done = 0.0  # when the last step's tokens were read
        # the longest decode step replayed from graphs that the graphs' background work (ModelRunner.background)
        # ran beside, and its longest turn beside a graph step; when it last ran (start, end); the times of the last
        # graph steps without it, whose median sets its turns' budget
        self.max_step_background_s = 0.0
        self.max_background_turn_s = 0.0
        self._background = (0.0, 0.0)
        self._graph_steps_s: deque[float] = deque(maxlen=16)
        self._ids = itertools.count(1)
        self._handles: dict[int, RequestHandle] = {}
        self._outputs: dict[int, OutputState] = {}
        self._incoming: list[RequestHandle] = []
        self._cancels: list[int] = []
        self._cv = threading.Condition()
        self._stopped = False
        # (time, tokens) of the steps of the last RATE_WINDOW_S, and their tokens' sum: stats() is read after every
        # step (the engine process's forwarder, beside the engine's thread), so it adds no loop over them
        self._step_tokens: deque[tuple[float, int]] = deque()
        self._window_tokens = 0
        self._last_batch = 0
        self._thread = threading.Thread(target=self._loop, name="llamaterm-engine", daemon=True)
        self.ready_at = time.perf_counter()  # serving from here on
        self._thread.start()

    @classmethod
    def from_model(cls, config: EngineConfig = EngineConfig(), sink: Sink | None = None) -> Engine:
        """Load config.model (a store name or a path; None: the default model) onto config.device."""
        from llamaterm.engine.store.loader import load_checkpoint

        name = config.model
        dev = resolve_device(config.device)
        with triton_cache_key_beside(dev):
            t0 = time.perf_counter()
            ckpt, tokenizer, path = load_checkpoint(name)
            t1 = time.perf_counter()
            dtype = torch.float32 if dev.type == "cpu" else torch.float16
            with out_of_memory("loading the weights", "free the GPU, or take a smaller model (or --device cpu)"):
                model = Model(ckpt.config, ckpt.tensors, dev, dtype)
        t2 = time.perf_counter()
        shown = name if name and not Path(name).suffix and "/" not in name else Path(path).stem  # a store name
        draft = None
        if config.speculate == "draft" and config.draft:
            try:
                draft_ckpt, draft_tokenizer, _ = load_checkpoint(config.draft)
            except LlamatermError as e:
                raise LlamatermError(f"--draft {config.draft}: {e}") from None
            check_vocabulary(draft_tokenizer, tokenizer, config.draft, shown)
            with out_of_memory("loading the draft model", "take a smaller draft model, or --speculate ngram"):
                draft = Model(draft_ckpt.config, draft_ckpt.tensors, dev, dtype)
        t3 = time.perf_counter()
        engine = cls(model, tokenizer, config, name=shown, sink=sink, draft=draft)
        engine.sampling_defaults = model_sampling_defaults(Path(path), ckpt.metadata)
        engine.startup_s = {
            "read checkpoint": t1 - t0,
            "weights to device": t2 - t1,
            **({"draft model": t3 - t2} if draft else {}),
            **engine.startup_s,
        }
        return engine

    # ---- caller side (any thread) ----

    def pool_tokens(self) -> int:
        return self.block_manager.num_blocks * self.block_manager.block_size

    def sequence_limit(self) -> int:
        """The longest sequence the pool can hold on its own. With a sliding window in every layer a sequence
        holds only its window and one step's tokens (BlockManager.slide), so any length fits a pool above that."""
        bm, window = self.block_manager, self.model.config.kv_window()
        if window is not None and window + self.scheduler.max_batch_tokens + 2 * bm.block_size <= self.pool_tokens():
            return self.max_context
        return min(self.max_context, self.pool_tokens())

    def encode_prompt(
        self, prompt: list[dict] | str, raw: bool = False, enable_thinking: bool | None = None
    ) -> list[int]:
        return self.prompts.encode(prompt, raw, enable_thinking)[0]

    def submit(
        self,
        prompt: list[dict] | str | None,
        params: SamplingParams | None = None,
        *,
        raw: bool = False,
        enable_thinking: bool | None = None,
        parse_special: bool = True,
        prompt_ids: list[int] | None = None,
        tools: list[dict] | None = None,
        request_id: int | None = None,
    ) -> RequestHandle:
        """Queue a request: chat messages, a string (a user message, or raw text with raw=True, its special-token
        text parsed unless parse_special=False) or token ids, encoded here, in the caller's thread.
        enable_thinking: the chat template's thinking switch (None: the template's default). tools: what the chat
        template renders of a request's tools (engine/tool_calls.py). request_id: the caller's own id
        (engine/serving/process.py), unique among its requests."""
        params = params or SamplingParams()
        ids, opens = self.prompts.prompt_ids(prompt, raw, enable_thinking, prompt_ids, parse_special, tools)
        limit = self.sequence_limit()
        check_prompt(ids, self.model.config.vocab_size, self.max_context, limit)
        params.check_vocabulary(self.model.config.vocab_size)
        seq = Sequence(
            id=next(self._ids) if request_id is None else request_id,
            token_ids=ids,
            num_prompt_tokens=len(ids),
            params=params,
            max_tokens=min(params.max_tokens, limit - len(ids)),
            seed=params.seed if params.seed is not None else secrets.randbits(64),
            grammar=None if params.grammar is None else self._vocabulary().matcher(params.grammar),
        )
        # a grammar's matcher would need advancing through the drafts; a draft model's draws would count up a
        # penalised sequence's tokens (its drafts' rows of the model have counts of their own: model_runner.py)
        if self.speculate != "off" and params.grammar is None and not (self.speculate == "draft" and penalised(params)):
            seq.speculation = Speculation()
        handle = RequestHandle(seq.id, seq, self, opens_thinking=opens)
        with self._cv:
            if self._stopped:
                raise RequestError("the engine has shut down")
            self._incoming.append(handle)
            self._cv.notify()
        return handle

    @contextmanager
    def together(self):
        """Requests submitted inside (from this thread) reach the scheduler in one step: a response's n choices of
        one prompt, which then fork from its one prefill (engine/serving/scheduler.py)."""
        with self._cv:  # (a reentrant lock: submit takes it again)
            yield

    def ready_grammars(self, grammars: list[Grammar]) -> None:
        """Build what requests with these grammars need (the vocabulary, each grammar's compiled matcher), so that
        their submit only copies it; one refused is left to its submit to refuse."""
        for grammar in grammars:
            try:
                self._vocabulary().check(grammar)
            except RequestError:
                continue

    def _vocabulary(self) -> Vocabulary:
        """The vocabulary grammars are matched over, built by the first request with a grammar, on its thread (0.4 s
        for the default model, 1.2 s for 152k tokens; llguidance's part releases the GIL)."""
        return vocabulary(self.tokenizer, self.model.config.vocab_size)

    def cancel(self, handle: RequestStream | int) -> None:
        """Stop a request at once and free its blocks; a no-op for unknown or finished requests."""
        with self._cv:
            self._cancels.append(handle if isinstance(handle, int) else handle.id)
            self._cv.notify()

    def generate(self, prompt, params: SamplingParams | None = None, **kwargs) -> tuple[str, RequestHandle]:
        """Blocking convenience: the whole reply text."""
        handle = self.submit(prompt, params, **kwargs)
        text = []
        for event in handle.events():
            if event.error:
                raise RequestError(event.error)
            text.append(event.text)
        return "".join(text), handle

    def stats(self) -> EngineStats:
        now = time.perf_counter()
        try:  # (the engine's thread may empty the window meanwhile)
            first, last = self._step_tokens[0][0], self._step_tokens[-1][0]
        except IndexError:
            first = last = now
        span = now - first if now - last <= RATE_WINDOW_S else 0.0  # no step for a whole window: no rate
        return EngineStats(
            model=self.model_name,
            device=self.device,
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting) + len(self._incoming),
            batch_size=self._last_batch,
            kv_blocks_used=self.block_manager.num_blocks - self.block_manager.num_free,
            kv_blocks_total=self.block_manager.num_blocks,
            tokens_per_s=self._window_tokens / span if span > 0.05 else 0.0,
            steps=self.num_steps,
            host_s=self.host_s,
            drafted=self.drafted,
            kept=self.kept,
            draft_steps=self.draft_steps,
            serial_steps=self.serial_steps,
            mask_steps=(masks := self.runner.mask_times).steps,
            mask_fill_s=masks.fill_s,
            mask_tokens_s=masks.tokens_s,
            mask_wait_s=masks.wait_s,
            forced_tokens=masks.forced_tokens,
            **self._graph_stats(),
        )

    def _graph_stats(self) -> dict:
        graphs = self.runner.graphs
        if graphs is None:
            return {}
        ready = sorted(list(graphs.ready_at.items()))  # (a copy first: the loop may add one meanwhile)
        return {
            "graphs_ready_s": tuple((bucket, t - self.ready_at) for bucket, t in ready),
            "graphs_pending": len(graphs.wanted(idle=True)),
            "graphs_in_use_pending": len(graphs.wanted(idle=False)),
            "max_step_background_s": self.max_step_background_s,
            "max_background_turn_s": self.max_background_turn_s,
            "slowest_background_piece": graphs.slowest_piece,
        }

    def shutdown(self) -> None:
        """Stop the loop; requests still in flight finish as cancelled."""
        with self._cv:
            self._stopped = True
            self._cv.notify()
        self._thread.join()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- the loop (engine thread only) ----

    def _loop(self) -> None:
        inflight: LaunchedStep | None = None  # the step launched last, its tokens not yet read
        idle_wait = IDLE_S
        while True:
            idle_piece = False
            with self._cv:
                while not (self._incoming or self._cancels or self.scheduler.has_work() or self._stopped):
                    if not self.runner.background_pending(idle=True):
                        self._cv.wait()
                    elif not self._cv.wait(idle_wait):  # idle a while: the graphs' work goes on
                        idle_piece = True
                        break
                if self._stopped:
                    break
                incoming, self._incoming = self._incoming, []
                cancels, self._cancels = self._cancels, []
            if idle_piece:
                _, waiting = self._background_turn(IDLE_PIECE_S, idle=True)
                idle_wait = IDLE_WAITING_S if waiting else 0.0
                continue
            idle_wait = IDLE_S
            start = time.perf_counter()
            self._wait_s = 0.0
            for handle in incoming:
                self._admit(handle)
            for request_id in cancels:
                if request_id in self._handles:
                    self._finish(self._handles[request_id], "cancelled")
            # The next step is launched before the last one's tokens are read, so scheduling, building its inputs
            # and reading tokens overlap the device's work; it finds the tokens it needs on the device. Drafts are
            # proposed from tokens on the host: a step that verified drafts, or one before a step that may draft,
            # completes first (no step in flight ever holds drafts when the scheduler runs).
            if inflight is not None and (not self.overlap or inflight.has_drafts or self.scheduler.may_draft()):
                self.serial_steps += self.overlap
                self._complete(inflight)
                inflight = None
            launched = self._launch()
            piece_s = 0.0
            if launched is not None and self.runner.background_pending(idle=False):
                piece_s = self._turn_beside(inflight or launched)  # the tokens read next wait for it
            if inflight is not None:
                self._complete(inflight, launched)
            inflight = launched
            self._flush()
            self.host_s += time.perf_counter() - start - self._wait_s - piece_s
        for handle in self._incoming:  # submitted while the last step ran: they end with the rest
            self._admit(handle)
        for handle in list(self._handles.values()):
            self._finish(handle, "cancelled")
        self._flush()

    def _admit(self, handle: RequestHandle) -> None:
        """A submitted request, in the loop's hands."""
        self._handles[handle.id] = handle
        if self.sink is None:
            prefix = THINK_OPEN if handle.opens_thinking else ""
            self._outputs[handle.id] = OutputState(self.tokenizer, handle.seq.params.stop, prefix)
        self.scheduler.add(handle.seq)

    def _turn_beside(self, step: LaunchedStep) -> float:
        """A turn of the graphs' background work while the device runs the steps queued, a share of the time of
        `step`, whose tokens wait for it; returns its time."""
        own_s = statistics.median(self._graph_steps_s or [0.0]) if step.graphed else step.launch_s
        turn_s, _ = self._background_turn(PIECE_SHARE * own_s)
        if step.graphed:
            self.max_background_turn_s = max(self.max_background_turn_s, turn_s)
        return turn_s

    def _background_turn(self, budget_s: float, idle: bool = False) -> tuple[float, bool]:
        """The CUDA graphs' background work for about budget_s (model_runner.py); returns its time, and whether it
        waits for a thread of its own."""
        t = time.perf_counter()
        waiting = self.runner.background(budget_s, idle)
        self._background = (t, time.perf_counter())
        return self._background[1] - t, waiting

    def _flush(self) -> None:
        if self._records or self._cached:
            assert self.sink is not None
            self.sink(self._records, self._cached)
            self._records, self._cached = [], []

    def _launch(self) -> LaunchedStep | None:
        """Schedule and launch one step; its sampled tokens stay on the device (model_runner.py)."""
        start = time.perf_counter()
        chunks = self.scheduler.schedule()
        if not chunks:
            return None
        self._last_batch = len(chunks)
        self.num_steps += 1
        try:
            if self.draft is not None and (drafting := [c.seq for c in chunks if c.seq.num_drafts]):
                self.draft.propose(drafting)
            step = self.runner.launch(chunks, start)
        except Exception as e:  # the whole batch shared this failure
            for c in chunks:
                self._finish(self._handles[c.seq.id], "error", f"{type(e).__name__}: {e}")
            return None
        self.scheduler.advance(chunks)
        return step

    def _complete(self, step: LaunchedStep, after: LaunchedStep | None = None) -> None:
        """Read a launched step's tokens (waiting for the device) and hand them to their requests; `after`: the step
        launched while it ran."""
        t = time.perf_counter()
        try:
            tokens = self.runner.complete(step)
        except Exception as e:  # a device error surfaces here, after the launch: the step's requests share it
            for seq in step.sampling:
                if (handle := self._handles.get(seq.id)) is not None and handle.seq is seq:
                    self._finish(handle, "error", f"{type(e).__name__}: {e}")
            return
        now = time.perf_counter()
        self._wait_s += now - t
        step_s = now - max(step.start, self._last_done)  # with overlap, about the step's time on the device
        self.max_step_s = max(self.max_step_s, step_s)
        # a graph step's time, unless an eager launch after it held its tokens up (a whole step's Python)
        graphed = step.graphed and (after is None or after.graphed)
        if self._background[1] > now - step_s:  # the graphs' background work may have held this step up
            if graphed and not step.prefill_tokens:  # (a decode step, whose usual time is a session's token gap)
                self.max_step_background_s = max(self.max_step_background_s, step_s)
        else:  # the pace of prefill learns from steps as they run without it
            self.scheduler.pace.observe(step.decode_rows, step.prefill_tokens, step_s)
            if graphed:
                self._graph_steps_s.append(step_s)
        self._last_done = now
        for seq, drafts in zip(step.sampling, step.drafts, strict=True):
            if drafts and seq.status is not Status.FINISHED:
                self.scheduler.drop_rejected(seq)
        self.drafted, self.kept = self.drafted + step.verified, self.kept + step.kept
        self.draft_steps += step.has_drafts
        for seq, token, logprob in tokens:
            handle = self._handles.get(seq.id)
            if handle is None or handle.seq is not seq:  # ended by an earlier token of this step
                continue
            try:
                self._on_token(handle, token, logprob, now)
            except Exception as e:  # one request's failure stays its own
                self._finish(handle, "error", f"{type(e).__name__}: {e}")
        self._step_tokens.append((now, len(tokens)))
        self._window_tokens += len(tokens)
        while now - self._step_tokens[0][0] > RATE_WINDOW_S:
            self._window_tokens -= self._step_tokens.popleft()[1]

    def _on_token(self, handle: RequestHandle, token: int, logprob: TokenLogprob | None, now: float) -> None:
        seq = handle.seq
        handle.num_read += 1
        seq.token_times.append(now)
        if seq.first_token_time is None:
            seq.first_token_time = now
            if self.sink is not None:
                self._cached.append((seq.id, seq.num_cached))
        if token < 0:  # not finite; under a grammar, no token allowed (-1) or one refused (REFUSED)
            problem = NOT_FINITE if seq.grammar is None else str(seq.grammar.error() or NOT_ALLOWED)
            return self._finish(handle, "error", problem)
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.tokenizer.stop_ids):
            return self._finish(handle, "stop", token_ids=(token,))
        text = ""
        if self.sink is None:
            text, stopped = self._outputs[seq.id].push(token)
            if stopped:
                return self._finish(handle, "stop", text=text, token_ids=(token,), logprob=logprob)
        handle.num_tokens += 1
        if handle.num_tokens >= seq.max_tokens:
            return self._finish(handle, "length", text=text, token_ids=(token,), logprob=logprob)
        if self.sink is None:
            handle.events_queue.put(Event(seq.id, text, (token,), logprobs=() if logprob is None else (logprob,)))
        else:
            self._records.append((seq.id, token, None, None, logprob))
        if seq.grammar is not None and seq.grammar.is_done():  # the reply is whole: nothing may follow
            self._finish(handle, "stop")

    def _finish(
        self,
        handle: RequestHandle,
        reason: str,
        error: str | None = None,
        *,
        text: str = "",
        token_ids: tuple[int, ...] = (),
        logprob: TokenLogprob | None = None,
    ) -> None:
        """End a request. A sink's record of a "stop" carries the stop token, which is no text; of a "length",
        the last token, which is. `logprob` is the last token's, where it is part of the reply."""
        seq = handle.seq
        self.scheduler.finish(seq)
        drop_pending(seq)
        del seq.token_ids[seq.num_prompt_tokens + handle.num_read :]  # a step's drafts or forced run past its end
        del self._handles[handle.id]
        handle.finished, handle.finish_time = True, time.perf_counter()
        if self.sink is not None:
            self._records.append((handle.id, token_ids[0] if token_ids else -1, reason, error, logprob))
            return
        output = self._outputs.pop(handle.id)
        if reason in ("length", "stop") and not error:
            text += output.finish()
        logprobs = () if logprob is None else (logprob,)
        handle.events_queue.put(Event(handle.id, text, token_ids, True, reason, error, logprobs))


@contextmanager
def triton_cache_key_beside(device: torch.device):
    """Triton keys its kernel cache by a hash of its own library (libtriton, 500 MB), computed at the first kernel
    lookup: 0.4 s on an H200's host, 1.6 s on two CPU cores, on the way to the first request. Hashing lets go of
    the GIL, so a thread computes it beside the block's work (reading the checkpoint, the weights to the device);
    the block ends once both are done. Nothing off CUDA."""
    if device.type != "cuda" or REFERENCES_ONLY:
        yield
        return
    from triton.runtime.cache import triton_key  # (an lru_cache: computed once a process)

    thread = threading.Thread(target=triton_key, name="llamaterm-triton-key", daemon=True)
    thread.start()
    try:
        yield
    finally:
        thread.join()


@contextmanager
def out_of_memory(doing: str, advice: str):
    """The GPU running out of memory at start-up is one line that says what to change, not a traceback."""
    try:
        yield
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()  # what the failed step held goes back, so a caller that stays up can retry
        free, total = torch.cuda.mem_get_info()
        raise LlamatermError(
            f"the GPU ran out of memory {doing} ({free / 1e9:.3g} of {total / 1e9:.3g} GB free now): {advice}"
        ) from None


def default_kv_tokens(model: Model, share: float = 1.0, kv_bytes: int | None = None, free: int | None = None) -> int:
    """CUDA: most of the memory left after the weights. CPU: a quarter of the free memory, at most 32k tokens.
    An engine that shares the device with others takes `share` of that. kv_bytes: a token's (default: the
    model's; with a draft model, both models'); free: the bytes the engine may take (default: the free memory)."""
    free, per_token = free or free_memory(model.device), kv_bytes or model.kv_bytes_per_token()
    if model.device.type == "cuda":
        return int(free * 0.85 * share) // per_token
    return max(1024, min(32768, int(free / 4 * share) // per_token))


def context_limit(model_context: int, asked: int | None) -> int:
    """--ctx, which may shorten the model's own context but not lengthen it (its positions were never trained)."""
    if asked is not None and asked > model_context:
        raise LlamatermError(f"--ctx {asked} is past the model's own context of {model_context}: give at most that")
    return asked or model_context


def context_pool(c: EngineConfig, kv_tokens: int, kv_bytes: int, free: int) -> int:
    """A KV pool of kv_tokens grown to hold one sequence of --ctx tokens; refused where memory cannot hold it."""
    assert c.context_length is not None
    if c.kv_tokens is not None and c.kv_tokens < c.context_length:
        raise LlamatermError(
            f"--kv-tokens {c.kv_tokens} cannot hold one sequence of --ctx {c.context_length}: give at least as many "
            "KV tokens as --ctx, or leave --kv-tokens out"
        )
    if c.context_length * kv_bytes > free:
        raise LlamatermError(
            f"--ctx {c.context_length} needs {c.context_length * kv_bytes / 1e9:.3g} GB of KV cache, and "
            f"{free / 1e9:.3g} GB are free: give at most --ctx {free // kv_bytes}"
        )
    return max(kv_tokens, c.context_length)


def check_speculation(c: EngineConfig, model: Model, draft: Model | None) -> None:
    if c.speculate not in SPECULATE:
        raise LlamatermError(f"unknown speculation {c.speculate!r}: one of {', '.join(SPECULATE)}")
    if (c.speculate == "draft") != (draft is not None):
        raise LlamatermError("speculation with a draft model needs one: give --draft MODEL with --speculate draft")
    if draft is not None and draft.config.vocab_size != model.config.vocab_size:
        raise LlamatermError(
            f"the draft model's vocabulary differs from the model's (size {draft.config.vocab_size} vs "
            f"{model.config.vocab_size}): pick a draft model of the same family, or --speculate ngram"
        )
    if draft is not None and model.config.kv_window() is not None:  # its blocks behind the window are given back
        raise LlamatermError(
            "a draft model needs a model that attends to its whole context, and this one slides a window in every "
            "layer: use --speculate ngram"
        )
