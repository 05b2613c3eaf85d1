"""Pilot tests of the panes' backends: several models side by side, a pane moving to another model, a model that
does not load, and a pane on an OpenAI-compatible server (the server's app over the fake engine)."""

import json

import pytest
from textual.widgets import Input

from llamaterm.app.announcements import Announcer, ServedModel
from llamaterm.app.tui import backends
from llamaterm.app.tui.app import ChatApp
from llamaterm.app.tui.backends import Backend
from llamaterm.app.tui.screens import chat
from llamaterm.app.tui.screens.settings import SettingsScreen
from llamaterm.app.tui.widgets.stats import StatusBar
from llamaterm.engine.errors import ModelNotFound
from tests.support.fake_engine import REPLY, FakeEngine
from tests.support.serve_support import app_server, free_port
from tests.support.tui_support import idle, run, wait_until


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMATERM_HOME", str(tmp_path))
    monkeypatch.setattr(chat, "RENDER_SHARE", 1.0)
    return tmp_path


class FakeLoader:
    """A fake engine per backend, named after its model; models named "broken" do not load. Each takes its
    kv_share of what is left of a device's memory (1.0 in all), as Engine's default pool does."""

    def __init__(self, **options):
        self.options, self.engines, self.taken = options, {}, {}
        self.free = 1.0

    def __call__(self, backend: Backend, kv_share: float):
        if backend.model == "broken":
            raise ModelNotFound("no model named 'broken'")
        self.taken[backend] = kv_share * self.free
        self.free -= self.taken[backend]
        name = backend.model or "default"
        engine = self.engines[backend] = FakeEngine(lambda messages: f"{name} says hi", model_name=name, **self.options)
        return engine


def status_text(app: ChatApp) -> str:
    return str(app.chat.query_one(StatusBar).render())


async def all_loaded(pilot, count: int) -> None:
    await wait_until(pilot, lambda: len(pilot.app.chat.engines) == count)
    await pilot.pause()


def test_two_local_models_side_by_side_answer_the_same_question():
    loader = FakeLoader()
    app = ChatApp(loader, sessions=2, backends=[Backend("alpha"), Backend("beta")])

    async def scenario(pilot):
        await all_loaded(pilot, 2)
        # the memory split evenly between them (it was 1/2 each of what was free: a half, then a quarter)
        assert loader.taken == {Backend("alpha"): 0.5, Backend("beta"): 0.5}
        await pilot.press(*"hello", "enter")
        await idle(pilot)
        panes = app.chat.panes
        assert [p.session.messages[-1].content for p in panes] == ["alpha says hi", "beta says hi"]
        assert [p.border_subtitle for p in panes] == ["alpha", "beta"]
        assert [e.submitted[0][0][-1]["content"] for e in loader.engines.values()] == ["hello", "hello"]
        app.chat.refresh_stats()
        assert "alpha on cpu" in status_text(app) and "beta on cpu" in status_text(app)

    run(app, scenario)


def stored(home, name: str) -> None:
    """A model of that name in the test's store, for the settings dialog, which checks that a local model is there
    (the fake loader never reads it)."""
    folder = home / "models" / name
    folder.mkdir(parents=True)
    manifest = {"format": "gguf", "files": [{"path": f"{name}.gguf", "size": 0}]}
    (folder / "llamaterm.json").write_text(json.dumps(manifest))


def test_a_pane_moved_to_another_model_gets_its_own_engine_and_the_unused_one_stops(home):
    stored(home, "gamma")
    loader = FakeLoader()
    app = ChatApp(loader, sessions=2)

    async def scenario(pilot):
        await all_loaded(pilot, 1)
        await pilot.press("ctrl+s")
        screen = app.screen
        assert isinstance(screen, SettingsScreen)
        screen.query_one("#model", Input).value = "gamma"
        await pilot.press("ctrl+s")
        await all_loaded(pilot, 2)
        await pilot.press(*"hi", "enter")
        await idle(pilot)
        assert [p.session.messages[-1].content for p in app.chat.panes] == ["gamma says hi", "default says hi"]
        assert app.chat.panes[0].session.settings.model == "gamma"  # saved with the conversation

        app.chat.panes[1].query_one(".pane-input").focus()
        await pilot.press("f8")  # the last pane on the default model closes: its engine stops
        await wait_until(pilot, lambda: list(app.chat.engines) == [Backend("gamma")])
        await wait_until(pilot, lambda: loader.engines[Backend()]._stopped)

    run(app, scenario)


def test_a_model_that_does_not_load_fails_its_panes_only():
    loader = FakeLoader()
    app = ChatApp(loader, sessions=2, backends=[Backend("broken"), Backend()])

    async def scenario(pilot):
        await wait_until(pilot, lambda: app.chat.failed and app.chat.engines)
        await pilot.press(*"hello", "enter")  # the broken one is tried again, and fails again
        await idle(pilot)
        broken, working = app.chat.panes
        assert broken.session.messages[-1].finish_reason == "error"
        assert "no model named 'broken'" in str(broken.reply_view.query_one(".note").render())
        assert working.session.messages[-1].content == "default says hi"
        assert "broken did not load" in status_text(app)

    run(app, scenario)


def test_a_pane_on_a_server_beside_a_local_pane():
    served = FakeEngine(model_name="served-llama", tokens_per_s=100)
    local = FakeEngine(model_name="local-llama")
    with served, app_server(served, api_key="k") as url:

        def load(backend: Backend, kv_share: float):
            return backends.Loader("k")(backend, kv_share) if backend.server else local

        app = ChatApp(load, sessions=2, backends=[Backend(), Backend(server=url)])

        async def scenario(pilot):
            await all_loaded(pilot, 2)
            await pilot.press(*"hello", "enter")
            await idle(pilot)
            here, there = app.chat.panes
            assert here.session.messages[-1].content == there.session.messages[-1].content == REPLY
            assert there.border_subtitle == f"served-llama @ {url.split('/')[2]}"
            stats = there.session.stats  # measured from the stream; token counts from the server's usage
            assert stats.generated_tokens == here.session.stats.generated_tokens
            assert stats.prompt_tokens == here.session.stats.prompt_tokens
            assert stats.ttft_s > 0 and stats.tokens_per_s > 0
            assert "ctx" in str(there.query_one(".pane-stats").render())

            # a request the server refuses ends that pane's reply with its reason; the local pane is untouched
            served.max_context = 3
            await pilot.press(*"a prompt longer than three words", "enter")
            await idle(pilot)
            assert there.session.messages[-1].finish_reason == "error"
            assert "refused the request (400)" in there.session.messages[-1].error
            assert here.session.messages[-1].content == REPLY and here.session.messages[-1].error is None

        run(app, scenario)


def test_a_server_failing_mid_reply_fails_that_pane_only():
    served = FakeEngine(model_name="served-llama", hold=True)
    local = FakeEngine(model_name="local-llama")
    with served, app_server(served) as url:
        app = ChatApp(
            lambda b, share: backends.Loader()(b, share) if b.server else local,
            sessions=2,
            backends=[Backend(), Backend(server=url)],
        )

        async def scenario(pilot):
            await all_loaded(pilot, 2)
            here, there = app.chat.panes
            await pilot.press(*"hello", "enter")
            await wait_until(pilot, lambda: there.session.messages[-1].content == REPLY)
            served.shutdown()  # the server's engine ends every request as cancelled: the stream fails
            await wait_until(pilot, lambda: not there.session.busy)
            assert there.session.messages[-1].finish_reason == "error"
            assert "shutting down" in there.session.messages[-1].error
            assert here.session.messages[-1].content == REPLY and here.session.messages[-1].error is None

        run(app, scenario)


def test_a_pane_put_on_a_server_in_its_settings_and_a_server_that_is_down():
    """The per-pane backend choice as a user makes it: ctrl+s, the Server field, save. A server that is down is
    one line in that pane (and the status bar); the other pane keeps its local model."""
    served = FakeEngine(lambda messages: "from the server", model_name="served-llama")
    local = FakeEngine(model_name="local-llama")
    with served, app_server(served) as url:
        app = ChatApp(lambda b, share: backends.Loader()(b, share) if b.server else local, sessions=2)

        async def settings_server(pilot, pane: int, server: str) -> None:
            app.chat.panes[pane].query_one(".pane-input").focus()
            await pilot.press("ctrl+s")
            assert isinstance(app.screen, SettingsScreen)
            app.screen.query_one("#server", Input).value = server
            await pilot.press("ctrl+s")

        async def scenario(pilot):
            await all_loaded(pilot, 1)
            await settings_server(pilot, 0, url)
            await all_loaded(pilot, 2)
            app.query_one("#prompt").focus()  # the prompt that asks every pane
            await pilot.press(*"hello", "enter")
            await idle(pilot)
            there, here = app.chat.panes
            assert there.session.messages[-1].content == "from the server"
            assert here.session.messages[-1].content == REPLY
            assert there.border_subtitle == f"served-llama @ {url.split('/')[2]}"

            await settings_server(pilot, 0, "http://127.0.0.1:9/v1")  # the discard port: nothing listens
            await wait_until(pilot, lambda: app.chat.failed)
            app.query_one("#prompt").focus()
            await pilot.press(*"again", "enter")
            await idle(pilot)
            assert there.session.messages[-1].finish_reason == "error"
            assert "cannot reach the server at http://127.0.0.1:9/v1" in there.session.messages[-1].error
            assert here.session.messages[-1].content == REPLY and here.session.messages[-1].error is None
            assert "cannot reach the server" in status_text(app)

        run(app, scenario)


def model_file(folder) -> str:
    """What a server announces it holds: a file that is no model, so a pane that loaded it here would fail."""
    path = folder / "model.gguf"
    path.write_bytes(b"not a model")
    return str(path.resolve())


def test_a_local_pane_uses_the_server_on_this_machine_that_holds_its_model(tmp_path):
    """As `run` does: the pane's model is not loaded a second time where a `llamaterm serve` holds it."""
    model, engine = model_file(tmp_path), FakeEngine(max_context=4096)
    found = Announcer("127.0.0.1", free_port(), "cpu", [ServedModel("fake-llama", model, None, None)])
    with engine, app_server(engine, None, found):
        app = ChatApp(backends.Loader(), backends=[Backend(model)])

        async def scenario(pilot):
            await all_loaded(pilot, 1)
            await pilot.press(*"hello", "enter")
            await idle(pilot)
            assert app.chat.panes[0].session.messages[-1].content == REPLY
            assert engine.submitted[-1][0][-1] == {"role": "user", "content": "hello"}
            assert f"The llamaterm serve at {found.url} holds it" in "\n".join(n.message for n in app._notifications)
            assert status_text(app).startswith(f"fake-llama on 127.0.0.1:{found.port} │ ctx 4096 │")

        run(app, scenario)


@pytest.mark.slow  # the engine process starts, and fails on the file
@pytest.mark.parametrize("loader", [backends.Loader(local=True), backends.Loader(shape={"context_length": 64})])
def test_local_or_a_flag_that_shapes_the_engine_loads_the_model_here(tmp_path, loader):
    model, engine = model_file(tmp_path), FakeEngine()
    found = Announcer("127.0.0.1", free_port(), "cpu", [ServedModel("fake-llama", model, None, None)])
    with engine, app_server(engine, None, found):
        app = ChatApp(loader, backends=[Backend(model)])

        async def scenario(pilot):
            await wait_until(pilot, lambda: app.chat.failed, timeout=60)
            assert "not a GGUF file" in status_text(app) and not engine.submitted

        run(app, scenario)
