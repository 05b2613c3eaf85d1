"""Replies that think (<think>...</think>, Qwen3 and the DeepSeek-R1 distills): the split into thinking and
answer, the chat template's thinking switch through every engine, and `llamaterm run`'s two streams. The oracle for
the switch is the real Qwen3 template (tests/data/qwen3-0.6b.jinja) rendered by transformers."""

import json
from pathlib import Path

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from llamaterm.app import cli
from llamaterm.app.remote import request_body
from llamaterm.app.server.requests import parse_request
from llamaterm.engine.api import EngineConfig
from llamaterm.engine.checkpoints.sampling_defaults import LLAMA_CPP_DEFAULTS
from llamaterm.engine.sampling_params import SamplingParams
from llamaterm.engine.serving.engine import Engine
from llamaterm.engine.thinking import ThinkingSplitter, split_reply
from tests.support import DATA
from tests.support.cli import llamaterm
from tests.support.fake_engine import FakeEngine
from tests.support.family_oracle import save_tiny_qwen3

QWEN3_TEMPLATE = (DATA / "qwen3-0.6b.jinja").read_text(encoding="utf-8")
REPLY = "<think>\nThe user says hi.\nGreet back.\n</think>\n\nHello!"


def split_stream(deltas: list[str]) -> tuple[str, str]:
    split, thinking, answer = ThinkingSplitter(), "", ""
    for d in [*deltas, None]:
        t, a = split.finish() if d is None else split.push(d)
        thinking, answer = thinking + t, answer + a
    return thinking, answer


@pytest.mark.parametrize(
    "reply, thinking, answer",
    [
        (REPLY, "The user says hi.\nGreet back.\n", "Hello!"),
        ("  <think>x</think>y", "x", "y"),
        ("<think>\n\n</think>\n\nHi", "", "Hi"),  # what Qwen3 writes with thinking off
        ("<think>still thinking", "still thinking", ""),  # stopped before </think>
        ("Hello <think> world", "", "Hello <think> world"),  # a tag not at the start is text
        (" Hi\n", "", " Hi\n"),  # a reply that does not think is untouched
        ("<thi", "", "<thi"),
    ],
)
def test_split_whole_and_streamed_in_every_cut(reply, thinking, answer):
    assert split_reply(reply) == (thinking, answer)
    for cut in range(1, len(reply)):  # tags split across deltas
        assert split_stream([reply[:cut], reply[cut:]]) == (thinking, answer), cut
    assert split_stream(list(reply)) == (thinking, answer)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> Path:
    """A tiny Qwen3 with a tokenizer holding <think> and </think> and the real Qwen3 chat template."""
    folder = tmp_path_factory.mktemp("qwen3") / "tiny-qwen3"
    return save_tiny_qwen3(folder, ["<think>", "</think>", "<|im_start|>", "<|im_end|>"], 256)


@pytest.fixture(scope="module")
def engine(qwen3_dir):
    e = Engine.from_model(EngineConfig(model=str(qwen3_dir), device="cpu", kv_tokens=512))
    yield e
    e.shutdown()


CHAT = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("switch", [None, True, False])
def test_the_thinking_switch_renders_the_template_as_transformers_does(engine, switch):
    extra = {} if switch is None else {"enable_thinking": switch}
    want, _ = render_jinja_template(
        conversations=[CHAT], chat_template=QWEN3_TEMPLATE, add_generation_prompt=True, **extra
    )
    assert engine.tokenizer.apply_chat_template(CHAT, enable_thinking=switch) == want[0]
    assert want[0].endswith("<think>\n\n</think>\n\n") == (switch is False)
    ids = engine.encode_prompt(CHAT, enable_thinking=switch)
    assert ids == engine.tokenizer.encode(want[0], add_special=False, parse_special=True)


def test_a_template_that_opens_the_block_starts_the_reply_with_the_tag(qwen3_dir, tmp_path):
    """DeepSeek-R1 distills and QwQ end the prompt with <think>: the reply's text then opens with the tag, as a
    reply of Qwen3 does, so every consumer splits it the same way (the token ids stay the model's)."""
    folder = tmp_path / "r1-like"
    folder.mkdir()
    for f in qwen3_dir.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    template = "{% for m in messages %}<|im_start|>{{ m.content }}{% endfor %}<|im_start|><think>\n"
    config = json.loads((folder / "tokenizer_config.json").read_text()) | {"chat_template": template}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with Engine.from_model(EngineConfig(model=str(folder), device="cpu", kv_tokens=512)) as e:
        text, handle = e.generate(CHAT, SamplingParams(max_tokens=3, ignore_eos=True))
        assert text == "<think>" + e.tokenizer.decode(handle.token_ids)
        raw, handle = e.generate("<think>", SamplingParams(max_tokens=3, ignore_eos=True), raw=True)
        assert raw == e.tokenizer.decode(handle.token_ids)  # a raw prompt is the caller's: nothing added
        # with tools (the server's path): the engine renders them, and the reply opens with the tag as well
        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        handle = e.submit(CHAT, SamplingParams(max_tokens=3, ignore_eos=True), tools=[tool])
        text = "".join(event.text for event in handle.events())
        assert text == "<think>" + e.tokenizer.decode(handle.token_ids)


def test_the_switch_reaches_every_engine_and_server():
    fake = FakeEngine()
    fake.submit(CHAT, enable_thinking=False)
    assert fake.thinking_switches == [False]
    body = {"model": "m", "messages": CHAT, "chat_template_kwargs": {"enable_thinking": False}}
    parse = lambda body: parse_request(body, "m", 4096, True, LLAMA_CPP_DEFAULTS)
    assert parse(body).enable_thinking is False
    assert parse(body | {"chat_template_kwargs": None}).enable_thinking is None
    _, sent = request_body("m", CHAT, SamplingParams(), raw=False, enable_thinking=True)
    assert sent["chat_template_kwargs"] == {"enable_thinking": True}
    _, sent = request_body("m", CHAT, SamplingParams(), raw=False)
    assert "chat_template_kwargs" not in sent  # strict servers see only what they know


@pytest.mark.parametrize("hide", [False, True])
def test_run_streams_the_answer_to_stdout_and_the_thinking_to_stderr(capsys, hide):
    handle = FakeEngine(REPLY).submit(CHAT)
    reply = cli.collect(handle, echo=True, hide_thinking=hide)
    out, err = capsys.readouterr()
    assert out == "Hello!\n" and reply.text == "Hello!"
    assert err == ("" if hide else "The user says hi.\nGreet back.\n\n")
    assert reply.thinking == (None if hide else "The user says hi.\nGreet back.\n")


def test_run_prints_gpt_oss_analysis_as_thinking(capsys):
    """A harmony reply (gpt-oss) thinks in its analysis channel: the same two streams."""
    reply = "<|channel|>analysis<|message|>The user says hi.<|end|><|start|>assistant<|channel|>final<|message|>Hello!"
    result = cli.collect(FakeEngine(reply).submit(CHAT), echo=True)
    out, err = capsys.readouterr()
    assert (out, err) == ("Hello!\n", "The user says hi.\n") and result.thinking == "The user says hi."


@pytest.mark.slow
def test_run_flags(qwen3_dir):
    """--no-think switches the template (its prompt then holds the empty thinking block), --json has the parts."""

    def run(*flags) -> dict:
        out = llamaterm("run", "--model", str(qwen3_dir), "--json", "--max-tokens", "2", *flags, "Hi")
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    default, on, off = run(), run("--think"), run("--no-think")
    assert default["prompt_tokens"] == on["prompt_tokens"] < off["prompt_tokens"]
    assert set(default) >= {"text", "thinking"}
