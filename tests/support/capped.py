"""Run untrusted-input code in a child process under a memory cap: a loader that allocates without bound gets
MemoryError there (or dies) instead of taking the test machine down.

The cap is on address space (RLIMIT_AS), set once torch is imported: MEMORY_BUDGET beyond what the interpreter and
torch's libraries already map, so it means the same with a CPU build of torch and a CUDA one (whose libraries map
gigabytes)."""

import resource
import subprocess
import sys
from pathlib import Path

MEMORY_BUDGET = 2 << 30  # torch's tensors, the loaders and a tiny model need well under a gigabyte of it
PRELUDE = (
    f"import sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\nfrom capped import cap_memory\ncap_memory()\n"
)


def cap_memory() -> None:
    """Limit this process's address space to what it maps now, torch included, plus MEMORY_BUDGET."""
    import torch  # noqa: F401 (its libraries count in what is mapped now)

    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (mapped + MEMORY_BUDGET, resource.RLIM_INFINITY))


def run_capped(
    code: str, *args: str, timeout: float = 120, stdin: str | bytes | None = None, env: dict | None = None
) -> subprocess.CompletedProcess:
    """`python -c code args...` under the cap; output captured as text, or as bytes when stdin is bytes."""
    return subprocess.run(
        [sys.executable, "-c", PRELUDE + code, *args],
        input=stdin,
        capture_output=True,
        text=not isinstance(stdin, bytes),
        timeout=timeout,
        env=env,
    )


def llamaterm_capped(*args: str, **kwargs) -> subprocess.CompletedProcess:
    """The `llamaterm` command line (its console script's entry point), under the cap."""
    return run_capped(
        "import sys; from llamaterm.app.__main__ import main; sys.argv[0] = 'llamaterm'; main()", *args, **kwargs
    )


def one_line_error(stderr: str) -> bool:
    """What the CLI prints for bad input: one line, `llamaterm: ...`, no traceback."""
    lines = stderr.strip().splitlines()
    return len(lines) == 1 and lines[0].startswith("llamaterm: ")
