"""The prompt input: several lines, as prompts are. It grows with its text (up to the height its CSS allows, then
scrolls); Enter sends; shift+Enter, ctrl+J or alt+Enter start a new line (terminals send shift+Enter as Enter
unless they speak the kitty keyboard protocol; ctrl+J works in every one); a paste keeps every line, as the
terminal's bracketed paste delivers it whole. ↑ on the first line and ↓ on the last recall the prompts sent before,
this session's and the history's, as a shell recalls commands.

Its keys are TextArea's but for those the chat screen owns: ctrl+z (zoom) and ctrl+y (copy the reply), which undo
and redo keep as super+z and super+y; F6 and F7 (the next pane, a reply's tokens), TextArea's select line and select
all; and PageUp / PageDown, which scroll the active pane's transcript."""

from __future__ import annotations

import re

from textual import events
from textual.binding import Binding
from textual.message import Message
from textual.widgets import TextArea

NEWLINE_KEYS = ("shift+enter", "ctrl+j", "alt+enter")
SCREEN_KEYS = {"ctrl+z", "ctrl+y", "f6", "f7", "pageup", "pagedown"}  # the chat screen's, not the input's


def without_screen_keys(bindings: list) -> list[Binding | tuple[str, str] | tuple[str, str, str]]:
    """TextArea's bindings less SCREEN_KEYS (a binding whose keys are all the screen's goes)."""
    kept: list[Binding | tuple[str, str] | tuple[str, str, str]] = []
    for binding in bindings:
        assert isinstance(binding, Binding)  # TextArea writes each as a Binding
        keys = [k for k in binding.key.split(",") if k not in SCREEN_KEYS]
        if keys:
            kept.append(Binding(",".join(keys), binding.action, binding.description, show=binding.show))
    return kept


def prompt_text(value: str) -> str:
    """A prompt as typed, less the blank lines and spaces at its ends: the first line's indent stays (code)."""
    return re.sub(r"\A(?:[ \t]*\n)+", "", value.rstrip())


class PromptInput(TextArea, inherit_bindings=False):
    BINDINGS = without_screen_keys(TextArea.BINDINGS)

    class Submitted(Message):
        """Enter: the prompt's text (the input keeps it; the screen clears it once the prompt is sent)."""

        def __init__(self, input: PromptInput, value: str):
            super().__init__()
            self.input, self.value = input, value

        @property
        def control(self) -> PromptInput:
            return self.input

    def __init__(self, recalled: list[str], placeholder: str = "", **kwargs):
        """recalled: the prompts ↑ and ↓ go through, oldest first, which the screen's inputs share and the screen
        adds each prompt sent to."""
        super().__init__(
            soft_wrap=True, tab_behavior="focus", highlight_cursor_line=False, placeholder=placeholder, **kwargs
        )
        self.recalled = recalled
        self.recalling: int | None = None  # the index in `recalled` shown; None: the user's own text
        self.draft = ""  # the user's own text, kept while recalled prompts are shown

    @property
    def value(self) -> str:
        return self.text

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            self.post_message(self.Submitted(self, self.text))
        elif event.key in NEWLINE_KEYS:
            event.stop()
            event.prevent_default()
            self.replace("\n", *self.selection)
        else:
            await super()._on_key(event)

    def action_cursor_up(self, select: bool = False) -> None:
        if select or not self.cursor_at_first_line or not self.recall(-1):
            super().action_cursor_up(select)

    def action_cursor_down(self, select: bool = False) -> None:
        if select or not self.cursor_at_last_line or not self.recall(1):
            super().action_cursor_down(select)

    def recall(self, step: int) -> bool:
        """Show the prompt `step` before (-1) or after (1) the one shown; past the newest, the user's own text.
        Returns whether there was one to show."""
        newest = len(self.recalled)
        at = newest if self.recalling is None else self.recalling
        to = at + step
        if not 0 <= to <= newest or to == at:
            return False
        if self.recalling is None:
            self.draft = self.text
        self.recalling = None if to == newest else to
        self.load_text(self.draft if self.recalling is None else self.recalled[to])
        self.move_cursor(self.document.end)
        return True

    def clear_sent(self) -> None:
        """After a prompt is sent: empty, and ↑ starts from the newest prompt again."""
        self.recalling, self.draft = None, ""
        self.clear()
