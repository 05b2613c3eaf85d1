"""The help screen: every key, grouped by where it works (the rows come from the screens' bindings)."""

from __future__ import annotations

from rich.table import Table
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Label, Static


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,f1,q,question_mark", "dismiss", "Close")]

    def __init__(self, sections: list[tuple[str, list[tuple[str, str]]]]):
        super().__init__()
        self.sections = sections

    def compose(self) -> ComposeResult:
        with VerticalScroll(classes="dialog help"):
            yield Label("Keys", classes="dialog-title")
            for name, rows in self.sections:
                table = Table(title=name, title_justify="left", show_header=False, box=None, expand=True)
                table.add_column(style="bold", no_wrap=True)
                table.add_column()
                for key, what in rows:
                    table.add_row(key, what)
                yield Static(table, classes="help-section")
            yield Label("Esc, F1 or q closes this screen", classes="dialog-hint")
