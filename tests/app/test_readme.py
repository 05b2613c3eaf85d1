"""README's examples, run: every `$ llamaterm ...` example shown with its output whose output does not depend on
the machine (timings aside) prints what README says, on the default model on the CPU, in a store that holds the
default model alone (as a fresh install's does)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from llamaterm.engine.store.model_store import default_model_path

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
TIMINGS = {"ttft_s", "tokens_per_s"}  # a JSON output's fields that measure this machine
# examples whose output is not this machine's to reproduce: the network (pull), the user's store (rm NAME), a
# server that runs until stopped and the servers running (ps, stop), the line chat's prompts (below) and the figures
# of a busy machine
ELSEWHERE = (
    "llamaterm pull",
    "llamaterm rm",
    "llamaterm serve",
    "llamaterm ps",
    "llamaterm stop",
    "llamaterm chat",
    "llamaterm bench",
)


def examples() -> list[tuple[str, str]]:
    """(command, output) of each README example that shows its output: a `    $ ` line, then the indented lines
    up to a blank line."""
    text = (ROOT / "README.md").read_text()
    found = re.findall(r"^    \$ ([^\n]*)\n((?:    (?!\$ )[^\n]*\n)+)", text, re.M)
    return [(command, "\n".join(line[4:] for line in output.splitlines())) for command, output in found]


def shown(command: str) -> bool:
    return "llamaterm" in command and not any(part in command for part in ELSEWHERE) and "#" not in command


@pytest.fixture
def fresh_store(tmp_path) -> dict[str, str]:
    """The environment of a user whose store holds the default model alone."""
    model = default_model_path()
    (tmp_path / "models" / "default").mkdir(parents=True)
    (tmp_path / "models" / "default" / model.name).symlink_to(model)
    return {**os.environ, "LLAMATERM_HOME": str(tmp_path), "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}


@pytest.mark.slow
@pytest.mark.parametrize("command, output", [e for e in examples() if shown(e[0])], ids=lambda v: v[:40])
def test_readme_example(command, output, fresh_store):
    result = subprocess.run(
        command, shell=True, capture_output=True, text=True, timeout=300, env=fresh_store, stdin=subprocess.DEVNULL
    )
    printed = (result.stdout + result.stderr).strip()
    if output.startswith("{"):
        drop = lambda d: {k: v for k, v in json.loads(d).items() if k not in TIMINGS}
        assert drop(printed) == drop(output), printed
    else:
        assert printed == output.strip(), printed


def test_every_example_is_run_or_named_as_not_reproducible_here():
    """A new example with output is run by the test above unless it is of a kind named in ELSEWHERE."""
    commands = [command for command, _ in examples()]
    assert sum(shown(c) for c in commands) >= 5, commands


@pytest.mark.slow
def test_the_line_chat_example_answers_as_readme_shows(fresh_store):
    chat = next(output for command, output in examples() if command == "llamaterm chat --plain --temperature 0")
    question, answer = (line for line in chat.splitlines()[1:3])
    result = subprocess.run(
        [str(BIN / "llamaterm"), "chat", "--plain", "--temperature", "0"],
        input=question.removeprefix("> ") + "\n",
        capture_output=True,
        text=True,
        timeout=300,
        env=fresh_store,
    )
    # stdout: the prompts ("> ") and the answer; the banner and the rate go to stderr
    assert result.returncode == 0 and result.stdout == f"> {answer}\n> ", result.stdout
