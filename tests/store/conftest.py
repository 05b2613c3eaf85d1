"""The store room's fixtures: a Hub look-alike per test (tests/support/hub_server.py) with HF_ENDPOINT pointing at
it and LLAMATERM_HOME / HF_HOME in the test's tmp dir, so the real store and the real Hub are never touched; and
tiny GGUF files in the real format to serve."""

import pytest

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
