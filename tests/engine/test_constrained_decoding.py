"""Replies under a grammar (SamplingParams.grammar): a random model's sampled replies match the JSON schema, the
regular expression or the Lark grammar they were given (pydantic, re and a hand-written parse are the oracles),
alone and in batches beside free rows, with steps overlapped or not; seeded replies repeat; a grammar that never
ends stops at max_tokens; a fill of the masks that fails ends its step's requests, and the engine goes on; tokens a
grammar forces are taken unsampled, a few steps a run, up to max_tokens, but where log-probabilities are asked."""

import json
import re
import sys
import threading
from typing import Annotated

import pydantic
import pytest
import torch

from llamaterm.engine.api import EngineConfig
from llamaterm.engine.sampling_params import Grammar, SamplingParams
from llamaterm.engine.serving import model_runner
from llamaterm.engine.serving.engine import Engine
from llamaterm.engine.serving.grammar import Vocabulary
from tests.support.engine_checks import assert_every_block_back
from tests.support.tiny_models import write_tiny_llama


class Person(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    name: str = pydantic.Field(max_length=12)
    age: int
    tags: list[Annotated[str, pydantic.StringConstraints(max_length=8)]] = pydantic.Field(max_length=3)  # bounded noise


PERSON = Grammar("json_schema", json.dumps(Person.model_json_schema()))
DATE = r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
SUM = 'start: NUMBER " + " NUMBER " = " NUMBER\nNUMBER: /[1-9][0-9]{0,2}/'
SAMPLED = dict(temperature=1.0, top_p=0.95, max_tokens=120)

pytestmark = pytest.mark.slow  # a model's replies on the CPU, seconds each


@pytest.fixture(
    scope="module",
    params=[("cpu", False), ("cpu", True), pytest.param(("cuda", None), marks=pytest.mark.cuda)],
    ids=["stepwise", "overlapped", "cuda"],
)
def engine(request, tmp_path_factory):
    """A random Llama with the default model's vocabulary: its replies are noise unless a grammar holds them. On
    CUDA the steps overlap and replay from graphs, the masks written between the forward pass and the sampler."""
    device, overlap = request.param
    model = write_tiny_llama(tmp_path_factory.mktemp("grammar") / "tiny.gguf", context_length=512)
    with Engine.from_model(EngineConfig(model=str(model), device=device, overlap=overlap)) as e:
        yield e


def reply(engine: Engine, grammar: Grammar, seed: int, **params) -> tuple[str, str | None]:
    events = list(engine.submit("Hi", SamplingParams(grammar=grammar, seed=seed, **(SAMPLED | params))).events())
    assert events[-1].error is None, events[-1].error
    return "".join(e.text for e in events), events[-1].finish_reason


def test_json_schema_regex_and_lark_replies_match_in_one_batch(engine):
    handles = []
    for seed in range(3):
        for grammar in (PERSON, Grammar("regex", DATE), Grammar("lark", SUM), None):
            params = SamplingParams(grammar=grammar, seed=seed, **SAMPLED)
            handles.append((grammar, engine.submit("Hi", params)))
    for grammar, handle in handles:
        events = list(handle.events())
        text, end = "".join(e.text for e in events), events[-1]
        assert end.error is None, end.error
        if grammar is None:
            continue
        assert end.finish_reason == "stop", (grammar, text)
        if grammar is PERSON:
            Person.model_validate_json(text)
        elif grammar.kind == "regex":
            assert re.fullmatch(DATE, text), text
        else:
            a, b, c = map(int, re.fullmatch(r"(\d+) \+ (\d+) = (\d+)", text).groups())
            assert max(a, b, c) < 1000


def test_a_seeded_constrained_reply_repeats_alone_and_in_a_batch(engine):
    alone = reply(engine, PERSON, seed=11)
    crowd = [engine.submit("Hi", SamplingParams(seed=s, **SAMPLED)) for s in range(5)]
    again = reply(engine, PERSON, seed=11)
    for h in crowd:
        list(h.events())
    assert again == alone


def test_a_grammar_the_model_never_ends_stops_at_max_tokens(engine):
    never = tuple((t, -100.0) for t in engine.tokenizer.stop_ids)  # the grammar may end after any "ab": never here
    text, reason = reply(engine, Grammar("regex", "(ab)+"), seed=1, max_tokens=9, logit_bias=never)
    assert reason == "length" and re.fullmatch("(ab)+a?", text), text


def test_masks_that_fail_end_their_steps_requests_and_the_next_ones_are_served(engine, monkeypatch):
    fill, calls = model_runner.fill_bitmasks, []

    def fails_once(*args):
        calls.append(1)
        if len(calls) == 3:  # a reply under way
            raise RuntimeError("the masks broke")
        fill(*args)

    monkeypatch.setattr(model_runner, "fill_bitmasks", fails_once)
    events = list(engine.submit("Hi", SamplingParams(grammar=PERSON, seed=3, **SAMPLED)).events())
    assert events[-1].finish_reason == "error" and "the masks broke" in events[-1].error
    text, reason = reply(engine, PERSON, seed=3)  # the engine still serves, masks and all
    assert reason == "stop" and Person.model_validate_json(text)
    assert reply(engine, None, seed=3)[1] == "length"


# the steps overlap: a step's masks are filled as the step before ends, in two parts where runs are taken
OVERLAPPED = [("cpu", True), pytest.param(("cuda", None), marks=pytest.mark.cuda)]


@pytest.mark.parametrize("engine", OVERLAPPED, indirect=True, ids=["overlapped", "cuda"])
def test_a_first_fill_that_fails_ends_its_step_s_requests_too(engine, monkeypatch):
    """A step's masks may fill in two parts (the rows whose grammars force text next after their runs are taken;
    a row that asks for log-probabilities takes none): a failure of the first is the step's, not masks left from
    an earlier step."""
    fill, asked, failed = model_runner.fill_bitmasks, set(), []

    def first_of_two_fails(matchers, *args):
        # b's grammar forces text next: it fills second, alone
        if matchers and asked and not asked & set(map(id, matchers)) and not failed:
            failed.append(1)
            raise RuntimeError("the masks broke")
        fill(matchers, *args)

    made, matcher = [], Vocabulary.matcher  # the matchers of the requests' sequences, as the engine makes them
    monkeypatch.setattr(Vocabulary, "matcher", lambda self, g: made.append(matcher(self, g)) or made[-1])
    monkeypatch.setattr(model_runner, "fill_bitmasks", first_of_two_fails)
    a = engine.submit("Hi", SamplingParams(grammar=PERSON, seed=3, **SAMPLED))
    b = engine.submit("Hi", SamplingParams(grammar=PERSON, seed=4, logprobs=0, **SAMPLED))
    asked.add(id(made[-1]))  # b's
    ends = [list(h.events())[-1] for h in (a, b)]
    assert failed and all(e.finish_reason == "error" and "the masks broke" in e.error for e in ends), ends


def test_python_s_switch_interval_is_its_own_after_a_step_s_two_fills(engine):
    """A fill lowers Python's switch interval until it starts (model_runner._fill): a step's two fills, both
    waiting to start, put it back (the second found the lowered one and kept it, for good)."""
    before, runner, gate = sys.getswitchinterval(), engine.core.runner, threading.Event()
    runner._mask_filler.submit(gate.wait)  # the masks' thread busy: neither fill starts before both are queued
    try:
        bitmask = torch.zeros(1, 1, dtype=torch.int32)
        first = runner._fill([], bitmask, (0, 1), None)
        second = runner._fill([], bitmask, (0, 1), first)
        assert sys.getswitchinterval() == pytest.approx(model_runner.MASK_SWITCH_S)
    finally:
        gate.set()
    assert second.result()[:2] == (0, 1) and sys.getswitchinterval() == before


def test_a_seeded_reply_is_the_same_whatever_replies_came_before(engine):
    """Forced runs are kept by their text and shared (grammar.Vocabulary.forced_run): the text `, ` comes before
    digits in one branch and before a word in the other, where a piece of the vocabulary that begins with a space
    may follow; a branch's reply is the same as the first of its grammar and after the other branch's. (The
    grammar's text differs by its trailing newlines: each is compiled, and its runs were kept, anew.)"""

    def both(n: int) -> Grammar:
        return Grammar("lark", 'start: "A" ("1" ", " /[0-9]{1,6}/ | "2" ", " /[a-z]{1,6}/)' + "\n" * n)

    branches = {}
    for seed in range(12):
        branches.setdefault(reply(engine, both(0), seed=seed, max_tokens=20)[0][:2], seed)
    assert set(branches) == {"A1", "A2"}, branches
    for n, (first, second) in enumerate((("A1", "A2"), ("A2", "A1"))):
        alone = reply(engine, both(2 * n + 1), seed=branches[second], max_tokens=20)
        reply(engine, both(2 * n + 2), seed=branches[first], max_tokens=20)
        assert reply(engine, both(2 * n + 2), seed=branches[second], max_tokens=20) == alone


FORCED = "The answer, in full: forty-two and no other number."


def stream(engine: Engine, grammar: Grammar, **params) -> list:
    events = list(engine.submit("Hi", SamplingParams(grammar=grammar, **(SAMPLED | params))).events())
    assert events[-1].error is None, events[-1].error
    return events


def test_tokens_a_grammar_forces_are_taken_without_sampling_each(engine):
    """Fast-forward: a reply the grammar spells out takes a few steps, not one a token (its tokens are computed in
    one chunk, unsampled), and arrives whole; under the schema, a reply's keys and punctuation are forced."""
    steps = engine.step_stats().steps
    events = stream(engine, Grammar("regex", re.escape(FORCED)), seed=1)
    tokens = [t for e in events for t in e.token_ids]
    assert "".join(e.text for e in events) == FORCED and events[-1].finish_reason == "stop"
    assert len(tokens) >= 10 and engine.step_stats().steps - steps <= 4, (
        len(tokens),
        engine.step_stats().steps - steps,
    )
    steps = engine.step_stats().steps
    events = stream(engine, PERSON, seed=2)
    tokens = [t for e in events for t in e.token_ids]
    Person.model_validate_json("".join(e.text for e in events))
    assert engine.step_stats().steps - steps <= len(tokens) - 5, (len(tokens), engine.step_stats().steps - steps)
    assert_every_block_back(engine)


def test_a_forced_run_stops_at_max_tokens(engine):
    for most in (1, 2, 3, 7):
        events = stream(engine, Grammar("regex", re.escape(FORCED)), seed=1, max_tokens=most)
        assert sum(len(e.token_ids) for e in events) == most and events[-1].finish_reason == "length"
        assert FORCED.startswith("".join(e.text for e in events))
    assert_every_block_back(engine)


def test_every_token_is_sampled_where_log_probabilities_are_asked(engine):
    """A forced token would have no log-probability of its own: a request that asks for them samples each."""
    events = stream(engine, Grammar("regex", re.escape(FORCED)), seed=1, logprobs=0)
    assert "".join(e.text for e in events) == FORCED
    assert all(len(e.logprobs) == len(e.token_ids) for e in events if not e.finished)
    assert sum(len(e.logprobs) for e in events) >= 10


def test_forced_runs_beside_free_and_penalised_rows_in_one_batch(engine):
    """Rows with forced runs, rows sampling every token (a penalty on) and free rows share steps; each reply is as
    its grammar says and every block comes back."""
    handles = []
    for seed in range(4):
        for grammar, extra in ((PERSON, {}), (PERSON, {"presence_penalty": 1.5}), (None, {})):
            handles.append(
                (grammar, engine.submit("Hi", SamplingParams(grammar=grammar, seed=seed, **(SAMPLED | extra))))
            )
    for grammar, handle in handles:
        events = list(handle.events())
        assert events[-1].error is None, events[-1].error
        if grammar is not None:
            Person.model_validate_json("".join(e.text for e in events))
    assert_every_block_back(engine)


def test_a_forced_run_counts_in_the_penalties(tmp_path):
    """The tokens a penalised request's grammar forced count in its penalties as sampled ones do: its sampler slot's
    counts are the histogram of its reply (stepwise, where no step samples past the reply's end)."""
    model = write_tiny_llama(tmp_path / "tiny.gguf", context_length=512)
    with Engine.from_model(EngineConfig(model=str(model), device="cpu", overlap=False)) as engine:
        events = stream(engine, Grammar("regex", re.escape(FORCED) + " ?"), seed=1, presence_penalty=1.0)
        tokens = [t for e in events for t in e.token_ids]
        slot = engine.core.scheduler.free_slots[-1]  # the slot it had, free again
        counts = engine.core.runner.sampler.tables.counts[slot]
        expected = torch.bincount(torch.tensor(tokens), minlength=counts.numel()).to(counts.dtype)
        assert engine.step_stats().steps <= len(tokens) - 5 and torch.equal(counts, expected)


@pytest.mark.parametrize("limits", [{"max_batch_tokens": 8}, {"kv_tokens": 200}], ids=["chunks cut short", "preempted"])
def test_forced_runs_whole_where_chunks_are_cut_short_or_preempted(tmp_path, limits):
    """Overlapped steps where a chunk holding a forced run is cut short by the step's budget (so a later run is
    placed after it) or its sequence is preempted for blocks: each reply is its grammar's text, whole, the
    preemptions happened, and every block comes back."""
    model = write_tiny_llama(tmp_path / "tiny.gguf", context_length=512)
    text = (FORCED + " ") * 2
    preemptions = []
    with Engine.from_model(EngineConfig(model=str(model), device="cpu", overlap=True, **limits)) as engine:
        preempt = engine.core.scheduler.preempt
        engine.core.scheduler.preempt = lambda seq: preemptions.append(seq) or preempt(seq)
        grammar = Grammar("regex", re.escape(text))
        handles = [engine.submit("Hi", SamplingParams(grammar=grammar, seed=s, **SAMPLED)) for s in range(6)]
        for handle in handles:
            events = list(handle.events())
            assert events[-1].error is None and "".join(e.text for e in events) == text
        assert_every_block_back(engine)
    assert preemptions or "kv_tokens" not in limits


def test_no_grammar_is_fast_forwarded_while_its_mask_fills(tmp_path, monkeypatch):
    """llguidance's matcher takes one caller at a time, and a launch fills the masks of grammars that force nothing
    next while it looks for the others' runs: no grammar whose mask a launch has handed to the masks' thread is
    fast-forwarded before the next launch (which waits for those masks), over overlapped steps of schema replies
    and spelled-out ones; and the replies are whole."""
    handed: set[int] = set()  # the grammars whose masks this launch handed over
    launch, fill = model_runner.ModelRunner.launch, model_runner.ModelRunner._fill
    fast_forward = model_runner.GrammarMatcher.fast_forward

    def on_launch(self, *args):
        handed.clear()
        return launch(self, *args)

    def on_fill(self, seqs, *args):
        handed.update(id(seq.grammar) for seq in seqs)
        return fill(self, seqs, *args)

    def on_fast_forward(self, most):
        assert id(self) not in handed
        return fast_forward(self, most)

    monkeypatch.setattr(model_runner.ModelRunner, "launch", on_launch)
    monkeypatch.setattr(model_runner.ModelRunner, "_fill", on_fill)
    monkeypatch.setattr(model_runner.GrammarMatcher, "fast_forward", on_fast_forward)
    model = write_tiny_llama(tmp_path / "tiny.gguf", context_length=512)
    with Engine.from_model(EngineConfig(model=str(model), device="cpu", overlap=True)) as engine:
        spelled = Grammar("regex", re.escape(FORCED))
        grammars = [PERSON, spelled] * 3
        handles = [engine.submit("Hi", SamplingParams(grammar=g, seed=s, **SAMPLED)) for s, g in enumerate(grammars)]
        for grammar, handle in zip(grammars, handles, strict=True):
            events = list(handle.events())
            assert events[-1].error is None, events[-1].error
            text = "".join(e.text for e in events)
            assert text == FORCED if grammar is spelled else Person.model_validate_json(text)
        assert engine.core.runner.mask_times.forced_tokens > 0
        assert_every_block_back(engine)
