"""The TUI application: opens the history, shows the chat screen at once and loads the engine in a thread.

The prompt input works from the first frame; prompts typed while the model loads are queued by their panes and
sent when it is ready. Importing this module does not import torch: the engine is imported by the loader thread.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

from textual import work
from textual.app import App, SystemCommand
from textual.screen import Screen

from llamaterm.app.history import History
from llamaterm.app.tui.screens.chat import MAX_PANES, ChatScreen
from llamaterm.app.tui.session import ChatSettings, Session

ASSETS = Path(__file__).resolve().parents[2] / "assets"


class ChatApp(App):
    TITLE = "llamaterm"
    CSS_PATH = [ASSETS / "chat.tcss", ASSETS / "dialogs.tcss"]

    def __init__(self, load_engine: Callable[[], object], sessions: int = 1, system: str | None = None):
        """load_engine runs in a worker thread and returns an engine (serving.process.EngineProcess or a stand-in)."""
        super().__init__()
        if not 1 <= sessions <= MAX_PANES:
            raise ValueError(f"sessions must be between 1 and {MAX_PANES}, not {sessions}")
        self.load_engine = load_engine
        self.session_count = sessions
        self.settings = ChatSettings(system=system or "")
        self.history: History | None = None

    def get_default_screen(self) -> Screen:
        self.history = History.open()
        self.chat = ChatScreen(self.history, [Session(self.history, self.settings) for _ in range(self.session_count)])
        return self.chat

    def on_mount(self) -> None:
        self.history.on_problem = self.history_failed
        if self.history.problem:
            self.history_failed(self.history.problem)
        self.start_engine()

    def history_failed(self, problem: str) -> None:
        """The history file could not be used: say so now, and for as long as it lasts in the status bar."""
        self.notify(problem, title="History", severity="error", timeout=30)
        if self.history.path is None and self.chat.is_mounted:  # else the screen's on_mount shows it
            self.chat.history_in_memory()

    @work(thread=True, exit_on_error=False, group="engine")
    def start_engine(self) -> None:
        try:
            engine = self.load_engine()
        except Exception as e:  # shown in the status bar; the app stays usable (history, export)
            self.call_from_thread(self.chat.engine_failed, str(e) or type(e).__name__)
            return
        try:
            self.call_from_thread(self.chat.engine_ready, engine)
        except RuntimeError:  # the app quit while the model loaded
            engine.shutdown()

    def on_unmount(self) -> None:
        if self.chat.engine is not None:
            self.chat.engine.shutdown()
        self.history.close()

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        if isinstance(screen, ChatScreen):
            yield from screen.commands()


def run_tui(model: str | None, sessions: int, system: str | None) -> None:
    """`llamaterm chat`: the TUI on `model` (None: the default model) with `sessions` panes."""

    def load_engine():
        from llamaterm.engine.api import EngineConfig
        from llamaterm.engine.serving.process import EngineProcess  # the engine loop never shares a GIL with the UI

        return EngineProcess(EngineConfig(model=model))

    ChatApp(load_engine, sessions=sessions, system=system).run()
