"""The engine in a child process, behind the calls the TUI and the server make on serving.engine.Engine.

In one process a UI shares the GIL with the engine loop: every frame Textual lays out is time the loop's Python
waits. Here the loop runs in a process of its own and does nothing but steps. The parent encodes prompts (template
and tokenizer, engine/serving/prompt.py), checks them against the model's limits, detokenizes replies and finds
their stop strings (engine/serving/output.py), as vLLM's front end does for its engine core; the child sends one
message per step with every request's new token ids (fewer when the parent reads slowly: the steps that queued up
go as one). The messages are pickles of plain tuples and our own dataclasses between our own two processes.
"""

from __future__ import annotations

import gc
import itertools
import multiprocessing as mp
import queue
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

from llamaterm.engine.api import (
    ArrivalStats,
    EngineConfig,
    EngineStats,
    Event,
    EventStream,
    RequestStream,
    TokenLogprob,
)
from llamaterm.engine.checkpoints.sampling_defaults import SamplingDefaults
from llamaterm.engine.checkpoints.tokenizer import Tokenizer
from llamaterm.engine.errors import LlamatermError
from llamaterm.engine.sampling_params import SamplingParams
from llamaterm.engine.serving.grammar import vocabulary
from llamaterm.engine.serving.output import OutputState
from llamaterm.engine.serving.prompt import PromptEncoder, check_prompt
from llamaterm.engine.synthetic import SyntheticTokenizer, is_synthetic
from llamaterm.engine.thinking import OPEN as THINK_OPEN

if TYPE_CHECKING:  # the parent never imports the engine (nor torch)
    from llamaterm.engine.serving.engine import Engine, Record, Sink

IDLE_TICK_S = 0.5  # engine stats still refresh while nothing streams


# ---- messages, parent -> child ----


@dataclass(frozen=True)
class Submit:
    request_id: int
    prompt_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class Cancel:
    request_id: int


@dataclass(frozen=True)
class Shutdown:
    pass


# ---- messages, child -> parent ----


@dataclass(frozen=True)
class Ready:
    model_name: str
    device: str
    max_context: int
    sequence_limit: int  # the longest prompt plus reply the KV pool holds (Engine.sequence_limit)
    vocab_size: int
    info: dict  # for `llamaterm bench`: where start-up went, weight bytes a decode step reads, CUDA graphs or not
    sampling_defaults: SamplingDefaults  # the model's (Engine.sampling_defaults)


@dataclass(frozen=True)
class LoadFailed:
    error: LlamatermError


@dataclass(frozen=True)
class StepOutput:
    """What the steps since the last message produced: engine/serving/engine.py's Record per token or finish, in
    order, and the prefix-cache hits of requests that got their first token."""

    records: list[Record]
    cached: list[tuple[int, int]]
    stats: EngineStats


@dataclass(eq=False)
class ProcessHandle(ArrivalStats, EventStream):
    """A request of the parent's: its text as its tokens arrive, and its stats, measured here."""

    id: int
    output: OutputState
    prompt_tokens: int
    max_context: int
    events_queue: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    cached_tokens: int = 0
    generated: int = 0
    start: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    end: float | None = None
    token_times: deque = field(default_factory=lambda: deque(maxlen=32))

    def push(
        self, token: int, reason: str | None, error: str | None, logprob: TokenLogprob | None, now: float
    ) -> tuple[bool, bool]:
        """One record from the child. Returns (finished, a stop string ended it here: the child must cancel)."""
        if token >= 0:
            self.generated += 1
            self.token_times.append(now)
            self.first_token = self.first_token or now
        text, stopped = "", False
        if token >= 0 and reason in (None, "length"):  # a "stop" record's token is a stop token: no text
            text, stopped = self.output.push(token)
        if stopped:
            reason = "stop"
        logprobs = () if logprob is None else (logprob,)
        if reason is None:
            self.events_queue.put(Event(self.id, text, (token,), logprobs=logprobs))
            return False, False
        if reason in ("length", "stop") and error is None:
            text += self.output.finish()
        self.end = now
        ids = (token,) if token >= 0 else ()
        self.events_queue.put(Event(self.id, text, ids, True, reason, error, logprobs))
        return True, stopped


Load = Callable[[EngineConfig, "Sink"], "Engine"]  # run in the child


def load_engine(config: EngineConfig, sink: Sink) -> Engine:
    """The model config names, or random weights in a model's shapes (synthetic:NAME, engine/bench.py)."""
    from llamaterm.engine.bench import open_engine

    return open_engine(config.model, config.device, config, sink).engine


class EngineProcess:
    """Satisfies engine.api.EngineClient with the engine in a child process. `load` builds the child's engine (a
    module-level function, as the child imports it); `tokenizer` encodes and decodes here (default: the model's)."""

    def __init__(
        self, config: EngineConfig = EngineConfig(), load: Load = load_engine, tokenizer: Tokenizer | None = None
    ):
        ctx = mp.get_context("spawn")  # a fork would copy the parent's threads and locks
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(target=serve, args=(child, config, load), name="llamaterm-engine", daemon=True)
        start_with_real_stderr(self._process)
        child.close()
        try:
            if tokenizer is None:  # read while the child loads the weights
                from llamaterm.engine.store.loader import load_tokenizer

                # a synthetic model's tokenizer has the methods prompts and replies use (engine/synthetic.py)
                synthetic = cast(Tokenizer, SyntheticTokenizer())
                tokenizer = synthetic if is_synthetic(config.model) else load_tokenizer(config.model)
            reply = self._conn.recv()
        except EOFError:
            raise LlamatermError("the engine process exited while loading the model") from None
        except BaseException:
            self._process.kill()
            raise
        if isinstance(reply, LoadFailed):
            self._process.join()
            raise reply.error
        self.model_name, self.device, self.max_context = reply.model_name, reply.device, reply.max_context
        self._ready = reply
        self.info, self.vocab_size = reply.info, reply.vocab_size
        self.sampling_defaults = reply.sampling_defaults
        if isinstance(tokenizer, SyntheticTokenizer):
            tokenizer.vocab = reply.vocab_size
        self.tokenizer = tokenizer
        self.prompts = PromptEncoder(tokenizer)
        self._send_lock = threading.Lock()
        self._group = threading.local()  # .submits: what together() gathers in this thread
        self._handles: dict[int, ProcessHandle] = {}
        self._stats = EngineStats(model=self.model_name, device=self.device)
        self._ids = itertools.count(1)
        # set by the reader once the child is gone (its pipe closed) and every request in flight has ended with an
        # error: a server watches it to restart the engine
        self.exited = threading.Event()
        self._reader = threading.Thread(target=self._read, name="llamaterm-engine-reader", daemon=True)
        self._reader.start()

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
    ) -> ProcessHandle:
        """As Engine.submit; a request the model cannot take raises here, in the caller's thread."""
        params = params or SamplingParams()
        ids, opens = self.prompts.prompt_ids(prompt, raw, enable_thinking, prompt_ids, parse_special, tools)
        r = self._ready
        check_prompt(ids, r.vocab_size, r.max_context, r.sequence_limit)
        params.check_vocabulary(r.vocab_size)
        if params.grammar is not None:  # refused here, at once, rather than by the engine after the pipe
            vocabulary(self.tokenizer, r.vocab_size).check(params.grammar)
        request_id = next(self._ids)
        output = OutputState(self.tokenizer, params.stop, THINK_OPEN if opens else "")
        handle = self._handles[request_id] = ProcessHandle(request_id, output, len(ids), self.max_context)
        if (group := getattr(self._group, "submits", None)) is not None:
            group.append(Submit(request_id, ids, params))
            return handle
        self._submit([Submit(request_id, ids, params)])
        return handle

    @contextmanager
    def together(self):
        """Requests submitted inside (from this thread) go to the child as one message, which its engine takes in
        one step (Engine.together): a response's n choices, forked from one prefill."""
        if getattr(self._group, "submits", None) is not None:  # inside another together(): one group
            yield
            return
        self._group.submits = []
        try:
            yield
        finally:
            group, self._group.submits = self._group.submits, None
            if group:
                self._submit(group)

    def _submit(self, submits: list[Submit]) -> None:
        try:
            self._send(submits)
        except LlamatermError:
            for submit in submits:
                del self._handles[submit.request_id]
            raise

    def cancel(self, handle: RequestStream | int) -> None:
        self._send(Cancel(handle if isinstance(handle, int) else handle.id))

    def stats(self) -> EngineStats:
        return self._stats

    @property
    def exitcode(self) -> int | None:
        """The child's exit code once it has been reaped (shutdown() reaps it), negative for a signal's number."""
        return self._process.exitcode

    def shutdown(self) -> None:
        if self._process.is_alive():
            try:
                self._send(Shutdown())
            except LlamatermError:
                pass
            self._process.join(timeout=10)
        if self._process.is_alive():
            self._process.kill()
        self._reader.join(timeout=10)

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def _send(self, message: list[Submit] | Cancel | Shutdown) -> None:
        with self._send_lock:
            try:
                self._conn.send(message)
            except (BrokenPipeError, OSError):
                raise LlamatermError("the engine process has exited") from None

    def _read(self) -> None:
        while True:
            try:
                message: StepOutput = self._conn.recv()
            except (EOFError, OSError):
                break
            now = time.perf_counter()
            self._stats = message.stats
            for request_id, cached in message.cached:
                if (handle := self._handles.get(request_id)) is not None:
                    handle.cached_tokens = cached
            for request_id, token, reason, error, logprob in message.records:
                if (handle := self._handles.get(request_id)) is None:  # finished here by a stop string
                    continue
                finished, stopped = handle.push(token, reason, error, logprob, now)
                if finished:
                    del self._handles[request_id]
                if stopped:
                    try:
                        self._send(Cancel(request_id))
                    except LlamatermError:
                        pass
        # the child is gone: whatever was in flight ends with an error rather than hanging its reader
        for request_id, handle in list(self._handles.items()):
            handle.end = time.perf_counter()
            handle.events_queue.put(
                Event(request_id, finished=True, finish_reason="error", error="the engine process exited")
            )
        self.exited.set()


def start_with_real_stderr(process) -> None:
    """multiprocessing hands sys.stderr's descriptor to its resource tracker; under a TUI sys.stderr is a capture
    whose fileno() is -1 ("bad value(s) in fds_to_keep"), so the start sees the real one."""
    saved = sys.stderr
    sys.stderr = sys.__stderr__ or saved
    try:
        process.start()
    finally:
        sys.stderr = saved


def serve(conn, config: EngineConfig, load: Load) -> None:
    """The child: load the engine, take requests from the parent, send each step's tokens back."""
    outbox = Outbox(conn)
    try:
        engine = load(config, outbox.sink)
    except Exception as e:
        conn.send(LoadFailed(e if isinstance(e, LlamatermError) else LlamatermError(f"{type(e).__name__}: {e}")))
        return
    from llamaterm.engine.bench import engine_info

    # What start-up made (torch's modules, the model, the tokenizer: some 180,000 objects) lives to the end: frozen,
    # the collector's full passes skip it. A long-lived engine's requests leave enough behind to start one now and
    # then, and each went over it all: 95 ms on a 2-core machine, a stall of every session.
    gc.freeze()
    conn.send(
        Ready(
            engine.model_name,
            engine.device,
            engine.max_context,
            engine.sequence_limit(),
            engine.model.config.vocab_size,
            engine_info(engine),
            engine.sampling_defaults,
        )
    )
    forwarder = threading.Thread(target=outbox.forward, args=(engine,), name="llamaterm-forward", daemon=True)
    forwarder.start()
    with engine:
        take_requests(conn, engine, outbox.sink)
    outbox.close()  # the engine has stopped, its last records are queued: they are sent, then the thread ends
    forwarder.join()


def take_requests(conn, engine: Engine, sink: Sink) -> None:
    """The parent's messages to the engine, until it says to shut down or is gone: requests sent together (a
    response's n choices) reach the engine's scheduler together, and fork from one prefill."""
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        if isinstance(message, Shutdown):
            return
        if isinstance(message, Cancel):
            engine.cancel(message.request_id)
            continue
        # the model's grammar vocabulary (built by the first request with a grammar: 0.4-1.2 s) and each grammar's
        # compiled matcher are readied before together() takes the engine's lock, which its steps wait for
        engine.ready_grammars([submit.params.grammar for submit in message if submit.params.grammar is not None])
        with engine.together():
            for submit in message:
                take(submit, engine, sink)


def take(message: Submit, engine: Engine, sink: Sink) -> None:
    try:
        engine.submit(None, message.params, prompt_ids=message.prompt_ids, request_id=message.request_id)
    except Exception as e:  # the parent checked the prompt: a refusal here is unforeseen; keep serving
        error = e if isinstance(e, LlamatermError) else f"{type(e).__name__}: {e}"
        sink([(message.request_id, -1, "error", f"the engine could not take the request ({error})", None)], [])


class Outbox:
    """The child's steps on their way to the parent. The engine loop's thread hands each step's records to sink(),
    which never blocks on the pipe; forward(), a thread of its own, sends what has gathered as one message with the
    engine's stats, and one every IDLE_TICK_S when nothing has."""

    def __init__(self, conn) -> None:
        self.conn = conn
        self.steps: deque[tuple[list, list]] = deque()
        self.ready = threading.Condition()
        self.stopped = False

    def sink(self, records: list, cached: list) -> None:
        with self.ready:
            self.steps.append((records, cached))
            self.ready.notify()

    def close(self) -> None:
        """No more steps: forward() sends those gathered, then returns."""
        with self.ready:
            self.stopped = True
            self.ready.notify()

    def forward(self, engine: Engine) -> None:
        last, done = 0.0, False
        while not done:
            with self.ready:
                if not self.steps and not self.stopped:
                    self.ready.wait(IDLE_TICK_S)
                batch = list(self.steps)
                self.steps.clear()
                done = self.stopped
            now = time.perf_counter()
            if batch or now - last >= IDLE_TICK_S:
                records = [r for part, _ in batch for r in part]
                cached = [c for _, part in batch for c in part]
                try:
                    self.conn.send(StepOutput(records, cached, engine.stats()))
                except (BrokenPipeError, OSError):  # the parent is gone
                    return
                last = now
