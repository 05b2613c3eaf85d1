"""Files a process may not write now: read-only ones (for root, whom modes do not stop, immutable too) and
SQLite files another process holds locked or mid-write. The history tests use them, and the TUI's."""

import contextlib
import os
import subprocess
import sys

import pytest


@contextlib.contextmanager
def read_only_file(path):
    """The file cannot be written by this process: mode 0444, and for root (whom modes do not stop) the
    immutable attribute."""
    path.chmod(0o444)
    root = os.geteuid() == 0
    if root:
        subprocess.run(["chattr", "+i", str(path)], check=True)
    try:
        with pytest.raises(PermissionError):
            open(path, "r+b").close()
        yield path
    finally:
        if root:
            subprocess.run(["chattr", "-i", str(path)], check=True)
        path.chmod(0o644)


@contextlib.contextmanager
def held_by_another_process(path, statements: str):
    """Another process keeps `path` open in the state `statements` leave it in, until the block ends."""
    code = (
        "import sqlite3, sys\nc = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
        f"c.executescript({statements!r})\nprint('ready', flush=True)\nsys.stdin.read()"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline() == "ready\n"
        yield
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)


EXCLUSIVE = "PRAGMA locking_mode = EXCLUSIVE; BEGIN EXCLUSIVE; UPDATE conversations SET title = title;"
WRITING = "BEGIN IMMEDIATE; UPDATE conversations SET title = title;"
