"""The store as the Hub tests see it (their fixtures, a Hub look-alike per test and tiny GGUF files, are in
tests/store/conftest.py): the `llamaterm` command run against them, the store's folder and manifests, and the
checks that a pull that failed said so in one line and left nothing visible."""

import json
import os
import subprocess
from pathlib import Path

from llamaterm.engine.store.model_store import MANIFEST
from tests.support.cli import LLAMATERM


def llamaterm(*args: str, input: str | None = None, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [LLAMATERM, *args], input=input, capture_output=True, text=True, timeout=120, env={**os.environ, **env}
    )


def home() -> Path:
    return Path(os.environ["LLAMATERM_HOME"]) / "models"


def stored(name: str) -> dict:
    return json.loads((home() / name / MANIFEST).read_text())


def ls() -> list[dict]:
    r = llamaterm("ls", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def assert_user_error(r: subprocess.CompletedProcess, *fragments: str) -> None:
    """Exit 1 with a one-line message naming the problem, no traceback, nothing on stdout."""
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    assert r.stdout == ""
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("llamaterm: ")
    for fragment in fragments:
        assert fragment in last, last


def assert_store_empty() -> None:
    """Nothing half-written is visible: no model listed, no folder outside the hidden ones."""
    assert ls() == []
    assert list(home().glob("[!.]*")) == []
