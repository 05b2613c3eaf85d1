"""A reply's text read as it streams, into the typed pieces its Event carries (engine/api.py): its content as
OpenAI's message has it, less its tool calls (tool_calls.py); the calls' pieces; and that content parted into
thinking and answer (thinking.py). One reader a request, wherever a reply's text arrives: the output processor
(engine/serving/output_processor.py) for the engine in this process and the engine process alike, a remote
server's stream (app/remote.py). Its callers read the fields and parse no text. Text work only: no torch."""

from __future__ import annotations

from typing import NamedTuple, Protocol

from llamaterm.engine import harmony
from llamaterm.engine.api import SubmitOptions, ToolCallDelta
from llamaterm.engine.checkpoints.chat_template import ChatTemplate
from llamaterm.engine.thinking import ThinkingSplitter
from llamaterm.engine.tool_calls import HARMONY, ToolCallStream


class ReplyPiece(NamedTuple):
    """What one more text of the reply adds to each reading: Event's fields of the same names."""

    content: str
    thinking: str
    answer: str
    tool_calls: tuple[ToolCallDelta, ...]


class ReplyReader:
    """push() takes the next text of the reply and gives the piece it adds; final=True at the reply's end gives
    what was held back (text that may be the start of a tag or a call). family: the syntax of calls to read
    (engine/tool_calls.py), read_calls=False to read harmony's channels only; None: the reply is text, its
    thinking (a <think> block, or harmony's channels where a remote server's text opens with one) split off."""

    def __init__(self, family: str | None = None, read_calls: bool = True):
        self.calls = None if family is None else ToolCallStream(family, read_calls)
        self.split = ThinkingSplitter()

    def push(self, text: str, final: bool = False) -> ReplyPiece:
        content, calls = (text, []) if self.calls is None else self.calls.push(text, final)
        parts = [self.split.push(content)] + ([self.split.finish()] if final else [])
        thinking, answer = ("".join(p[i] for p in parts) for i in (0, 1))
        return ReplyPiece(content, thinking, answer, tuple(calls))


class Templated(Protocol):
    """A tokenizer, as far as a reader asks: its model's chat template."""

    @property
    def chat_template(self) -> ChatTemplate: ...


def reader_for(tokenizer: Templated, options: SubmitOptions) -> ReplyReader:
    """A request's reader: calls in the family its options name; else, for a chat prompt of gpt-oss's template, its
    reply's channels (the content carries the thinking as a <think> block, the form `serve` gives every model's);
    else text. (A raw prompt's or token ids' reply is text: the template is read for chat prompts only.)"""
    family = options.get("tool_calls")
    chat = not options.get("raw") and options.get("prompt_ids") is None
    if family is None and chat and harmony.speaks_harmony(tokenizer.chat_template.source):
        return ReplyReader(HARMONY, read_calls=False)
    return ReplyReader(family)
