"""The wheel users install: one top-level package, `llamaterm`, with the TUI's styles and without the tests'
benchmarks. Built here with setuptools, the project's own build backend."""

import subprocess
import sys
import zipfile

import pytest

from tests.support import ROOT

pytestmark = pytest.mark.slow  # a wheel built by pip in a subprocess


def test_the_wheel_installs_one_top_level_package(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            str(ROOT),
            "-w",
            str(tmp_path),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("llamaterm-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"llamaterm"}  # no app, engine, kernels, assets
    assert {
        "llamaterm/assets/chat.tcss",
        "llamaterm/assets/dialogs.tcss",
        "llamaterm/app/cli.py",
        "llamaterm/engine/serving/engine.py",
        "llamaterm/kernels/linear_triton.py",
    } <= set(names)
    assert not [n for n in names if "benchmarks" in n or n.startswith("llamaterm/tests")]
