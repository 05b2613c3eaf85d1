"""The HTTP server: uvicorn on the routes, with a deadline on each request's headers and a bounded drain at a SIGTERM
or SIGINT."""

from __future__ import annotations

import asyncio
import logging
import socket
import time

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from llamaterm.app.announcements import Announcer
from llamaterm.app.server.handlers import Service, create_app
from llamaterm.engine.errors import LlamatermError

HEADERS_TIMEOUT_S = 10  # a request's line and headers must arrive within this of the connection or the last response
KEEP_ALIVE_S = 5  # an idle connection between requests is closed after this
SHUTDOWN_GRACE_S = 2  # once a drain has ended the requests, how long their last bytes may take to go out
MAX_HEADER_BYTES = 16 * 1024  # a request line and headers longer than this get 400
log = logging.getLogger("uvicorn.error")  # uvicorn prints it


def check_port(host: str, port: int) -> str | None:
    """Why host:port cannot be listened on (in use, no such address), or None: known before the model loads."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
            s.bind((host, port))
    except OSError as e:
        return e.strerror or str(e)
    return None


class HeadersDeadline(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's headers. uvicorn times out only a connection idle
    after a response, and the next request's first byte stops that clock: a connection that sent nothing, or
    headers a byte at a time, stayed open without end. Here the headers must be whole HEADERS_TIMEOUT_S after the
    connection opens or the last response ends, or the connection closes. (The body's deadline is the app's.)"""

    deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.arm()

    def data_received(self, data: bytes) -> None:
        cycle = self.cycle
        super().data_received(data)
        if self.cycle is not cycle:  # a request's headers arrived
            self.disarm()

    def on_response_complete(self) -> None:
        cycle = self.cycle
        super().on_response_complete()
        if self.cycle is cycle:  # no pipelined request began
            self.arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self.disarm()
        super().connection_lost(exc)

    def arm(self) -> None:
        self.disarm()
        self.deadline = self.loop.call_later(HEADERS_TIMEOUT_S, self.transport.close)

    def disarm(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None


class Server(uvicorn.Server):
    """uvicorn's server on the service, with a bounded drain. uvicorn's own stop closes the socket at the first
    SIGTERM or SIGINT and waits for every response without limit; a second signal cuts them mid-body. Here the
    first starts a drain: new requests get 503 while those in flight may finish for `shutdown_timeout` seconds;
    then, or at a second signal, the rest end with an error event and [DONE], and the server exits. It exits too
    when the supervisor gives up on the engine. With an announcer, it announces itself once it answers."""

    def __init__(
        self,
        service: Service,
        host: str,
        port: int,
        api_key: str | None,
        shutdown_timeout: float = 10,
        announcer: Announcer | None = None,
    ):
        config = uvicorn.Config(
            create_app(service, api_key, host, announcer),
            host=host,
            port=port,
            http=HeadersDeadline,
            log_level="warning",
            timeout_keep_alive=KEEP_ALIVE_S,
            timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
            h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        )
        super().__init__(config)
        self.service, self.shutdown_timeout, self.announcer = service, shutdown_timeout, announcer
        self.drain_until: float | None = None

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and self.announcer is not None:
            try:
                self.announcer.write()
            except (LlamatermError, OSError) as e:
                log.warning("llamaterm serve: not announced for `llamaterm run` (%s): it serves all the same", e)

    def handle_exit(self, sig: int, frame) -> None:
        if self.drain_until is None:
            self.service.draining = True
            self.drain_until = time.monotonic() + self.shutdown_timeout
        else:
            self.drain_until = 0.0

    async def on_tick(self, counter: int) -> bool:
        drained = self.drain_until is not None and (not self.service.pump.live or time.monotonic() > self.drain_until)
        if drained or self.service.supervisor.gave_up:
            self.service.stop()
            self.should_exit = True
        return await super().on_tick(counter)


def serve(
    service: Service,
    host: str,
    port: int,
    api_key: str | None,
    shutdown_timeout: float,
    announcer: Announcer | None = None,
) -> None:
    """Serve until a SIGTERM or SIGINT (Ctrl-C, `llamaterm stop`) has drained the server; raises LlamatermError if the
    engine failed too often. The announcement, if any, goes as the server stops answering, however it stops."""
    try:
        Server(service, host, port, api_key, shutdown_timeout, announcer).run()
    finally:
        if announcer is not None:
            announcer.remove()
    if service.supervisor.gave_up:
        raise LlamatermError(service.supervisor.gave_up)
