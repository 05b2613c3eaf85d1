"""Thinking in replies: models such as Qwen3 and the DeepSeek-R1 distills reason first, between <think> and
</think>, then answer. Where the chat template opens the block itself (the R1 distills, QwQ), the engine starts
the reply's text with the tag (engine/serving/output_processor.py), so every reply that thinks opens with it.

ThinkingSplitter parts a reply into its thinking and its answer as the text streams in, for the reply reader
(engine/reply_reader.py) that fills each event's thinking and answer. gpt-oss thinks in harmony's analysis channel
instead (engine/harmony.py): a reply that opens with a channel is read as harmony's, so the same splitter serves
both, on the engine's text and on a remote server's alike.
"""

from llamaterm.engine.harmony import CHANNEL, HarmonySplitter

OPEN, CLOSE = "<think>", "</think>"


def opens_thinking(prompt_tail: str) -> bool:
    """Whether a prompt (its last text) leaves a thinking block open for the reply, as llama.cpp's server decides
    it: the rendered prompt ends with the opening tag."""
    return prompt_tail.rstrip().endswith(OPEN)


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (a tag split across deltas)."""
    return next((n for n in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:n])), 0)


def split_reply(text: str) -> tuple[str, str]:
    """A whole reply's (thinking, answer)."""
    split = ThinkingSplitter()
    parts = split.push(text), split.finish()
    return parts[0][0] + parts[1][0], parts[0][1] + parts[1][1]


class ThinkingSplitter:
    """Feed a reply's text deltas to push(); each call returns (new thinking text, new answer text). A reply thinks
    when it opens with <think> (after any whitespace); in such a reply the whitespace that starts each part is
    dropped. Text that may be the start of a tag waits for the next delta (or finish). A reply that opens with
    harmony's <|channel|> goes to a HarmonySplitter, whose state and thinks this one then shows."""

    def __init__(self) -> None:
        self.state = "start"  # -> "thinking" -> "answer", or "start" -> "answer"
        self.held = ""  # text not given out yet
        self.thinks = False  # the reply opened a thinking block
        self.started = False  # the current part has given out text
        self.harmony: HarmonySplitter | None = None

    def push(self, delta: str) -> tuple[str, str]:
        if self.harmony is not None:
            return self._harmony(self.harmony.push(delta))
        self.held += delta
        thinking = answer = ""
        if self.state == "start":
            body = self.held.lstrip()
            if body.startswith(CHANNEL):
                self.harmony, self.held = HarmonySplitter(), ""
                return self._harmony(self.harmony.push(body))
            if body.startswith(OPEN):
                self.state, self.thinks, self.held = "thinking", True, body[len(OPEN) :]
            elif not body or OPEN.startswith(body) or CHANNEL.startswith(body):
                return "", ""  # whitespace, or a tag's first characters: not known yet
            else:
                self.state = "answer"
        if self.state == "thinking":
            end = self.held.find(CLOSE)
            if end >= 0:
                thinking, self.held = self._give(self.held[:end]), self.held[end + len(CLOSE) :]
                self.state, self.started = "answer", False
            else:
                cut = len(self.held) - _partial_tag(self.held, CLOSE)
                thinking, self.held = self._give(self.held[:cut]), self.held[cut:]
        if self.state == "answer":
            answer, self.held = self._give(self.held), ""
        return thinking, answer

    def finish(self) -> tuple[str, str]:
        """The end of the reply: what was held back, in the part it belongs to."""
        if self.harmony is not None:
            return self._harmony(self.harmony.finish())
        held, self.held = self.held, ""
        return (self._give(held), "") if self.state == "thinking" else ("", held)

    def _harmony(self, parts: tuple[str, str]) -> tuple[str, str]:
        assert self.harmony is not None
        self.state, self.thinks = self.harmony.state, self.harmony.thinks
        return parts

    def _give(self, text: str) -> str:
        if self.thinks and not self.started:
            text = text.lstrip()
        self.started = self.started or bool(text)
        return text
