"""A pane's settings: its model (local or on a server), system prompt and every sampling value the engine takes,
checked by the engine's own rules before saving (a local model must be there to load); a preset (app/presets.py)
fills the prompt and values at once. A sampling value left blank is the model's default: the screen shows it, and
where it came from (the model's files, llama.cpp's defaults, or the server's own). A JSON schema that replies follow
is pasted, or read from the file named; llguidance checks it here, before the dialog closes."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.content import Content
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Select, TextArea

from llamaterm.app.presets import PresetError, load_presets
from llamaterm.app.tui.session import ChatSettings
from llamaterm.engine.checkpoints.sampling_defaults import DESCRIBED, USER, SamplingDefaults
from llamaterm.engine.checkpoints.sampling_defaults import FIELDS as SAMPLING
from llamaterm.engine.errors import LlamatermError, RequestError

# (field, label, Input type, hint); the model, the server, the seed and the sampling values may be left blank
FIELDS: list[tuple[str, str, Literal["integer", "number", "text"], str]] = [
    ("model", "Model", "text", "store name or path; blank = default (a server's: its first)"),
    ("server", "Server", "text", "blank = this machine, or http://host:port/v1"),
    ("temperature", "Temperature", "number", "0 = greedy"),
    ("top_k", "Top-k", "integer", "0 = off"),
    ("top_p", "Top-p", "number", "1 = off"),
    ("min_p", "Min-p", "number", "0 = off"),
    ("repetition_penalty", "Repeat penalty", "number", "1 = off"),
    ("presence_penalty", "Presence pen.", "number", "0 = off"),
    ("frequency_penalty", "Frequency pen.", "number", "0 = off"),
    ("max_tokens", "Max tokens", "integer", ">= 1"),
    ("seed", "Seed", "integer", "blank = random"),
]
OPTIONAL = {"model", "server", "seed", *SAMPLING}
# The chat template's thinking switch: the template's default, or set (only templates with one read it)
THINKING = [("template default", None), ("on", True), ("off", False)]
SHADING = [("off", False), ("on", True)]  # token probabilities


def origin(name: str, text: str, defaults: SamplingDefaults | None) -> str:
    """Where a sampling field's value comes from, given what its input holds."""
    if text.strip():
        return DESCRIBED[USER]
    if defaults is None:
        return "the model's (loading)"
    default = defaults.values[name]
    source = DESCRIBED[default.source]
    return source if default.value is None else f"{default.value:g} · {source}"


class SettingsScreen(ModalScreen[ChatSettings | None]):
    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel"), Binding("ctrl+s", "save", "Save")]

    def __init__(self, title: str, settings: ChatSettings, defaults: SamplingDefaults | None = None):
        """defaults: the sampling defaults of the pane's engine; None while it loads."""
        super().__init__()
        self.title_text, self.settings, self.defaults = title, settings, defaults
        try:
            self.presets, self.presets_problem = load_presets(), ""
        except PresetError as e:
            self.presets, self.presets_problem = {}, str(e)

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog settings"):
            yield Label(f"Settings · {self.title_text}", classes="dialog-title", markup=False)
            with Horizontal(classes="field"):
                yield Label("Preset", classes="field-label")
                options = [(name, name) for name in self.presets]
                yield Select(options, prompt="none", id="preset", compact=True, disabled=not options)
                where = "fills the fields below" if options else "none yet: `llamaterm presets` says where they go"
                yield Label(where, classes="field-hint", markup=False)
            yield Label("System prompt")
            yield TextArea(self.settings.system, id="system", soft_wrap=True)
            for name, label, kind, hint in FIELDS:
                value = getattr(self.settings, name)
                with Horizontal(classes="field"):
                    yield Label(label, classes="field-label")
                    if kind == "text":  # a name or a URL: the whole width, the hint as its placeholder
                        yield Input(value, placeholder=hint, id=name, compact=True, classes="wide")
                        continue
                    text = "" if value is None else str(value)
                    yield Input(text, type=kind, id=name, compact=True)
                    if name in SAMPLING:
                        yield Label(origin(name, text, self.defaults), id=f"{name}-source", classes="field-source")
                    yield Label(hint, classes="field-hint")
            with Horizontal(classes="field"):
                yield Label("Thinking", classes="field-label")
                options = [(label, str(value)) for label, value in THINKING]
                yield Select(options, value=str(self.settings.thinking), allow_blank=False, id="thinking", compact=True)
                yield Label("enable_thinking, as Qwen3's", classes="field-hint")
            with Horizontal(classes="field"):
                yield Label("Token probs", classes="field-label")
                options = [(label, str(value)) for label, value in SHADING]
                yield Select(
                    options, value=str(self.settings.token_probabilities), allow_blank=False, id="shading", compact=True
                )
                yield Label("shade tokens; F7: alternatives", classes="field-hint")
            yield Label("JSON schema (replies follow it)")
            yield TextArea(
                self.settings.json_schema,
                id="json_schema",
                soft_wrap=True,
                placeholder="a file's path, or the schema pasted; blank = none",
            )
            yield Label(self.presets_problem, id="error", markup=False)
            with Horizontal(classes="buttons"):
                yield Button("Save", variant="primary", id="save")
                yield Button("Cancel", id="cancel")
            yield Label("^s saves · Esc cancels · Tab moves between fields", classes="dialog-hint")

    def on_mount(self) -> None:
        self.query_one("#system", TextArea).focus()

    @on(Select.Changed, "#preset")
    def fill_from_preset(self, event: Select.Changed) -> None:
        preset = self.presets.get(str(event.value))
        if preset is None:  # back to "none": the fields keep what they hold
            return
        if preset.system is not None:
            self.query_one("#system", TextArea).load_text(preset.system)
        for name, value in (preset.sampling or {}).items():
            self.query_one(f"#{name}", Input).value = f"{value:g}" if isinstance(value, float) else str(value)

    @on(Input.Changed)
    def show_origin(self, event: Input.Changed) -> None:
        name = event.input.id
        if name in SAMPLING:
            self.query_one(f"#{name}-source", Label).update(origin(name, event.value, self.defaults))

    @on(Button.Pressed, "#save")
    @on(Input.Submitted)
    def action_save(self) -> None:
        try:
            values: dict[str, Any] = {  # each ChatSettings field's own type, which ChatSettings checks
                name: parse(label, kind, self.query_one(f"#{name}", Input).value, name in OPTIONAL)
                for name, label, kind, _ in FIELDS
            }
            if values["model"] and not values["server"]:
                check_local_model(values["model"])
            settings = ChatSettings(
                system=self.query_one("#system", TextArea).text.strip(),
                thinking=self.chosen("#thinking", THINKING),
                token_probabilities=self.chosen("#shading", SHADING),
                json_schema=schema_text(self.query_one("#json_schema", TextArea).text),
                **values,
            )
        except LlamatermError as e:
            self.query_one("#error", Label).update(Content(str(e)))
            return
        self.dismiss(settings)

    def chosen(self, select: str, options: list[tuple[str, Any]]) -> Any:
        choice = self.query_one(select, Select).value
        assert isinstance(choice, str)  # allow_blank=False: always one of the options
        return {str(value): value for _, value in options}[choice]

    @on(Button.Pressed, "#cancel")
    def cancel(self) -> None:
        self.dismiss(None)


def check_local_model(name: str) -> None:
    """A model on this machine: one in the store (by name or as pulled) or a checkpoint's path, as the pane's next
    prompt would load it. (A server's model is checked as the pane connects: its list is the server's to give.)"""
    from llamaterm.engine.store.model_store import resolve_model

    try:
        resolve_model(name)
    except LlamatermError as e:
        raise RequestError(f"Model: {e}") from None


def schema_text(given: str) -> str:
    """The JSON schema field's text: a schema pasted (it starts with "{"), or the file it names, read; ChatSettings
    checks it."""
    given = given.strip()
    if not given or given.startswith("{"):
        return given
    path = Path(given).expanduser()
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else "not UTF-8 text"
        problem = f"JSON schema: cannot read the file {given}: {reason}"
        raise RequestError(f"{problem} (give a path, or paste the schema)") from None


def parse(label: str, kind: str, text: str, optional: bool) -> str | float | int | None:
    text = text.strip()
    if kind == "text":
        return text
    if not text:
        if optional:
            return None
        raise RequestError(f"{label}: give a value")
    try:
        return float(text) if kind == "number" else int(text)
    except ValueError:
        raise RequestError(f"{label}: {text!r} is not a {'number' if kind == 'number' else 'whole number'}") from None
