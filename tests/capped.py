"""Run untrusted-input code in a child process under a memory cap: a loader that allocates without bound gets
MemoryError there (or dies) instead of taking the test machine down."""

import resource
import subprocess
import sys

MEMORY_CAP = 2 << 30  # address space: torch, the loaders and a tiny model fit in well under a gigabyte


def run_capped(code: str, *args: str, timeout: float = 120, memory: int = MEMORY_CAP,
               stdin: str | None = None) -> subprocess.CompletedProcess:
    """`python -c code args...` with RLIMIT_AS = memory; text output captured."""

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

    return subprocess.run([sys.executable, "-c", code, *args], input=stdin, capture_output=True, text=True,
                          timeout=timeout, preexec_fn=cap)


def one_line_error(stderr: str) -> bool:
    """What the CLI prints for bad input: one line, `llamaterm: ...`, no traceback."""
    lines = stderr.strip().splitlines()
    return len(lines) == 1 and lines[0].startswith("llamaterm: ")


def llamaterm_capped(*args: str, **kwargs) -> subprocess.CompletedProcess:
    """The `llamaterm` command line, under the memory cap."""
    return run_capped("import sys; from llamaterm.app.cli import main; sys.argv[0] = 'llamaterm'; main()", *args,
                      **kwargs)
