"""Sampling: each filter against a direct definition, and draws against the distribution they should follow."""

import pytest
import torch

from llamaterm.engine.errors import RequestError
from llamaterm.engine.sampling_params import SamplingParams
from llamaterm.engine.serving.sampling import filter_logits, sample
from llamaterm.engine.serving.sequence import Sequence


def make_seq(params: SamplingParams, prompt=(1, 2, 3), generated=(), seed=0) -> Sequence:
    g = torch.Generator().manual_seed(seed)
    ids = list(prompt) + list(generated)
    return Sequence(0, ids, len(prompt), params, params.max_tokens, generator=g)


def kept(logits: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(logits)).flatten().tolist())


def test_greedy_is_argmax():
    logits = torch.randn(4, 50)
    seqs = [make_seq(SamplingParams()) for _ in range(4)]
    assert sample(logits, seqs).tolist() == logits.argmax(-1).tolist()


def test_top_k_top_p_min_p_match_their_definitions():
    logits = torch.tensor([3.0, 1.0, 2.5, -1.0, 0.5, 2.0])
    probs = logits.softmax(-1).tolist()
    order = sorted(range(6), key=lambda i: -probs[i])
    assert kept(filter_logits(logits, 2, 1.0, 0.0)) == set(order[:2])
    # top-p: the smallest prefix of the ranking whose mass reaches p
    for p in (0.3, 0.6, 0.9, 0.999):
        mass, nucleus = 0.0, set()
        for i in order:
            nucleus.add(i)
            mass += probs[i]
            if mass >= p:
                break
        assert kept(filter_logits(logits, 0, p, 0.0)) == nucleus, p
    top = max(probs)
    assert kept(filter_logits(logits, 0, 1.0, 0.2)) == {i for i in range(6) if probs[i] >= 0.2 * top}


def test_seeded_draws_follow_the_softmax_and_repeat_with_the_seed():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    params = SamplingParams(temperature=1.0, seed=7)
    seq = make_seq(params, seed=7)
    draws = [int(sample(logits, [seq])[0]) for _ in range(4000)]
    freq = torch.bincount(torch.tensor(draws), minlength=4).float() / len(draws)
    assert torch.allclose(freq, logits.softmax(-1)[0], atol=0.03)
    again = make_seq(params, seed=7)
    assert [int(sample(logits, [again])[0]) for _ in range(50)] == draws[:50]


def test_temperature_sharpens():
    logits = torch.tensor([[1.0, 0.0]])
    seq = make_seq(SamplingParams(temperature=0.25), seed=1)
    draws = [int(sample(logits, [seq])[0]) for _ in range(2000)]
    expected = (logits / 0.25).softmax(-1)[0, 1].item()
    assert abs(sum(draws) / len(draws) - expected) < 0.02


def test_penalties_follow_the_formulas():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, 3.0]])
    # repetition penalty over prompt and output: divide positive, multiply negative logits
    seq = make_seq(SamplingParams(repetition_penalty=10.0), prompt=(4,), generated=(1,))
    assert sample(logits.clone(), [seq]).tolist() == [0]  # token 4 (3.0 -> 0.3) falls below token 0 (2.0)
    # frequency and presence penalties count generated tokens only
    seq = make_seq(SamplingParams(frequency_penalty=1.0, presence_penalty=0.6), prompt=(2,), generated=(4, 4, 0))
    # 4: 3 - 2 - 0.6 = 0.4; 0: 2 - 1 - 0.6 = 0.4 - ties resolved by argmax order; 2 (prompt only) keeps 1.0
    assert sample(logits.clone(), [seq]).tolist() == [2]


@pytest.mark.parametrize(
    "bad",
    [
        dict(temperature=-1),
        dict(top_p=0),
        dict(top_p=1.5),
        dict(top_k=-1),
        dict(min_p=1.0),
        dict(max_tokens=0),
        dict(repetition_penalty=0),
        dict(presence_penalty=3),
        dict(stop=("",)),
    ],
)
def test_invalid_values_are_named(bad):
    with pytest.raises(RequestError) as e:
        SamplingParams(**bad)
    assert next(iter(bad)) in str(e.value)


def test_a_vanishing_temperature_samples_the_greedy_token():
    # 1e-45 sent every logit to +-inf and the softmax to NaN: token 0 came out, an empty reply with exit 0
    logits = torch.randn(8, 50) * 5
    seqs = [make_seq(SamplingParams(temperature=t), seed=i) for i, t in enumerate([1e-45, 1e-30, 1e-12, 1e-7] * 2)]
    assert sample(logits, seqs).tolist() == logits.argmax(-1).tolist()


@pytest.mark.parametrize("values", [{"seed": 2**70}, {"seed": -1}, {"temperature": float("inf")}])
def test_seeds_and_temperatures_out_of_range_are_refused(values):
    with pytest.raises(RequestError, match="seed|temperature"):
        SamplingParams(**values)
