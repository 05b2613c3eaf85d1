"""What every command writes to the terminal, and how it stops: data lines to stdout, messages to stderr, a failure
as one line and an exit code. The commands' modules (app/cli.py, app/models_cli.py, app/bench.py) share it, so none
imports another for its helpers. Lines quote what models, files and servers hold: on a terminal, only as text."""

import gc
import signal
import sys
from contextlib import contextmanager
from typing import NoReturn

import typer

from llamaterm.app.terminal import shown


def echo(line: str) -> None:
    """A line of data to stdout."""
    typer.echo(shown(line, sys.stdout))


def say(message: str) -> None:
    """A line to stderr: progress, a diagnostic."""
    typer.echo(shown(message, sys.stderr), err=True)


def startup_split(parts: dict[str, float]) -> str:
    """Where start-up time went, as `run --verbose` and `llamaterm bench` say it: 'imports 1.02 s, read checkpoint
    0.10 s, ... (total 1.80 s)'."""
    return ", ".join(f"{k} {v:.2f} s" for k, v in parts.items()) + f" (total {sum(parts.values()):.2f} s)"


def fail(message: str, code: int = 1) -> NoReturn:
    say(f"llamaterm: {message}")
    raise typer.Exit(code)


@contextmanager
def interrupts_held():
    """Hold a Ctrl-C back while the engine's libraries import. numpy's import swallows a KeyboardInterrupt raised
    inside it (the command then ran on to the end and exited 0, or failed later with an AttributeError
    traceback); taken once the imports are done, it exits 130 like a Ctrl-C at any other point. Where SIGINT is
    not Python's KeyboardInterrupt (ignored, as in a script's background job), it is left as it is."""
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    pending = []
    previous = signal.signal(signal.SIGINT, lambda *_: pending.append(True))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if pending:
        raise KeyboardInterrupt


@contextmanager
def imports_frozen():
    """The garbage collector paused while the engine's libraries import, and what they made frozen (left out of
    every later collection): torch's import makes a few hundred thousand objects that live to the end, and
    collecting them as they came is time the import need not take."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()
