"""The server's engine, kept running: a supervisor restarts an engine process that dies, and stops the server after
MAX_FAILURES in FAILURE_WINDOW_S. It unloads the engine when told (serve --keep-alive: app/server/keep_alive.py) and
loads it again."""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Protocol

from starlette.concurrency import run_in_threadpool

from llamaterm.engine.api import EngineClient

if TYPE_CHECKING:
    from llamaterm.engine.checkpoints.tokenizer import Tokenizer

WATCH_S = 0.05  # how often the supervisor looks for an engine that exited
MAX_FAILURES, FAILURE_WINDOW_S = 3, 600  # this many engine failures in the window stop the server
log = logging.getLogger("uvicorn.error")  # uvicorn prints it


class SupervisedEngine(EngineClient, Protocol):
    """An engine whose end a server can see (engine/serving/process.py's EngineProcess), and whose tokenizer renders
    the prompts that hold tools."""

    exited: threading.Event  # set once it has exited and its requests have ended with an error event
    tokenizer: Tokenizer
    info: dict  # what it holds: its KV cache's tokens, its memory (EngineCore.describe)

    @property
    def exitcode(self) -> int | None: ...  # once shut down

    def together(self) -> AbstractContextManager[object]: ...  # requests submitted inside reach the engine together


def exit_text(code: int | None) -> str:
    return f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"


class EngineSupervisor:
    """The server's engine, kept running. When it exits (its requests have then ended with an error event), the
    child is reaped and `start` builds another with the same config; the MAX_FAILURES-th failure (an exit, or a
    start that failed) within FAILURE_WINDOW_S gives up, and the server exits. Unloaded, `engine` is the engine that
    was shut down: its model's name, context, tokenizer and sampling defaults still answer for it."""

    def __init__(self, start: Callable[[], SupervisedEngine]):
        self.start = start
        self.engine = start()
        self.loaded = True
        self.restarting = False
        self.gave_up: str | None = None  # why the server must stop
        self.failures: list[float] = []  # their times, within the window

    @property
    def alive(self) -> bool:
        """Takes requests: a model unloaded on purpose loads again for the next one."""
        return not self.restarting and (not self.loaded or not self.engine.exited.is_set())

    async def watch(self) -> None:
        while self.gave_up is None:
            if self.loaded and self.engine.exited.is_set():
                await self.restart()
            await asyncio.sleep(WATCH_S)

    async def unload(self) -> None:
        """The engine process exits, its memory freed with it."""
        self.loaded = False
        await run_in_threadpool(self.engine.shutdown)

    async def load(self) -> None:
        """An engine again, after `unload`; what its start raised, where it failed (the model stays unloaded)."""
        self.engine = await run_in_threadpool(self.start)
        self.loaded = True

    async def restart(self) -> None:
        self.restarting = True
        await run_in_threadpool(self.engine.shutdown)  # reaps the child: no zombie
        problem = f"the engine process exited ({exit_text(self.engine.exitcode)})"
        while not self.too_many_failures(problem):
            log.warning("llamaterm serve: %s: starting it again", problem)
            try:
                self.engine = await run_in_threadpool(self.start)
            except Exception as e:  # the server keeps supervising, whatever the start raised
                problem = f"the engine did not start again ({e})"
                continue
            self.restarting = False
            return

    def too_many_failures(self, problem: str) -> bool:
        now = time.monotonic()
        self.failures = [t for t in self.failures if now - t < FAILURE_WINDOW_S] + [now]
        if len(self.failures) < MAX_FAILURES:
            return False
        self.gave_up = (
            f"the engine failed {MAX_FAILURES} times in {FAILURE_WINDOW_S // 60} minutes, last: {problem}: "
            "the server stops; see the log above"
        )
        return True

    def __enter__(self) -> EngineSupervisor:
        return self

    def __exit__(self, *exc) -> None:
        self.engine.shutdown()
