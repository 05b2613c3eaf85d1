"""The engine core in a child process, behind the front end (front_end.py) that the TUI and the server call.

In one process a UI shares the GIL with the engine loop: every frame Textual lays out is time the loop's Python
waits. Here the loop runs in a process of its own and does nothing but steps. The parent runs the front end: it
encodes prompts and checks them against the model's limits, and its output processor turns the core's token ids
into text (output_processor.py), as vLLM's front end does for its engine core; the child sends one message per
step with every request's outputs (fewer when the parent reads slowly: the steps that queued up go as one). The
messages are pickles of plain tuples and our own dataclasses between our own two processes.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from llamaterm.engine.api import EngineConfig, EngineStats
from llamaterm.engine.checkpoints.tokenizer import Tokenizer
from llamaterm.engine.errors import LlamatermError
from llamaterm.engine.sampling_params import SamplingParams
from llamaterm.engine.serving.front_end import CoreInfo, FrontEnd
from llamaterm.engine.serving.output_processor import TokenOutput
from llamaterm.engine.serving.step_stats import StepStats
from llamaterm.engine.synthetic import SyntheticTokenizer, is_synthetic

if TYPE_CHECKING:  # the parent never imports the engine core (nor torch)
    from llamaterm.engine.serving.engine_core import EngineCore, Sink

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
    core: CoreInfo
    info: dict  # for `llamaterm bench`: where start-up went, weight bytes a decode step reads, CUDA graphs or not


@dataclass(frozen=True)
class LoadFailed:
    error: LlamatermError


@dataclass(frozen=True)
class StepOutput:
    """What the steps since the last message produced: a TokenOutput per token or finish, in order, and the
    prefix-cache hits of requests that got their first token."""

    outputs: list[TokenOutput]
    cached: list[tuple[int, int]]
    stats: EngineStats
    step_stats: StepStats


Load = Callable[[EngineConfig], "EngineCore"]  # run in the child


def load_core(config: EngineConfig) -> EngineCore:
    """The model config names, or random weights in a model's shapes (synthetic:NAME)."""
    from llamaterm.engine.serving.engine_core import EngineCore

    return EngineCore.from_model(config)


class ChildCore:
    """The engine core in the child, as the front end calls it (front_end.CoreClient): messages down the pipe. Its
    stats are those of the child's last message."""

    def __init__(self, conn, process, stats: EngineStats):
        self.conn, self.process = conn, process
        self.last: tuple[EngineStats, StepStats] = stats, StepStats()
        self._send_lock = threading.Lock()
        self._group = threading.local()  # .submits: what together() gathers in this thread

    def add(self, request_id: int, prompt_ids: list[int], params: SamplingParams) -> None:
        submit = Submit(request_id, prompt_ids, params)
        if (group := getattr(self._group, "submits", None)) is not None:
            group.append(submit)
        else:
            self._send([submit])

    @contextmanager
    def together(self):
        """Requests added inside (from this thread) go to the child as one message, which its core takes in one
        step (EngineCore.together)."""
        if getattr(self._group, "submits", None) is not None:  # inside another together(): one group
            yield
            return
        self._group.submits = []
        try:
            yield
        finally:
            group, self._group.submits = self._group.submits, None
            if group:
                self._send(group)

    def abort(self, request_id: int) -> None:
        self._send(Cancel(request_id))

    def stats(self) -> EngineStats:
        return self.last[0]

    def step_stats(self) -> StepStats:
        return self.last[1]

    def shutdown(self) -> None:
        if self.process.is_alive():
            try:
                self._send(Shutdown())
            except LlamatermError:
                pass
            self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()

    def _send(self, message: list[Submit] | Cancel | Shutdown) -> None:
        with self._send_lock:
            try:
                self.conn.send(message)
            except (BrokenPipeError, OSError):
                raise LlamatermError("the engine process has exited") from None


class EngineProcess(FrontEnd):
    """Satisfies engine.api.EngineClient with the engine core in a child process. `load` builds the child's core (a
    module-level function, as the child imports it); `tokenizer` encodes and decodes here (default: the model's)."""

    def __init__(
        self, config: EngineConfig = EngineConfig(), load: Load = load_core, tokenizer: Tokenizer | None = None
    ):
        ctx = mp.get_context("spawn")  # a fork would copy the parent's threads and locks
        conn, child = ctx.Pipe()
        process = ctx.Process(target=serve, args=(child, config, load), name="llamaterm-engine", daemon=True)
        start_with_real_stderr(process)
        child.close()
        try:
            if tokenizer is None:  # read while the child loads the weights
                from llamaterm.engine.store.loader import load_tokenizer

                # a synthetic model's tokenizer has the methods prompts and replies use (engine/synthetic.py)
                synthetic = cast(Tokenizer, SyntheticTokenizer())
                tokenizer = synthetic if is_synthetic(config.model) else load_tokenizer(config.model)
            reply = conn.recv()
        except EOFError:
            raise LlamatermError("the engine process exited while loading the model") from None
        except BaseException:
            process.kill()
            raise
        if isinstance(reply, LoadFailed):
            process.join()
            raise reply.error
        if isinstance(tokenizer, SyntheticTokenizer):
            tokenizer.vocab = reply.core.vocab_size
        self._child = ChildCore(conn, process, EngineStats(model=reply.core.model_name, device=reply.core.device))
        super().__init__(self._child, tokenizer, reply.core)
        self.info = reply.info
        # set by the reader once the child is gone (its pipe closed) and every request in flight has ended with an
        # error: a server watches it to restart the engine
        self.exited = threading.Event()
        self._reader = threading.Thread(target=self._read, name="llamaterm-engine-reader", daemon=True)
        self._reader.start()

    @property
    def exitcode(self) -> int | None:
        """The child's exit code once it has been reaped (shutdown() reaps it), negative for a signal's number."""
        return self._child.process.exitcode

    def shutdown(self) -> None:
        self._child.shutdown()
        self._reader.join(timeout=10)

    def _read(self) -> None:
        while True:
            try:
                message: StepOutput = self._child.conn.recv()
            except (EOFError, OSError):
                break
            self._child.last = message.stats, message.step_stats
            self.take_outputs(message.outputs, message.cached)
        self.output.end_all("the engine process exited")
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
    """The child: load the engine core, take requests from the parent, send each step's outputs back."""
    try:
        core = load(config)
    except Exception as e:
        conn.send(LoadFailed(e if isinstance(e, LlamatermError) else LlamatermError(f"{type(e).__name__}: {e}")))
        return
    # What start-up made (torch's modules, the model, the tokenizer: some 180,000 objects) lives to the end: frozen,
    # the collector's full passes skip it. A long-lived engine's requests leave enough behind to start one now and
    # then, and each went over it all: a stall of every session.
    gc.freeze()
    conn.send(Ready(core.info(), core.describe()))
    outbox = Outbox(conn)
    core.start(outbox.sink)
    forwarder = threading.Thread(target=outbox.forward, args=(core,), name="llamaterm-forward", daemon=True)
    forwarder.start()
    try:
        take_requests(conn, core, outbox.sink)
    finally:
        core.shutdown()
    outbox.close()  # the core has stopped, its last outputs are queued: they are sent, then the thread ends
    forwarder.join()


def take_requests(conn, core: EngineCore, sink: Sink) -> None:
    """The parent's messages to the core, until it says to shut down or is gone: requests sent together (a
    response's n choices) reach the core's scheduler together, and fork from one prefill."""
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        if isinstance(message, Shutdown):
            return
        if isinstance(message, Cancel):
            core.abort(message.request_id)
            continue
        # the model's grammar vocabulary (built by the first request with a grammar: seconds) and each grammar's
        # compiled matcher are readied before together() takes the core's lock, which its steps wait for
        core.ready_grammars([submit.params.grammar for submit in message if submit.params.grammar is not None])
        with core.together():
            for submit in message:
                take(submit, core, sink)


def take(message: Submit, core: EngineCore, sink: Sink) -> None:
    try:
        core.add(message.request_id, message.prompt_ids, message.params)
    except Exception as e:  # the parent checked the prompt: a refusal here is unforeseen; keep serving
        error = e if isinstance(e, LlamatermError) else f"{type(e).__name__}: {e}"
        problem = f"the engine could not take the request ({error})"
        sink([TokenOutput(message.request_id, -1, "error", problem)], [])


class Outbox:
    """The child's steps on their way to the parent. The core's thread hands each step's outputs to sink(), which
    never blocks on the pipe; forward(), a thread of its own, sends what has gathered as one message with the
    core's stats, and one every IDLE_TICK_S when nothing has."""

    def __init__(self, conn) -> None:
        self.conn = conn
        self.steps: deque[tuple[list[TokenOutput], list[tuple[int, int]]]] = deque()
        self.ready = threading.Condition()
        self.stopped = False

    def sink(self, outputs: list[TokenOutput], cached: list[tuple[int, int]]) -> None:
        with self.ready:
            self.steps.append((outputs, cached))
            self.ready.notify()

    def close(self) -> None:
        """No more steps: forward() sends those gathered, then returns."""
        with self.ready:
            self.stopped = True
            self.ready.notify()

    def forward(self, core: EngineCore) -> None:
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
                outputs = [o for part, _ in batch for o in part]
                cached = [c for _, part in batch for c in part]
                try:
                    self.conn.send(StepOutput(outputs, cached, core.stats(), core.step_stats()))
                except (BrokenPipeError, OSError):  # the parent is gone
                    return
                last = now
