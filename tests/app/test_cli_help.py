"""What every command offers as a CLI: --version, -h beside --help, help without raw type labels on its flags, and
shell completion (Typer's), commands and stored model names both; each run as a user runs it."""

import os
import re
import subprocess
from importlib.metadata import version

import pytest

from tests.support.cli import LLAMATERM, llamaterm

pytestmark = pytest.mark.slow  # `llamaterm` in subprocesses

COMMANDS = ["run", "chat", "serve", "ps", "stop", "tokenize", "pull", "ls", "rm", "info", "presets", "bench"]


def test_version():
    for flag in ("--version", "-V"):
        out = llamaterm(flag)
        assert (out.returncode, out.stdout) == (0, f"llamaterm {version('llamaterm')}\n")


def test_every_command_is_listed_and_takes_h_for_help():
    listed = llamaterm("-h")
    assert listed.returncode == 0
    assert re.findall(r"^│ (\w+) ", listed.stdout, re.M) == COMMANDS
    for command in COMMANDS:
        short, long = llamaterm(command, "-h"), llamaterm(command, "--help")
        assert short.returncode == 0 and short.stdout == long.stdout, command
        assert f"Usage: llamaterm {command}" in short.stdout
        assert "<bool>" not in short.stdout, command  # a flag takes no value: no type beside it


def completions(words: str, home: str | None = None) -> list[str]:
    """What bash completion offers for the command line `words` (the cursor at its end), as Typer's script asks."""
    env = {**os.environ, "_LLAMATERM_COMPLETE": "complete_bash", "COMP_WORDS": words}
    env["COMP_CWORD"] = str(len(words.split()) - (0 if words.endswith(" ") else 1))
    if home:
        env["LLAMATERM_HOME"] = home
    out = subprocess.run([LLAMATERM], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_shell_completion_of_commands_options_and_model_names(tmp_path):
    assert completions("llamaterm s") == ["serve", "stop"]
    assert "--keep-alive" in completions("llamaterm serve --k")
    (tmp_path / "models" / "qwen3-0.6b").mkdir(parents=True)
    (tmp_path / "models" / "qwen2.5-7b").mkdir(parents=True)
    (tmp_path / "models" / ".partial").mkdir(parents=True)
    assert completions("llamaterm run --model qw", str(tmp_path)) == ["qwen2.5-7b", "qwen3-0.6b"]
    assert completions("llamaterm rm ", str(tmp_path)) == ["qwen2.5-7b", "qwen3-0.6b"]


def test_completion_installs_for_the_shell(tmp_path):
    # Typer's switch for tests: the shell named on the command line, not detected from the parent processes (under
    # make and pytest, no interactive shell)
    env = {**os.environ, "HOME": str(tmp_path), "_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION": "1"}
    shown = subprocess.run([LLAMATERM, "--show-completion", "bash"], env=env, capture_output=True, text=True)
    assert shown.returncode == 0 and "_LLAMATERM_COMPLETE=complete_bash" in shown.stdout
    out = subprocess.run([LLAMATERM, "--install-completion", "bash"], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "llamaterm" in (tmp_path / ".bashrc").read_text()
