"""Presets (app/presets.py): a named system prompt and sampling values in presets.toml, listed by `llamaterm presets`
and taken by `--preset` on run, chat and serve, flags given beside it winning. What reaches the engine is read from
the fake engine behind a server (run and the line chat through --server, serve's own handling in this process)."""

import json
import os

import httpx2
import pytest

from llamaterm.app.presets import Preset, find_preset
from tests.support.cli import llamaterm
from tests.support.fake_engine import FakeEngine
from tests.support.serve_support import app_server

PRESETS = """\
[coder]
system = "You are a careful programmer: answer with the code first."
temperature = 0.2
top_k = 20
max_tokens = 64

[creative]
temperature = 1
top_p = 0.9
"""


@pytest.fixture
def presets(tmp_path, monkeypatch) -> str:
    """The user's presets.toml, in a config folder of the test's own (the commands it runs inherit it); its path."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    (tmp_path / "llamaterm").mkdir()
    (tmp_path / "llamaterm" / "presets.toml").write_text(PRESETS)
    return str(tmp_path / "llamaterm" / "presets.toml")


@pytest.mark.slow
def test_presets_lists_them_and_says_where_they_go(presets, tmp_path):
    listed = llamaterm("presets")
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.splitlines() == [
        'coder       system "You are a careful programmer: answer with the code first."; temperature 0.2, top_k 20, '
        "max_tokens 64",
        "creative    temperature 1, top_p 0.9",
    ]
    assert json.loads(llamaterm("presets", "--json").stdout)["creative"] == {
        "system": None,
        "temperature": 1.0,
        "top_p": 0.9,
    }
    os.remove(presets)
    empty = llamaterm("presets")
    assert empty.returncode == 0 and empty.stdout == ""
    assert f"No presets yet: write them in {presets}, a table each, as" in empty.stderr
    assert "[coder]" in empty.stderr  # the form to copy


@pytest.mark.slow
@pytest.mark.parametrize(
    "toml, words",
    [
        ("[coder]\ntemperature = 'hot'\n", "[coder]: temperature must be a number, not 'hot'"),
        ("[coder]\ntemprature = 0.2\n", "[coder]: unknown key 'temprature': a preset takes system, temperature"),
        ("[coder]\ntop_p = 1.5\n", "[coder]: invalid sampling value: top_p must be in (0, 1]"),
        ("[coder\n", "is not TOML"),
        ("coder = 1\n", "[coder]: a preset is a table"),
    ],
)
def test_a_mistake_in_the_file_is_one_line_naming_it(presets, toml, words):
    with open(presets, "w") as f:
        f.write(toml)
    out = llamaterm("presets")
    assert out.returncode == 1 and len(out.stderr.splitlines()) == 1
    assert out.stderr.startswith(f"llamaterm: {presets}") and words in out.stderr, out.stderr


@pytest.mark.slow
def test_run_takes_a_preset_and_flags_given_win(presets):
    engine = FakeEngine()
    with engine, app_server(engine) as url:
        assert llamaterm("run", "--server", url, "--preset", "coder", "Hi").returncode == 0
        given = llamaterm(
            "run", "--server", url, "--preset", "coder", "--temperature", "0.7", "--system", "Be terse.", "Hi"
        )
        assert given.returncode == 0, given.stderr
    (first, first_params), (second, second_params) = engine.submitted
    assert first[0] == {"role": "system", "content": "You are a careful programmer: answer with the code first."}
    assert (first_params.temperature, first_params.top_k, first_params.max_tokens) == (0.2, 20, 64)
    assert second[0] == {"role": "system", "content": "Be terse."}
    assert (second_params.temperature, second_params.top_k) == (0.7, 20)
    unknown = llamaterm("run", "--preset", "poet", "Hi")
    assert unknown.returncode == 2
    assert unknown.stderr == (
        f"llamaterm: no preset named 'poet' in {presets} (it has coder, creative): `llamaterm presets` lists them\n"
    )


def test_a_server_under_a_preset_fills_what_requests_leave_out(presets):
    engine = FakeEngine()
    coder = find_preset("coder")
    with engine, app_server(engine, preset=coder) as url:
        ask = lambda **body: httpx2.post(f"{url}/chat/completions", json={"model": "fake-llama", **body}, timeout=30)
        assert ask(messages=[{"role": "user", "content": "Hi"}]).status_code == 200
        own = [{"role": "system", "content": "Mine."}, {"role": "user", "content": "Hi"}]
        assert ask(messages=own, temperature=0.9, max_tokens=5).status_code == 200
    (first, first_params), (second, second_params) = engine.submitted
    assert first == [{"role": "system", "content": coder.system}, {"role": "user", "content": "Hi"}]
    assert (first_params.temperature, first_params.top_k) == (0.2, 20)
    assert first_params.max_tokens == 2048  # a server's request runs to the context unless it says: not the preset's
    assert second == own and (second_params.temperature, second_params.top_k, second_params.max_tokens) == (0.9, 20, 5)


def test_a_preset_never_replaces_what_a_command_was_given():
    preset = Preset("p", None, {"temperature": 0.2, "seed": 7})
    assert preset.fill({"temperature": 0.9, "seed": None, "top_p": None}) == {
        "temperature": 0.9,
        "seed": 7,
        "top_p": None,
    }
