"""The `llamaterm` command as a user runs it: a subprocess of the installed script."""

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.capped import llamaterm_capped, one_line_error
from tests.support.cli import LLAMATERM, interruptible, llamaterm
from tests.support.tiny_models import write_tiny_llama

pytestmark = pytest.mark.slow  # `llamaterm` in subprocesses


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("cli") / "tiny.gguf", context_length=64)


def test_help_is_instant_and_torch_free():
    t = time.perf_counter()
    out = llamaterm("--help")
    assert out.returncode == 0 and "run" in out.stdout
    assert time.perf_counter() - t < 5
    probe = subprocess.run(
        [sys.executable, "-c", "import sys, llamaterm.app.cli; print('torch' in sys.modules)"],
        capture_output=True,
        text=True,
    )
    assert probe.stdout.strip() == "False"


def test_run_json_from_stdin():
    out = llamaterm(
        "run", "--json", "--temperature", "0", "--max-tokens", "8", "-", stdin="What is the capital of France?"
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert "Paris" in result["text"]
    assert result["generated_tokens"] == len(result["token_ids"]) <= 8
    assert result["prompt_tokens"] > 0 and result["ttft_s"] > 0


def test_each_line_keeps_input_order(tiny):
    prompts = ["first prompt", "a second, longer prompt than the first", "third"]
    out = llamaterm(
        "run",
        "--model",
        str(tiny),
        "--raw",
        "--temperature",
        "0",
        "--each-line",
        "--json",
        "--max-tokens",
        "3",
        stdin="\n".join(prompts) + "\n",
    )
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(rows) == 3
    alone = [
        json.loads(
            llamaterm(
                "run", "--model", str(tiny), "--raw", "--temperature", "0", "--json", "--max-tokens", "3", p
            ).stdout
        )
        for p in prompts
    ]
    assert [r["token_ids"] for r in rows] == [a["token_ids"] for a in alone]


def test_each_line_cuts_at_newlines_only(tiny):
    """A form feed or U+2028 inside a line is part of its prompt (str.splitlines cut there too)."""
    stdin = "a\u2028b\r\nc\x0cd\n\n"
    out = llamaterm("run", "--model", str(tiny), "--raw", "--each-line", "--json", "--max-tokens", "1", stdin=stdin)
    assert out.returncode == 0, out.stderr
    assert [json.loads(line)["prompt_tokens"] for line in out.stdout.splitlines()] == [
        len(json.loads(llamaterm("tokenize", "--model", str(tiny), "--json", p).stdout)["ids"])
        for p in ("a\u2028b", "c\x0cd")
    ]


def test_plain_chat_keeps_the_conversation():
    out = llamaterm(
        "chat",
        "--plain",
        "--temperature",
        "0",
        "--max-tokens",
        "16",
        stdin="My name is Ada.\nWhat is my name?\n/exit\n",
    )
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
        (["run", "--model", "/no/such/model.gguf", "hi"], 1, "no such file or folder: /no/such/model.gguf"),
        (["run", "--logprobs", "2", "hi"], 2, "--logprobs goes in the JSON output: add --json"),
        (["run", "--json", "--logprobs", "21", "hi"], 2, "--logprobs"),
    ],
)
def test_bad_input_gets_a_clear_error(args, code, words):
    out = llamaterm(*args)
    assert out.returncode == code
    assert words in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize(
    "args, stdin, words",
    [
        (["run", "-"], b"caf\xe9 au lait", "stdin is not UTF-8 text (byte 0xe9 at offset 3)"),
        (["run", "-"], bytes(range(256)), "stdin is not UTF-8 text (byte 0x80 at offset 128)"),
        (["tokenize", "-"], b"\xff\xfe", "stdin is not UTF-8 text"),
        (["run", "caf\udce9"], b"", "the prompt is not UTF-8 text (byte 0xe9 at offset 3)"),  # argv b"caf\xe9"
        (["tokenize", "\udcff"], b"", "the prompt is not UTF-8 text (byte 0xff at offset 0)"),
        (["run", "--system", "\udcff", "hi"], b"", "the text is not valid Unicode"),
        (["run", "--each-line", "--file", "{tmp}/missing.txt"], b"", "cannot read --file"),
        (["run", "--each-line", "an ignored prompt"], b"Name a fruit.\n", "not from PROMPT"),
        (["run", "--each-line", "--file", "{tmp}"], b"", "cannot read --file"),
        (["run", "--each-line", "--file", "{tmp}/latin1.txt"], b"", "latin1.txt is not UTF-8 text"),
        (["run", "--file", "{tmp}/missing.txt"], b"", "cannot read --file"),  # without --each-line: stdin was read
        (["run", "--file", "{tmp}"], b"", "cannot read --file"),
        (["run", "--file", "{tmp}/latin1.txt", "hi"], b"", "give a PROMPT or --file, not both"),
        (["run", "--seed", str(2**70), "hi"], b"", "seed must be in [0, 2**64)"),
        (["run", "--device", "bogus", "hi"], b"", "unknown device 'bogus'"),
        (["run", "--device", "cuda", "hi"], b"", "no CUDA GPU"),  # run with no GPU visible, below
        (["run", "--kv-tokens", str(10**12), "hi"], b"", "give a smaller --kv-tokens"),  # a 10 GB block list, before
    ],
)
def test_bad_input_is_one_line_not_a_traceback(tmp_path, args, stdin, words):
    (tmp_path / "latin1.txt").write_bytes("d\xe9j\xe0 vu\n".encode("latin-1"))
    args = [a.format(tmp=tmp_path) for a in args]
    out = llamaterm_capped(*args, stdin=stdin, timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    stderr = out.stderr.decode()
    assert out.returncode in (1, 2) and one_line_error(stderr), stderr
    assert words in stderr


@pytest.mark.parametrize("strict", [False, True])
def test_binary_lines_in_the_plain_chat_are_refused_and_the_chat_goes_on(strict):
    """A line that is not UTF-8 reached the tokenizer as surrogates: a TypeError traceback ended the chat. Where
    the locale decodes stdin strictly (en_US.UTF-8; C.UTF-8 does not), input() raised a UnicodeDecodeError."""
    out = subprocess.run(
        [LLAMATERM, "chat", "--plain", "--temperature", "0", "--max-tokens", "8"],
        capture_output=True,
        timeout=300,
        input=b"\xff\xfe\x00binary\nWhat is the capital of France?\n",
        env=os.environ | ({"PYTHONIOENCODING": "utf-8:strict"} if strict else {}),
    )
    stderr = out.stderr.decode()
    assert out.returncode == 0 and "Traceback" not in stderr, stderr
    assert "llamaterm: the text is not valid Unicode" in stderr
    assert "Paris" in out.stdout.decode()


def test_an_ignored_sigint_stays_ignored_while_the_engine_imports():
    """A command started with SIGINT ignored (a script's background job) must not exit on one."""
    code = (
        "import os, signal, sys\n"
        "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "class Interrupt:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'numpy.dtypes':\n"
        "            os.kill(os.getpid(), signal.SIGINT)\n"
        "sys.meta_path.insert(0, Interrupt())\n"
        "sys.argv = ['llamaterm', 'tokenize', 'Hello world']\n"
        "from llamaterm.app.__main__ import main\n"
        "main()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout) == (0, "19556 905\n"), out.stderr  # tests/data: llama.cpp's ids


def test_file_alone_is_the_prompt(tmp_path):
    (tmp_path / "question.txt").write_text("What is the capital\nof France?\n")
    out = llamaterm(
        "run", "--json", "--temperature", "0", "--max-tokens", "8", "--file", str(tmp_path / "question.txt")
    )
    assert out.returncode == 0, out.stderr
    assert "Paris" in json.loads(out.stdout)["text"]


@pytest.mark.parametrize(
    "module, args",
    [
        ("typer", ["run", "hi"]),  # the first tenth of a second: a KeyboardInterrupt traceback
        # inside numpy's extension module, which turned it into an ImportError traceback (or, a moment later,
        # swallowed it: the command ran on and exited 0)
        ("numpy.dtypes", ["run", "--max-tokens", "1", "hi"]),
        ("numpy.dtypes", ["tokenize", "hi"]),
        ("numpy.dtypes", ["info", "default"]),
    ],
)
def test_ctrl_c_while_the_command_line_loads_exits_quietly(module, args):
    """SIGINT while `module` is being imported, in the first instant of a command: now exit 130 and nothing on
    stderr, as for a Ctrl-C at any later point."""
    code = (
        "import os, signal, sys\n"
        "class Interrupt:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name == {module!r}:\n"
        "            os.kill(os.getpid(), signal.SIGINT)\n"
        "sys.meta_path.insert(0, Interrupt())\n"
        f"sys.argv = ['llamaterm', *{args!r}]\n"
        "from llamaterm.app.__main__ import main\n"
        "main()\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, preexec_fn=interruptible
    )
    assert (out.returncode, out.stderr) == (130, "")


def test_a_vanishing_temperature_answers_like_greedy():
    """--temperature 1e-45 printed an empty reply (token 0) with exit 0; its limit is the greedy reply."""
    runs = [
        llamaterm("run", "--json", "--max-tokens", "8", "--temperature", t, "--seed", "1", "What is 2+2?")
        for t in ("1e-45", "0")
    ]
    tiny, greedy = (json.loads(r.stdout) for r in runs)
    assert tiny["token_ids"] == greedy["token_ids"] and tiny["text"].strip()


def test_info_shows_the_template_the_engine_uses(tmp_path):
    """A model without a chat template showed "(none)" while the engine formats its chats as ChatML."""
    bare = write_tiny_llama(tmp_path / "bare.gguf", metadata={"tokenizer.chat_template": None})
    out = llamaterm("info", str(bare))
    assert out.returncode == 0, out.stderr
    shown = out.stdout.split("\nchat template\n", 1)[1]
    assert "ChatML" in shown and "<|im_start|>" in shown


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


def test_run_json_logprobs_on_a_local_model(tiny):
    """Greedy: each token is the likeliest of its alternatives, which come most probable first; the tokens' bytes
    spell the reply's token ids (as the tokenizer decodes them) and are the reply's text."""
    out = llamaterm(
        "run",
        "--model",
        str(tiny),
        "--raw",
        "--temperature",
        "0",
        "--max-tokens",
        "6",
        "--json",
        "--logprobs",
        "3",
        "hello",
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    content = result["logprobs"]["content"]
    assert len(content) == len(result["token_ids"]) - (result["finish_reason"] == "stop")  # a stop token is no text
    for token in content:
        top = token["top_logprobs"]
        assert len(top) == 3 and [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
        assert (top[0]["bytes"], top[0]["logprob"]) == (token["bytes"], token["logprob"]) and token["logprob"] <= 0
        assert token["token"] == bytes(token["bytes"]).decode(errors="replace") or token["token"].startswith("bytes:")
    assert b"".join(bytes(t["bytes"]) for t in content).decode(errors="replace") == result["text"]


def test_run_json_logprobs_through_a_server():
    """--server: the fake engine behind `llamaterm serve` gives its words the probabilities 0.9, 0.6, 0.3 in turn,
    the rest going to " maybe" and " perhaps"."""
    from tests.support.fake_engine import FakeEngine
    from tests.support.serve_support import app_server

    served = FakeEngine("Paris is nice.")
    with served, app_server(served) as url:
        out = llamaterm("run", "--server", url, "--json", "--logprobs", "2", "Capital of France?")
    assert out.returncode == 0, out.stderr
    content = json.loads(out.stdout)["logprobs"]["content"]
    assert [(t["token"], round(math.exp(t["logprob"]), 6)) for t in content] == [
        ("Paris", 0.9),
        (" is", 0.6),
        (" nice.", 0.3),
    ]
    assert [[(a["token"], round(math.exp(a["logprob"]), 6)) for a in t["top_logprobs"]] for t in content] == [
        [("Paris", 0.9), (" maybe", 0.05)],
        [(" is", 0.6), (" maybe", 0.2)],
        [(" maybe", 0.35), (" nice.", 0.3)],
    ]


@pytest.mark.parametrize(
    "body, code, stdout, stderr",
    [
        ("print('done', end='')\nexit_now(3)", 3, "done", ""),  # the output flushed, the code kept
        ("print('done')\nexit_now(None)", 0, "done\n", ""),
        # a thread still running: the interpreter's own exit, which waits for it
        ("threading.Thread(target=lambda: (time.sleep(0.3), print('late'))).start()\nexit_now(0)", 0, "late\n", ""),
        ("exit_now('llamaterm: no model')", 1, "", "llamaterm: no model\n"),  # a message: as sys.exit
    ],
)
def test_a_command_ends_at_once_unless_something_is_left_to_wind_down(body, code, stdout, stderr):
    """A finished command exits without the interpreter's teardown (app/__main__.py exit_now), its output and exit
    code as sys.exit gives them."""
    script = f"import threading, time\nfrom llamaterm.app.__main__ import exit_now\n{body}\n"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout, out.stderr) == (code, stdout, stderr)
