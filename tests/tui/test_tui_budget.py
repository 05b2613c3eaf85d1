"""The render budget: the UI thread's busy time caps how often streamed text is drawn, never what is drawn."""

import time

from textual.widgets import Markdown

from llamaterm.app.tui.app import ChatApp
from llamaterm.app.tui.budget import RenderBudget
from llamaterm.app.tui.widgets.chat_pane import ChatPane
from tests.support.fake_engine import REPLY, FakeEngine
from tests.support.tui_support import engine_ready, idle, run


def spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_busy_time_spends_the_share_and_waiting_refills_it():
    budget = RenderBudget(share=0.5, burst_s=0.1, max_wait_s=60)
    assert budget.allows()
    spin(0.3)
    assert not budget.allows()  # 0.3 s busy against 0.1 s held + 0.15 s earned
    time.sleep(0.5)
    assert budget.allows()


def test_text_waits_at_most_max_wait():
    budget = RenderBudget(share=0.0, burst_s=0.0, max_wait_s=0.2)
    spin(0.05)
    assert not budget.allows()
    time.sleep(0.2)
    assert budget.allows()
    spin(0.05)
    assert not budget.allows()


def test_a_tight_budget_draws_fewer_larger_batches_and_all_the_text(tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMATERM_HOME", str(tmp_path))
    draws = []
    draw = ChatPane.draw

    async def counted(self):
        draws.append(len(self.reply_view.message.content) - self.reply_view.shown)
        await draw(self)

    monkeypatch.setattr(ChatPane, "draw", counted)
    app = ChatApp(lambda *_: FakeEngine(REPLY * 3, tokens_per_s=200))

    async def scenario(pilot):
        app.chat.render_budget = RenderBudget(share=0.0, burst_s=0.0, max_wait_s=0.3)
        await engine_ready(pilot)
        start = time.monotonic()
        await pilot.press(*"go", "enter")
        await idle(pilot)
        elapsed = time.monotonic() - start
        assert app.chat.panes[0].reply_view.query_one(Markdown).source == REPLY * 3
        # At 25 ticks a second it would draw about 15 times; the budget draws every 0.3 s, and once at the end.
        assert 2 <= len(draws) <= elapsed / 0.3 + 2, (draws, elapsed)

    run(app, scenario)


def test_an_ample_share_draws_every_tick():
    budget = RenderBudget(share=1.0)
    assert all(budget.allows() for _ in range(100))
