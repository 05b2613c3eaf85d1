"""A reply streamed in small pieces ends up exactly as if it had been rendered in one go."""

import asyncio

import pytest
from textual.app import App, ComposeResult
from textual.widgets import Markdown

from llamaterm.app.tui.session import ChatMessage
from llamaterm.app.tui.widgets.transcript import ReplyMessage, streamed_blocks_match
from tests.support.fake_engine import REPLY

DOCUMENTS = {
    "code": REPLY,
    "setext heading": "para\nHeading\n---\nmore",
    "lists": "- a\n- b\n\n  nested para\n\n1. x\n2. y\n",
    "table": "| a | b |\n|---|---|\n| 1 | 2 |\n| 3 | 4 |\n\nafter",
    "fence with blank lines, quote, rule": "```\ncode\n\n\nmore code\n```\n> quote\n> more\n\n***\n",
    "reference link defined after use": "see [x]\n\n[x]: http://a.b\n",  # streaming gets this one wrong
}


class Host(App):
    def __init__(self, content: str):
        super().__init__()
        self.message = ChatMessage("assistant", content, answer=content)

    def compose(self) -> ComposeResult:
        yield ReplyMessage(self.message)


def render(text: str, streamed: bool) -> tuple[str, bool | None]:
    """The screen after the reply ends, and whether the streamed blocks matched before the final render."""

    async def main():
        app = Host("" if streamed else text)
        async with app.run_test(size=(60, 30)) as pilot:
            matched = None
            if streamed:
                view = app.query_one(ReplyMessage)
                for i in range(0, len(text), 3):
                    view.message.answer += text[i : i + 3]
                    await view.draw_new_text()
                    await pilot.pause(0)
                await pilot.pause()
                matched = streamed_blocks_match(view.query_one(Markdown))
                await view.finish()
            await pilot.pause()
            return app.export_screenshot(), matched

    return asyncio.run(main())


@pytest.mark.parametrize("name", DOCUMENTS)
def test_a_finished_reply_looks_like_a_full_render(name):
    text = DOCUMENTS[name]
    streamed, matched = render(text, streamed=True)
    full, _ = render(text, streamed=False)
    assert matched == (name != "reference link defined after use")  # the check catches what streaming got wrong
    assert streamed == full


def test_a_reply_not_yet_mounted_waits_for_the_next_draw():
    """The screen's tick may come between a reply's view being made and its mounting (which makes its Markdown):
    the text waits, and the next draw, mounted, shows it."""

    async def main():
        app = Host("")
        async with app.run_test(size=(60, 30)) as pilot:
            early = ReplyMessage(ChatMessage("assistant", ""))
            early.message.answer = "streamed **text**"
            await early.draw()  # not mounted: nothing to draw into yet
            assert early.lagging
            await app.mount(early)
            await early.draw()
            await pilot.pause()
            assert not early.lagging and early.query_one(Markdown).source == "streamed **text**"

    asyncio.run(main())
