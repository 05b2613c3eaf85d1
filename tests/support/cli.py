"""The `llamaterm` command as a user runs it: the installed script in a subprocess, its output captured as text."""

import signal
import subprocess
import sys
from pathlib import Path

LLAMATERM = str(Path(sys.executable).parent / "llamaterm")


def llamaterm(*args: str, stdin: str | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([LLAMATERM, *args], input=stdin, capture_output=True, text=True, timeout=timeout)


def interruptible() -> None:
    """preexec_fn: Ctrl-C reaches the child as at a terminal, also where the tests themselves run with SIGINT ignored
    (a background job of a non-interactive shell passes that on, and Python then installs no KeyboardInterrupt)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
