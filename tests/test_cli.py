"""The `llamaterm` command as a user runs it: a subprocess of the installed script."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.tiny_models import write_tiny_llama

LLAMATERM = str(Path(sys.executable).parent / "llamaterm")


def llamaterm(*args: str, stdin: str | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([LLAMATERM, *args], input=stdin, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("cli") / "tiny.gguf", context_length=64)


def test_help_is_instant_and_torch_free():
    t = time.perf_counter()
    out = llamaterm("--help")
    assert out.returncode == 0 and "run" in out.stdout
    assert time.perf_counter() - t < 5
    probe = subprocess.run([sys.executable, "-c", "import sys, llamaterm.app.cli; print('torch' in sys.modules)"],
                           capture_output=True, text=True)
    assert probe.stdout.strip() == "False"


def test_run_json_from_stdin():
    out = llamaterm("run", "--json", "--max-tokens", "8", "-", stdin="What is the capital of France?")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert "Paris" in result["text"]
    assert result["generated_tokens"] == len(result["token_ids"]) <= 8
    assert result["prompt_tokens"] > 0 and result["ttft_s"] > 0


def test_each_line_keeps_input_order(tiny):
    prompts = ["first prompt", "a second, longer prompt than the first", "third"]
    out = llamaterm("run", "--model", str(tiny), "--raw", "--each-line", "--json", "--max-tokens", "3",
                    stdin="\n".join(prompts) + "\n")
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(rows) == 3
    alone = [json.loads(llamaterm("run", "--model", str(tiny), "--raw", "--json", "--max-tokens", "3", p).stdout)
             for p in prompts]
    assert [r["token_ids"] for r in rows] == [a["token_ids"] for a in alone]


def test_plain_chat_keeps_the_conversation():
    out = llamaterm("chat", "--plain", "--max-tokens", "16",
                    stdin="My name is Ada.\nWhat is my name?\n/exit\n")
    assert out.returncode == 0, out.stderr
    assert "Ada" in out.stdout
    assert out.stderr.count("tok/s") == 2  # a rate after each turn


def test_tokenize(tiny):
    out = llamaterm("tokenize", "--json", "Hello world")
    assert json.loads(out.stdout)["ids"] == [19556, 905]  # tests/data/smollm2_tokenizer.json: llama.cpp's ids
    special = llamaterm("tokenize", "--special", "<|im_start|>user")
    assert special.stdout.split()[0] == "1"


@pytest.mark.parametrize(
    "args, code, words",
    [
        (["run", "--temperature", "-1", "hi"], 2, "temperature"),
        (["run", "--top-p", "0", "hi"], 2, "top_p"),
        (["run", ""], 2, "empty"),
        (["run", "--bogus-flag", "hi"], 2, "bogus"),
        (["run", "--model", "no-such-model", "hi"], 1, "no model named"),
    ],
)
def test_bad_input_gets_a_clear_error(args, code, words):
    out = llamaterm(*args)
    assert out.returncode == code
    assert words in out.stderr
    assert "Traceback" not in out.stderr


def test_bad_model_files(tmp_path, tiny):
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(tiny.read_bytes()[: tiny.stat().st_size // 2])
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("just some text, not a model\n")
    for path in (truncated, not_gguf):
        out = llamaterm("run", "--model", str(path), "hi")
        assert out.returncode == 1
        assert str(path.name) in out.stderr and "Traceback" not in out.stderr


def test_prompt_over_the_context(tiny):
    out = llamaterm("run", "--model", str(tiny), "--raw", "word " * 200)
    assert out.returncode == 1
    assert "context" in out.stderr and "Traceback" not in out.stderr
