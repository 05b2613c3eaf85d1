"""A model's sampling defaults and where each came from (issue #24, item 5). The oracles: transformers'
GenerationConfig writes the generation_config.json; the gguf package names the GGUF keys (gguf.Keys.General) and
writes them with llama.cpp's types; llama.cpp's own defaults (common/common.h, common_params_sampling: temp 0.80,
top_k 40, top_p 0.95, min_p 0.05, penalty_repeat 1.00, presence and frequency 0.00) are written out by hand."""

import json

import pytest
import transformers
from gguf import GGUFValueType, Keys

from llamaterm.app.remote import request_body
from llamaterm.engine.api import EngineConfig
from llamaterm.engine.checkpoints.gguf import read_gguf_info
from llamaterm.engine.checkpoints.sampling_defaults import (
    LLAMA_CPP_DEFAULTS,
    SERVER_DEFAULTS,
    from_generation_config,
    from_gguf,
)
from llamaterm.engine.sampling_params import SamplingParams
from llamaterm.engine.serving.engine import Engine
from llamaterm.engine.serving.process import EngineProcess
from tests.support.cli import llamaterm
from tests.support.tiny_models import write_tiny_llama

LLAMA_CPP = {
    "temperature": (0.8, "llama.cpp"),
    "top_k": (40, "llama.cpp"),
    "top_p": (0.95, "llama.cpp"),
    "min_p": (0.05, "llama.cpp"),
    "repetition_penalty": (1.0, "llama.cpp"),
    "presence_penalty": (0.0, "llama.cpp"),
    "frequency_penalty": (0.0, "llama.cpp"),
}
G = Keys.General
GGUF_SAMPLING = {  # what llama.cpp's converter writes from a generation_config.json, in its types
    G.SAMPLING_TEMP: (0.6, GGUFValueType.FLOAT32),
    G.SAMPLING_TOP_K: (20, GGUFValueType.INT32),
    G.SAMPLING_TOP_P: (0.9, GGUFValueType.FLOAT32),
    G.SAMPLING_MIN_P: (0.1, GGUFValueType.FLOAT32),
    G.SAMPLING_PENALTY_REPEAT: (1.1, GGUFValueType.FLOAT32),
}
FROM_GGUF = LLAMA_CPP | {
    "temperature": (0.6, "gguf"),
    "top_k": (20, "gguf"),
    "top_p": (0.9, "gguf"),
    "min_p": (0.1, "gguf"),
    "repetition_penalty": (1.1, "gguf"),
}


def shown(defaults) -> dict:
    return {name: (d.value, d.source) for name, d in defaults.values.items()}


def test_a_generation_config_gives_its_values_and_llama_cpp_the_rest(tmp_path):
    transformers.GenerationConfig(
        do_sample=True, temperature=0.6, top_p=0.9, top_k=20, repetition_penalty=1.05
    ).save_pretrained(tmp_path)
    defaults = from_generation_config(tmp_path)
    assert shown(defaults) == LLAMA_CPP | {
        "temperature": (0.6, "generation_config.json"),
        "top_k": (20, "generation_config.json"),
        "top_p": (0.9, "generation_config.json"),
        "repetition_penalty": (1.05, "generation_config.json"),
    }
    assert defaults.warnings == ()


def test_a_folder_or_gguf_without_them_gives_llama_cpp_defaults(tmp_path):
    assert shown(from_generation_config(tmp_path)) == LLAMA_CPP
    tiny = write_tiny_llama(tmp_path / "plain.gguf")
    assert shown(from_gguf(read_gguf_info(tiny)["metadata"], str(tiny))) == LLAMA_CPP


def test_a_gguf_with_sampling_keys_gives_them_to_the_engine(tmp_path):
    tiny = write_tiny_llama(tmp_path / "sampled.gguf", metadata=GGUF_SAMPLING)
    with Engine.from_model(EngineConfig(model=str(tiny), device="cpu", kv_tokens=256)) as engine:
        assert shown(engine.sampling_defaults) == FROM_GGUF  # float32 0.9 reads as 0.9


@pytest.mark.slow
def test_the_engine_process_and_info_show_the_gguf_keys(tmp_path):
    tiny = write_tiny_llama(tmp_path / "sampled.gguf", metadata=GGUF_SAMPLING)
    with EngineProcess(EngineConfig(model=str(tiny), device="cpu", kv_tokens=256)) as engine:
        assert shown(engine.sampling_defaults) == FROM_GGUF
    out = llamaterm("info", "--json", str(tiny))
    info = json.loads(out.stdout)
    assert {k: (v["value"], v["source"]) for k, v in info["sampling_defaults"].items()} == FROM_GGUF
    assert "temperature         0.6     the GGUF" in llamaterm("info", str(tiny)).stdout


def test_bad_values_are_skipped_with_a_warning_naming_the_file_and_key(tmp_path):
    """A generation_config.json only advises: a bad value is left out (llama.cpp's then) rather than refusing a
    model whose weights are fine."""
    path = tmp_path / "generation_config.json"
    path.write_text(
        json.dumps({"temperature": "hot", "top_p": 1.5, "top_k": 2.5, "min_p": [0.1], "repetition_penalty": 0.9})
    )
    defaults = from_generation_config(tmp_path)
    assert shown(defaults) == LLAMA_CPP | {"repetition_penalty": (0.9, "generation_config.json")}
    assert len(defaults.warnings) == 4
    for key, warning in zip(("temperature", "top_k", "top_p", "min_p"), defaults.warnings, strict=True):
        assert warning.startswith(f"{path}: {key} = ") and "ignored" in warning
    # past what the sampler's tables hold: every request would be refused with the model's defaults
    path.write_text(json.dumps({"temperature": 1e39, "top_k": 2**63, "repetition_penalty": 1e-35}))
    defaults = from_generation_config(tmp_path)
    assert shown(defaults) == LLAMA_CPP and len(defaults.warnings) == 3
    assert defaults.params({}) == SamplingParams(**{k: v for k, (v, _) in LLAMA_CPP.items()})
    path.write_text("{not json")
    (warning,) = from_generation_config(tmp_path).warnings
    assert str(path) in warning and "llama.cpp's defaults" in warning
    bad_gguf = write_tiny_llama(tmp_path / "bad.gguf", metadata={G.SAMPLING_TOP_P: ("high", GGUFValueType.STRING)})
    defaults = from_gguf(read_gguf_info(bad_gguf)["metadata"], str(bad_gguf))
    assert shown(defaults) == LLAMA_CPP
    assert defaults.warnings == (
        f'{bad_gguf}: general.sampling.top_p = "high" is not a number in (0, 1]: ignored, top_p defaults to '
        "llama.cpp's 0.95",
    )


@pytest.mark.slow
def test_run_warns_and_answers_with_a_bad_generation_config(tmp_path):
    bad = write_tiny_llama(tmp_path / "bad.gguf", metadata={G.SAMPLING_TEMP: (-1.0, GGUFValueType.FLOAT32)})
    out = llamaterm("run", "--model", str(bad), "--raw", "--max-tokens", "2", "hi")
    assert out.returncode == 0, out.stderr
    assert f"llamaterm: warning: {bad}: general.sampling.temp = -1.0 is not a number >= 0" in out.stderr


def test_what_the_user_gives_wins_and_a_server_fills_the_rest():
    params = LLAMA_CPP_DEFAULTS.params({"temperature": 0, "top_k": None})
    assert params == SamplingParams(temperature=0, top_k=40, top_p=0.95, min_p=0.05)
    remote = SERVER_DEFAULTS.params({"temperature": 0.3, "max_tokens": 5, "top_p": None})
    assert remote.unset == {"top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"}
    _, body = request_body("m", "hi", remote, raw=True)
    assert body == {
        "model": "m",
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 5,
        "temperature": 0.3,
        "prompt": "hi",
    }
    assert [d.source for d in SERVER_DEFAULTS.resolve({"temperature": 0.3}).values()] == ["user"] + ["server"] * 6
    # filters turned off by the user go as given: left out, the server's defaults would filter (top_k 40, min_p 0.05)
    off = SERVER_DEFAULTS.params({"top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, "max_tokens": 5})
    _, body = request_body("m", "hi", off, raw=True)
    assert (body["top_k"], body["min_p"], body["repetition_penalty"]) == (0, 0.0, 1.0) and "top_p" not in body
