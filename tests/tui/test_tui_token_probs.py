"""The pane settings of issue #24: replies shaded by their tokens' probabilities, with each token's alternatives
under a cursor, and a JSON schema that replies follow. Over the fake engine, whose reply tokens have the
probabilities 0.9, 0.6, 0.3 in turn, the rest going to " maybe", " perhaps", " instead", " or", " not", halving."""

import asyncio
import json
import re

import pytest
from textual.app import App
from textual.widgets import Select, TextArea

from llamaterm.app.history import History
from llamaterm.app.logprobs import ShownToken
from llamaterm.app.tui.app import ChatApp
from llamaterm.app.tui.screens import chat
from llamaterm.app.tui.screens.chat import ChatScreen
from llamaterm.app.tui.screens.settings import SettingsScreen
from llamaterm.app.tui.session import ChatMessage, ChatSettings, Session
from llamaterm.app.tui.widgets import token_view
from llamaterm.app.tui.widgets.prompt_input import PromptInput
from llamaterm.app.tui.widgets.token_view import ShadedReply, TokenParagraph
from llamaterm.engine.sampling_params import Grammar
from tests.support.fake_engine import FakeEngine
from tests.support.tui_support import engine_ready, idle, run

CITY = {"title": "City", "type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMATERM_HOME", str(tmp_path))
    monkeypatch.setattr(chat, "RENDER_SHARE", 1.0)
    return tmp_path


def panel(view: ShadedReply) -> str:
    return str(view.query_one(".alternatives").render())


def alpha(style: str) -> float:
    """The opacity of a shade's background (0: none)."""
    found = re.search(r"rgba\(\d+,\d+,\d+,([\d.]+)\)", style)
    return float(found.group(1)) if found else 0.0


def styles(view: ShadedReply) -> list[tuple[str, str]]:
    """(text, style) of every token span the view draws."""
    shown = []
    for paragraph in view.query(TokenParagraph):
        content = paragraph.visual
        shown += [(content.plain[s.start : s.end], str(s.style)) for s in content.spans]
    return shown


async def set_probabilities(pilot, on: bool, schema: str = "") -> SettingsScreen:
    await pilot.press("ctrl+s")
    screen = pilot.app.screen
    assert isinstance(screen, SettingsScreen)
    screen.query_one("#shading", Select).value = str(on)
    screen.query_one("#json_schema", TextArea).text = schema
    await pilot.press("ctrl+s")
    return screen


def test_a_pane_shading_tokens_asks_for_alternatives_and_lists_them_under_the_cursor():
    engine = FakeEngine("Paris is nice.")
    app = ChatApp(lambda *_: engine)

    async def scenario(pilot):
        await engine_ready(pilot)
        await set_probabilities(pilot, True)
        assert "token probs" in str(app.chat.panes[0].border_title)
        await pilot.press(*"Capital of France?", "enter")
        await idle(pilot)
        assert engine.submitted[-1][1].logprobs == 5
        view = app.chat.panes[0].reply_view
        assert isinstance(view, ShadedReply)
        assert "".join(p.visual.plain for p in view.query(TokenParagraph)) == "Paris is nice."
        shades = styles(view)
        assert [text for text, _ in shades] == ["Paris", " is", " nice."]
        assert 0 < alpha(shades[0][1]) < alpha(shades[1][1]) < alpha(shades[2][1])  # the less likely, the deeper

        await pilot.press("f7")
        assert app.focused is view
        assert panel(view).splitlines() == [
            'token 3 of 3: " nice."  30.00%',
            '   35.00%  " maybe"',
            '   30.00%  " nice."',
            '   17.50%  " perhaps"',
            '    8.75%  " instead"',
            '    4.38%  " or"',
        ]
        assert styles(view)[2] == (" nice.", "reverse")  # the cursor
        await pilot.press("left")
        second = ['token 2 of 3: " is"  60.00%', '   60.00%  " is"', '   20.00%  " maybe"']
        assert panel(view).splitlines()[:3] == second
        assert [s for _, s in styles(view)][1:] == ["reverse", shades[2][1]]
        await pilot.press("home")
        assert panel(view).splitlines()[0] == 'token 1 of 3: "Paris"  90.00%'
        await pilot.press("escape")
        assert app.focused.id == "prompt" and not view.query_one(".alternatives").display
        assert styles(view) == shades  # no cursor left behind

        await set_probabilities(pilot, False)
        await pilot.press(*"Again?", "enter")
        await idle(pilot)
        assert engine.submitted[-1][1].logprobs is None
        assert not isinstance(app.chat.panes[0].reply_view, ShadedReply)
        await pilot.press("f7")
        assert isinstance(app.focused, PromptInput)  # nothing to enter: a notice says how to turn it on

    run(app, scenario)


def test_a_paragraph_ends_after_a_token_that_ends_a_line(monkeypatch):
    """Long replies redraw only their last paragraph as tokens arrive, and the paragraphs the cursor moves in."""
    monkeypatch.setattr(token_view, "PARAGRAPH_TOKENS", 2)
    pieces = [("One.\n", 0.5), ("Two", 1.0), (".\n", 0.25), ("Three", 1.0)]
    tokens = [ShownToken(text, p, ((text, p),)) for text, p in pieces]
    message = ChatMessage("assistant", "One.\nTwo.\nThree", finish_reason="stop", tokens=tokens)

    class Reply(App):
        def compose(self):
            yield ShadedReply(message)

    async def main():
        async with Reply().run_test() as pilot:
            await pilot.pause()
            paragraphs = list(pilot.app.query(TokenParagraph))
            assert [(p.start, p.end, p.visual.plain) for p in paragraphs] == [
                (0, 3, "One.\nTwo.\n"),  # not after "One.\n": a paragraph holds 2 tokens at least
                (3, 4, "Three"),
            ]

    asyncio.run(main())


def test_a_json_schema_is_checked_in_the_dialog_sent_with_requests_and_kept(tmp_path):
    engine = FakeEngine('{"name": "Paris"}')
    app = ChatApp(lambda *_: engine)
    schema_file = tmp_path / "city.json"
    schema_file.write_text(json.dumps(CITY))

    async def scenario(pilot):
        await engine_ready(pilot)
        screen = await set_probabilities(pilot, False, '{"type": "array", "uniqueItems": true}')
        assert app.screen is screen
        assert "the JSON schema is not supported" in str(screen.query_one("#error").render())
        assert "uniqueItems" in str(screen.query_one("#error").render())  # the part llguidance does not implement
        screen.query_one("#json_schema", TextArea).text = str(tmp_path / "missing.json")
        await pilot.press("ctrl+s")
        assert "cannot read the file" in str(screen.query_one("#error").render())
        screen.query_one("#json_schema", TextArea).text = str(schema_file)
        await pilot.press("ctrl+s")
        assert isinstance(app.screen, ChatScreen)
        assert "{} City" in str(app.chat.panes[0].border_title)

        await pilot.press(*"Capital of France?", "enter")
        await idle(pilot)
        assert engine.submitted[-1][1].grammar == Grammar("json_schema", json.dumps(CITY))

    run(app, scenario)
    history = History.open()
    reopened = Session.reopen(history, history.load(history.search()[0].id))
    assert reopened.settings.json_schema == json.dumps(CITY)
    assert reopened.settings.sampling_given()["grammar"] == Grammar("json_schema", json.dumps(CITY))


def test_a_schema_without_a_title_is_named_as_one():
    assert ChatSettings(json_schema='{"type": "object"}').schema_name == "JSON schema"
    assert ChatSettings().schema_name == ""
