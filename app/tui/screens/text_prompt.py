"""A dialog that asks for text: one line (rename a pane), or a prompt of several (edit the last message)."""

from __future__ import annotations

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Label

from llamaterm.app.tui.widgets.prompt_input import PromptInput, prompt_text


class TextPromptScreen(ModalScreen[str | None]):
    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel")]

    def __init__(self, title: str, text: str, multiline: bool = False):
        super().__init__()
        self.title_text, self.text, self.multiline = title, text, multiline

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(self.title_text, classes="dialog-title", markup=False)
            if self.multiline:
                field = PromptInput([], id="text")
                field.load_text(self.text)
                field.move_cursor(field.document.end)
                yield field
            else:
                yield Input(self.text, select_on_focus=False, id="text")
            yield Label("Enter accepts · Esc cancels", classes="dialog-hint")

    @on(Input.Submitted)
    @on(PromptInput.Submitted)
    def accept(self, event: Input.Submitted | PromptInput.Submitted) -> None:
        self.dismiss(prompt_text(event.value) if self.multiline else event.value.strip())
