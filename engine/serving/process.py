"""The engine in a child process, behind the calls the TUI makes on serving.engine.Engine.

In one process a UI shares the GIL with the engine loop: every frame Textual lays out is time the loop's Python
waits, and 8 streaming panes cost the engine about a tenth of its throughput. Here the loop runs in a process of
its own; the parent sends requests and cancels down a pipe and a reader thread receives events and stats in
batches (one message per tick). The messages are pickles of our own dataclasses between our own two processes.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import queue
import sys
import threading
import time
from dataclasses import dataclass

from llamaterm.engine.api import EngineConfig, EngineStats, Event, EventStream, RequestStats, RequestStream
from llamaterm.engine.errors import LlamatermError
from llamaterm.engine.sampling_params import SamplingParams

TICK_S = 0.02  # how often the child forwards events: 50 Hz is smoother than any terminal redraws
IDLE_TICK_S = 0.5  # engine stats still refresh while nothing streams


# ---- messages, parent -> child ----


@dataclass(frozen=True)
class Submit:
    request_id: int
    prompt: list[dict] | str
    params: SamplingParams
    raw: bool
    enable_thinking: bool | None


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


@dataclass(frozen=True)
class LoadFailed:
    error: LlamatermError


@dataclass(frozen=True)
class Ack:
    """The answer to a Submit: error is None when the engine took the request."""

    request_id: int
    error: LlamatermError | None


@dataclass(frozen=True)
class RequestUpdate:
    request_id: int
    events: list[Event]
    stats: RequestStats


@dataclass(frozen=True)
class Tick:
    updates: list[RequestUpdate]
    stats: EngineStats


class ProcessHandle(EventStream):
    def __init__(self, request_id: int, max_context: int):
        self.id = request_id
        self.events_queue = queue.SimpleQueue()
        self.latest = RequestStats(max_context=max_context)

    def stats(self) -> RequestStats:
        return self.latest


class EngineProcess:
    """Satisfies engine.api.EngineClient with the engine in a child process."""

    def __init__(self, config: EngineConfig = EngineConfig()):
        ctx = mp.get_context("spawn")  # a fork would copy the parent's threads and locks
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(target=serve, args=(child, config), name="llamaterm-engine", daemon=True)
        start_with_real_stderr(self._process)
        child.close()
        try:
            reply = self._conn.recv()
        except EOFError:
            raise LlamatermError("the engine process exited while loading the model") from None
        if isinstance(reply, LoadFailed):
            self._process.join()
            raise reply.error
        self.model_name, self.device, self.max_context = reply.model_name, reply.device, reply.max_context
        self._send_lock = threading.Lock()
        self._handles: dict[int, ProcessHandle] = {}
        self._acks: dict[int, queue.SimpleQueue] = {}
        self._stats = EngineStats(model=self.model_name, device=self.device)
        self._ids = itertools.count(1)
        self._reader = threading.Thread(target=self._read, name="llamaterm-engine-reader", daemon=True)
        self._reader.start()

    def submit(
        self,
        prompt: list[dict] | str,
        params: SamplingParams | None = None,
        *,
        raw: bool = False,
        enable_thinking: bool | None = None,
    ) -> ProcessHandle:
        """As Engine.submit; a request the engine refuses raises here, in the caller's thread."""
        request_id = next(self._ids)
        handle = self._handles[request_id] = ProcessHandle(request_id, self.max_context)
        ack = self._acks[request_id] = queue.SimpleQueue()
        self._send(Submit(request_id, prompt, params or SamplingParams(), raw, enable_thinking))
        error = ack.get()
        if error is not None:
            del self._handles[request_id]
            raise error
        return handle

    def cancel(self, handle: RequestStream | int) -> None:
        self._send(Cancel(handle if isinstance(handle, int) else handle.id))

    def stats(self) -> EngineStats:
        return self._stats

    def shutdown(self) -> None:
        if self._process.is_alive():
            self._send(Shutdown())
            self._process.join(timeout=10)
        if self._process.is_alive():
            self._process.kill()
        self._reader.join(timeout=10)

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def _send(self, message: Submit | Cancel | Shutdown) -> None:
        with self._send_lock:
            try:
                self._conn.send(message)
            except (BrokenPipeError, OSError):
                raise LlamatermError("the engine process has exited") from None

    def _read(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            if isinstance(message, Ack):
                self._acks.pop(message.request_id).put(message.error)
                continue
            self._stats = message.stats  # a Tick
            for update in message.updates:
                handle = self._handles.get(update.request_id)
                if handle is None:
                    continue
                handle.latest = update.stats
                for event in update.events:
                    handle.events_queue.put(event)
                if update.events and update.events[-1].finished:
                    del self._handles[update.request_id]
        # the child is gone: whatever was in flight ends with an error rather than hanging its reader
        for request_id, handle in list(self._handles.items()):
            handle.events_queue.put(
                Event(request_id, finished=True, finish_reason="error", error="the engine process exited")
            )
        for ack in self._acks.values():
            ack.put(LlamatermError("the engine process has exited"))


def start_with_real_stderr(process) -> None:
    """multiprocessing hands sys.stderr's descriptor to its resource tracker; under a TUI sys.stderr is a capture
    whose fileno() is -1 ("bad value(s) in fds_to_keep"), so the start sees the real one."""
    saved = sys.stderr
    sys.stderr = sys.__stderr__ or saved
    try:
        process.start()
    finally:
        sys.stderr = saved


def serve(conn, config: EngineConfig) -> None:
    """The child: load the engine, then forward events and stats each tick until told to stop."""
    from llamaterm.engine.serving.engine import Engine

    try:
        engine = Engine.from_model(config)
    except Exception as e:
        conn.send(LoadFailed(e if isinstance(e, LlamatermError) else LlamatermError(f"{type(e).__name__}: {e}")))
        return
    conn.send(Ready(engine.model_name, engine.device, engine.max_context))
    handles: dict[int, object] = {}  # parent's request id -> the engine's handle
    send_lock = threading.Lock()
    stopped = threading.Event()

    def forward() -> None:
        last = 0.0
        while not stopped.wait(TICK_S):
            updates = []
            for request_id, handle in list(handles.items()):
                events = handle.poll()
                if events:
                    updates.append(RequestUpdate(request_id, events, handle.stats()))
                    if events[-1].finished:
                        del handles[request_id]
            now = time.perf_counter()
            if updates or now - last >= IDLE_TICK_S:
                with send_lock:
                    conn.send(Tick(updates, engine.stats()))
                last = now

    forwarder = threading.Thread(target=forward, name="llamaterm-forward", daemon=True)
    forwarder.start()
    with engine:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):  # the parent is gone
                break
            if isinstance(message, Shutdown):
                break
            if isinstance(message, Cancel):
                if (handle := handles.get(message.request_id)) is not None:
                    engine.cancel(handle)
                continue
            try:
                handles[message.request_id] = engine.submit(
                    message.prompt, message.params, raw=message.raw, enable_thinking=message.enable_thinking
                )
                error = None
            except LlamatermError as e:
                error = e
            except Exception as e:  # a request the engine fails on in a way not foreseen: refuse it, keep serving
                error = LlamatermError(f"the engine could not take the request ({type(e).__name__}: {e})")
            with send_lock:
                conn.send(Ack(message.request_id, error))
        stopped.set()
        forwarder.join()
