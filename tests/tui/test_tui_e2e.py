"""End to end on the real models (CPU): two panes on one engine, a local pane beside a pane on `llamaterm serve`,
and two panes on two local models."""

from dataclasses import replace

import pytest
from textual.widgets import Markdown

from llamaterm.app.tui.app import ChatApp
from llamaterm.app.tui.backends import Backend, Loader
from llamaterm.app.tui.session import ChatSettings
from llamaterm.engine.store.model_store import resolve_model
from tests.support.serve_support import llamaterm_serve
from tests.support.tiny_models import write_tiny_llama
from tests.support.tui_support import idle, run, wait_until

DEFAULT = resolve_model(None)  # from the user's store, before a test moves the history to its tmp_path


@pytest.mark.slow
def test_two_panes_stream_a_broadcast_question(tmp_path, monkeypatch):
    model = str(resolve_model(None))  # from the user's store, before the history moves to tmp_path
    monkeypatch.setenv("LLAMATERM_HOME", str(tmp_path))

    def load_engine(*_):
        from llamaterm.engine.api import EngineConfig
        from llamaterm.engine.serving.process import EngineProcess

        return EngineProcess(EngineConfig(model=model))

    app = ChatApp(load_engine, sessions=2, settings=ChatSettings(system="You are a helpful assistant."))

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


def ask_each_pane(app: ChatApp, question: str, max_tokens: int, check):
    """Ask every pane the question (settings kept but max_tokens, and greedy), wait for the replies, then
    check(chat)."""

    async def scenario(pilot):
        chat = app.chat
        for pane in chat.panes:
            pane.session.configure(replace(pane.session.settings, max_tokens=max_tokens, temperature=0))
        await wait_until(pilot, lambda: len(chat.engines) == len(chat.backends()), timeout=300)
        await pilot.press(*question, "enter")
        await wait_until(pilot, lambda: not any(p.session.busy for p in chat.panes), timeout=300)
        await idle(pilot)
        chat.refresh_stats()
        check(chat)

    return scenario


@pytest.mark.slow
def test_a_local_pane_beside_a_pane_on_llamaterm_serve(tmp_path, monkeypatch):
    with llamaterm_serve("--device", "cpu") as url:
        monkeypatch.setenv("LLAMATERM_HOME", str(tmp_path))  # the history; the server has read the store
        app = ChatApp(
            lambda b, share: Loader()(b, share),
            sessions=2,
            backends=[Backend(str(DEFAULT)), Backend(server=url)],
        )

        def check(chat):
            here, there = (p.session for p in chat.panes)
            # the same model, greedy: the same reply and token counts, whichever side of the HTTP it ran
            assert here.messages[-1].content == there.messages[-1].content and "Paris" in here.messages[-1].content
            assert here.stats.generated_tokens == there.stats.generated_tokens > 0
            assert here.stats.prompt_tokens == there.stats.prompt_tokens
            assert there.stats.ttft_s > 0 and there.stats.tokens_per_s > 0

        run(app, ask_each_pane(app, "What is the capital of France?", 12, check))


@pytest.mark.slow
def test_two_panes_on_two_local_models(tmp_path, monkeypatch):
    tiny = write_tiny_llama(tmp_path / "tiny.gguf", context_length=256)
    monkeypatch.setenv("LLAMATERM_HOME", str(tmp_path))
    app = ChatApp(lambda b, share: Loader()(b, share), sessions=2, backends=[Backend(str(DEFAULT)), Backend(str(tiny))])

    def check(chat):
        names = [chat.engines[p.session.settings.backend].model_name for p in chat.panes]
        assert names == [DEFAULT.stem, "tiny"]
        for pane in chat.panes:
            assert pane.session.messages[-1].finish_reason in ("stop", "length")
            assert pane.session.stats.generated_tokens > 0
        status = str(chat.query_one("#status").render())
        assert all(f"{name} on cpu" in status for name in names)

    run(app, ask_each_pane(app, "Hello!", 6, check))
