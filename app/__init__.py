"""The front ends: the `llamaterm` CLI (cli.py, models_cli.py, bench.py), the TUI (tui/), the OpenAI-compatible
server (server/) and the remote backend (remote.py). May import llamaterm.engine, never llamaterm.kernels."""
