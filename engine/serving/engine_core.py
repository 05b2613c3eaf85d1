"""The engine core: one loop thread that owns the model, the KV cache and the scheduler, and turns requests of
token ids into token ids. Each step reads schedule -> run -> settle: the scheduler picks the step's chunks, the model
runner launches them, and the tokens a step sampled are settled into their sequences and handed to the sink, one
list of TokenOutput a step (engine/serving/output_processor.py turns them into text, in this process or the engine
process's parent).

The loop never waits on consumers (the sink only queues) and consumers never block the loop (add and abort only
enqueue). A failure while serving one request fails that request alone.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import cast

import torch

from llamaterm.engine.api import EngineConfig, EngineStats, TokenLogprob
from llamaterm.engine.checkpoints.sampling_defaults import LLAMA_CPP_DEFAULTS, model_sampling_defaults
from llamaterm.engine.checkpoints.tokenizer import Tokenizer
from llamaterm.engine.errors import LlamatermError, RequestError
from llamaterm.engine.sampling_params import Grammar, SamplingParams
from llamaterm.engine.serving.block_manager import BlockManager, pool_blocks
from llamaterm.engine.serving.device import check_weights_fit, free_memory, memory_budget, resolve_device
from llamaterm.engine.serving.draft_model import check_vocabulary
from llamaterm.engine.serving.front_end import CoreInfo
from llamaterm.engine.serving.grammar import Vocabulary, vocabulary
from llamaterm.engine.serving.model import Model
from llamaterm.engine.serving.model_runner import LaunchedStep, ModelRunner
from llamaterm.engine.serving.output_processor import TokenOutput
from llamaterm.engine.serving.sampling import penalised
from llamaterm.engine.serving.scheduler import Scheduler
from llamaterm.engine.serving.sequence import Sequence, Status
from llamaterm.engine.serving.speculation import MAX_DRAFT, SPECULATE, Speculation
from llamaterm.engine.serving.step_stats import StepRecorder, StepStats
from llamaterm.engine.serving.synthetic_model import parse_synthetic, synthetic_model
from llamaterm.engine.serving.weight_bytes import weight_bytes
from llamaterm.engine.synthetic import SyntheticTokenizer, is_synthetic
from llamaterm.kernels.cpu_native import use_threads
from llamaterm.kernels.dispatch import REFERENCES_ONLY

# What the sink receives per step: a TokenOutput per token or finish, and (request id, prompt tokens served from the
# prefix cache) for each request whose first token is among them
Sink = Callable[[list[TokenOutput], list[tuple[int, int]]], None]
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


class EngineCore:
    def __init__(
        self,
        model: Model,
        tokenizer: Tokenizer,
        config: EngineConfig = EngineConfig(),
        name: str = "",
        draft: Model | None = None,
    ):
        """tokenizer: for its stop tokens and the grammars' vocabulary. draft: the draft model of config.speculate
        "draft" (from_model loads it and checks its vocabulary). The loop starts with start()."""
        self.model, self.tokenizer, self.model_name = model, tokenizer, name
        self.sampling_defaults = LLAMA_CPP_DEFAULTS  # from_model reads the model's
        self.sink: Sink = lambda outputs, cached: None
        self._outputs: list[TokenOutput] = []  # this step's, for the sink
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
        self.scheduler = Scheduler(self.block_manager, max_batch_tokens, c.max_running, spec_rows)
        # steps overlap on CUDA (_loop); on the CPU a launch computes the whole step, so
        # overlapping would only hold each token back by one step
        self.overlap = c.overlap if c.overlap is not None else model.device.type == "cuda"
        with out_of_memory(
            f"preparing a KV cache of {kv_tokens} tokens{' for both models' if draft else ''} and the CUDA graphs",
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
                draft,
            )
        # where start-up time went; from_model adds the loading
        self.startup_s = {"dense prefill weights": dense_s, **self.runner.startup_s}
        self.recorder = StepRecorder()
        self._requests: dict[int, Sequence] = {}  # those in the loop's hands
        self._incoming: list[Sequence] = []
        self._cancels: list[int] = []
        self._cv = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="llamaterm-engine", daemon=True)
        self.ready_at = 0.0  # serving from here on

    def start(self, sink: Sink) -> None:
        """Start the loop, its steps' outputs to `sink` (called on the loop's thread)."""
        self.sink = sink
        self.ready_at = time.perf_counter()
        self._thread.start()

    @classmethod
    def from_model(cls, config: EngineConfig = EngineConfig()) -> EngineCore:
        """Load config.model (a store name or a path; None: the default model) onto config.device, or make random
        weights in a model's shapes (synthetic:NAME[:fp16], synthetic_model.py)."""
        from llamaterm.engine.checkpoints.checkpoint_info import weight_bytes
        from llamaterm.engine.store.loader import load_checkpoint
        from llamaterm.engine.store.model_store import resolve_model

        if is_synthetic(config.model):
            return cls._synthetic(config)
        name = config.model
        dev = resolve_device(config.device)
        with triton_cache_key_beside(dev):
            t0 = time.perf_counter()
            if dev.type == "cuda":  # a model that cannot fit is refused before it is read
                checkpoint = resolve_model(name)
                check_weights_fit(checkpoint.name, weight_bytes(checkpoint), free_memory(dev))
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
        core = cls(model, tokenizer, config, name=shown, draft=draft)
        core.sampling_defaults = model_sampling_defaults(Path(path), ckpt.metadata)
        core.startup_s = {
            "read checkpoint": t1 - t0,
            "weights to device": t2 - t1,
            **({"draft model": t3 - t2} if draft else {}),
            **core.startup_s,
        }
        return core

    @classmethod
    def _synthetic(cls, config: EngineConfig) -> EngineCore:
        assert config.model is not None
        name, quantized = parse_synthetic(config.model)
        dev = resolve_device(config.device)
        with triton_cache_key_beside(dev):
            t = time.perf_counter()
            model = synthetic_model(name, quantized, dev)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            made = time.perf_counter() - t
        tokenizer = cast(Tokenizer, SyntheticTokenizer(model.config.vocab_size))  # (the methods the engine uses)
        core = cls(model, tokenizer, config, name=model.config.name)
        core.startup_s = {"make random weights": made, **core.startup_s}
        return core

    # ---- the front end's side (any thread) ----

    def info(self) -> CoreInfo:
        return CoreInfo(
            self.model_name,
            self.device,
            self.max_context,
            self.sequence_limit(),
            self.model.config.vocab_size,
            self.sampling_defaults,
        )

    def describe(self) -> dict:
        """What `llamaterm bench` and `ps` show of this engine: where start-up went, the weight bytes a decode step
        reads, CUDA graphs or not, the dense copies kept for prefill, its KV pool in tokens and the memory it holds."""
        return {
            "startup_s": self.startup_s,
            "weight_bytes": weight_bytes(self.model),
            "cuda_graphs": self.runner.graphs is not None,
            "dense_weight_bytes": self.dense_weight_bytes,
            "kv_tokens": self.pool_tokens(),
            "memory_bytes": self.memory_held(),
        }

    def memory_held(self) -> int:
        """What the engine holds of its device's memory: on a GPU, torch's reservation; on the CPU, the weights and
        the KV cache."""
        device = self.model.device
        if device.type == "cuda":
            return torch.cuda.memory_reserved(device)
        return weight_bytes(self.model) + self.pool_tokens() * self.model.kv_bytes_per_token()

    def pool_tokens(self) -> int:
        return self.block_manager.num_blocks * self.block_manager.block_size

    def sequence_limit(self) -> int:
        """The longest sequence the pool can hold on its own. With a sliding window in every layer a sequence
        holds only its window and one step's tokens (BlockManager.slide), so any length fits a pool above that."""
        bm, window = self.block_manager, self.model.config.kv_window()
        if window is not None and window + self.scheduler.max_batch_tokens + 2 * bm.block_size <= self.pool_tokens():
            return self.max_context
        return min(self.max_context, self.pool_tokens())

    def add(self, request_id: int, prompt_ids: list[int], params: SamplingParams) -> None:
        """Queue a request the front end has checked (engine/serving/front_end.py), under its id; its sequence (and
        grammar matcher) is made here, in the caller's thread."""
        seq = Sequence(
            id=request_id,
            prompt=prompt_ids,
            params=params,
            max_tokens=min(params.max_tokens, self.sequence_limit() - len(prompt_ids)),
            seed=params.seed if params.seed is not None else secrets.randbits(64),
            grammar=None if params.grammar is None else self._vocabulary().matcher(params.grammar),
        )
        # a grammar's matcher would need advancing through the drafts; a draft model's draws would count up a
        # penalised sequence's tokens (its drafts' rows of the model have counts of their own: model_runner.py)
        if self.speculate != "off" and params.grammar is None and not (self.speculate == "draft" and penalised(params)):
            seq.speculation = Speculation()
        with self._cv:
            if self._stopped:
                raise RequestError("the engine has shut down")
            self._incoming.append(seq)
            self._cv.notify()

    @contextmanager
    def together(self):
        """Requests added inside (from this thread) reach the scheduler in one step: a response's n choices of one
        prompt, which then fork from its one prefill (engine/serving/scheduler.py)."""
        with self._cv:  # (a reentrant lock: add takes it again)
            yield

    def ready_grammars(self, grammars: list[Grammar]) -> None:
        """Build what requests with these grammars need (the vocabulary, each grammar's compiled matcher), so that
        their add only copies it; one refused is left to its add to refuse."""
        for grammar in grammars:
            try:
                self._vocabulary().check(grammar)
            except RequestError:
                continue

    def _vocabulary(self) -> Vocabulary:
        """The vocabulary grammars are matched over, built by the first request with a grammar, on its thread
        (llguidance's part releases the GIL)."""
        return vocabulary(self.tokenizer, self.model.config.vocab_size)

    def abort(self, request_id: int) -> None:
        """Stop a request at once and free its blocks; it ends as cancelled. A no-op for unknown or finished
        requests."""
        with self._cv:
            self._cancels.append(request_id)
            self._cv.notify()

    def stats(self) -> EngineStats:
        return EngineStats(
            model=self.model_name,
            device=self.device,
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting) + len(self._incoming),
            batch_size=self.recorder.batch,
            kv_blocks_used=self.block_manager.num_blocks - self.block_manager.num_free,
            kv_blocks_total=self.block_manager.num_blocks,
            tokens_per_s=self.recorder.tokens_per_s(),
        )

    def step_stats(self) -> StepStats:
        return self.recorder.snapshot(self.runner, self.ready_at)

    def shutdown(self) -> None:
        """Stop the loop; requests still in flight finish as cancelled."""
        with self._cv:
            self._stopped = True
            self._cv.notify()
        self._thread.join()

    # ---- the loop (engine thread only) ----

    def _loop(self) -> None:
        inflight: LaunchedStep | None = None  # the step launched last, its tokens not yet read
        while (work := self._wait_for_work()) is not None:
            start = self.recorder.turn_started()
            self._take(*work)
            # The next step is launched before the last one's tokens are read, so scheduling, building its inputs
            # and reading tokens overlap the device's work; it finds the tokens it needs on the device. Drafts are
            # proposed from tokens on the host: a step that verified drafts, or one before a step that may draft,
            # completes first (no step in flight ever holds drafts when the scheduler runs).
            if inflight is not None and (not self.overlap or inflight.has_drafts or self._may_draft()):
                self.recorder.serial_steps += self.overlap
                self._settle(inflight)
                inflight = None
            launched = self._launch()  # schedule -> run
            background_s = self._background_beside(inflight or launched) if launched is not None else 0.0
            if inflight is not None:
                self._settle(inflight, launched)
            inflight = launched
            self._flush()
            self.recorder.turn_ended(start, background_s)
        self._take(self._incoming, [])  # added while the last step ran: they end with the rest
        for seq in list(self._requests.values()):
            self._finish(seq, "cancelled")
        self._flush()
        self.runner.close()

    def _wait_for_work(self) -> tuple[list[Sequence], list[int]] | None:
        """Until there is work: the requests added and aborted since; None once shut down. Idle, the CUDA graphs'
        background work goes on a piece at a time, after a pause, so that a request that comes at once (`run` after
        start-up) goes first."""
        idle_wait = IDLE_S
        while True:
            with self._cv:
                while not (self._incoming or self._cancels or self.scheduler.has_work() or self._stopped):
                    if not self.runner.background_pending(idle=True):
                        self._cv.wait()
                    elif not self._cv.wait(idle_wait):  # idle a while: a piece of the graphs' work
                        break
                else:
                    if self._stopped:
                        return None
                    work = self._incoming, self._cancels
                    self._incoming, self._cancels = [], []
                    return work
            _, waiting = self._background_turn(IDLE_PIECE_S, idle=True)
            idle_wait = IDLE_WAITING_S if waiting else 0.0

    def _take(self, incoming: list[Sequence], aborts: list[int]) -> None:
        """Added requests, in the loop's hands; aborted ones, ended."""
        for seq in incoming:
            self._requests[seq.id] = seq
            self.scheduler.add(seq)
        for request_id in aborts:
            if request_id in self._requests:
                self._finish(self._requests[request_id], "cancelled")

    def _may_draft(self) -> bool:
        return self.runner.proposer.may_draft(self.scheduler.running, self.scheduler.draft_rows())

    def _launch(self) -> LaunchedStep | None:
        """Schedule and launch one step, with the drafts proposed for it; its sampled tokens stay on the device
        (model_runner.py)."""
        start = time.perf_counter()
        self.runner.propose(self.scheduler.running, self.scheduler.draft_rows())
        chunks = self.scheduler.schedule()
        if not chunks:
            return None
        self.recorder.steps += 1
        self.recorder.batch = len(chunks)
        try:
            step = self.runner.launch(chunks, start)
        except Exception as e:  # the whole batch shared this failure
            for c in chunks:
                self._finish(c.seq, "error", f"{type(e).__name__}: {e}")
            return None
        self.scheduler.advance(chunks)
        return step

    def _settle(self, step: LaunchedStep, after: LaunchedStep | None = None) -> None:
        """Read a launched step's tokens (waiting for the device), settled into their sequences by the runner, and
        hand them out; `after`: the step launched while it ran."""
        t = time.perf_counter()
        try:
            tokens = self.runner.complete(step)
        except Exception as e:  # a device error surfaces here, after the launch: the step's requests share it
            for seq in step.sampling:
                if self._requests.get(seq.id) is seq:
                    self._finish(seq, "error", f"{type(e).__name__}: {e}")
            return
        if (step_s := self.recorder.completed(step, after, t)) is not None:  # not held up by the graphs' work
            self.scheduler.pace.observe(step.decode_rows, step.prefill_tokens, step_s)
        for seq, drafts in zip(step.sampling, step.drafts, strict=True):
            if drafts and seq.status is not Status.FINISHED:
                self.scheduler.drop_rejected(seq)
        for seq, token, logprob in tokens:
            if self._requests.get(seq.id) is not seq:  # ended by an earlier token of this step
                continue
            try:
                self._on_token(seq, token, logprob)
            except Exception as e:  # one request's failure stays its own
                self._finish(seq, "error", f"{type(e).__name__}: {e}")
        self.recorder.tokens(len(tokens))

    def _background_beside(self, step: LaunchedStep) -> float:
        """A turn of the CUDA graphs' background work while the device runs the steps queued, a share of the time
        of `step`, whose tokens wait for it; returns its time."""
        if not self.runner.background_pending(idle=False):
            return 0.0
        own_s = self.recorder.graph_step_s() if step.graphed else step.launch_s
        turn_s, _ = self._background_turn(PIECE_SHARE * own_s, beside=step)
        return turn_s

    def _background_turn(
        self, budget_s: float, idle: bool = False, beside: LaunchedStep | None = None
    ) -> tuple[float, bool]:
        """The CUDA graphs' background work for about budget_s (model_runner.py); returns its time, and whether it
        waits for a thread of its own."""
        t = time.perf_counter()
        waiting = self.runner.background(budget_s, idle)
        end = time.perf_counter()
        self.recorder.background_ran(t, end, beside is not None and beside.graphed)
        return end - t, waiting

    def _flush(self) -> None:
        if self._outputs or self._cached:
            self.sink(self._outputs, self._cached)
            self._outputs, self._cached = [], []

    def _on_token(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> None:
        if not seq.num_emitted:  # its first token
            self._cached.append((seq.id, seq.num_cached))
        if token < 0:  # not finite; under a grammar, no token allowed (-1) or one refused (REFUSED)
            problem = NOT_FINITE if seq.grammar is None else str(seq.grammar.error() or NOT_ALLOWED)
            return self._finish(seq, "error", problem)
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.tokenizer.stop_ids):
            return self._finish(seq, "stop", token=token)
        seq.num_emitted += 1
        if seq.num_emitted >= seq.max_tokens:
            return self._finish(seq, "length", token=token, logprob=logprob)
        self._outputs.append(TokenOutput(seq.id, token, logprob=logprob))
        if seq.grammar is not None and seq.grammar.is_done():  # the reply is whole: nothing may follow
            self._finish(seq, "stop")

    def _finish(
        self, seq: Sequence, reason: str, error: str | None = None, token: int = -1, logprob: TokenLogprob | None = None
    ) -> None:
        """End a request. The output of a "stop" carries the stop token, which is no text; of a "length", the last
        token, which is. `logprob` is the last token's, where it is part of the reply."""
        self.scheduler.finish(seq)
        seq.drop()  # a step's drafts or forced run past its end
        del self._requests[seq.id]
        self._outputs.append(TokenOutput(seq.id, token, reason, error, logprob))


@contextmanager
def triton_cache_key_beside(device: torch.device):
    """Triton keys its kernel cache by a hash of its own library (libtriton, 500 MB), computed at the first kernel
    lookup, on the way to the first request: a second or more. Hashing lets go of
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
