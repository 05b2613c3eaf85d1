"""The `llamaterm` command (and `python -m llamaterm.app`): load the command line, then run it.

The console script imports this small module, so a Ctrl-C while the command line itself loads (typer, the first
tenth of a second) exits quietly with 130 like one at any later point, not with a traceback.
"""

import gc
import os
import sys
import threading


def main() -> None:
    try:
        from llamaterm.app.cli import main as run_command_line
    except KeyboardInterrupt:
        sys.exit(130)
    code: int | str | None = None
    try:
        run_command_line()
    except SystemExit as e:
        code = e.code
    finally:
        # The interpreter's last collections go over every object still alive, torch's modules a large part of every
        # exit. Frozen, they are passed by; everything is freed as the process ends all the same.
        gc.freeze()
    exit_now(code)


def exit_now(code: int | str | None) -> None:
    """End the process with the command's exit code, skipping the interpreter's teardown of every module (torch's
    is a noticeable part of a `run`) where nothing is left to wind down: no other thread, no child process,
    the output flushed. Otherwise (or for an exit with a message), as sys.exit."""
    multiprocessing = sys.modules.get("multiprocessing")
    busy = threading.active_count() > 1 or (multiprocessing is not None and multiprocessing.active_children())
    if busy or not (code is None or isinstance(code, int)):
        sys.exit(code)
    if (logging := sys.modules.get("logging")) is not None:
        logging.shutdown()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except OSError:  # a closed pipe: the interpreter's own exit reports it
        sys.exit(code)
    os._exit(code or 0)


if __name__ == "__main__":  # the engine's child process imports this module again (spawn)
    main()
