"""The batched sampler (kernels/sampling.py): its torch reference against the row-by-row oracle given the same
random draws, the Triton kernel against the reference (under TRITON_INTERPRET=1 on the CPU, compiled on a GPU) on
peaked and flat rows through each of its paths, the filters' edge values, the draws' distribution, and rows whose
logits are not finite."""

import dataclasses
import math
import random

import pytest
import torch

from llamaterm.engine.errors import RequestError
from llamaterm.engine.sampling_params import SamplingParams
from llamaterm.kernels.sampling import SamplingTables, sample_ref
from tests.support.kernel_cases import DEVICE
from tests.support.sampling_cases import VOCAB, Batch, logits_like
from tests.support.sampling_oracle import sample_row


def random_params(rng: random.Random) -> SamplingParams:
    """Every filter and penalty on or off, in every mix; a third of the rows greedy."""
    if rng.random() < 0.3:
        return SamplingParams(repetition_penalty=rng.choice([1.0, 1.0, 1.3]))
    return SamplingParams(
        temperature=rng.choice([0.3, 0.8, 1.0, 1.7]),
        top_k=rng.choice([0, 0, 1, 5, 40, 150, VOCAB + 5]),
        top_p=rng.choice([1.0, 1.0, 0.5, 0.9, 0.97]),
        min_p=rng.choice([0.0, 0.0, 0.05, 0.3]),
        repetition_penalty=rng.choice([1.0, 1.0, 1.1, 2.0]),
        presence_penalty=rng.choice([0.0, 0.5, -0.5]),
        frequency_penalty=rng.choice([0.0, 0.0, 0.4]),
        seed=rng.randrange(2**64),
    )


@pytest.mark.parametrize("kind", ["peaked", "plain", "flat"])
def test_reference_matches_the_row_by_row_oracle(kind):
    rng = random.Random(kind)
    batch = Batch([random_params(rng) for _ in range(40)], seed=1, slots=64)
    logits = logits_like(kind, 40, seed=2)
    expected = [
        sample_row(logits[i], p, batch.prompts[i] + batch.generated[i], batch.generated[i], batch.exponential(i))
        for i, p in enumerate(batch.params)
    ]
    assert sample_ref(logits.clone(), batch.slots, batch.positions, batch.tables).tolist() == expected


def biased_and_constrained(rng: random.Random, n: int) -> tuple[list[SamplingParams], list[set[int] | None]]:
    """Rows of every kind, a third with a logit bias and a third allowed only some tokens (as a grammar would)."""
    params, allowed = [], []
    for _ in range(n):
        p = random_params(rng)
        if rng.random() < 0.4:
            biases = [-100.0, -3.0, 2.5, 100.0]
            bias = tuple((rng.randrange(VOCAB), rng.choice(biases)) for _ in range(rng.randint(1, 6)))
            p = dataclasses.replace(p, logit_bias=bias)
        params.append(p)
        allowed.append(set(rng.sample(range(VOCAB), rng.choice([1, 3, 40, 150]))) if rng.random() < 0.4 else None)
    return params, allowed


@pytest.mark.parametrize("kind", ["peaked", "flat"])
def test_bias_and_grammar_mask_sample_as_if_applied_to_the_logits(kind):
    """Oracle: the same rows without bias or mask, their logits biased and masked by hand, give the same tokens
    (the same draws: a row's noise depends only on its seed, position and token)."""
    params, allowed = biased_and_constrained(random.Random(kind), 40)
    batch = Batch(params, seed=7, slots=64)
    for i, tokens in enumerate(allowed):
        if tokens is not None:
            batch.allow_only(i, tokens)
    logits = logits_like(kind, len(params), seed=8)
    by_hand = logits.clone()
    for i, (p, tokens) in enumerate(zip(params, allowed, strict=True)):
        for token, bias in p.logit_bias:
            by_hand[i, token] += bias
        if tokens is not None:
            by_hand[i, [t for t in range(VOCAB) if t not in tokens]] = float("-inf")
    plain = Batch([dataclasses.replace(p, logit_bias=()) for p in params], seed=7, slots=64)
    expected = sample_ref(by_hand, plain.slots, plain.positions, plain.tables)
    tokens = sample_ref(logits.clone(), batch.slots, batch.positions, batch.tables)
    assert tokens.tolist() == expected.tolist()
    assert all(t in a for t, a in zip(tokens.tolist(), allowed, strict=True) if a is not None)


# The Triton kernel's path is slow: on the CPU it runs under the interpreter (seconds a case, minutes for the draws)
KERNEL = pytest.param("kernel", marks=pytest.mark.slow)


def kernel(logits, batch: Batch, **sizes):
    from llamaterm.kernels.sampling_triton import sample_triton

    tables = batch.tables_on(DEVICE)
    out = sample_triton(logits.to(DEVICE), batch.slots.to(DEVICE), batch.positions.to(DEVICE), tables, **sizes)
    return out.cpu(), tables


@pytest.mark.slow  # the Triton kernel (see KERNEL)
@pytest.mark.parametrize("kind", ["peaked", "flat"])
@pytest.mark.parametrize("cap", [4, 32])  # 4 candidates a chunk: rows whose cut passes them bisect the whole row
def test_kernel_matches_the_reference(kind, cap):
    pytest.importorskip("triton")
    rng = random.Random(cap)
    params, allowed = biased_and_constrained(rng, 14)
    params += [SamplingParams(temperature=1.0, top_p=0.9, seed=5), SamplingParams(temperature=0.9, top_k=100)]
    batch = Batch(params, seed=3)
    for i, tokens in enumerate(allowed):
        if tokens is not None:
            batch.allow_only(i, tokens)
    logits = logits_like(kind, len(params), seed=4)
    ref_logits, ref_tables = logits.clone(), batch.tables_on("cpu")
    expected = sample_ref(ref_logits, batch.slots, batch.positions, ref_tables)
    tokens, tables = kernel(logits.clone(), batch, chunk=64, candidates=cap, block=64)
    assert tokens.tolist() == expected.tolist()
    assert torch.equal(tables.counts.cpu(), ref_tables.counts)  # the sampled tokens counted, penalised rows only


@pytest.mark.cuda
@pytest.mark.parametrize("vocab", [49152, 128256, 262144])  # SmolLM2 / Llama 3 / Gemma 3
@pytest.mark.parametrize("kind", ["peaked", "plain", "flat"])
def test_kernel_matches_the_reference_at_real_shapes(vocab, kind):
    """64 rows at the block, candidate and bin sizes the engine runs (the GPU's exp and log round differently
    from the CPU's, so a token may only differ where two scores nearly tie: none do in these draws). The last 8
    rows are under a grammar that allows 1-300 tokens, as a JSON schema's masks do: fewer than top-k in most."""
    rng = random.Random(vocab)
    params = [random_params(rng) for _ in range(56)]
    params += [SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repetition_penalty=1.1, seed=9)] * 8
    batch = Batch(params, seed=5, slots=256, vocab=vocab)
    for i, n in enumerate([1, 2, 3, 5, 12, 40, 41, 300], start=56):
        batch.allow_only(i, set(rng.sample(range(vocab), n)))
    logits = logits_like(kind, len(params), seed=6, vocab=vocab)
    expected = sample_ref(logits.clone(), batch.slots, batch.positions, batch.tables_on("cpu"))
    from llamaterm.kernels.sampling_triton import sample_triton

    tokens = sample_triton(logits.cuda(), batch.slots.cuda(), batch.positions.cuda(), batch.tables_on("cuda"))
    assert tokens.cpu().tolist() == expected.tolist()


EDGES = [
    ("top_k=1", SamplingParams(temperature=1.0, top_k=1), "greedy"),
    ("top_k above the vocabulary", SamplingParams(temperature=1.0, top_k=10 * VOCAB), "any"),
    ("top_p near 0", SamplingParams(temperature=1.0, top_p=1e-9), "greedy"),
    ("top_p near 1", SamplingParams(temperature=1.0, top_p=1 - 1e-7), "any"),
    ("min_p=1", SamplingParams(temperature=1.0, min_p=1.0), "greedy"),
    ("temperature 1e-30", SamplingParams(temperature=1e-30, top_p=0.9, top_k=20), "greedy"),
    ("temperature 1e30", SamplingParams(temperature=1e30, top_k=7), "top 7"),
    ("penalties 1", SamplingParams(temperature=0.8, repetition_penalty=1.0, presence_penalty=0.0), "any"),
    ("large penalties", SamplingParams(repetition_penalty=1e30, presence_penalty=2, frequency_penalty=2), "unseen"),
]


@pytest.mark.parametrize("path", ["reference", KERNEL])
def test_edge_values_give_defined_tokens(path):
    if path == "kernel":
        pytest.importorskip("triton")
    params = [p for _, p, _ in EDGES]
    batch = Batch(params, seed=7)
    logits = logits_like("peaked", len(params), seed=8)
    if path == "reference":
        tokens = sample_ref(logits.clone(), batch.slots, batch.positions, batch.tables)
    else:
        tokens, _ = kernel(logits.clone(), batch, chunk=64, candidates=16, block=64)
    for i, (name, _, expect) in enumerate(EDGES):
        token = int(tokens[i])
        assert 0 <= token < VOCAB, name
        if expect == "greedy":
            assert token == int(logits[i].argmax()), name
        elif expect == "top 7":  # a flat draw among the top-k
            assert token in logits[i].topk(7).indices.tolist(), name
        elif expect == "unseen":  # every token seen in the prompt or output is pushed to the bottom
            assert token not in batch.prompts[i] + batch.generated[i], name


def chi_square_upper(df: int, alpha: float) -> float:
    """The chi-square statistic exceeded with probability alpha (Wilson-Hilferty), so a test fails by chance
    with probability alpha."""
    z = {1e-3: 3.090, 1e-4: 3.719}[alpha]
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("path", ["reference", KERNEL])
def test_draws_follow_the_filtered_distribution(path):
    """Many draws of one row (one slot, positions 0..n-1 key fresh noise) against the distribution the filters
    define: top-k 6 of these logits, then top-p 0.9 of what is left, temperature 0.7. False alarm rate 1e-4."""
    logits = torch.tensor([3.0, 2.6, 2.5, 1.0, 0.7, 0.4, 0.3, -1.0] + [-3.0] * 12)
    probs = (logits[:6] / 0.7).softmax(-1)
    kept = int((probs.cumsum(-1) - probs < 0.9).sum())  # the nucleus of the top-6
    expected = probs[:kept] / probs[:kept].sum()
    n = 4000 if path == "reference" else 300
    tables = SamplingTables.allocate(1, 20, torch.device("cpu"))
    tables.floats[0] = torch.tensor([0.7, 0.9, 0.0, 1.0, 0.0, 0.0])
    tables.ints[0, :2] = torch.tensor([6, 12345])
    rows, slots, positions = logits.expand(n, 20).clone(), torch.zeros(n, dtype=torch.int64), torch.arange(n)
    if path == "reference":
        tokens = sample_ref(rows, slots, positions, tables)
    else:
        from llamaterm.kernels.sampling_triton import sample_triton

        t = tables.copy(DEVICE)
        tokens = sample_triton(
            rows.to(DEVICE), slots.to(DEVICE), positions.to(DEVICE), t, chunk=16, candidates=8, block=32
        ).cpu()
    counts = torch.bincount(tokens, minlength=20).double()
    assert counts[kept:].sum() == 0  # nothing outside the nucleus
    stat = ((counts[:kept] - n * expected) ** 2 / (n * expected)).sum().item()
    assert stat < chi_square_upper(kept - 1, 1e-4), (counts[:kept].tolist(), (n * expected).tolist())


@pytest.mark.parametrize("path", ["reference", KERNEL])
def test_rows_with_nan_or_inf_sample_minus_one_and_the_others_go_on(path):
    params = [SamplingParams(), SamplingParams(temperature=0.8, top_k=40, repetition_penalty=1.2, seed=1)] * 3
    batch = Batch(params, seed=9)
    logits = logits_like("plain", 6, seed=10)
    logits[1, 17] = float("nan")
    logits[2, 3] = float("inf")
    logits[4] = float("-inf")
    expected = sample_ref(
        logits[[0, 3, 5]].clone(), batch.slots[[0, 3, 5]], batch.positions[[0, 3, 5]], batch.tables_on("cpu")
    )
    if path == "reference":
        tokens = sample_ref(logits.clone(), batch.slots, batch.positions, batch.tables)
    else:
        pytest.importorskip("triton")
        tokens, _ = kernel(logits.clone(), batch, chunk=64, candidates=16, block=64)
    assert tokens[[1, 2, 4]].tolist() == [-1, -1, -1]
    assert tokens[[0, 3, 5]].tolist() == expected.tolist()


def test_padding_rows_are_left_alone():
    batch = Batch([SamplingParams(temperature=1.0, presence_penalty=1.0, seed=3)] * 2, seed=11)
    slots = torch.tensor([batch.slots[0].item(), -1, batch.slots[1].item(), -1])
    before = batch.tables.counts.clone()
    tokens = sample_ref(logits_like("plain", 4, 12), slots, torch.tensor([5, 0, 6, 0]), batch.tables)
    assert tokens[[1, 3]].tolist() == [-1, -1]
    assert int((batch.tables.counts - before).sum()) == 2  # the two real rows' tokens counted, nothing else


@pytest.mark.parametrize(
    "bad",
    [
        dict(temperature=-1),
        dict(top_p=0),
        dict(top_p=1.5),
        dict(top_k=-1),
        dict(min_p=1.5),
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


@pytest.mark.parametrize("values", [{"seed": 2**70}, {"seed": -1}, {"temperature": float("inf")}])
def test_seeds_and_temperatures_out_of_range_are_refused(values):
    with pytest.raises(RequestError, match="seed|temperature"):
        SamplingParams(**values)
