"""The servers on this machine as ollama's and LM Studio's users handle theirs: `llamaterm ps` lists them with their
load, `llamaterm stop` ends one with its drain, and `serve --keep-alive` unloads an idle model and loads it again for
the next request, as its /health and /metrics say. Servers run the fake engine (in this process, or in a process of
its own where `stop` signals it) or, for the keep-alive, the default model in `llamaterm serve`."""

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx2
import pytest

from llamaterm.app.announcements import Announcer, ServedModel, servers_dir
from tests.support.cli import llamaterm
from tests.support.fake_engine import FakeEngine
from tests.support.serve_support import app_server, free_port, metrics, served

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_announcements")]  # `llamaterm`, servers: subprocesses
REPO = Path(__file__).resolve().parents[2]


def model_file(folder: Path, name: str = "model.gguf") -> Path:
    """What a fake server announces it holds (a file that is no model: nothing here loads it)."""
    path = folder / name
    path.write_bytes(b"not a model")
    return path.resolve()


@contextmanager
def in_process(model: Path, **fake) -> Iterator[tuple[Announcer, FakeEngine]]:
    """The server on the fake engine in this process, announced as holding `model`."""
    engine = FakeEngine(**fake)
    found = Announcer("127.0.0.1", free_port(), "cpu", [ServedModel("fake-llama", str(model), None, None)])
    with engine, app_server(engine, None, found):
        yield found, engine


@contextmanager
def in_a_process(model: Path) -> Iterator[tuple[subprocess.Popen, str]]:
    """The fake server in a process of its own (tests/support/fake_server.py), announced: (its process, its URL)."""
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "tests.support.fake_server", str(model), str(port)], cwd=REPO)
    try:
        file = servers_dir() / f"{process.pid}-{port}.json"
        deadline = time.monotonic() + 60
        while not file.exists():
            assert process.poll() is None and time.monotonic() < deadline, "the fake server did not announce itself"
            time.sleep(0.05)
        yield process, f"http://127.0.0.1:{port}/v1"
    finally:
        process.kill()
        process.wait()


@contextmanager
def streaming(url: str) -> Iterator[list[str]]:
    """A chat completion streaming from the server while the block runs: the lines of its events, as they come
    (the block ends once the reply has)."""
    lines: list[str] = []
    started = threading.Event()

    def read() -> None:
        body = {"model": "fake-llama", "messages": [{"role": "user", "content": "go"}], "stream": True}
        with httpx2.stream("POST", f"{url}/chat/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                lines.append(line)
                started.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert started.wait(30), "the stream did not start"
    yield lines
    reader.join(timeout=60)


def test_ps_lists_the_servers_with_their_models_and_sessions(tmp_path):
    model = model_file(tmp_path)
    with in_process(model, reply="word " * 200, tokens_per_s=50) as (found, _), streaming(found.url):  # 4 s
        listed = llamaterm("ps", "--json")
        assert listed.returncode == 0, listed.stderr
        (row,) = json.loads(listed.stdout)
        assert (row["model"], row["url"], row["pid"], row["device"]) == ("fake-llama", found.url, os.getpid(), "cpu")
        assert (row["status"], row["loaded"], row["context"], row["running"], row["waiting"]) == (
            "ok",
            True,
            2048,
            1,
            0,
        )
        assert row["kv_blocks_total"] == 1024 and row["keep_alive_s"] == 0
        table = llamaterm("ps").stdout.splitlines()
        assert table[0].split() == [
            "MODEL", "URL", "PID", "DEVICE", "CONTEXT", "RUNNING", "WAITING", "KV", "TOKENS", "MEMORY", "UP", "UNLOADS"
        ]  # fmt: skip
        assert table[1].split()[:7] == ["fake-llama", found.url, str(os.getpid()), "cpu", "2048", "1", "0"]
        assert table[1].split()[-1] == "never"
    gone = llamaterm("ps")
    assert gone.returncode == 0 and gone.stdout == ""
    assert gone.stderr == "No llamaterm serve runs on this machine: `llamaterm serve` starts one.\n"


def test_stop_ends_a_server_with_its_drain(tmp_path):
    model = model_file(tmp_path)
    with in_a_process(model) as (process, url), streaming(url) as lines:
        stopped = llamaterm("stop")
        assert stopped.returncode == 0, stopped.stderr
        assert stopped.stderr == f"Stopped fake-llama at {url} (pid {process.pid}).\n"
        assert process.poll() == 0  # gone, and by its own exit
        assert not list(servers_dir().glob(f"{process.pid}-*"))  # its announcement went with it
    assert [line for line in lines if line][-1] == "data: [DONE]"  # the request in flight ended in its stream


def test_stop_picks_a_server_by_its_model_or_url_and_never_guesses(tmp_path):
    first, second = model_file(tmp_path, "first.gguf"), model_file(tmp_path, "second.gguf")
    with ExitStack() as stack:
        (one, one_url), (two, two_url) = (stack.enter_context(in_a_process(m)) for m in (first, second))
        ambiguous = llamaterm("stop")
        assert ambiguous.returncode == 2
        assert f"2 servers run (fake-llama at {one_url}, fake-llama at {two_url})" in ambiguous.stderr
        assert one.poll() is None and two.poll() is None
        assert llamaterm("stop", two_url.removesuffix("/v1")).returncode == 0
        assert two.poll() == 0 and one.poll() is None
        missing = llamaterm("stop", str(second))
        assert missing.returncode == 1 and f"no llamaterm serve on this machine holds or listens at {second}" in (
            missing.stderr
        )
        assert llamaterm("stop", str(first)).returncode == 0 and one.poll() == 0
    nothing = llamaterm("stop", "--all")
    assert nothing.returncode == 1 and nothing.stderr == "llamaterm: no llamaterm serve runs on this machine\n"


def health(url: str) -> dict:
    return httpx2.get(url.removesuffix("/v1") + "/health", timeout=5).json()


def wait_for(condition, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_keep_alive_unloads_an_idle_model_and_loads_it_for_the_next_request():
    with served("--keep-alive", "2s") as server:
        assert health(server.url)["loaded"] is True
        assert "unloaded after 2s idle" in server.log()
        wait_for(lambda: health(server.url)["loaded"] is False)
        assert health(server.url)["status"] == "ok"  # it still takes requests
        (row,) = json.loads(llamaterm("ps", "--json").stdout)
        assert (row["loaded"], row["memory_bytes"], row["keep_alive_s"]) == (False, 0, 2.0)
        assert llamaterm("ps").stdout.splitlines()[1].split()[-1] == "unloaded"
        assert metrics(server.url)["llamaterm_model_loaded"] == 0

        body = {"model": "SmolLM2-135M-Instruct.Q4_1", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        reply = httpx2.post(f"{server.url}/chat/completions", json=body, timeout=120)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] >= 1
        assert float(reply.headers["X-Load-Seconds"]) > 0  # what loading it again cost this request
        assert health(server.url)["loaded"] is True
        again = httpx2.post(f"{server.url}/chat/completions", json=body, timeout=120)
        assert "X-Load-Seconds" not in again.headers  # loaded: no cost
        wait_for(lambda: health(server.url)["loaded"] is False)  # and idle again, unloaded again
        log = server.log()
        assert "unloaded SmolLM2-135M-Instruct.Q4_1 after 2s without a request" in log
        assert "loaded SmolLM2-135M-Instruct.Q4_1 again for a request" in log


@pytest.mark.parametrize("given", ["-5m", "5 minutes", "forever", "1h-"])
def test_a_keep_alive_that_is_no_duration_is_refused_before_anything_loads(given):
    out = llamaterm("serve", "--keep-alive", given)
    assert out.returncode == 2
    assert out.stderr == (
        f"llamaterm: --keep-alive: {given!r} is not a duration: give one as 30s, 5m, 1h30m, or 0 to keep the model "
        "loaded\n"
    )
