"""The `llamaterm` command as a user runs it: the installed script in a subprocess, its output captured as text."""

import subprocess
import sys
from pathlib import Path

LLAMATERM = str(Path(sys.executable).parent / "llamaterm")


def llamaterm(*args: str, stdin: str | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([LLAMATERM, *args], input=stdin, capture_output=True, text=True, timeout=timeout)
