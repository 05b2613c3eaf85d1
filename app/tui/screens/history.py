"""The history list: search past conversations (title or any message), reopen one, export it."""

from __future__ import annotations

import time
from typing import ClassVar

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.content import Content
from textual.screen import ModalScreen
from textual.widgets import Input, Label, OptionList
from textual.widgets.option_list import Option

from llamaterm.app.history import History, export_file


class HistoryScreen(ModalScreen[int | None]):
    """Dismisses with the id of the conversation to reopen, or None."""

    # typed as Binding (Textual's BINDINGS may also hold tuples): the chat's help reads their tooltips
    KEY_BINDINGS: ClassVar[list[Binding]] = [
        Binding("escape", "dismiss(None)", "Close", tooltip="Back to the chat"),
        Binding("enter", "open", "Open", tooltip="Reopen the highlighted conversation"),
        Binding("m", "export('md')", "Markdown", tooltip="Export the highlighted conversation as Markdown"),
        Binding("j", "export('json')", "JSON", tooltip="Export the highlighted conversation as JSON"),
        Binding("down", "focus_list", show=False, tooltip="From the search box to the list"),
    ]
    BINDINGS = [*KEY_BINDINGS]

    def __init__(self, history: History):
        super().__init__()
        self.history = history

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog history"):
            yield Label("History", classes="dialog-title")
            yield Input(placeholder="Search titles and messages…", id="search")
            yield OptionList(id="conversations")
            yield Label("Enter opens · m exports Markdown · j exports JSON · Esc closes", classes="dialog-hint")

    def on_mount(self) -> None:
        self.show_matches("")

    @on(Input.Changed, "#search")
    def search(self, event: Input.Changed) -> None:
        self.show_matches(event.value)

    def show_matches(self, text: str) -> None:
        options = self.query_one("#conversations", OptionList)
        options.clear_options()
        for conv in self.history.search(text):
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(conv.updated_at))
            line = f"{conv.title}  ·  {conv.message_count} messages  ·  {when}"
            options.add_option(Option(Content(line), id=str(conv.id)))
        if options.option_count:
            options.highlighted = 0

    def selected_id(self) -> int | None:
        options = self.query_one("#conversations", OptionList)
        if options.highlighted is None:
            return None
        option_id = options.get_option_at_index(options.highlighted).id
        assert option_id is not None  # show_matches gives every option its conversation's id
        return int(option_id)

    @on(Input.Submitted, "#search")
    @on(OptionList.OptionSelected)
    def action_open(self) -> None:
        if self.selected_id() is not None:
            self.dismiss(self.selected_id())

    def action_export(self, fmt: str) -> None:
        conversation_id = self.selected_id()
        if conversation_id is not None:
            self.notify(f"Exported to {export_file(self.history.load(conversation_id), fmt)}")

    def action_focus_list(self) -> None:
        self.query_one("#conversations", OptionList).focus()
