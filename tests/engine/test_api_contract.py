"""The one engine contract (engine/api.py): the in-process engine, the engine process and the test fake all
satisfy EngineClient, checked statically by mypy over tests/typing/engine_clients.py."""

import os
import subprocess
import sys

import pytest

from tests.support import ROOT

pytestmark = pytest.mark.slow  # mypy over the engines, in a subprocess


def test_every_engine_meets_the_engine_client_protocol(tmp_path):
    # mypy cannot follow the editable install's package-dir mapping, so give it the llamaterm tree as links.
    package = tmp_path / "llamaterm"
    package.mkdir()
    for room in ("app", "engine", "kernels"):
        (package / room).symlink_to(ROOT / room)
    env = {**os.environ, "MYPYPATH": str(tmp_path)}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--follow-imports=silent",
            "--explicit-package-bases",
            "--no-incremental",
            "tests/typing/engine_clients.py",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
