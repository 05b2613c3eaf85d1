"""The TUI application: opens the history, shows the chat screen at once and loads the engines in threads.

The prompt input works from the first frame; prompts typed while a model loads are queued by their panes and
sent when it is ready. Importing this module does not import torch: engines are imported by the loader threads.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import replace
from importlib.resources import files
from itertools import cycle
from pathlib import Path

from textual import work
from textual.app import App, SystemCommand
from textual.screen import Screen

from llamaterm.app.history import History
from llamaterm.app.tui.backends import Backend, Loader
from llamaterm.app.tui.screens.chat import MAX_PANES, ChatScreen
from llamaterm.app.tui.session import ChatSettings, Session
from llamaterm.engine.api import EngineClient

ASSETS = Path(str(files("llamaterm.assets")))  # the styles, wherever the package is installed


class ChatApp(App):
    TITLE = "llamaterm"
    CSS_PATH = [ASSETS / "chat.tcss", ASSETS / "dialogs.tcss"]

    def __init__(
        self,
        load_engine: Callable[[Backend, float], EngineClient],
        sessions: int = 1,
        settings: ChatSettings | None = None,
        backends: list[Backend] | None = None,
    ):
        """load_engine(backend, kv_share) runs in a worker thread and returns the backend's engine (a Loader, or a
        stand-in). The panes start with `settings` and take `backends` in turn (default: the default local model).

        Local models load one at a time, each measuring the memory free once the one before has its own, and each
        takes 1 / (the local loads still to come, its own included) of it: models loaded together split it evenly
        (with 1/n each, the second of two got half of what the first left, a quarter of the whole)."""
        super().__init__()
        self.local_load = threading.Lock()
        self.local_loads_waiting = 0  # guarded by waiting_lock
        self.waiting_lock = threading.Lock()
        if not 1 <= sessions <= MAX_PANES:
            raise ValueError(f"sessions must be between 1 and {MAX_PANES}, not {sessions}")
        self.load_engine = load_engine
        self.session_count = sessions
        self.settings = settings or ChatSettings()
        self.initial_backends = backends or [Backend()]
        # self.history and self.chat are made in get_default_screen, which Textual calls before on_mount

    def get_default_screen(self) -> Screen:
        self.history = History.open()
        settings = [replace(self.settings, model=b.model, server=b.server) for b in self.initial_backends]
        sessions = [Session(self.history, s) for s, _ in zip(cycle(settings), range(self.session_count))]
        self.chat = ChatScreen(self.history, sessions)
        return self.chat

    def on_mount(self) -> None:
        self.history.on_problem = self.history_failed
        if self.history.problem:
            self.history_failed(self.history.problem)

    def history_failed(self, problem: str) -> None:
        """The history file could not be used: say so now, and for as long as it lasts in the status bar."""
        self.notify(problem, title="History", severity="error", timeout=30)
        if self.history.path is None and self.chat.is_mounted:  # else the screen's on_mount shows it
            self.chat.history_in_memory()

    def start_engine(self, backend: Backend) -> None:
        """Load the backend's engine in a worker thread. A local load is counted here, before its thread starts,
        so that loads started together all count in each other's share."""
        if backend.local:
            with self.waiting_lock:
                self.local_loads_waiting += 1
        self.load_in_thread(backend)

    @work(thread=True, exit_on_error=False, group="engine")
    def load_in_thread(self, backend: Backend) -> None:
        try:
            engine = self.load_local(backend) if backend.local else self.load_engine(backend, 1.0)
        except Exception as e:  # shown in the status bar and the waiting panes; the app stays usable
            self.call_from_thread(self.chat.engine_failed, backend, str(e) or type(e).__name__)
            return
        try:
            self.call_from_thread(self.chat.engine_ready, backend, engine)
        except RuntimeError:  # the app quit while the model loaded
            engine.shutdown()

    def load_local(self, backend: Backend) -> EngineClient:
        try:
            with self.local_load:
                with self.waiting_lock:
                    share = 1 / self.local_loads_waiting
                return self.load_engine(backend, share)
        finally:
            with self.waiting_lock:
                self.local_loads_waiting -= 1

    @work(thread=True, exit_on_error=False, group="engine")
    def stop_engine(self, engine: EngineClient) -> None:
        engine.shutdown()

    def on_unmount(self) -> None:
        for engine in self.chat.engines.values():
            engine.shutdown()
        self.history.close()

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        if isinstance(screen, ChatScreen):
            yield from screen.commands()


def run_tui(backends: list[Backend], sessions: int, settings: ChatSettings, loader: Loader) -> None:
    """`llamaterm chat`: the TUI with `sessions` panes, which start with `settings` and take `backends` in turn,
    their engines opened by `loader`."""
    ChatApp(loader, sessions=sessions, settings=settings, backends=backends).run()
