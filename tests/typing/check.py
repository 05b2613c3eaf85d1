"""mypy over the whole llamaterm package, as it installs: app/, engine/ and kernels/ checked as llamaterm.app,
llamaterm.engine and llamaterm.kernels (the editable install maps them with an import hook mypy cannot follow, so
each file is handed to mypy with its module's name), and tests/typing/engine_clients.py, where every engine and
backend must meet engine.api.EngineClient. `make lint` runs it.

    python -m tests.typing.check
"""

import os
import sys
import tempfile
from pathlib import Path

from mypy import build
from mypy.errors import CompileError
from mypy.main import process_options
from mypy.modulefinder import BuildSource

ROOT = Path(__file__).resolve().parents[2]


def sources() -> list[BuildSource]:
    out = [BuildSource(None, "llamaterm", text="")]  # the namespace package itself
    for room in ("app", "engine", "kernels"):
        for path in sorted((ROOT / room).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out.append(BuildSource(str(path), f"llamaterm.{module}"))
    # the engine contract, checked statically
    for module in ("tests.support.fake_engine", "tests.typing.engine_clients"):
        out.append(BuildSource(str(ROOT / (module.replace(".", "/") + ".py")), module))
    return out


def main() -> int:
    # the files are given whole: nothing is looked up from the working directory, where app/ and kernels/ would
    # also pass for top-level packages
    _, options = process_options(["-c", "pass", "--ignore-missing-imports", "--cache-dir", str(ROOT / ".mypy_cache")])
    os.chdir(tempfile.gettempdir())
    try:
        messages = build.build(sources(), options).errors
    except CompileError as e:
        messages = e.messages
    errors = [m for m in messages if ": error:" in m]
    print("\n".join(messages) if messages else "mypy: no issues in llamaterm")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
