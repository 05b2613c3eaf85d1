"""A pane: one conversation's transcript, its live stats line and its own input.

The pane does what the screen asks of its session and mirrors the result in widgets; it never waits on the
engine (the screen's timer calls `pull`, which only drains what is already queued).
"""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.content import Content
from textual.reactive import reactive

from llamaterm.app.tui.session import Session
from llamaterm.app.tui.widgets.prompt_input import PromptInput
from llamaterm.app.tui.widgets.stats import PaneStats
from llamaterm.app.tui.widgets.transcript import ReplyMessage, UserMessage, message_view
from llamaterm.engine.api import EngineClient


class Transcript(VerticalScroll, can_focus=False):
    """The messages, scrolled by the mouse wheel and by PageUp / PageDown from wherever the focus is (the screen's
    keys): never focused, so Tab goes from input to input and a key typed is never lost on it."""


class ChatPane(Vertical):
    selected = reactive(True)  # receives prompts from the broadcast input
    number = reactive(1)
    closing = False  # being removed: its children may already be gone
    thinking_shown = False  # replies show their thinking unfolded

    def __init__(self, session: Session, number: int, recalled: list[str]):
        """recalled: the prompts sent before, which its input recalls (PromptInput)."""
        super().__init__()
        self.session, self.recalled = session, recalled
        self.set_reactive(ChatPane.number, number)

    def compose(self) -> ComposeResult:
        yield PaneStats(classes="pane-stats")
        with Transcript(classes="transcript"):
            yield from (message_view(m, self.thinking_shown) for m in self.session.messages)
        yield PromptInput(self.recalled, placeholder="Ask this pane…", compact=True, classes="pane-input")

    def on_mount(self) -> None:
        self.transcript.anchor()  # pinned to the bottom until the user scrolls up
        self.show_title()
        self.show_stats()

    @property
    def transcript(self) -> Transcript:
        return self.query_one(Transcript)

    @property
    def reply_view(self) -> ReplyMessage | None:
        """The last reply's view. (Just after a prompt is asked, until show_asked mounts the new one, the
        previous reply's.)"""
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
        settings = self.session.settings
        schema = f"{{}} {settings.schema_name}" if settings.json_schema else ""
        shading = "token probs" if settings.token_probabilities else ""
        parts = [f"{mark} {self.number}", self.session.title, schema, shading]
        self.border_title = Content(" · ".join(p for p in parts if p))

    def show_stats(self) -> None:
        self.query_one(PaneStats).show(self.session.stats, self.session.queued)

    def ask(self, text: str, engine: EngineClient | None) -> None:
        """Save the prompt and send it if the engine is ready (else it stays queued). No drawing here: with a
        broadcast, every pane's request reaches the engine before any pane spends time on widgets."""
        self.session.ask(text)
        if engine is not None:
            self.session.submit(engine)

    async def show_asked(self) -> None:
        """Show the prompt just asked and its reply (empty, or as far as it got meanwhile)."""
        if self.has_undrawn:  # the previous reply's last text and final form, still waiting for the budget
            await self.draw()
        await self.transcript.mount_all(message_view(m, self.thinking_shown) for m in self.session.messages[-2:])
        self.transcript.anchor()  # a new question brings the view back to the bottom
        self.show_submitted()
        self.show_title()

    def submit(self, engine: EngineClient) -> None:
        """Send a prompt that was queued while the model loaded."""
        self.session.submit(engine)
        self.show_submitted()

    def show_submitted(self) -> None:
        self.session.refresh_stats()  # prompt and cached tokens are known at once
        self.show_stats()

    def toggle_thinking(self) -> None:
        """Show or fold the thinking of every reply in the pane (and of those to come)."""
        self.thinking_shown = not self.thinking_shown
        for view in self.transcript.query_children(ReplyMessage):
            view.show_thinking(self.thinking_shown)

    def pull(self) -> None:
        """Take what the engine produced since the last tick into the session (cheap: no drawing)."""
        self.session.poll()

    @property
    def has_undrawn(self) -> bool:
        view = self.reply_view
        return view is not None and view.lagging

    async def draw(self) -> None:
        """The reply's new text in one batch; its final form once it ended (refused and stopped ones too)."""
        view = self.reply_view
        assert view is not None  # the screen draws only panes with undrawn text, which have a reply view
        ending = view.message.finish_reason is not None
        await view.draw()
        if ending:
            self.show_stats()

    async def show_session(self, session: Session) -> None:
        """Show another conversation (a cleared pane, a reopened one)."""
        self.session.close()
        self.session = session
        await self.transcript.remove_children()
        await self.transcript.mount_all(message_view(m, self.thinking_shown) for m in session.messages)
        self.transcript.anchor()
        self.show_title()
        self.show_stats()

    async def drop_forgotten(self) -> None:
        """Remove the views of messages the session rewound."""
        kept = set(map(id, self.session.messages))
        # the transcript holds only message views (message_view)
        views = [w for w in self.transcript.children if isinstance(w, UserMessage | ReplyMessage)]
        await self.transcript.remove_children([w for w in views if id(w.message) not in kept])
