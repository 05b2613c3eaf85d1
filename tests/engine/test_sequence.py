"""A sequence's token tail (engine/serving/sequence.py), on its own: tokens in flight, forced runs and drafts go
after the confirmed tokens and reach them only through settle, in order; drop forgets the tail."""

import random

import pytest

from llamaterm.engine.sampling_params import SamplingParams
from llamaterm.engine.serving.sequence import PENDING, Sequence
from llamaterm.engine.serving.speculation import Speculation

PROMPT = [5, 6, 7, 8]


def fresh(max_tokens: int = 100) -> Sequence:
    return Sequence(0, list(PROMPT), SamplingParams(max_tokens=max_tokens), max_tokens)


def test_a_fresh_sequence_holds_its_prompt_and_no_tail():
    seq = fresh()
    assert list(seq.token_ids) == PROMPT and seq.num_known == seq.num_tokens == 4
    assert seq.num_inflight == seq.num_forced == seq.num_drafts == seq.num_generated == 0
    assert seq.tokens(0, 4) == PROMPT and list(seq.generated) == []


def test_a_token_in_flight_is_pending_until_its_step_settles():
    seq = fresh()
    seq.launch()
    assert seq.num_inflight == 1 and seq.num_known == 4 and seq.num_tokens == 5 and seq.num_generated == 1
    assert seq.tokens(3, 5) == [8, PENDING]
    assert seq.settle([42]) == [42]
    assert list(seq.token_ids) == [*PROMPT, 42] and seq.num_inflight == 0 and seq.num_tokens == 5


def test_overlapped_steps_settle_in_order_and_a_forced_run_goes_with_its_token():
    """Two steps in flight, the second's token forced onward by its grammar: the first settles alone, the second
    with its run."""
    seq = fresh()
    seq.launch()
    seq.launch()
    seq.force([1, 2])
    assert seq.tokens(4, seq.num_tokens) == [PENDING, PENDING, 1, 2]
    assert seq.num_inflight == 2 and seq.num_forced == 2 and seq.num_generated == 4
    assert seq.settle([10]) == [10]
    assert seq.tokens(4, seq.num_tokens) == [10, PENDING, 1, 2]
    assert seq.settle([11]) == [11, 1, 2]
    assert list(seq.generated) == [10, 11, 1, 2] and seq.num_tokens == seq.num_known


def test_a_run_forced_before_the_next_launch_goes_with_the_token_before_it():
    seq = fresh()
    seq.launch()
    seq.force([1])
    seq.launch()  # the next step samples after the run
    assert seq.tokens(4, seq.num_tokens) == [PENDING, 1, PENDING]
    assert seq.settle([10]) == [10, 1] and seq.settle([11]) == [11]


@pytest.mark.parametrize("matching, kept", [(0, [9]), (2, [20, 21, 9]), (3, [20, 21, 22, 9])])
def test_drafts_the_sampled_tokens_confirm_are_kept_with_the_token_after_them(matching, kept):
    seq = fresh()
    seq.propose([20, 21, 22])
    assert seq.num_drafts == 3 and seq.num_generated == 0 and seq.num_tokens == 7
    seq.launch()
    assert seq.tokens(3, seq.num_tokens) == [8, 20, 21, 22, PENDING]
    sampled = [20, 21, 22][:matching] + [9] * (4 - matching)
    assert seq.settle(sampled) == kept
    assert list(seq.generated) == kept and seq.num_drafts == 0 and seq.num_tokens == seq.num_known


def test_drafts_follow_the_confirmed_tokens_and_runs_a_token_in_flight():
    seq = fresh()
    with pytest.raises(AssertionError):
        seq.force([1])  # nothing in flight to follow
    seq.launch()
    with pytest.raises(AssertionError):
        seq.propose([1, 2])  # drafts are proposed from tokens on the host
    seq.settle([3])
    seq.propose([1, 2])
    seq.propose([4])  # a new proposal replaces the last
    assert list(seq.drafts) == [4]


def test_drop_forgets_the_tail_or_the_drafts_past_those_kept():
    seq = fresh()
    seq.launch()
    seq.settle([10])
    seq.launch()
    seq.force([1, 2])
    seq.drop()
    assert list(seq.token_ids) == [*PROMPT, 10] and seq.num_tokens == seq.num_known == 5
    assert seq.num_inflight == seq.num_forced == 0
    seq.speculation = Speculation(draft_computed=8)  # a draft model computed the drafts' K/V
    seq.propose([7, 8, 9])
    seq.drop(keep_drafts=2)  # the step has room for two
    assert list(seq.drafts) == [7, 8] and seq.num_tokens == 7 and seq.speculation.draft_computed == 7
    seq.drop()
    assert seq.num_drafts == 0 and seq.speculation.draft_computed == 5


def test_done_sampling_counts_the_tokens_in_flight():
    seq = fresh(max_tokens=2)
    seq.launch()
    assert not seq.done_sampling
    seq.launch()
    assert seq.done_sampling and seq.num_known == 4  # its last token is sampled, not yet on the host


def test_random_protocols_confirm_each_token_once_in_order():
    """Random runs of the model runner's calls, each where the protocol allows it, against an oracle that keeps
    the steps in flight as a queue of (token, the run forced after it)."""
    rng = random.Random(0)
    for trial in range(300):
        seq, confirmed, flight, drafts = fresh(), list(PROMPT), [], []
        for _ in range(40):
            moves = ["launch"] * (not (drafts and flight)) + ["settle"] * bool(flight)  # a draft step completes first
            moves += ["force"] * bool(flight and not drafts) + ["propose"] * (not flight)
            moves += ["drop"] * (rng.random() < 0.05)
            move = rng.choice(moves)
            if move == "launch":
                seq.launch()
                flight.append([])
            elif move == "force":
                run = [rng.randrange(100) for _ in range(rng.randint(1, 3))]
                seq.force(run)
                flight[-1] += run
            elif move == "propose":
                drafts = [rng.randrange(3) for _ in range(rng.randint(0, 3))]
                seq.propose(drafts)
            elif move == "drop":
                seq.drop()
                flight, drafts = [], []
            else:
                sampled = [rng.randrange(3) for _ in range(len(drafts) + 1)]
                n = next((i for i, (d, t) in enumerate(zip(drafts, sampled, strict=False)) if d != t), len(drafts))
                expected = sampled[: n + 1] if drafts else [sampled[0], *flight[0]]
                assert seq.settle(sampled) == expected, trial
                confirmed += expected
                flight.pop(0)
                drafts = []
            tail = [t for run in flight for t in (PENDING, *run)]
            assert list(seq.token_ids) == confirmed and list(seq.drafts) == drafts, trial
            assert seq.tokens(0, seq.num_tokens) == confirmed + drafts + tail, trial
            assert seq.num_inflight == len(flight) and seq.num_forced == len(tail) - len(flight), trial
            assert seq.num_generated == len(confirmed) + len(tail) - len(PROMPT), trial
