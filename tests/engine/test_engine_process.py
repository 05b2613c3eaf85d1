"""The engine in a child process gives what the in-process engine gives, and its failures reach the caller."""

import time
from contextlib import contextmanager
from types import SimpleNamespace

import pytest

from llamaterm.engine.api import EngineConfig
from llamaterm.engine.errors import ModelNotFound, RequestError
from llamaterm.engine.sampling_params import Grammar, SamplingParams
from llamaterm.engine.serving.engine import Engine
from llamaterm.engine.serving.process import EngineProcess, Shutdown, Submit, take_requests
from tests.support.tiny_models import write_tiny_llama

pytestmark = pytest.mark.slow  # each test starts an engine process


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(write_tiny_llama(tmp_path_factory.mktemp("proc") / "tiny.gguf", context_length=256))


def test_same_tokens_as_in_process(tiny):
    prompts = ["Once upon a time", "The quick brown fox", "In a hole in the ground"]
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, seed=5)
    with Engine.from_model(EngineConfig(model=tiny, device="cpu")) as local:
        expected = [local.generate(p, params, raw=True)[1].token_ids for p in prompts]
    with EngineProcess(EngineConfig(model=tiny, device="cpu")) as remote:
        handles = [remote.submit(p, params, raw=True) for p in prompts]
        for handle, ids in zip(handles, expected, strict=True):
            events = list(handle.events())
            assert [t for e in events for t in e.token_ids] == ids
            assert events[-1].finish_reason == "length"
            assert handle.stats().finished and handle.stats().generated_tokens == 12
        assert remote.stats().model == "tiny"


def test_choices_submitted_together_fork_from_one_prefill(tiny):
    """A response's n choices, submitted together (as serve does), reach the child's scheduler in one step: the
    prompt is computed once (every other choice's prompt tokens come from it) and each choice samples what it
    samples alone."""
    prompt = [(13 * t) % 30000 + 5 for t in range(150)]
    params = [SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.9, seed=3 + i) for i in range(4)]
    with Engine.from_model(EngineConfig(model=tiny, device="cpu")) as local:
        expected = [local.generate(None, p, prompt_ids=prompt)[1].token_ids for p in params]
    with EngineProcess(EngineConfig(model=tiny, device="cpu")) as remote:
        with remote.together():
            handles = [remote.submit(None, p, prompt_ids=prompt) for p in params[:2]]
            with remote.together():  # nested: still the one message
                handles += [remote.submit(None, p, prompt_ids=prompt) for p in params[2:]]
        assert [[t for e in h.events() for t in e.token_ids] for h in handles] == expected
        assert [h.stats().cached_tokens for h in handles] == [0, 150, 150, 150]


def test_text_and_stop_strings_as_in_process(tiny):
    """The parent detokenizes and finds stop strings: the same text and finish as the in-process engine, and the
    child stops the request (its blocks come back)."""
    params = SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.9, seed=11)
    with Engine.from_model(EngineConfig(model=tiny, device="cpu")) as local:
        full = local.generate("Once upon a time", params, raw=True)[0]
        stop = full[len(full) // 2 : len(full) // 2 + 2]
        stopped = SamplingParams(**{**params.__dict__, "stop": (stop,)})
        expected = [local.generate(p, stopped, raw=True)[0] for p in ("Once upon a time", "The sea")]
    with EngineProcess(EngineConfig(model=tiny, device="cpu")) as remote:
        got = []
        for h in [remote.submit(p, stopped, raw=True) for p in ("Once upon a time", "The sea")]:
            events = list(h.events())
            got.append("".join(e.text for e in events))
            assert events[-1].finish_reason in ("stop", "length")
        assert got == expected and got[0] == full[: full.index(stop)]
        deadline = time.time() + 5
        while remote.stats().kv_blocks_used and time.time() < deadline:
            time.sleep(0.05)
        assert remote.stats().kv_blocks_used == 0


def test_cancel_and_errors_cross_the_process(tiny):
    with EngineProcess(EngineConfig(model=tiny, device="cpu")) as remote:
        with pytest.raises(RequestError, match="empty"):
            remote.submit("", raw=True)
        with pytest.raises(RequestError, match="context"):
            remote.submit("word " * 400, raw=True)
        handle = remote.submit("Tell me everything", SamplingParams(max_tokens=200, ignore_eos=True), raw=True)
        while handle.stats().generated_tokens < 2:
            time.sleep(0.01)
        remote.cancel(handle)
        assert list(handle.events())[-1].finish_reason == "cancelled"
        deadline = time.time() + 5
        while remote.stats().kv_blocks_used and time.time() < deadline:
            time.sleep(0.05)
        assert remote.stats().kv_blocks_used == 0


def test_a_request_the_engine_fails_on_is_refused_and_the_process_serves_on(tiny):
    """An exception other than LlamatermError in the child's submit ended the child: every later request of
    `llamaterm serve` then got 503. A prompt of the wrong type is now refused in the parent, which encodes it."""
    with EngineProcess(EngineConfig(model=tiny, device="cpu")) as remote:
        with pytest.raises(RequestError, match="chat messages"):
            remote.submit(42, raw=True)  # type: ignore[arg-type]
        events = list(
            remote.submit("Once upon a time", SamplingParams(max_tokens=3, ignore_eos=True), raw=True).events()
        )
        assert events[-1].finish_reason == "length"


def test_a_missing_model_fails_at_start():
    with pytest.raises(ModelNotFound):
        EngineProcess(EngineConfig(model="no-such-model", device="cpu"))


def test_a_message_s_grammars_are_readied_before_the_engine_s_lock_is_taken():
    """The child builds what a message's grammars need (the model's grammar vocabulary, seconds the first time;
    each grammar's compiled matcher) before together() takes the engine's lock, which its steps wait for; then it
    submits the message's requests under that lock."""
    grammar = Grammar("json")
    calls: list = []

    class Recorder:  # the engine's side of take_requests
        def ready_grammars(self, grammars):
            calls.append(("ready", grammars))

        @contextmanager
        def together(self):
            calls.append("lock")
            yield
            calls.append("unlock")

        def add(self, request_id, prompt_ids, params):
            calls.append(("add", request_id))

    messages = iter(
        [[Submit(1, [5, 6], SamplingParams(grammar=grammar)), Submit(2, [7], SamplingParams())], Shutdown()]
    )
    conn = SimpleNamespace(recv=lambda: next(messages))
    take_requests(conn, Recorder(), lambda outputs, cached: None)
    assert calls == [("ready", [grammar]), "lock", ("add", 1), ("add", 2), "unlock"]
