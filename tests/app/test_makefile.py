"""Every Makefile target works: CI runs `make lint` and `make test` (.ci/run); this runs the others as a user runs
them, shortened where the target takes a knob for it (10 s of fuzzing, a short bench, a narrow fast lane).
`make chat` starts the TUI: it runs here under a pseudo-terminal, answers a question (sampled: what it says varies,
that it answers does not), and quits on ctrl+q."""

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import termios
import time
from pathlib import Path

import pytest

from llamaterm.app.history import History
from llamaterm.engine.store.model_store import default_model_path

pytestmark = pytest.mark.slow  # make, the model, a terminal
ROOT = Path(__file__).resolve().parents[2]
RUN_HERE = {"setup", "chat", "test-fast", "fuzz", "bench-cpu"}


def phony_targets() -> set[str]:
    (line,) = re.findall(r"^\.PHONY: (.*)$", (ROOT / "Makefile").read_text(), re.M)
    return set(line.split())


def ci_targets() -> set[str]:
    return set(re.findall(r"^make (\S+)", (ROOT / ".ci" / "run").read_text(), re.M))


def test_every_target_is_run_here_or_by_ci():
    assert ci_targets() == {"lint", "test"}
    assert phony_targets() == RUN_HERE | ci_targets()


@pytest.fixture
def user(tmp_path) -> dict[str, str]:
    """The environment of a user whose store holds the default model alone, in a home of its own (the history of
    `make chat` goes there)."""
    model = default_model_path()
    (tmp_path / "models" / "default").mkdir(parents=True)
    (tmp_path / "models" / "default" / model.name).symlink_to(model)
    return {**os.environ, "LLAMATERM_HOME": str(tmp_path), "PYTEST_ADDOPTS": ""}


def make(target: str, env: dict[str, str], *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["make", "-s", target, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_make_setup_is_idempotent(user):
    first, second = make("setup", user), make("setup", user)
    assert first.returncode == second.returncode == 0, first.stderr + second.stderr


def test_make_test_fast_runs_the_fast_lane(user):
    out = make("test-fast", user | {"PYTEST_ADDOPTS": "tests/app/test_history.py"})
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r"\d+ passed", out.stdout) and "slowest 5 durations" in out.stdout


def test_make_fuzz(user):
    out = make("fuzz", user | {"LLAMATERM_FUZZ_SEED": "1"}, "FUZZ_SECONDS=10")  # 50 cases at least; a seed of its own
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 passed" in out.stdout


def test_make_bench_cpu(user):
    """The default model beside Hugging Face transformers on the CPU, shortened."""
    out = make("bench-cpu", user, "BENCH_ARGS=--tokens 16 --prompt 16 --window 0.5 --warmup 0.2")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    at = lines.index("one session, 16-token prompts, 16 new tokens, medians of 3 runs:")
    assert lines[at + 2].startswith("llamaterm") and lines[at + 3].startswith("Hugging Face transformers")
    assert lines[at + 4].startswith("speed-up ") and lines[at + 4].endswith("same tokens: True")


def read_until(fd: int, seen: bytearray, wanted: bytes, timeout: float) -> None:
    """Reads the terminal into `seen` until the pattern `wanted` shows, the program's escape sequences aside."""
    deadline = time.monotonic() + timeout
    while not re.search(wanted, re.sub(rb"\x1b\[[0-9;?]*[A-Za-z]", b"", bytes(seen))):
        left = deadline - time.monotonic()
        assert left > 0, f"{wanted!r} did not appear; the terminal showed {bytes(seen)[-2000:]!r}"
        if select.select([fd], [], [], min(left, 0.5))[0]:
            try:
                seen += os.read(fd, 1 << 16)
            except OSError:  # the program closed the terminal
                return


def test_make_chat_answers_in_a_terminal_and_quits_on_ctrl_q(user):
    pid, fd = pty.fork()
    if pid == 0:  # the child: make chat on the pseudo-terminal, 100 x 30
        fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
        os.execvpe("make", ["make", "-s", "-C", str(ROOT), "chat"], user | {"TERM": "xterm-256color"})
    try:
        seen = bytearray()
        read_until(fd, seen, b"Ask every selected pane", 120)
        read_until(fd, seen, b"tok/s", 120)  # the model is loaded: the status bar shows the engine
        os.write(fd, b"What is the capital of France?\r")
        read_until(fd, seen, rb"TTFT \d+ ms", 120)  # the pane's figures: the reply has begun
        os.write(fd, b"\x11")  # ctrl+q
        _, status = os.waitpid(pid, 0)
        pid = 0
        assert os.waitstatus_to_exitcode(status) == 0
        history = History.open(Path(user["LLAMATERM_HOME"]) / "history.db")
        (conversation,) = history.search()
        question, answer = history.load(conversation.id).messages
        history.close()
        assert (question.role, question.content) == ("user", "What is the capital of France?")
        assert answer.role == "assistant" and answer.content.strip()
    finally:
        if pid:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        os.close(fd)
