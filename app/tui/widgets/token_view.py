"""A reply shown as its tokens, each shaded by its probability (the pane's "Token probs" setting), with a cursor
that moves from token to token and a panel listing the alternatives of the token under it.

Drawing stays cheap on long replies: the tokens are laid out in paragraphs (a new one at the first line end after
PARAGRAPH_TOKENS tokens), and new tokens or a cursor move redraw only the paragraphs they touch.
"""

from __future__ import annotations

from bisect import bisect_right

from textual import events
from textual.app import ComposeResult
from textual.binding import Binding
from textual.content import Content, Span
from textual.message import Message
from textual.widgets import Static

from llamaterm.app.logprobs import ShownToken
from llamaterm.app.tui.widgets.transcript import ReplyMessage

SHADES = 8  # steps of shading, so that tokens share a few styles
PARAGRAPH_TOKENS = 64  # a paragraph's least tokens: few widgets, each quick to redraw
CURSOR = "reverse"


def shade(probability: float) -> str:
    """The less likely a token was, the deeper its background: none for a certain token, full red for one the
    model thought impossible."""
    step = round((1 - probability) * SHADES)
    return f"on rgba(255,64,32,{0.7 * step / SHADES:.3f})" if step else ""


def percent(probability: float) -> str:
    return f"{100 * probability:.2f}%" if probability >= 0.0001 else "<0.01%"


def alternatives_text(tokens: list[ShownToken], index: int) -> str:
    token = tokens[index]
    lines = [f"token {index + 1} of {len(tokens)}: {shown(token.text)}  {percent(token.probability)}"]
    lines += [f"  {percent(p):>7}  {shown(text)}" for text, p in token.alternatives]
    return "\n".join(lines)


def shown(text: str) -> str:
    """A token's text with its spaces and line ends visible, as a quoted string."""
    return '"' + text.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t").replace('"', '\\"') + '"'


class TokenParagraph(Static):
    """Tokens start..end of the reply, drawn with their shading (and the cursor, where it is)."""

    def __init__(self, start: int):
        super().__init__(classes="token-paragraph")
        self.start = self.end = start

    def draw(self, tokens: list[ShownToken], end: int, cursor: int | None) -> None:
        self.end = end
        text, spans, at = [], [], 0
        for i in range(self.start, end):
            piece = tokens[i].text
            style = CURSOR if i == cursor else shade(tokens[i].probability)
            if style and piece:
                spans.append(Span(at, at + len(piece), style))
            text.append(piece)
            at += len(piece)
        self.update(Content("".join(text), spans=spans))


class ShadedReply(ReplyMessage):
    """A reply whose tokens came with their probabilities. Entered (F7, or a click), ←/→ move the cursor,
    Home/End go to the first/last token, Esc leaves. Focusable only while entered: Tab goes from input to input."""

    can_focus = False
    BINDINGS = [
        Binding("left", "move(-1)", "Previous token", show=False),
        Binding("right", "move(1)", "Next token", show=False),
        Binding("home", "move_to(0)", "First token", show=False),
        Binding("end", "move_to(-1)", "Last token", show=False),
        Binding("escape", "leave", "Leave", show=False),
    ]

    class Left(Message):
        """Esc: the user is done with the tokens; the screen gives the focus back to the pane's input."""

        def __init__(self, view: ShadedReply):
            super().__init__()
            self.view = view

    def __init__(self, message, thinking_shown: bool = False):
        super().__init__(message, thinking_shown)
        self.drawn = 0  # tokens the paragraphs hold
        self.cursor: int | None = None  # while focused

    @property
    def tokens(self) -> list[ShownToken]:
        assert self.message.tokens is not None  # message_view makes this view for such replies only
        return self.message.tokens

    def compose(self) -> ComposeResult:
        yield TokenParagraph(0)
        panel = Static("", classes="alternatives", markup=False)
        panel.display = False
        yield panel
        note = Static(self._note(), classes="note", markup=False)
        note.display = bool(self._note())
        yield note

    async def on_mount(self) -> None:
        await self.draw_tokens()

    @property
    def paragraphs(self) -> list[TokenParagraph]:
        return list(self.query_children(TokenParagraph))

    @property
    def lagging(self) -> bool:
        return self.drawn < len(self.tokens) or (self.message.finish_reason is not None and not self.finished)

    async def draw(self) -> None:
        if not self.is_mounted:  # as ReplyMessage.draw: its paragraphs are made as it mounts
            return
        await self.draw_tokens()
        if self.message.finish_reason is not None and not self.finished:
            self.finished = True
            if not self.tokens and self.message.content:  # a server that gave no logprobs: the text, unshaded
                self.paragraphs[-1].update(Content(self.message.content))
            note = self.query_one(".note", Static)
            note.update(self._note())
            note.display = bool(self._note())

    async def draw_tokens(self) -> None:
        """Draw the tokens that arrived since the last draw: into the last paragraph, and new ones after line ends."""
        tokens, paragraphs = self.tokens, self.paragraphs
        last = paragraphs[-1]
        start = self.drawn
        for i in range(start, len(tokens)):
            if tokens[i].text.endswith("\n") and i + 1 - last.start >= PARAGRAPH_TOKENS and i + 1 < len(tokens):
                last.draw(tokens, i + 1, self.cursor)
                last = TokenParagraph(i + 1)
                await self.mount(last, before=self.query_one(".alternatives"))
        last.draw(tokens, len(tokens), self.cursor)
        self.drawn = len(tokens)

    def show_thinking(self, shown: bool) -> None:
        self.thinking_shown = shown  # the tokens show the thinking as they show the rest

    def on_click(self, event: events.Click) -> None:
        self.enter()

    def enter(self) -> None:
        self.can_focus = True
        self.focus()

    def on_focus(self) -> None:
        if self.tokens:
            self.move_cursor(len(self.tokens) - 1 if self.cursor is None else self.cursor)

    def on_blur(self) -> None:
        self.can_focus = False
        old, self.cursor = self.cursor, None
        if old is not None:
            self.redraw_at(old)
        self.query_one(".alternatives", Static).display = False

    def action_move(self, step: int) -> None:
        if self.cursor is not None:
            self.move_cursor(max(0, min(len(self.tokens) - 1, self.cursor + step)))

    def action_move_to(self, index: int) -> None:
        if self.tokens:
            self.move_cursor(index % len(self.tokens))

    def action_leave(self) -> None:
        self.post_message(self.Left(self))

    def move_cursor(self, index: int) -> None:
        old, self.cursor = self.cursor, index
        if old is not None and old != index:
            self.redraw_at(old)
        paragraph = self.redraw_at(index)
        panel = self.query_one(".alternatives", Static)
        panel.update(alternatives_text(self.tokens, index))
        panel.display = True
        paragraph.scroll_visible()

    def redraw_at(self, index: int) -> TokenParagraph:
        """Redraw the paragraph that holds token `index` (drawn already), with the cursor where it is now."""
        paragraphs = self.paragraphs
        paragraph = paragraphs[bisect_right([p.start for p in paragraphs], index) - 1]
        paragraph.draw(self.tokens, paragraph.end, self.cursor)
        return paragraph
