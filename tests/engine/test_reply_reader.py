"""The reply reader the output processor runs per request (engine/reply_reader.py): whether a reply's text comes a
character at a time, token by token or all at once, its pieces add up to the same thinking, answer, content and
calls."""

from types import SimpleNamespace

import pytest

from llamaterm.engine.api import SubmitOptions, whole_calls
from llamaterm.engine.checkpoints.chat_template import CHATML_TEMPLATE, ChatTemplate
from llamaterm.engine.checkpoints.tokenizer import Tokenizer
from llamaterm.engine.reply_reader import ReplyReader, reader_for
from llamaterm.engine.tool_calls import HARMONY, HERMES
from tests.support.tokenizer_files import QWEN3_FILES

THINKING = "<think>\nThe user says hi.\nGreet back.\n</think>\n\nHello!"
HARMONY_REPLY = (
    "<|channel|>analysis<|message|>The user says hi.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Hello!<|return|>"
)
HERMES_CALL = (
    '<think>\nWeather.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)
HARMONY_CALL = (
    "<|channel|>analysis<|message|>Weather.<|end|>"
    '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
)
# (reply, family, read_calls, its thinking, its answer, its content, its calls)
CASES = {
    "thinking block": (THINKING, None, True, "The user says hi.\nGreet back.\n", "Hello!", THINKING, []),
    "harmony reply": (
        HARMONY_REPLY,
        HARMONY,
        False,
        "The user says hi.",
        "Hello!",
        "<think>The user says hi.</think>Hello!",
        [],
    ),
    "hermes call": (
        HERMES_CALL,
        HERMES,
        True,
        "Weather.\n",
        "",
        "<think>\nWeather.\n</think>",
        [("get_weather", '{"city": "Paris"}')],
    ),
    "harmony call": (
        HARMONY_CALL,
        HARMONY,
        True,
        "Weather.",
        "",
        "<think>Weather.</think>",
        [("get_weather", '{"city": "Paris"}')],
    ),
}


def read(family: str | None, read_calls: bool, pieces: list[str]) -> tuple[str, str, str, list[tuple[str, str]]]:
    """The pieces through one reader, the last push final: (thinking, answer, content, [(name, arguments)])."""
    reader, got = ReplyReader(family, read_calls), []
    for i, text in enumerate(pieces):
        got.append(reader.push(text, final=i == len(pieces) - 1))
    calls = whole_calls([d for piece in got for d in piece.tool_calls])
    thinking, answer, content = ("".join(getattr(p, field) for p in got) for field in ("thinking", "answer", "content"))
    return thinking, answer, content, [(c.name, c.arguments) for c in calls]


@pytest.mark.parametrize("name", CASES)
def test_a_reply_reads_the_same_a_character_a_token_or_all_at_once(name):
    reply, family, read_calls, *want = CASES[name]
    tokenizer = Tokenizer.from_hf_dir(QWEN3_FILES)
    tokens = [tokenizer.decode([t]) for t in tokenizer.encode(reply)]
    assert "".join(tokens) == reply
    assert read(family, read_calls, [reply]) == tuple(want)
    assert read(family, read_calls, [*reply, ""]) == tuple(want)
    assert read(family, read_calls, [*tokens, ""]) == tuple(want)


def test_a_request_is_read_as_its_options_and_its_template_say():
    chatml = SimpleNamespace(chat_template=ChatTemplate(CHATML_TEMPLATE))
    harmony = SimpleNamespace(chat_template=ChatTemplate("{{ '<|channel|>' }}"))

    def family(tokenizer, **options: SubmitOptions) -> tuple[str | None, bool] | None:
        calls = reader_for(tokenizer, options).calls
        return None if calls is None else (calls.family, calls.read_calls)

    assert family(chatml) is None
    assert family(chatml, tool_calls=HERMES) == (HERMES, True)
    assert family(harmony) == (HARMONY, False)  # a chat reply's channels, without tools
    assert family(harmony, raw=True) is None  # a completion's text is text
    assert family(SimpleNamespace(), prompt_ids=[1, 2]) is None  # token ids: the template is not read
    assert family(harmony, tool_calls=HARMONY) == (HARMONY, True)
