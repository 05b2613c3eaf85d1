"""serve --keep-alive: a server that has had no request for that long unloads its model (the engine process exits,
and its memory is freed), and loads it again for the next request, whose response says what that cost in its
X-Load-Seconds header. 0, the default, keeps the model loaded for as long as the server runs."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

from llamaterm.app.durations import shown_duration
from llamaterm.app.server.errors import APIError
from llamaterm.app.server.streaming import EventPump
from llamaterm.app.server.supervisor import EngineSupervisor, SupervisedEngine

WATCH_S = 0.25  # how often an idle server looks at the time
LOAD_HEADER = "X-Load-Seconds"
log = logging.getLogger("uvicorn.error")  # uvicorn prints it


class KeepAlive:
    """The model of a server with `seconds` of keep-alive (0: forever), unloaded once the server has been idle that
    long (no request arriving or in flight) and loaded again for the next request."""

    def __init__(self, supervisor: EngineSupervisor, pump: EventPump, seconds: float):
        self.supervisor, self.pump, self.seconds = supervisor, pump, seconds
        self.lock = asyncio.Lock()  # a load and an unload never overlap
        self.arriving = 0  # requests between their arrival and their streams in the pump (or their answer)
        self.last_used = time.monotonic()

    @contextmanager
    def request(self) -> Iterator[None]:
        """Around a request's handling: the server is not idle while it lasts."""
        self.arriving += 1
        try:
            yield
        finally:
            self.arriving -= 1
            self.last_used = time.monotonic()

    async def engine(self) -> tuple[SupervisedEngine, float | None]:
        """The engine, loaded first if it was unloaded, and the seconds that took (None: it was loaded)."""
        async with self.lock:
            if self.supervisor.loaded:
                return self.supervisor.engine, None
            t = time.monotonic()
            try:
                await self.supervisor.load()
            except Exception as e:
                raise APIError(503, f"the model did not load again: {e}", kind="server_error") from None
            took = time.monotonic() - t
            name = self.supervisor.engine.model_name
            log.warning("llamaterm serve: loaded %s again for a request (%.2f s)", name, took)
            return self.supervisor.engine, took

    @property
    def idle(self) -> bool:
        return not self.arriving and not self.pump.live

    async def watch(self) -> None:
        """Unloads the model once the server has been idle for `seconds` (runs only where they are not 0)."""
        while True:
            await asyncio.sleep(WATCH_S)
            now = time.monotonic()
            if not self.idle:
                self.last_used = now
            elif self.supervisor.loaded and now - self.last_used >= self.seconds:
                async with self.lock:
                    if self.idle and self.supervisor.loaded:
                        await self.supervisor.unload()
                        log.warning(
                            "llamaterm serve: unloaded %s after %s without a request (the next one loads it again)",
                            self.supervisor.engine.model_name,
                            shown_duration(self.seconds),
                        )
