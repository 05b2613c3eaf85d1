"""The main screen: 1 to 8 panes in columns or a grid, the broadcast input and the engines' status bar.

Each pane's settings name its backend (a local model or a server's); the screen holds one engine per backend the
panes use, loads a new one when a pane moves to it and shuts down one that no pane uses any more.

One timer connects it to the engine without blocking either side: TICK_HZ times a second it drains every
streaming pane's events (cheap), then, when the render budget allows, draws each pane's new text in one batch
and, STATS_HZ times a second, the engine's stats for the panes and the status bar. Nothing here waits on the
engine, and the engine never waits on the UI.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, ClassVar, cast

from textual import on
from textual.app import ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import Grid
from textual.events import DescendantFocus
from textual.screen import Screen
from textual.widgets import Footer

from llamaterm.app.history import History, export_file
from llamaterm.app.tui import clipboard
from llamaterm.app.tui.backends import Backend
from llamaterm.app.tui.budget import RenderBudget
from llamaterm.app.tui.screens.help import HelpScreen
from llamaterm.app.tui.screens.history import HistoryScreen
from llamaterm.app.tui.screens.settings import SettingsScreen
from llamaterm.app.tui.screens.text_prompt import TextPromptScreen
from llamaterm.app.tui.session import Session
from llamaterm.app.tui.widgets.chat_pane import ChatPane
from llamaterm.app.tui.widgets.prompt_input import PromptInput, prompt_text
from llamaterm.app.tui.widgets.stats import StatusBar
from llamaterm.app.tui.widgets.token_view import ShadedReply
from llamaterm.app.tui.widgets.transcript import CopyRequested
from llamaterm.engine.api import EngineClient

if TYPE_CHECKING:
    from llamaterm.app.tui.app import ChatApp  # which imports this module

MAX_PANES = 8
TICK_HZ = 20
STATS_HZ = 1
# The UI thread's share of the wall time; past it, streamed text waits, at most RENDER_MAX_WAIT_S (see RenderBudget).
# Chosen with tests/benchmarks/tui_bench.py on a 2-core machine, where drawing 8 panes takes much of the UI thread: a
# smaller share or a longer wait bought no throughput there that the noise did not hide, only staler panes.
RENDER_SHARE = 0.05
RENDER_MAX_WAIT_S = 4.0


class ChatScreen(Screen):
    AUTO_FOCUS = "#prompt"
    # typed as Binding (Textual's BINDINGS may also hold tuples): the help and the palette read their tooltips
    KEY_BINDINGS: ClassVar[list[Binding]] = [
        Binding("f1,question_mark", "help", "Help", tooltip="Every key and what it does"),
        Binding("escape", "stop", "Stop", tooltip="Stop the reply (from the broadcast input: every selected pane)"),
        Binding("ctrl+n", "new_pane", "New pane", tooltip="Open a pane with the active pane's settings"),
        Binding("f8", "close_pane", "Close pane", show=False, tooltip="Close the active pane (it stays in history)"),
        Binding("f2", "rename", "Rename", show=False, tooltip="Rename the active pane's conversation"),
        Binding(
            "ctrl+s",
            "settings",
            "Settings",
            tooltip="Model or server, system prompt, sampling values, thinking, token probabilities, JSON schema",
        ),
        Binding("f6", "focus_pane(1)", "Next pane", show=False, tooltip="Make the next pane active"),
        Binding("shift+f6", "focus_pane(-1)", "Previous pane", show=False, tooltip="Make the previous pane active"),
        Binding("ctrl+z", "zoom", "Zoom", show=False, tooltip="Show only the active pane, or all of them again"),
        Binding(
            "ctrl+t",
            "toggle_selected",
            "Select",
            show=False,
            tooltip="Add or remove the active pane from the broadcast targets",
        ),
        Binding("ctrl+r", "regenerate", "Regenerate", show=False, tooltip="Ask the last prompt again"),
        Binding("f4", "edit", "Edit last", show=False, tooltip="Edit the last prompt and send it again"),
        Binding(
            "f3",
            "toggle_thinking",
            "Thinking",
            show=False,
            tooltip="Show or fold the thinking (<think>...</think>) of the active pane's replies",
        ),
        Binding(
            "f7",
            "inspect_tokens",
            "Tokens",
            show=False,
            tooltip="Move through the last reply's tokens (←/→, Home/End; Esc leaves), each with its alternatives "
            "(the pane's settings: Token probs on)",
        ),
        Binding(
            "ctrl+y",
            "copy_reply",
            "Copy reply",
            show=False,
            tooltip="Copy the active pane's last reply (its answer, without the thinking)",
        ),
        Binding(
            "ctrl+b",
            "copy_code",
            "Copy code",
            show=False,
            tooltip="Copy the last code block of the active pane's last reply",
        ),
        Binding("ctrl+l", "clear", "Clear", show=False, tooltip="Start a new conversation in the active pane"),
        Binding("ctrl+o", "history", "History", tooltip="Search past conversations and reopen one"),
        Binding("pageup", "scroll_transcript(-1)", "Page up", show=False, tooltip="Scroll the active pane up a page"),
        Binding(
            "pagedown", "scroll_transcript(1)", "Page down", show=False, tooltip="Scroll the active pane down a page"
        ),
    ]
    BINDINGS = [*KEY_BINDINGS]
    PALETTE_ONLY = [
        ("Export pane as Markdown", "Write the active pane's conversation to a .md file", "export('md')"),
        ("Export pane as JSON", "Write the active pane's conversation to a .json file", "export('json')"),
        ("Stop every reply", "Stop all panes that are answering", "stop_all"),
    ]

    def __init__(self, history: History, sessions: list[Session]):
        super().__init__()
        self.history = history
        self.initial_sessions = sessions
        self.engines: dict[Backend, EngineClient] = {}  # the loaded ones
        self.loading_backends: set[Backend] = set()  # not `loading`: Widget.loading is Textual's reactive
        self.failed: dict[Backend, str] = {}  # why it did not load
        self.zoomed = False
        self.render_budget = RenderBudget(RENDER_SHARE, max_wait_s=RENDER_MAX_WAIT_S)
        self.stats_shown_at = 0.0
        self.recalled = history.recent_prompts()  # what ↑ recalls in the inputs (PromptInput), this session's after

    def compose(self) -> ComposeResult:
        with Grid(id="panes"):
            for number, session in enumerate(self.initial_sessions, 1):
                yield ChatPane(session, number, self.recalled)
        yield PromptInput(
            self.recalled, id="prompt", placeholder="Ask every selected pane… (Enter sends, ^j a new line, F1 the keys)"
        )
        yield StatusBar(id="status")
        yield Footer()

    def on_mount(self) -> None:
        self.activate(self.panes[0], focus=False)
        self.relayout()
        self.set_interval(1 / TICK_HZ, self.tick)
        self.call_after_refresh(self.load_backends)  # once the panes are laid out
        if self.history.path is None:
            self.history_in_memory()

    def history_in_memory(self) -> None:
        """The history file cannot be written: the status bar says so for the rest of the session."""
        status = self.query_one(StatusBar)
        status.note = " │ history in memory only: not saved"
        if not self.engines:
            status.update("loading model…" + status.note)

    @property
    def panes(self) -> list[ChatPane]:
        # a closing pane is left out: the tick runs while its removal is awaited
        return [p for p in self.query_one("#panes", Grid).query_children(ChatPane) if not p.closing]

    @property
    def chat_app(self) -> ChatApp:
        """The app, as the ChatApp that runs this screen (Textual types `app` as any App)."""
        return cast("ChatApp", self.app)

    @property
    def active(self) -> ChatPane:
        return self.query_one("ChatPane.-active", ChatPane)

    # ---- the engines ----

    @property
    def engine(self) -> EngineClient | None:
        """The active pane's engine; None while it loads (or before the panes are mounted)."""
        active = self.query("ChatPane.-active")
        return self.engine_for(active.first(ChatPane)) if active else None

    def engine_for(self, pane: ChatPane) -> EngineClient | None:
        """The engine of the pane's backend, None while it loads. A local engine whose process has exited (killed,
        out of memory) is dropped: the prompt waits while load_backends starts it again."""
        backend = pane.session.settings.backend
        engine = self.engines.get(backend)
        exited = getattr(engine, "exited", None)  # (engine/serving/process.py's EngineProcess)
        if engine is not None and exited is not None and exited.is_set():
            self.chat_app.stop_engine(self.engines.pop(backend))
            self.notify("Its engine process had exited: loading the model again.", title=backend.label)
            return None
        return engine

    def backends(self) -> list[Backend]:
        """The backends the panes use, in pane order."""
        return list(dict.fromkeys(p.session.settings.backend for p in self.panes))

    def load_backends(self) -> None:
        """Load the engine of each backend a pane uses that has none (again, if it failed); shut down the engines
        no pane uses. Local models loaded together split the device's free memory evenly (ChatApp.load_local)."""
        wanted = self.backends()
        for backend in wanted:
            if backend not in self.engines and backend not in self.loading_backends:
                self.loading_backends.add(backend)
                self.failed.pop(backend, None)
                self.chat_app.start_engine(backend)
        in_flight = {id(p.session.engine) for p in self.panes if p.session.handle is not None}
        for backend in [b for b in self.engines if b not in wanted and id(self.engines[b]) not in in_flight]:
            self.chat_app.stop_engine(self.engines.pop(backend))
        self.show_backends()

    def engine_ready(self, backend: Backend, engine: EngineClient) -> None:
        # a plain method (it awaits nothing): mypy cannot take a coroutine function for call_from_thread's callback
        self.loading_backends.discard(backend)
        self.engines[backend] = engine
        url = getattr(engine, "base_url", None)  # a RemoteEngine's: a server on this machine holds the local model
        if backend.local and url:
            self.notify(f"The llamaterm serve at {url} holds it: its panes use it (chat --local loads it here).")
        for warning in engine.sampling_defaults.warnings:  # the model's files advised a value it cannot take
            self.notify(warning, title=backend.label, severity="warning", timeout=30)
        for pane in self.panes:
            if pane.session.queued and pane.session.settings.backend == backend:
                pane.submit(engine)
        self.load_backends()  # a pane may have moved on while it loaded
        self.refresh_stats()

    def engine_failed(self, backend: Backend, message: str) -> None:
        """Shown in the status bar and in each pane waiting on that backend (drawn by the next tick), not in the
        others."""
        self.loading_backends.discard(backend)
        self.failed[backend] = message
        for pane in self.panes:
            if pane.session.queued and pane.session.settings.backend == backend:
                pane.session.fail(f"{backend.label} did not load: {message}")
        self.show_status()

    def show_backends(self) -> None:
        """With more than one backend in use, each pane names its model under its border."""
        several = len(self.backends()) > 1
        for pane in self.panes:
            engine = self.engine_for(pane)
            backend = pane.session.settings.backend
            name = (
                (engine.model_name if backend.local else f"{engine.model_name} @ {engine.device}")
                if engine
                else backend.label
            )
            if pane.border_subtitle != (name if several else None):
                pane.border_subtitle = name if several else None

    async def tick(self) -> None:
        panes = self.panes
        for pane in panes:
            if pane.session.handle is not None:
                pane.pull()
        if not self.render_budget.allows():
            return
        for pane in panes:
            if pane.has_undrawn:
                await pane.draw()
        if time.monotonic() - self.stats_shown_at >= 1 / STATS_HZ:
            self.refresh_stats()

    def refresh_stats(self) -> None:
        if not self.engines:
            return
        self.stats_shown_at = time.monotonic()
        self.show_status()
        for pane in self.panes:
            if pane.session.handle is not None:
                pane.session.refresh_stats()
                pane.show_stats()

    def show_status(self) -> None:
        failed = [f"{b.label} did not load: {m}" for b, m in self.failed.items() if b in self.backends()]
        self.query_one(StatusBar).show([self.engines[b] for b in self.backends() if b in self.engines], failed)

    # ---- layout and focus ----

    def relayout(self) -> None:
        """Up to 3 panes side by side, more in two rows; a zoomed pane alone."""
        panes = self.panes
        shown = 1 if self.zoomed else len(panes)
        columns = shown if shown <= 3 else -(-shown // 2)
        grid = self.query_one("#panes", Grid)
        grid.styles.grid_size_columns = columns
        grid.styles.grid_size_rows = -(-shown // columns)
        for pane in panes:
            pane.display = not self.zoomed or pane.has_class("-active")
        self.set_class(len(panes) == 1, "-single")  # one pane: the broadcast input is its input
        self.show_targets()

    def show_targets(self) -> None:
        panes = self.panes
        selected = sum(p.selected for p in panes)
        if len(panes) == 1:
            title = ""
        elif selected == 0:
            title = "no pane selected: ctrl+t selects the active one"
        else:
            title = f"→ all {selected} panes" if selected == len(panes) else f"→ {selected} of {len(panes)} panes"
        self.query_one("#prompt", PromptInput).border_title = title

    def activate(self, pane: ChatPane, focus: bool = True) -> None:
        for other in self.panes:
            other.set_class(other is pane, "-active")
        if self.zoomed:
            self.relayout()
        if focus:
            target = pane.query_one(".pane-input", PromptInput)
            (target if target.display and not self.has_class("-single") else self.query_one("#prompt")).focus()

    @on(DescendantFocus)
    def follow_focus(self, event: DescendantFocus) -> None:
        pane = next((w for w in event.widget.ancestors if isinstance(w, ChatPane)), None)
        if pane is not None and not pane.has_class("-active"):
            self.activate(pane, focus=False)

    # ---- prompts ----

    @on(PromptInput.Submitted)
    async def send(self, event: PromptInput.Submitted) -> None:
        text = prompt_text(event.value)
        if not text:
            return
        if event.input.id == "prompt":
            targets = [p for p in self.panes if p.selected]
            if not targets:
                self.notify("No pane is selected: ctrl+t selects the active pane.", severity="warning")
                return
        else:
            targets = [next(w for w in event.input.ancestors if isinstance(w, ChatPane))]
        busy = [p for p in targets if p.session.busy]
        if busy:
            numbers = ", ".join(str(p.number) for p in busy)
            self.notify(f"Pane {numbers} is still answering (Esc stops it).", severity="warning")
        if len(busy) == len(targets):
            return
        event.input.clear_sent()
        if not self.recalled or self.recalled[-1] != text:
            self.recalled.append(text)
        asked = [p for p in targets if p not in busy]
        for pane in asked:
            pane.ask(text, self.engine_for(pane))
        self.load_backends()  # one that failed before is tried again
        for pane in asked:
            await pane.show_asked()

    # ---- actions (keys and command palette) ----

    async def action_stop(self) -> None:
        if self.focused is self.query_one("#prompt"):
            targets = [p for p in self.panes if p.selected]
        else:
            targets = [self.active]
        for pane in targets:
            pane.session.stop()

    async def action_stop_all(self) -> None:
        for pane in self.panes:
            pane.session.stop()

    async def action_new_pane(self) -> None:
        await self.add_pane(Session(self.history, self.active.session.settings))

    async def add_pane(self, session: Session) -> None:
        if len(self.panes) >= MAX_PANES:
            self.notify(f"{MAX_PANES} panes is the most: close one (F8) first.", severity="warning")
            return
        pane = ChatPane(session, len(self.panes) + 1, self.recalled)
        await self.query_one("#panes", Grid).mount(pane)
        self.zoomed = False
        self.relayout()
        self.activate(pane)
        self.load_backends()

    async def action_close_pane(self) -> None:
        panes = self.panes
        if len(panes) == 1:
            self.notify("The last pane stays open: ctrl+l clears it.")
            return
        pane = self.active
        index = panes.index(pane)
        pane.closing = True
        await pane.remove()
        panes = self.panes
        for number, other in enumerate(panes, 1):
            other.number = number
        self.zoomed = False
        self.relayout()
        self.activate(panes[min(index, len(panes) - 1)])
        self.load_backends()

    def action_focus_pane(self, step: int) -> None:
        panes = self.panes
        self.activate(panes[(panes.index(self.active) + step) % len(panes)])

    def action_scroll_transcript(self, pages: int) -> None:
        transcript = self.active.transcript
        if pages < 0:
            transcript.scroll_page_up()
        else:
            transcript.scroll_page_down()

    def action_zoom(self) -> None:
        self.zoomed = not self.zoomed
        self.relayout()

    def action_toggle_selected(self) -> None:
        self.active.selected = not self.active.selected
        self.show_targets()

    def action_rename(self) -> None:
        pane = self.active

        def rename(name: str | None) -> None:
            if name is not None:
                pane.session.rename(name)
                pane.show_title()

        self.app.push_screen(TextPromptScreen(f"Rename pane {pane.number}", pane.session.title), rename)

    def action_settings(self) -> None:
        pane = self.active

        def configure(settings) -> None:
            if settings is not None:
                pane.session.configure(settings)
                pane.show_title()  # which names the schema and the shading
                self.load_backends()

        engine = self.engine_for(pane)
        defaults = engine.sampling_defaults if engine else None
        self.app.push_screen(
            SettingsScreen(f"Pane {pane.number}: {pane.session.title}", pane.session.settings, defaults), configure
        )

    async def action_regenerate(self) -> None:
        pane = self.active
        if pane.session.last_prompt() is None:
            self.notify("Nothing to regenerate yet.")
            return
        await self.resend(pane, pane.session.rewind())

    def action_edit(self) -> None:
        pane = self.active
        prompt = pane.session.last_prompt()
        if prompt is None:
            self.notify("No message to edit yet.")
            return

        async def edited(text: str | None) -> None:
            if text:
                pane.session.rewind()
                await self.resend(pane, text)

        title = "Edit the last message (Enter sends it again, ^j starts a new line)"
        self.app.push_screen(TextPromptScreen(title, prompt.content, multiline=True), edited)

    async def resend(self, pane: ChatPane, text: str) -> None:
        await pane.drop_forgotten()
        pane.ask(text, self.engine_for(pane))
        self.load_backends()
        await pane.show_asked()

    def action_toggle_thinking(self) -> None:
        self.active.toggle_thinking()

    def action_inspect_tokens(self) -> None:
        view = self.active.reply_view
        if not isinstance(view, ShadedReply) or not view.tokens:
            self.notify("No reply with token probabilities: turn on Token probs in the pane's settings (ctrl+s).")
            return
        view.enter()

    @on(ShadedReply.Left)
    def leave_tokens(self, event: ShadedReply.Left) -> None:
        self.activate(next(w for w in event.view.ancestors if isinstance(w, ChatPane)))

    def action_copy_reply(self) -> None:
        reply = self.active.session.reply
        answer = reply.answer if reply is not None else ""
        if not answer:
            self.notify("No reply to copy yet.")
            return
        self.copy(answer, "reply")

    def action_copy_code(self) -> None:
        view = self.active.reply_view
        blocks = view.code_blocks() if view is not None else []
        if not blocks:
            self.notify("The last reply has no code block.")
            return
        self.copy(blocks[-1], "code block")

    @on(CopyRequested)
    def copy_clicked(self, event: CopyRequested) -> None:
        self.copy(event.text, event.what)

    def copy(self, text: str, what: str) -> None:
        path = clipboard.copy(self.app, text)
        where = f" (if your terminal ignores OSC 52, it is in {path})" if path else ""
        self.notify(f"Copied the {what}{where}.")

    async def action_clear(self) -> None:
        pane = self.active
        await pane.show_session(Session(self.history, pane.session.settings, pane.session.name))

    def action_history(self) -> None:
        self.app.push_screen(HistoryScreen(self.history), self.open_conversation)

    async def open_conversation(self, conversation_id: int | None) -> None:
        """Reopen a stored conversation: where it is already open, else in an empty active pane, else in a new one."""
        if conversation_id is None:
            return
        for pane in self.panes:
            if pane.session.conversation_id == conversation_id:
                self.activate(pane)
                return
        session = Session.reopen(self.history, self.history.load(conversation_id))
        active = self.active
        if not active.session.messages and not active.session.busy:
            await active.show_session(session)
            self.activate(active)
            self.load_backends()
        else:
            await self.add_pane(session)

    def action_export(self, fmt: str) -> None:
        conversation_id = self.active.session.conversation_id
        if conversation_id is None:
            self.notify("Nothing to export yet.")
            return
        path = export_file(self.history.load(conversation_id), fmt)
        self.notify(f"Exported to {path}")

    def action_help(self) -> None:
        self.app.push_screen(HelpScreen(self.key_help()))

    # ---- discoverability: every key and command comes from BINDINGS, so help and palette never go stale ----

    def key_help(self) -> list[tuple[str, list[tuple[str, str]]]]:
        def keys(binding: Binding) -> str:
            return " / ".join(self.app.get_key_display(replace(binding, key=k)) for k in binding.key.split(","))

        chat = [
            ("Enter", "Send: from the broadcast input to every selected pane, from a pane's input to that pane"),
            ("Shift+Enter / ^j", "A new line in the prompt (a paste keeps its lines)"),
            ("↑ / ↓", "On the prompt's first / last line: the prompts sent before"),
            ("Tab / Shift+Tab", "Move between the inputs"),
            ("Mouse wheel", "Scroll the pane under the mouse"),
            ("Click", "Copy a message, or the code block under the mouse"),
            *((keys(b), b.tooltip) for b in self.KEY_BINDINGS),
            ("^p", "Command palette: every action, and export as Markdown or JSON"),
            ("^q", "Quit"),
        ]
        history = [(keys(b), b.tooltip) for b in HistoryScreen.KEY_BINDINGS]
        return [("Chat", chat), ("History list", history)]

    def commands(self) -> Iterable[SystemCommand]:
        for binding in self.KEY_BINDINGS:
            yield SystemCommand(binding.description, binding.tooltip, partial(self.run_action, binding.action))
        for title, help, action in self.PALETTE_ONLY:
            yield SystemCommand(title, help, partial(self.run_action, action))
