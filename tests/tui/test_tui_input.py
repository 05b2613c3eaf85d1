"""Pilot tests of typing and pasting: prompts of several lines (typed, pasted, recalled), where Tab goes, the page keys,
and the settings dialog's checks of a pane's model and its presets, over the fake engine."""

import pytest
from textual import events
from textual._xterm_parser import XTermParser
from textual.widgets import Input, Label, Select, TextArea

from llamaterm.app.history import History
from llamaterm.app.tui.app import ChatApp
from llamaterm.app.tui.screens import chat
from llamaterm.app.tui.screens.chat import ChatScreen
from llamaterm.app.tui.screens.help import HelpScreen
from llamaterm.app.tui.screens.settings import SettingsScreen
from llamaterm.app.tui.screens.text_prompt import TextPromptScreen
from llamaterm.app.tui.session import ChatSettings
from llamaterm.app.tui.widgets.prompt_input import PromptInput
from tests.support.fake_engine import FakeEngine
from tests.support.tui_support import engine_ready, idle, run, wait_until

CODE = "Fix this code:\n\ndef mean(xs):\n    return sum(xs) / len(xs) + 1\n"
LONG_REPLY = "".join(f"Line {i} of a long answer.\n\n" for i in range(200))


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMATERM_HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))  # the presets' folder
    monkeypatch.setattr(chat, "RENDER_SHARE", 1.0)
    return tmp_path


def sent(engine: FakeEngine) -> list[str]:
    """The user's messages of each request the engine got."""
    return [messages[-1]["content"] for messages, _ in engine.submitted]


def terminal_paste(text: str) -> list[events.Event]:
    """The events Textual makes of a terminal's bracketed paste of `text` (the bytes as a terminal sends them)."""
    return list(XTermParser().feed(f"\x1b[200~{text}\x1b[201~"))


def test_a_pasted_prompt_of_several_lines_is_sent_whole():
    """Textual's Input kept a paste's first line alone, silently: "Fix this code:" went without the code."""
    engine = FakeEngine()
    app = ChatApp(lambda *_: engine)

    async def scenario(pilot):
        await engine_ready(pilot)
        (paste,) = terminal_paste(CODE)
        assert isinstance(paste, events.Paste)
        app.post_message(paste)  # as the driver posts what the terminal sent
        await wait_until(pilot, lambda: app.focused.text == CODE)
        await pilot.press("enter")
        await idle(pilot)
        assert sent(engine) == [CODE.rstrip()]  # the trailing newline goes, the indent stays
        assert app.focused.text == ""
        assert app.chat.panes[0].session.title == " ".join(CODE.split())[:47] + "…"  # its title is on one line

    run(app, scenario)


@pytest.mark.parametrize("newline", ["shift+enter", "ctrl+j", "alt+enter"])
def test_shift_enter_or_ctrl_j_starts_a_line_and_enter_sends(newline):
    engine = FakeEngine()
    app = ChatApp(lambda *_: engine)

    async def scenario(pilot):
        await engine_ready(pilot)
        await pilot.press(*"first line", newline, *"  second", newline, *"third")
        prompt = app.chat.query_one("#prompt", PromptInput)
        assert prompt.text == "first line\n  second\nthird" and not engine.submitted
        assert prompt.size.height == 3  # it grew with its lines
        await pilot.press("enter")
        await idle(pilot)
        assert sent(engine) == ["first line\n  second\nthird"]
        assert prompt.size.height == 1

    run(app, scenario)


def test_up_and_down_recall_prompts_of_several_lines(home):
    earlier = History.open()  # a prompt of an earlier session, in the history
    earlier.add_message(earlier.create_conversation("before", {}), "user", "from yesterday")
    earlier.close()
    engine = FakeEngine()
    app = ChatApp(lambda *_: engine)

    async def scenario(pilot):
        await engine_ready(pilot)
        prompt = app.chat.query_one("#prompt", PromptInput)
        await pilot.press(*"one", "ctrl+j", *"two", "enter")
        await idle(pilot)
        await pilot.press(*"three", "enter")
        await idle(pilot)
        await pilot.press(*"draft")
        await pilot.press("up")
        assert prompt.text == "three"
        await pilot.press("up")  # the older prompt, its cursor on its last line
        assert prompt.text == "one\ntwo" and prompt.cursor_location == (1, 3)
        await pilot.press("up")  # within it first
        assert prompt.text == "one\ntwo" and prompt.cursor_location[0] == 0
        await pilot.press("up")
        assert prompt.text == "from yesterday"
        await pilot.press("up")  # the oldest: it stays
        assert prompt.text == "from yesterday"
        await pilot.press("down", "down")
        assert prompt.text == "three"
        await pilot.press("down")  # past the newest: what was being typed
        assert prompt.text == "draft"
        await pilot.press("up", "up", "enter")  # a recalled prompt of several lines is sent whole
        await idle(pilot)
        assert sent(engine) == ["one\ntwo", "three", "one\ntwo"]

    run(app, scenario)


def test_tab_visits_the_inputs_only_and_typed_text_reaches_them():
    """Tab stopped on each pane's transcript, where typed text was lost and "?" opened the help."""
    engine = FakeEngine("```python\nprint('hi')\n```\n\n" + LONG_REPLY, tokens_per_s=5000)
    app = ChatApp(lambda *_: engine, sessions=2)

    async def scenario(pilot):
        await engine_ready(pilot)
        await pilot.press(*"hello", "enter")
        await idle(pilot)  # replies with a code block and many lines are drawn
        inputs = [*app.chat.query(".pane-input"), app.chat.query_one("#prompt")]
        visited = []
        for _ in range(6):
            await pilot.press("tab")
            visited.append(app.focused)
        assert all(isinstance(w, PromptInput) for w in visited)
        assert set(visited) == set(inputs)
        backwards = []
        for _ in range(3):
            await pilot.press("shift+tab")
            backwards.append(app.focused)
        assert backwards == [visited[4], visited[3], visited[2]]
        pane_input = app.chat.panes[0].query_one(".pane-input", PromptInput)
        pane_input.focus()
        await pilot.press(*"why?")
        assert pane_input.text == "why?" and isinstance(app.screen, ChatScreen)

    run(app, scenario)


def test_page_keys_scroll_the_active_pane_from_the_input():
    engine = FakeEngine(LONG_REPLY, tokens_per_s=5000)
    app = ChatApp(lambda *_: engine, settings=ChatSettings(max_tokens=4096))

    async def scenario(pilot):
        await engine_ready(pilot)
        await pilot.press(*"long", "enter")
        await idle(pilot)
        transcript = app.chat.panes[0].transcript
        await wait_until(pilot, lambda: transcript.scroll_y == transcript.max_scroll_y > 0)
        bottom = transcript.scroll_y
        await pilot.press("pageup")
        await wait_until(pilot, lambda: transcript.scroll_y < bottom)
        assert isinstance(app.focused, PromptInput)
        await pilot.press("pagedown")
        await wait_until(pilot, lambda: transcript.scroll_y == bottom)

    run(app, scenario)


def test_the_inputs_keys_leave_the_screens_keys_alone():
    """TextArea binds F6, F7, ctrl+z and ctrl+y itself: in the inputs they would select, undo and redo instead of
    moving to the next pane, entering a reply's tokens, zooming and copying."""
    screen_keys = {key for binding in ChatScreen.BINDINGS for key in binding.key.split(",")}
    input_keys = {key for binding in PromptInput.BINDINGS for key in binding.key.split(",")}
    assert not screen_keys & input_keys


def test_the_help_names_the_keys_of_the_prompt():
    app = ChatApp(lambda *_: FakeEngine())

    async def scenario(pilot):
        await pilot.press("f1")
        assert isinstance(app.screen, HelpScreen)
        text = "\n".join(f"{key} {what}" for _, rows in app.screen.sections for key, what in rows)
        assert "Shift+Enter / ^j A new line in the prompt" in text
        assert "Scroll the active pane up a page" in text

    run(app, scenario)


def test_editing_the_last_prompt_keeps_its_lines():
    engine = FakeEngine()
    app = ChatApp(lambda *_: engine)

    async def scenario(pilot):
        await engine_ready(pilot)
        await pilot.press(*"line one", "ctrl+j", *"line two", "enter")
        await idle(pilot)
        await pilot.press("f4")
        assert isinstance(app.screen, TextPromptScreen)
        assert app.screen.query_one("#text", PromptInput).text == "line one\nline two"
        await pilot.press("ctrl+j", *"line three", "enter")
        await idle(pilot)
        assert sent(engine)[-1] == "line one\nline two\nline three"

    run(app, scenario)


async def open_settings(pilot) -> SettingsScreen:
    await pilot.press("ctrl+s")
    screen = pilot.app.screen
    assert isinstance(screen, SettingsScreen)
    return screen


def test_a_model_not_in_the_store_is_refused_in_the_dialog(home):
    """It saved without complaint and failed at the pane's next prompt."""
    app = ChatApp(lambda *_: FakeEngine())

    async def scenario(pilot):
        await engine_ready(pilot)
        screen = await open_settings(pilot)
        screen.query_one("#model", Input).value = "no-such-model"
        await pilot.press("ctrl+s")
        assert app.screen is screen  # not saved
        error = str(screen.query_one("#error", Label).render())
        assert error.startswith("Model: no model named 'no-such-model' in the store")
        checkpoint = home / "mine.gguf"
        checkpoint.write_bytes(b"")  # a path that is there is a model to try: loading it says what it holds
        screen.query_one("#model", Input).value = str(checkpoint)
        await pilot.press("ctrl+s")
        assert isinstance(app.screen, ChatScreen)
        assert app.chat.panes[0].session.settings.model == str(checkpoint)

    run(app, scenario)


def test_a_server_s_model_is_left_to_the_server(home):
    app = ChatApp(lambda *_: FakeEngine())

    async def scenario(pilot):
        await engine_ready(pilot)
        screen = await open_settings(pilot)
        screen.query_one("#model", Input).value = "served-elsewhere"
        screen.query_one("#server", Input).value = "http://127.0.0.1:9/v1"
        await pilot.press("ctrl+s")
        assert isinstance(app.screen, ChatScreen)

    run(app, scenario)


def test_a_preset_fills_the_dialog(home):
    (home / "config" / "llamaterm").mkdir(parents=True)
    presets = '[coder]\nsystem = "Answer with code."\ntemperature = 0.2\ntop_k = 20\n'
    (home / "config" / "llamaterm" / "presets.toml").write_text(presets)
    engine = FakeEngine()
    app = ChatApp(lambda *_: engine)

    async def scenario(pilot):
        await engine_ready(pilot)
        screen = await open_settings(pilot)
        screen.query_one("#preset", Select).value = "coder"
        await pilot.pause()
        assert screen.query_one("#system", TextArea).text == "Answer with code."
        assert [screen.query_one(f"#{k}", Input).value for k in ("temperature", "top_k", "top_p")] == ["0.2", "20", ""]
        await pilot.press("ctrl+s")
        await pilot.press(*"hi", "enter")
        await idle(pilot)
        messages, params = engine.submitted[-1]
        assert messages[0] == {"role": "system", "content": "Answer with code."}
        assert (params.temperature, params.top_k, params.top_p) == (0.2, 20, 0.95)  # top_p: the model's default

    run(app, scenario)


def test_a_broken_presets_file_is_named_in_the_dialog(home):
    (home / "config" / "llamaterm").mkdir(parents=True)
    (home / "config" / "llamaterm" / "presets.toml").write_text("[coder]\ntemperature = 'hot'\n")
    app = ChatApp(lambda *_: FakeEngine())

    async def scenario(pilot):
        await engine_ready(pilot)
        screen = await open_settings(pilot)
        error = str(screen.query_one("#error", Label).render())
        assert "presets.toml: [coder]: temperature must be a number, not 'hot'" in error
        assert screen.query_one("#preset", Select).disabled

    run(app, scenario)
