"""Start `llamaterm serve` (a subprocess of the installed script) or the server on a test's engine in a thread,
both on 127.0.0.1 at a free port, and read the server's /metrics."""

import contextlib
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx2

from llamaterm.app.announcements import Announcer, servers_dir
from llamaterm.app.presets import Preset
from llamaterm.app.server.handlers import Service
from llamaterm.app.server.http_server import Server
from llamaterm.app.server.supervisor import EngineSupervisor

LLAMATERM = str(Path(sys.executable).parent / "llamaterm")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Served:
    """A running `llamaterm serve`: its base URL (.../v1), its process, the file its stderr goes to, and how long
    it took from its start to its first healthy /health."""

    url: str
    process: subprocess.Popen
    log_path: Path
    startup_s: float = 0.0

    def log(self) -> str:
        return self.log_path.read_text()

    @property
    def announcement(self) -> Path:
        """Its announcement for `llamaterm run` (app/announcements.py), there while it serves."""
        return servers_dir() / f"{self.process.pid}-{self.url.split(':')[2].split('/')[0]}.json"


@contextlib.contextmanager
def served(*args: str, timeout: float = 300) -> Iterator[Served]:
    """`llamaterm serve ARGS` on a free loopback port until the block ends (then SIGTERM, and its exit awaited)."""
    port = free_port()
    with tempfile.TemporaryDirectory() as folder:
        log_path, start = Path(folder) / "stderr", time.monotonic()
        with log_path.open("w") as log:
            process = subprocess.Popen(
                [LLAMATERM, "serve", "--host", "127.0.0.1", "--port", str(port), *args],
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
        server = Served(f"http://127.0.0.1:{port}/v1", process, log_path)
        try:
            while not healthy(port):
                if process.poll() is not None:
                    raise AssertionError(f"llamaterm serve exited: {server.log()}")
                if time.monotonic() > start + timeout:
                    raise AssertionError("llamaterm serve did not start in time")
                time.sleep(0.1)
            server.startup_s = time.monotonic() - start
            while not server.announcement.exists():  # written as it began to answer
                assert time.monotonic() < start + timeout, "llamaterm serve did not announce itself"
                time.sleep(0.01)
            yield server
        finally:
            process.terminate()
            process.wait(timeout=30)


@contextlib.contextmanager
def llamaterm_serve(*args: str, timeout: float = 300) -> Iterator[str]:
    """`llamaterm serve ARGS` on a free loopback port until the block ends; yields its base URL (.../v1)."""
    with served(*args, timeout=timeout) as server:
        yield server.url


class NeverExits:
    """A test's engine (a fake, or one in this process) as the server's supervisor sees an engine process: one
    that never exits."""

    exitcode = None

    def __init__(self, engine):
        self.engine, self.exited = engine, threading.Event()
        self.info: dict = {}  # what an engine process says it holds (its memory, its KV tokens): unknown here

    def __getattr__(self, name: str):
        return getattr(self.engine, name)


@contextlib.contextmanager
def app_server(
    engine, api_key: str | None = None, announcer: Announcer | None = None, preset: Preset | None = None
) -> Iterator[str]:
    """The server on `engine` (the test's, which it shuts down), in a thread of this process; yields its base
    URL. With an announcer, on its port, announced while the block runs; with a preset, serving under it."""
    port = free_port() if announcer is None else announcer.port
    service = Service(EngineSupervisor(lambda: NeverExits(engine)), preset=preset)
    server = Server(service, "127.0.0.1", port, api_key, 10, announcer)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started or (announcer is not None and not announcer.file.exists()):
            time.sleep(0.02)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        if announcer is not None:
            announcer.remove()


def healthy(port: int) -> bool:
    try:
        return httpx2.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    except httpx2.TransportError:
        return False


def metrics(base_url: str, api_key: str | None = None) -> dict[str, float]:
    """/metrics as {name: value} (Prometheus text: one gauge per line, after the # HELP and # TYPE lines)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    text = httpx2.get(base_url.removesuffix("/v1") + "/metrics", headers=headers, timeout=5).text
    return {m[1]: float(m[2]) for m in re.finditer(r"^(\w+)\{[^}]*\} (\S+)$", text, re.M)}
