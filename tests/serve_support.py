"""Start `llamaterm serve` (a subprocess of the installed script) or the ASGI app on a test's engine, both on
127.0.0.1 at a free port, and read the server's /metrics."""

import contextlib
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2
import uvicorn

from llamaterm.app.serve import create_app

LLAMATERM = str(Path(sys.executable).parent / "llamaterm")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def llamaterm_serve(*args: str, timeout: float = 300) -> Iterator[str]:
    """`llamaterm serve ARGS` on a free loopback port until the block ends; yields its base URL (.../v1)."""
    port = free_port()
    process = subprocess.Popen(
        [LLAMATERM, "serve", "--host", "127.0.0.1", "--port", str(port), *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + timeout
        while not healthy(port):
            if process.poll() is not None:
                raise AssertionError(f"llamaterm serve exited: {process.stderr.read()}")
            if time.monotonic() > deadline:
                raise AssertionError("llamaterm serve did not start in time")
            time.sleep(0.2)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        process.terminate()
        process.wait(timeout=30)


@contextlib.contextmanager
def app_server(engine, api_key: str | None = None) -> Iterator[str]:
    """The server's ASGI app on `engine` (the test's), in a thread of this process; yields its base URL."""
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(engine, api_key), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.02)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def healthy(port: int) -> bool:
    try:
        return httpx2.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    except httpx2.TransportError:
        return False


def metrics(base_url: str) -> dict[str, float]:
    """/metrics as {name: value} (Prometheus text: one gauge per line, after the # HELP and # TYPE lines)."""
    text = httpx2.get(base_url.removesuffix("/v1") + "/metrics", timeout=5).text
    return {m[1]: float(m[2]) for m in re.finditer(r"^(\w+)\{[^}]*\} (\S+)$", text, re.M)}
