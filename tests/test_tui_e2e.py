"""End to end on the real default model (CPU): two panes, one broadcast prompt, both answers stream, stats move."""

import pytest
from textual.widgets import Markdown
from tui_support import idle, run, wait_until

from llamaterm.app.tui.app import ChatApp
from llamaterm.app.tui.session import ChatSettings
from llamaterm.engine.store.model_store import resolve_model


@pytest.mark.slow
def test_two_panes_stream_a_broadcast_question(tmp_path, monkeypatch):
    model = str(resolve_model(None))  # from the user's store, before the history moves to tmp_path
    monkeypatch.setenv("LLAMATERM_HOME", str(tmp_path))

    def load_engine(*_):
        from llamaterm.engine.api import EngineConfig
        from llamaterm.engine.serving.process import EngineProcess

        return EngineProcess(EngineConfig(model=model))

    app = ChatApp(load_engine, sessions=2, system="You are a helpful assistant.")

    async def scenario(pilot):
        chat = app.chat
        panes = chat.panes
        for pane in panes:
            pane.session.configure(ChatSettings(system=pane.session.settings.system, max_tokens=24))
        await pilot.press(*"Write a short poem about the sea.", "enter")  # likely typed while the model loads
        await wait_until(pilot, lambda: chat.engine is not None, timeout=300)

        seen_lengths = [set(), set()]
        seen_rates, seen_batch = [], []

        def sample() -> bool:
            for lengths, pane in zip(seen_lengths, panes, strict=True):
                lengths.add(len(pane.session.messages[-1].content))
            stats = chat.engine.stats()
            seen_batch.append(stats.batch_size)
            seen_rates.extend(p.session.stats.tokens_per_s for p in panes if p.session.stats)
            return not any(p.session.busy for p in panes)

        await wait_until(pilot, sample, timeout=300)
        await idle(pilot)

        for lengths, pane in zip(seen_lengths, panes, strict=True):
            reply = pane.session.messages[-1]
            assert reply.finish_reason in ("stop", "length") and reply.content.strip()
            assert len(lengths) >= 3, "the reply arrived in one piece instead of streaming"
            assert pane.reply_view.query_one(Markdown).source == reply.content
            assert pane.session.stats.generated_tokens > 0 and pane.session.stats.ttft_s > 0
        assert max(seen_batch) == 2  # both panes in one batch
        assert max(seen_rates) > 0
        status = str(chat.query_one("#status").render())
        assert "SmolLM2" in status and "cpu" in status

    run(app, scenario)
