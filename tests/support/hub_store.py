"""The store as the Hub tests see it: a Hub look-alike per test (hub_server.py) with HF_ENDPOINT pointing at it
and LLAMATERM_HOME / HF_HOME in the test's tmp dir, tiny GGUF files in the real format, the `llamaterm` command
run against them, the store's folder and manifests, and the checks that a pull that failed said so in one line
and left nothing visible."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from llamaterm.engine.store.model_store import MANIFEST
from tests.support.cli import LLAMATERM
from tests.support.hub_server import HubServer
from tests.support.tiny_models import write_tiny_llama


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict[str, bytes]:
    """GGUF files in the real format, by name. Written before any test points LLAMATERM_HOME elsewhere:
    the runnable model copies its tokenizer from the installed default model."""
    d = tmp_path_factory.mktemp("models")
    out = {"llama": write_tiny_llama(d / "llama.gguf", qtype="Q4_K").read_bytes()}
    for qtype in ("Q8_0", "Q4_0", "F16"):
        out[qtype] = write_tiny_llama(d / f"{qtype}.gguf", qtype=qtype, vocab_from=None).read_bytes()
    first = write_tiny_llama(d / "split.gguf", qtype="Q8_0", vocab_from=None, split_max_tensors=7)
    out |= {f"split{i}": first.with_name(f"split-0000{i}-of-00003.gguf").read_bytes() for i in (1, 2, 3)}
    return out


@pytest.fixture
def hub_server(tmp_path, monkeypatch):
    with HubServer() as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setenv("LLAMATERM_HOME", str(tmp_path / "home"))
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # no real token, no real cache
        for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
            monkeypatch.delenv(var, raising=False)
        yield server


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
