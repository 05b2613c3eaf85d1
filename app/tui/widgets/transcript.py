"""The messages of a conversation as shown in a pane: the user's as plain text, replies as streaming Markdown, a
reply's thinking (<think>...</think>, as the engine parts it: Event.thinking) dimmed and folded to one line until
it is shown."""

from __future__ import annotations

from markdown_it import MarkdownIt
from textual import events
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import Markdown, Static
from textual.widgets.markdown import MarkdownBlock, MarkdownFence, MarkdownStream

from llamaterm.app.tui.session import ChatMessage

NOTES: dict[str | None, str] = {"cancelled": "⏹ stopped", "length": "… max tokens reached"}


class CopyRequested(Message):
    """A click on a message or one of its code blocks: copy that text."""

    def __init__(self, text: str, what: str):
        super().__init__()
        self.text, self.what = text, what


class UserMessage(Static):
    def __init__(self, message: ChatMessage):
        super().__init__(message.content, markup=False)
        self.message = message

    def on_click(self) -> None:
        self.post_message(CopyRequested(self.message.content, "message"))


class ReplyMessage(Vertical):
    """Text arrives in batches through a MarkdownStream, which re-parses only the last block. When the reply
    ends, the document is rendered in full wherever the streamed blocks differ from a full parse; where they
    match, re-rendering would cost a long reply a visible stall (every block rebuilt) for the same result.
    The thinking (the message's, as the engine parted it) is a dimmed line above the answer: folded, its length;
    shown, its text."""

    def __init__(self, message: ChatMessage, thinking_shown: bool = False):
        super().__init__()
        self.message = message
        self.thinking_shown = thinking_shown
        self.shown = len(message.answer)  # how much of the message's answer the view holds; the rest is to draw
        self.finished = message.finish_reason is not None  # drawn in its final form
        self._stream: MarkdownStream | None = None

    @property
    def answer(self) -> str:
        """The answer as far as the view holds it."""
        return self.message.answer[: self.shown]

    def compose(self) -> ComposeResult:
        thinking = Static(self._thinking_text(), classes="thinking", markup=False)
        thinking.display = bool(self.message.thinking)
        yield thinking
        yield Markdown(self.answer)
        note = Static(self._note(), classes="note", markup=False)
        note.display = bool(self._note())
        yield note

    def _thinking_text(self) -> str:
        message = self.message
        state = "Thinking…" if message.finish_reason is None and not message.answer else "Thought"
        if not self.thinking_shown:
            return f"▸ {state} ({len(message.thinking.split())} words) · F3 shows"
        return f"▾ {state} · F3 folds\n{message.thinking.strip()}"

    def show_thinking(self, shown: bool) -> None:
        self.thinking_shown = shown
        self._draw_thinking()

    def _draw_thinking(self) -> None:
        view = self.query_one(".thinking", Static)
        view.display = bool(self.message.thinking)
        if view.display:
            view.update(self._thinking_text())

    @property
    def lagging(self) -> bool:
        """Whether the message has text, or an end, that the view does not show yet."""
        return self.shown < len(self.message.answer) or (self.message.finish_reason is not None and not self.finished)

    async def draw_new_text(self) -> None:
        """Append, in one batch, all the answer the message gained since the last draw, and its thinking's."""
        self._draw_thinking()
        text = self.message.answer[self.shown :]
        self.shown += len(text)
        if not text:
            return
        if self._stream is None:
            self._stream = Markdown.get_stream(self.query_one(Markdown))
        await self._stream.write(text)

    async def draw(self) -> None:
        """Catch up with the message: its new text in one batch, then its final form if it ended. Not before the
        view is mounted (its Markdown is made then, and a busy machine may tick the screen first): the text waits
        for the next tick."""
        if not self.is_mounted:
            return
        await self.draw_new_text()
        if self.message.finish_reason is not None and not self.finished:
            await self.finish()

    async def finish(self) -> None:
        self.finished = True
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
        self.shown = len(self.message.answer)
        self._draw_thinking()
        markdown = self.query_one(Markdown)
        if markdown.source != self.answer or not streamed_blocks_match(markdown):
            await markdown.update(self.answer)
        note = self.query_one(".note", Static)
        note.update(self._note())
        note.display = bool(self._note())

    def code_blocks(self) -> list[str]:
        return [fence.code for fence in self.query(MarkdownFence)]

    def on_click(self, event: events.Click) -> None:
        widget = event.widget
        assert widget is not None  # a click reaching this view was on one of its widgets
        fence = next((w for w in widget.ancestors_with_self if isinstance(w, MarkdownFence)), None)
        if fence is not None:
            self.post_message(CopyRequested(fence.code, "code block"))
        elif widget.has_class("thinking"):
            self.show_thinking(not self.thinking_shown)
        else:
            self.post_message(CopyRequested(self.answer, "reply"))

    def _note(self) -> str:
        if self.message.error:
            return f"⚠ {self.message.error}"
        return NOTES.get(self.message.finish_reason, "")


def streamed_blocks_match(markdown: Markdown) -> bool:
    """Whether the top-level blocks built while streaming are those a full parse of the source gives: same
    widget types over the same source lines. (A block stops changing once the next one starts.)"""
    expected = []
    for token in MarkdownIt("gfm-like").parse(markdown.source):
        key = token.tag if token.type == "heading_open" else token.type
        if token.level == 0 and token.map and key in markdown.BLOCKS:
            expected.append((markdown.get_block_class(key), tuple(token.map)))
    actual = [(type(block), tuple(block.source_range)) for block in markdown.query_children(MarkdownBlock)]
    return actual == expected


def message_view(message: ChatMessage, thinking_shown: bool = False) -> UserMessage | ReplyMessage:
    """A reply that came with its tokens' probabilities is shown as its shaded tokens."""
    from llamaterm.app.tui.widgets.token_view import ShadedReply  # which imports this module

    if message.role == "user":
        return UserMessage(message)
    return ReplyMessage(message, thinking_shown) if message.tokens is None else ShadedReply(message, thinking_shown)
