"""The command line and the server: `llamaterm` as a user runs it, serve and its faults, the remote engine, bench,
history, what reaches a terminal, the wheel."""
