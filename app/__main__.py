"""The `llamaterm` command (and `python -m llamaterm.app`): load the command line, then run it.

The console script imports this small module, so a Ctrl-C while the command line itself loads (typer, the first
tenth of a second) exits quietly with 130 like one at any later point, not with a traceback.
"""

import gc
import sys


def main() -> None:
    try:
        from llamaterm.app.cli import main as run_command_line
    except KeyboardInterrupt:
        sys.exit(130)
    try:
        run_command_line()
    finally:
        # The interpreter's last collections go over every object still alive: for torch's modules alone that took
        # 0.2-0.3 s of each exit. Frozen, they are passed by; everything is freed as the process ends all the same.
        gc.freeze()


if __name__ == "__main__":  # the engine's child process imports this module again (spawn)
    main()
