"""`llamaterm serve` under faults: an engine that dies, signals, slow and hostile clients, and a soak of 64 clients
that come and go. The servers run a tiny random model (tests/support/tiny_models.py) on the CPU."""

import asyncio
import json
import logging
import random
import signal
import socket
import subprocess
import threading
import time

import httpx2
import psutil
import pytest

from llamaterm.app.server import handlers, http_server, requests, supervisor
from tests.support.fake_engine import FakeEngine
from tests.support.serve_support import LLAMATERM, app_server, free_port, metrics, served
from tests.support.tiny_models import write_tiny_llama

pytestmark = pytest.mark.slow  # `llamaterm serve` in subprocesses

KEY = "fault-key"
LONG = {"max_tokens": 3000, "ignore_eos": True}  # runs longer than any test waits for it
HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny.gguf", context_length=4096))


def serve_tiny(model: str, *args: str):
    return served("--model", model, "--device", "cpu", *args)


@pytest.fixture(scope="module")
def server(tiny):
    """Keyless, on loopback."""
    with serve_tiny(tiny) as s:
        yield s


@pytest.fixture(scope="module")
def keyed(tiny):
    with serve_tiny(tiny, "--api-key", KEY) as s:
        yield s


def model_of(url: str, key: str | None = None) -> str:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx2.get(url + "/models", headers=headers, timeout=10).json()["data"][0]["id"]


def health(url: str) -> int:
    return httpx2.get(url.removesuffix("/v1") + "/health", timeout=5).status_code


def ask(url: str, body: dict | bytes, path: str = "/chat/completions", **headers) -> httpx2.Response:
    sent = {"content": body} if isinstance(body, bytes) else {"json": body}
    return httpx2.post(url + path, headers={"Content-Type": "application/json", **headers}, timeout=60, **sent)


class Stream(threading.Thread):
    """One streamed chat completion, read in a thread: the data of its server-sent events, and when each came."""

    def __init__(self, url: str, body: dict):
        super().__init__(daemon=True)
        self.url, self.body = url, body | {"stream": True}
        self.data: list[str] = []
        self.times: list[float] = []
        self.status: int | None = None

    def run(self) -> None:
        with httpx2.stream("POST", self.url + "/chat/completions", json=self.body, timeout=60) as reply:
            self.status = reply.status_code
            for line in reply.iter_lines():
                if line.startswith("data: "):
                    self.data.append(line.removeprefix("data: "))
                    self.times.append(time.monotonic())

    def wait_for_tokens(self, n: int = 3, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while len(self.data) < n:
            assert time.monotonic() < deadline and self.is_alive(), f"the stream did not start: {self.data}"
            time.sleep(0.02)

    def ended_with_an_error(self) -> bool:
        """Its last events are an OpenAI-style error object, then [DONE]."""
        return len(self.data) >= 2 and self.data[-1] == "[DONE]" and "error" in json.loads(self.data[-2])


def start_streams(url: str, n: int, **body) -> list[Stream]:
    streams = [Stream(url, {"model": model_of(url), "messages": HELLO} | body) for _ in range(n)]
    for s in streams:
        s.start()
    for s in streams:
        s.wait_for_tokens()
    return streams


def engine_child(serve_process: subprocess.Popen) -> psutil.Process:
    """The server's engine process; not one that was killed and is not yet reaped (a zombie has no command line)."""
    children = []
    for p in psutil.Process(serve_process.pid).children():
        try:
            if "spawn_main" in " ".join(p.cmdline()):
                children.append(p)
        except psutil.ZombieProcess:
            pass
    (child,) = children
    return child


def wait_gone(process: psutil.Process, timeout: float = 5) -> None:
    """Until the process is reaped (a zombie still has its pid)."""
    deadline = time.monotonic() + timeout
    while psutil.pid_exists(process.pid):
        assert time.monotonic() < deadline, f"process {process.pid} is still there: {process.status()}"
        time.sleep(0.05)


def wait_healthy(url: str, timeout: float) -> float:
    start = time.monotonic()
    while health(url) != 200:
        assert time.monotonic() < start + timeout, "the server did not become healthy again in time"
        time.sleep(0.05)
    return time.monotonic() - start


# ---- a dead engine ----


def test_a_killed_engine_ends_every_stream_and_restarts(tiny):
    with serve_tiny(tiny) as server:
        streams = start_streams(server.url, 8, **LONG)
        child = engine_child(server.process)
        child.kill()
        killed = time.monotonic()
        while health(server.url) != 503:  # the server sees its engine's end as the pipe from it closes
            assert time.monotonic() - killed < 0.5, "/health still said ok half a second after the engine died"
        for s in streams:
            s.join(timeout=10)
            assert s.ended_with_an_error() and s.times[-1] - killed < 1, s.data[-3:]
            assert "the engine process exited" in s.data[-2]
        wait_gone(child)  # reaped: no zombie
        # the restart takes as long as the server's start (README): the model loads again
        wait_healthy(server.url, timeout=server.startup_s)
        reply = ask(server.url, {"model": model_of(server.url), "messages": HELLO, "max_tokens": 4})
        assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"]
        assert engine_child(server.process).pid != child.pid


def test_the_third_engine_failure_in_ten_minutes_stops_the_server(tiny):
    with serve_tiny(tiny) as server:
        for _ in range(supervisor.MAX_FAILURES):
            wait_healthy(server.url, timeout=server.startup_s)
            child = engine_child(server.process)
            child.kill()
            wait_gone(child)  # reaped by the server: only then is /health sure to say it is restarting
        assert server.process.wait(timeout=30) == 1
        last = server.log().strip().splitlines()[-1]
        assert last.startswith("llamaterm: the engine failed 3 times in 10 minutes") and "SIGKILL" in last, last
        assert not server.announcement.exists() and not server.announcement.with_suffix(".key").exists()


# ---- stopping: SIGTERM and SIGINT ----


def test_a_sigterm_drains_for_the_shutdown_timeout_then_ends_the_streams(tiny):
    with serve_tiny(tiny, "--shutdown-timeout", "2") as server:
        streams = start_streams(server.url, 8, **LONG)
        server.process.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        time.sleep(0.3)
        # draining: the streams go on, new requests get 503, /health says so
        refused = ask(server.url, {"model": "any", "messages": HELLO})
        assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
        assert health(server.url) == 503
        for s in streams:
            s.join(timeout=10)
            assert s.ended_with_an_error() and "shutting down" in s.data[-2], s.data[-3:]
            assert 2 <= s.times[-1] - sent < 3
            assert any(sent + 1 < t < sent + 2 for t in s.times)  # it streamed during the drain
        assert server.process.wait(timeout=5) == 0
        assert time.monotonic() - sent < 2 + http_server.SHUTDOWN_GRACE_S + 1
        assert not server.announcement.exists() and not server.announcement.with_suffix(".key").exists()


def test_a_second_signal_ends_the_drain_at_once(tiny):
    with serve_tiny(tiny, "--shutdown-timeout", "60") as server:
        streams = start_streams(server.url, 2, **LONG)
        server.process.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        server.process.send_signal(signal.SIGINT)
        sent = time.monotonic()
        for s in streams:
            s.join(timeout=10)
            assert s.ended_with_an_error() and s.times[-1] - sent < 1, s.data[-3:]
        assert server.process.wait(timeout=5) == 0


def test_a_drain_ends_as_soon_as_the_requests_in_flight_finish(tiny):
    with serve_tiny(tiny, "--shutdown-timeout", "60") as server:
        (stream,) = start_streams(server.url, 1, max_tokens=200, ignore_eos=True)
        server.process.send_signal(signal.SIGINT)
        stream.join(timeout=30)
        assert stream.data[-1] == "[DONE]" and json.loads(stream.data[-2])["choices"][0]["finish_reason"] == "length"
        assert server.process.wait(timeout=5) == 0
        assert not server.announcement.exists()  # a SIGINT (Ctrl-C) too


# ---- what a request may be ----


def test_an_empty_api_key_is_a_usage_error():
    for host in ("127.0.0.1", "0.0.0.0"):
        out = subprocess.run(
            [LLAMATERM, "serve", "--host", host, "--api-key", ""], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 2 and out.stderr.startswith("llamaterm: --api-key is empty"), out.stderr
        assert len(out.stderr.strip().splitlines()) == 1


def test_a_keyless_server_beyond_loopback_is_warned_about_before_the_model_loads():
    for host, warned in (("0.0.0.0", True), ("127.0.0.1", False)):
        port = free_port()
        out = subprocess.run(
            [LLAMATERM, "serve", "--host", host, "--port", str(port), "-m", "no-such-model"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        warning = f"llamaterm: warning: anyone who reaches {host}:{port} can use the model: consider --api-key"
        assert (warning in out.stderr.splitlines()) == warned, out.stderr
        assert out.returncode == 1 and "no model named 'no-such-model'" in out.stderr  # and then the model's error


def deep_json(depth: int) -> bytes:
    return b'{"model": "m", "messages": ' + b"[" * depth + b"]" * depth + b"}"


@pytest.mark.parametrize(
    "body, status, words",
    [
        (deep_json(100_000), 400, "nested too deeply"),
        (b'{"model": "m", "seed": ' + b"7" * 5000 + b"}", 400, "4300 digits"),
        (b'{"model": "\\ud800", "messages": []}', 400, "not valid Unicode"),
        ({"messages": [{"role": ["user"], "content": "hi"}]}, 400, "role"),
        ({"messages": HELLO, "stop": ["a", "b", "c", "d", "e"]}, 400, "at most 4 strings of at most 256 characters"),
        ({"messages": HELLO, "stop": "x" * 257}, 400, "at most 4 strings of at most 256 characters"),
        (
            {"messages": [{"role": "user", "content": "é" * 40_000}]},
            400,
            "the prompt is 80000 bytes, more than the 65536 that can fit in the model's 4096-token context",
        ),
        ({"messages": [{"role": "user", "content": "x" * 5_000_000}]}, 413, "the request body is over"),
    ],
    ids=["deep", "long-int", "surrogate-model", "role-list", "five-stops", "long-stop", "prompt-bytes", "huge-body"],
)
def test_a_bad_request_is_a_4xx_openai_error_and_the_server_keeps_serving(server, body, status, words):
    if isinstance(body, dict):
        body = body | {"model": model_of(server.url)}
    reply = ask(server.url, body)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert words in error["message"] and error["type"] == "invalid_request_error", error
    ok = ask(server.url, {"model": model_of(server.url), "messages": HELLO, "max_tokens": 2})
    assert ok.status_code == 200


def test_a_keyless_server_on_loopback_answers_only_loopback_names(server, keyed):
    port = server.url.split(":")[2].split("/")[0]
    for host in (f"localhost:{port}", "LOCALHOST", f"127.0.0.1:{port}", f"[::1]:{port}"):
        assert httpx2.get(server.url + "/models", headers={"Host": host}).status_code == 200, host
    for host in ("attacker.example", f"attacker.example:{port}", "localhost.attacker.example", "[::1"):
        reply = httpx2.get(server.url + "/models", headers={"Host": host})
        assert reply.status_code == 403 and "localhost" in reply.json()["error"]["message"], host
    # behind a key, a name of its own is no attack
    reply = httpx2.get(keyed.url + "/models", headers={"Host": "attacker.example", "Authorization": f"Bearer {KEY}"})
    assert reply.status_code == 200


def test_a_web_page_cannot_drive_the_server(server, keyed):
    """A cross-origin POST with a text/plain body is what a browser sends without asking first: a body that is not
    JSON by its Content-Type is a 415, and a request from a page at another origin a 403, key or not; the server's
    own origin and clients that name none (not browsers) are answered."""
    body = json.dumps({"model": model_of(server.url), "messages": HELLO, "max_tokens": 2}).encode()
    for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {} if content_type is None else {"Content-Type": content_type}
        reply = httpx2.post(server.url + "/chat/completions", content=body, headers=headers, timeout=60)
        assert reply.status_code == 415 and "application/json" in reply.json()["error"]["message"], content_type
    page = {"Origin": "http://evil.example"}
    assert ask(server.url, body, **page).status_code == 403
    reply = httpx2.get(keyed.url + "/models", headers={**page, "Authorization": f"Bearer {KEY}"})
    assert reply.status_code == 403 and "--allowed-origins http://evil.example" in reply.json()["error"]["message"]
    port = server.url.split(":")[2].split("/")[0]
    assert ask(server.url, body, Origin=f"http://127.0.0.1:{port}").status_code == 200  # its own
    assert ask(server.url, body, **{"Content-Type": "application/json; charset=utf-8"}).status_code == 200


def test_allowed_origins_let_those_pages_in(tiny):
    with serve_tiny(tiny, "--allowed-origins", "http://localhost:3000") as s:
        body = {"model": model_of(s.url), "messages": HELLO, "max_tokens": 2}
        assert ask(s.url, body, Origin="http://localhost:3000").status_code == 200
        assert ask(s.url, body, Origin="http://localhost:3001").status_code == 403


def test_the_key_is_a_bearer_token_in_any_case_and_metrics_need_it(keyed):
    def status(path: str, authorization: str | None) -> int:
        headers = {"Authorization": authorization} if authorization is not None else {}
        return httpx2.get(keyed.url.removesuffix("/v1") + path, headers=headers, timeout=10).status_code

    for given in (f"Bearer {KEY}", f"bearer {KEY}", f"BEARER {KEY}"):
        assert status("/v1/models", given) == 200, given
    for given in (KEY, f"Basic {KEY}", f"Bearer{KEY}", "Bearer wrong", "", None):
        assert status("/v1/models", given) == 401, given
    assert status("/metrics", None) == 401 and status("/metrics", f"Bearer {KEY}") == 200
    assert status("/health", None) == 200


# ---- slow clients ----


@pytest.fixture
def quick_timeouts(monkeypatch):
    """A server in this process (on a fake engine) whose header and body deadlines are 1 s, and what it logs."""
    monkeypatch.setattr(http_server, "HEADERS_TIMEOUT_S", 1)
    monkeypatch.setattr(handlers, "BODY_TIMEOUT_S", 1)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("uvicorn.error").addHandler(handler)
    with FakeEngine(model_name="m") as engine, app_server(engine) as url:
        yield url.removesuffix("/v1").removeprefix("http://").split(":"), records
    logging.getLogger("uvicorn.error").removeHandler(handler)


def closed_within(sock: socket.socket, seconds: float) -> bytes:
    """What the server sent before it closed the connection, which it must do within `seconds`."""
    sock.settimeout(seconds)
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


def test_a_silent_or_slow_connection_is_closed(quick_timeouts):
    (host, port), records = quick_timeouts
    silent = socket.create_connection((host, int(port)))
    slow = socket.create_connection((host, int(port)))
    start = time.monotonic()
    for byte in b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: 1":  # a byte at a time, never the end
        try:
            slow.sendall(bytes([byte]))
        except (BrokenPipeError, ConnectionResetError):  # closed already
            break
        if time.monotonic() - start > 2:
            break
        time.sleep(0.05)
    assert closed_within(silent, 2) == b"" and closed_within(slow, 2) == b""
    assert time.monotonic() - start < 3


def test_a_body_that_never_arrives_gets_408(quick_timeouts):
    (host, port), records = quick_timeouts
    with socket.create_connection((host, int(port))) as sock:
        head = (
            "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            "Content-Length: 1000\r\n\r\n"
        )
        sock.sendall(head.encode() + b'{"model": "m"')
        reply = closed_within(sock, 3)
    assert reply.startswith(b"HTTP/1.1 408 ") and b"did not arrive within 1 s" in reply, reply
    assert not [r for r in records if r.exc_info], [r.getMessage() for r in records]


# ---- load ----


def test_a_big_prompt_being_tokenized_does_not_stall_the_streams(tmp_path):
    model = str(write_tiny_llama(tmp_path / "long.gguf", context_length=131072))
    with serve_tiny(model, "--kv-tokens", "4096") as server:
        (stream,) = start_streams(server.url, 1, **LONG)
        words = [
            random.choice(["hello", "world", "ünïcode", "tokens", "123", "foo_bar", "日本語"]) for _ in range(400_000)
        ]
        prompt = " ".join(words)[: requests.PROMPT_BYTES_PER_TOKEN * 131072 // 2]  # 1 MB: allowed, and slow to tokenize
        sent = time.monotonic()
        reply = ask(server.url, {"model": model_of(server.url), "messages": [{"role": "user", "content": prompt}]})
        done = time.monotonic()
        assert reply.status_code == 400 and "tokens" in reply.json()["error"]["message"]  # longer than the pool
        during = [t for t in stream.times if sent <= t <= done]
        gaps = [b - a for a, b in zip([sent, *during], [*during, done], strict=True)]
        assert max(gaps) < 0.25, f"the stream stalled {max(gaps):.2f} s while {done - sent:.2f} s of tokenizing ran"


# ---- a soak ----

SOAK_S = 20
MALFORMED = [
    b'{"model": "m", "messages": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",  # nested too deeply
    b'{"messages": [{"role": "user", "content": "hi"}',  # not JSON
    b'{"messages": "hi"}',  # not messages
    b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}',
    b'{"messages": [{"role": "user", "content": "' + b"x" * (3 << 20) + b'"}]}',  # a huge body
]


def server_rss(process: psutil.Process) -> int:
    """The server's resident memory, its engine process's included."""
    return sum(p.memory_info().rss for p in [process, *process.children(recursive=True)])


async def soak_client(url: str, model: str, rng: random.Random, deadline: float, statuses: list[int]) -> None:
    """Until the deadline: streamed chat completions, some left after a few chunks, a few whole ones, and now and
    then a malformed or huge request."""
    async with httpx2.AsyncClient(base_url=url, timeout=60) as client:
        while time.monotonic() < deadline:
            draw = rng.random()
            if draw < 0.05:
                body = rng.choice(MALFORMED).replace(b'"model": "m"', b'"model": "%s"' % model.encode())
                reply = await client.post(
                    "/chat/completions", content=body, headers={"Content-Type": "application/json"}
                )
                statuses.append(reply.status_code)
                continue
            request = {
                "model": model,
                "messages": HELLO,
                "max_tokens": rng.randint(4, 48),
                "ignore_eos": True,
                "temperature": 0,  # greedy, as before the model's sampling defaults: the soak's pace is the steps'
            }
            if draw < 0.15:
                statuses.append((await client.post("/chat/completions", json=request)).status_code)
                continue
            leave_after = rng.randint(1, 8) if draw < 0.45 else None  # a client that disconnects mid-reply
            async with client.stream("POST", "/chat/completions", json=request | {"stream": True}) as reply:
                statuses.append(reply.status_code)
                lines = 0
                async for line in reply.aiter_lines():
                    lines += line.startswith("data: ")
                    if leave_after is not None and lines >= leave_after:
                        break


def test_a_soak_of_64_clients_that_come_and_go_leaves_no_trace(tiny):
    with serve_tiny(tiny, "--kv-tokens", "8192") as server:
        model = model_of(server.url)
        process = psutil.Process(server.process.pid)
        for _ in range(3):  # warm: the first requests' allocations are not a leak
            assert ask(server.url, {"model": model, "messages": HELLO, "max_tokens": 8}).status_code == 200
        cold = server_rss(process)
        statuses: list[int] = []

        async def soak(seed: int) -> None:
            deadline = time.monotonic() + SOAK_S / 2
            rngs = [random.Random(seed + i) for i in range(64)]
            await asyncio.gather(*(soak_client(server.url, model, rng, deadline, statuses) for rng in rngs))

        def settled() -> int:
            """Once every request has ended and every KV block is back: the server's memory."""
            deadline = time.monotonic() + 5
            while (m := metrics(server.url))["llamaterm_kv_blocks_used"] or m["llamaterm_requests_running"]:
                assert time.monotonic() < deadline, m
                time.sleep(0.1)
            return server_rss(process)

        # Two rounds: the first reaches the high-water mark of 64 clients' buffers (the allocator keeps some of it,
        # more on a busy machine); a leak goes on growing through the second
        asyncio.run(soak(0))
        first = settled()
        asyncio.run(soak(64))
        after = settled()
        assert len(statuses) > 500 and {s for s in statuses if s >= 500} == set(), sorted(set(statuses))
        assert {s for s in statuses if s != 200} <= {400, 413}, sorted(set(statuses))
        assert after < 1.05 * first and after < 1.25 * cold, (
            f"the server held {cold / 1e6:.0f} MB, then {first / 1e6:.0f} MB, then {after / 1e6:.0f} MB"
        )
        assert ask(server.url, {"model": model, "messages": HELLO, "max_tokens": 4}).status_code == 200
