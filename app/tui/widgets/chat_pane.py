"""A pane: one conversation's transcript, its live stats line and its own input.

The pane does what the screen asks of its session and mirrors the result in widgets; it never waits on the
engine (the screen's timer calls `pull`, which only drains what is already queued).
"""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.content import Content
from textual.reactive import reactive
from textual.widgets import Input

from app.tui.session import Session
from app.tui.widgets.stats import PaneStats
from app.tui.widgets.transcript import ReplyMessage, message_view


class ChatPane(Vertical):
    selected = reactive(True)  # receives prompts from the broadcast input
    number = reactive(1)

    def __init__(self, session: Session, number: int):
        super().__init__()
        self.session = session
        self.set_reactive(ChatPane.number, number)
        self.undrawn: list[str] = []  # text taken from the engine, not drawn yet
        self.ended = False  # the reply ended; its final render is not drawn yet

    def compose(self) -> ComposeResult:
        yield PaneStats(classes="pane-stats")
        with VerticalScroll(classes="transcript"):
            yield from map(message_view, self.session.messages)
        yield Input(placeholder="Ask this pane…", compact=True, classes="pane-input")

    def on_mount(self) -> None:
        self.transcript.anchor()  # pinned to the bottom until the user scrolls up
        self.show_title()
        self.show_stats()

    @property
    def transcript(self) -> VerticalScroll:
        return self.query_one(".transcript", VerticalScroll)

    @property
    def reply_view(self) -> ReplyMessage | None:
        replies = self.transcript.query_children(ReplyMessage)
        return replies.last() if replies else None

    def on_unmount(self) -> None:
        self.session.close()  # the pane was closed, or the app quits

    def watch_selected(self) -> None:
        self.show_title()

    def watch_number(self) -> None:
        self.show_title()

    def show_title(self) -> None:
        mark = "◉" if self.selected else "○"
        self.border_title = Content(f"{mark} {self.number} · {self.session.title}")

    def show_stats(self) -> None:
        self.query_one(PaneStats).show(self.session.stats, self.session.queued)

    async def ask(self, text: str, engine) -> None:
        """Show the prompt and an empty reply, and submit it if the engine is ready (else it stays queued)."""
        prompt, reply = self.session.ask(text)
        await self.transcript.mount_all([message_view(prompt), message_view(reply)])
        self.transcript.anchor()  # a new question brings the view back to the bottom
        if engine is not None:
            await self.submit(engine)
        self.show_title()
        self.show_stats()

    async def submit(self, engine) -> None:
        self.session.submit(engine)
        if not self.session.busy:  # refused by the engine: show why
            await self.reply_view.finish()

    def pull(self) -> None:
        """Take what the engine produced since the last tick (cheap: no drawing)."""
        text, finished = self.session.poll()
        if text:
            self.undrawn.append(text)
        self.ended = self.ended or finished

    @property
    def has_undrawn(self) -> bool:
        return bool(self.undrawn) or self.ended

    async def draw(self) -> None:
        """Append the text pulled since the last draw in one batch; render the reply in full once it ended."""
        view = self.reply_view
        if self.undrawn:
            text, self.undrawn = "".join(self.undrawn), []
            await view.append(text)
        if self.ended:
            self.ended = False
            await view.finish()
            self.show_stats()

    async def stop(self) -> None:
        was_queued = self.session.queued
        self.session.stop()
        if was_queued:  # never reached the engine: it ends here, not in `pull`
            await self.reply_view.finish()
            self.show_stats()

    async def show_session(self, session: Session) -> None:
        """Show another conversation (a cleared pane, a reopened one)."""
        self.session.close()
        self.session = session
        self.undrawn, self.ended = [], False
        await self.transcript.remove_children()
        await self.transcript.mount_all(map(message_view, session.messages))
        self.transcript.anchor()
        self.show_title()
        self.show_stats()

    async def drop_forgotten(self) -> None:
        """Remove the views of messages the session rewound."""
        self.undrawn, self.ended = [], False
        kept = set(map(id, self.session.messages))
        await self.transcript.remove_children([w for w in self.transcript.children if id(w.message) not in kept])
