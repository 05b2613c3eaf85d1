"""Snapshots of the main screen with 1, 2 and 4 panes, a reply shaded by its tokens' probabilities, the history list
and the settings screen.

The fake engine makes them deterministic: fixed replies, nominal stats. Update with `--snapshot-update` and look
at the SVGs under __snapshots__/ before committing them.
"""

import time

import pytest
from textual.widgets import Input, TextArea

from llamaterm.app.history import History
from llamaterm.app.tui.app import ChatApp
from llamaterm.app.tui.screens import chat
from llamaterm.app.tui.session import ChatSettings
from tests.support.fake_engine import REPLY, FakeEngine
from tests.support.tui_support import engine_ready, idle, wait_until

QUESTION = "How do I write fib in Python?"
PERSONAS = {
    "": REPLY,
    "Answer like a pirate.": "Arr! Ye write it **recursive**, matey:\n\n```python\ndef fib(n):\n"
    "    return n if n < 2 else fib(n - 1) + fib(n - 2)\n```\n\nSlow as a barnacled hull, mind ye.\n",
    "Answer in one sentence.": "Use `fib = lambda n: n if n < 2 else fib(n - 1) + fib(n - 2)`, and cache it.\n",
    "Answer with a table.": "| n | fib(n) |\n|---|---|\n| 0 | 0 |\n| 1 | 1 |\n| 2 | 1 |\n| 3 | 2 |\n| 4 | 3 |\n",
}


def persona_reply(messages: list[dict]) -> str:
    return PERSONAS[messages[0]["content"] if messages[0]["role"] == "system" else ""]


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMATERM_HOME", str(tmp_path))
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    monkeypatch.setattr(chat, "RENDER_SHARE", 1.0)
    yield tmp_path
    monkeypatch.delenv("TZ")
    time.tzset()


def still_cursors(app: ChatApp) -> None:
    """A blinking cursor would make the screenshot depend on the moment it is taken."""
    for widget in [*app.screen.query(Input), *app.screen.query(TextArea)]:
        widget.cursor_blink = False


def ask_panes(systems: list[str], hold: bool = False):
    async def run_before(pilot):
        app = pilot.app
        await engine_ready(pilot)
        for pane, system in zip(app.chat.panes, systems, strict=True):
            pane.session.configure(ChatSettings(system=system))
        await pilot.press(*QUESTION, "enter")
        panes = app.chat.panes
        if hold:  # all text is in, the requests still run: the stats show a live rate
            await wait_until(
                pilot,
                lambda: all(p.session.messages[-1].content == PERSONAS[s] for p, s in zip(panes, systems, strict=True)),
            )
            # each pane's reply mounted (its view exists) and drawn: the text can be in before the pane mounts it
            await wait_until(pilot, lambda: not any(p.reply_view is None or p.has_undrawn for p in panes))
        else:
            await idle(pilot)
        app.chat.refresh_stats()
        still_cursors(app)
        await pilot.pause()

    return run_before


def test_one_pane(snap_compare):
    app = ChatApp(lambda *_: FakeEngine(persona_reply), sessions=1)
    assert snap_compare(app, terminal_size=(100, 32), run_before=ask_panes([""]))


def test_two_panes(snap_compare):
    app = ChatApp(lambda *_: FakeEngine(persona_reply), sessions=2)
    assert snap_compare(app, terminal_size=(130, 36), run_before=ask_panes(["", "Answer like a pirate."]))


def test_four_panes_streaming(snap_compare):
    app = ChatApp(lambda *_: FakeEngine(persona_reply, hold=True), sessions=4)
    assert snap_compare(app, terminal_size=(160, 48), run_before=ask_panes(list(PERSONAS), hold=True))


def test_history_list(snap_compare):
    history = History.open()
    for day, (title, text) in enumerate(
        [("Rust lifetimes", "What is 'a?"), ("Sourdough", "Starter ratio?"), ("Fibonacci", QUESTION)]
    ):
        cid = history.create_conversation(title, {})
        history.add_message(cid, "user", text)
        history.add_message(cid, "assistant", "An answer.", "stop")
        stamp = 1_790_000_000 + day * 86_400
        history.conn.execute("UPDATE conversations SET updated_at = ? WHERE id = ?", (stamp, cid))
    history.close()

    async def run_before(pilot):
        await engine_ready(pilot)
        await pilot.press("ctrl+o")
        still_cursors(pilot.app)

    app = ChatApp(lambda *_: FakeEngine(), sessions=1)
    assert snap_compare(app, terminal_size=(100, 30), run_before=run_before)


def test_settings_screen(snap_compare):
    async def run_before(pilot):
        await engine_ready(pilot)
        pilot.app.chat.panes[0].session.configure(
            ChatSettings(system="Answer like a pirate.", temperature=0.7, seed=42)
        )
        await pilot.press("ctrl+s")
        still_cursors(pilot.app)

    app = ChatApp(lambda *_: FakeEngine(), sessions=2)
    assert snap_compare(app, terminal_size=(100, 42), run_before=run_before)  # the whole dialog


def test_shaded_reply_with_a_token_s_alternatives(snap_compare):
    async def run_before(pilot):
        await engine_ready(pilot)
        pane = pilot.app.chat.panes[0]
        pane.session.configure(ChatSettings(token_probabilities=True))
        pane.show_title()
        await pilot.press(*QUESTION, "enter")
        await idle(pilot)
        pilot.app.chat.refresh_stats()  # the request's end, not its middle
        await pilot.press("f7", "left", "left")
        still_cursors(pilot.app)
        await pilot.pause()

    app = ChatApp(lambda *_: FakeEngine(persona_reply), sessions=1)
    assert snap_compare(app, terminal_size=(100, 36), run_before=run_before)
