"""Speculative decoding (engine/serving/speculation.py) against the engine without it as the oracle: greedy and
seeded replies are the same tokens, token for token, alone and in batches beside sequences that never draft, for
every draft length; sampled verification keeps the target's distribution (a chi-square test); rejected drafts give
their blocks back; prompt lookup proposes what a plain search of the tokens finds."""

import itertools
import random
from pathlib import Path

import pytest
import torch

from llamaterm.engine.api import EngineConfig
from llamaterm.engine.bench import EditText
from llamaterm.engine.checkpoints.gguf import load_gguf
from llamaterm.engine.errors import LlamatermError
from llamaterm.engine.sampling_params import Grammar, SamplingParams
from llamaterm.engine.serving import proposer, speculation
from llamaterm.engine.serving.cuda_graph import StepGraphs
from llamaterm.engine.serving.draft_model import DraftModel
from llamaterm.engine.serving.engine import Engine
from llamaterm.engine.serving.engine_core import EngineCore
from llamaterm.engine.serving.model import Model
from llamaterm.engine.serving.sampling import as_int64
from llamaterm.engine.serving.speculation import MAX_NGRAM, MIN_NGRAM, NgramIndex, accepted
from llamaterm.engine.synthetic import SyntheticTokenizer
from llamaterm.kernels.sampling import sample_ref
from llamaterm.kernels.sampling_tables import MIN_P, SEED, TEMPERATURE, TOP_K, TOP_P, SamplingTables
from tests.support.cli import llamaterm
from tests.support.engine_checks import assert_every_block_back, assert_greedy_choices, our_last_logits
from tests.support.graphs import record_without_running
from tests.support.tiny_engine import make_engine
from tests.support.tiny_models import write_tiny_llama
from tests.support.tokenizer_files import byte_level_meta, write_byte_level_gguf


def longest_match(tokens: list[int], k: int) -> list[int]:
    """The oracle of prompt lookup, by brute force: of every earlier position, how many tokens up to it equal the
    last ones (MAX_NGRAM at most); the latest of the longest, if that is MIN_NGRAM or more, and the k tokens after
    it (past the last token, the drafts themselves)."""
    best, best_n = None, MIN_NGRAM
    for end in range(len(tokens) - 1):
        n = 0
        while n < min(MAX_NGRAM, end + 1) and tokens[end - n] == tokens[-1 - n]:
            n += 1
        if n >= best_n:
            best, best_n = end, n
    if best is None:
        return []
    seq = list(tokens)
    for i in range(k):
        seq.append(seq[best + 1 + i])
    return seq[len(tokens) :]


def test_prompt_lookup_matches_a_plain_search():
    rng = random.Random(0)
    for trial in range(300):
        vocab = rng.choice([2, 3, 6])  # few tokens: matches as long as MAX_NGRAM and longer
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 60))]
        index = NgramIndex()
        for known in range(1, len(tokens) + 1):  # tokens arrive one at a time, as a reply's do
            k = rng.randint(1, 8)
            assert index.propose(tokens, known, k) == longest_match(tokens[:known], k), (trial, known)


def test_a_match_may_follow_where_the_last_tokens_occurred_before():
    """may_match (the engine gives up overlapping its steps for it) is true exactly where the last MIN_NGRAM known
    tokens occurred before with a known token after them; that token next would give the lookup a match."""
    rng = random.Random(1)
    m = speculation.MIN_NGRAM
    for trial in range(300):
        vocab = rng.choice([3, 6, 12])
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        index = NgramIndex()
        for known in range(1, len(tokens) + 1):
            ends = [e for e in range(m - 1, known - 1) if tokens[e - m + 1 : e + 1] == tokens[known - m : known]]
            assert index.may_match(tokens, known) == bool(ends), (trial, known)
            if ends:
                assert longest_match(tokens[:known] + [tokens[ends[-1] + 1]], 1)
            if rng.random() < 0.5:  # interleaved with proposals, as the scheduler asks
                index.propose(tokens, known, 1)


def test_prompt_lookup_drafts_a_quoted_prompt():
    code = list(range(100, 160))
    index = NgramIndex()
    assert index.propose([*code, 7, *code[:3]], 64, 5) == code[3:8]  # the reply quotes the prompt
    assert index.propose([1, 2, 3], 3, 4) == []  # nothing occurred before
    assert NgramIndex().propose([*code, 7, *code[:2]], 63, 5) == []  # two tokens' match: too seldom right
    # the longest match, not the latest: 5 6 7 8 then 9 before, 6 7 8 then 1 later
    assert NgramIndex().propose([5, 6, 7, 8, 9, 6, 7, 8, 1, 2, 5, 6, 7, 8], 14, 2) == [9, 6]


def sweep(values, fast) -> list:
    """A sweep's values, those not in `fast` marked slow: the fast lane runs a case of each behaviour (a sequence's
    token tail is unit-tested in test_sequence.py), `make test` the whole sweep."""
    return [v if v in fast else pytest.param(v, marks=pytest.mark.slow) for v in values]


@pytest.fixture
def fixed_k(monkeypatch):
    """Draft exactly k tokens wherever the lookup finds them and the step has rows for them (the adaptive length's
    choice and the batch's weighing of drafts against overlap set aside), after a match of `shortest` tokens or
    more."""

    def use(k: int, shortest: int = MIN_NGRAM) -> None:
        monkeypatch.setattr(speculation.DraftLength, "k", lambda self, generated: k)
        monkeypatch.setattr(speculation, "MIN_NGRAM", shortest)
        monkeypatch.setattr(proposer, "BATCH_OVERLAP_COST", 0.0)

    return use


def repetitive_prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts that repeat themselves, so drafts are proposed, and the model follows some and refuses others."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        base = [rng.randrange(3, 400) for _ in range(rng.randint(3, 24))]
        out.append((base * rng.randint(2, 4))[: rng.randint(8, 90)])
    return out


def replies(engine, requests) -> list[list[int]]:
    handles = [engine.submit(None, params, prompt_ids=prompt) for prompt, params in requests]
    for h in handles:
        list(h.events())
    return [h.token_ids for h in handles]


@pytest.mark.parametrize("k", sweep(range(1, 9), fast=(1, 4, 8)))
def test_greedy_replies_are_those_without_speculation(tiny, alone, fixed_k, k):
    greedy = SamplingParams(max_tokens=40, ignore_eos=True)
    requests = [(p, greedy) for p in repetitive_prompts(4, seed=k)]
    expected = alone(requests, speculate="off")
    fixed_k(k)
    with make_engine(tiny) as engine:
        assert [replies(engine, [r])[0] for r in requests] == expected  # alone
        assert engine.step_stats().kept > 0
        assert_every_block_back(engine)


def test_a_reply_that_stops_inside_a_run_of_kept_drafts_ends_there(tiny, alone, fixed_k):
    """A step hands out the drafts it confirms and the token after them; where the reply stops at one of them, the
    tokens after it were never the reply's: its sequence and stats end at the stop, as the stream does."""
    prompt = [11, 22, 33, 44, 55, 66] * 6  # the tiny model goes on repeating itself: drafts are confirmed in runs
    (reply,) = alone([(prompt, SamplingParams(max_tokens=40, ignore_eos=True))], speculate="off")
    text = lambda n: tiny[1].decode(reply[:n])
    fixed_k(8)
    with make_engine(tiny) as engine:
        for n in (10, 13, 17):
            stop = SamplingParams(max_tokens=40, ignore_eos=True, stop=(text(n),))
            handle = engine.submit(None, stop, prompt_ids=prompt)
            streamed = [t for event in handle.events() for t in event.token_ids]
            ends = next(i for i in range(1, n + 1) if text(n) in text(i))
            assert streamed == reply[:ends] == handle.token_ids and handle.stats().generated_tokens == ends
        assert engine.step_stats().kept >= 8
        assert_every_block_back(engine)


def test_an_engine_for_one_request_drafts_too(tiny, alone, fixed_k):
    """`llamaterm run` prepares an engine for one sequence: its steps still have a row for each of 8 drafts."""
    requests = [(p, SamplingParams(max_tokens=40, ignore_eos=True)) for p in repetitive_prompts(2, seed=50)]
    expected = alone(requests, speculate="off")
    fixed_k(8)
    with make_engine(tiny, max_running=1) as engine:
        assert replies(engine, requests) == expected
        assert engine.step_stats().drafted >= 8 and engine.step_stats().steps < 40
        assert_every_block_back(engine)


@pytest.mark.parametrize("k", sweep([1, 4, 8], fast=(8,)))
def test_penalised_replies_with_drafts_are_those_without(tiny, alone, fixed_k, k):
    """Repetition, presence and frequency penalties count the drafts before each row's position, and the kept ones
    after the step: greedy and seeded replies as without drafts, alone and together."""
    penalties = {"repetition_penalty": 1.1, "presence_penalty": 0.2, "frequency_penalty": 0.1, "ignore_eos": True}
    kinds = [
        SamplingParams(max_tokens=40, frequency_penalty=0.3, ignore_eos=True),  # random weights' loops, held back
        SamplingParams(max_tokens=40, temperature=0.9, seed=4, **penalties),
        SamplingParams(max_tokens=40, repetition_penalty=1.05, ignore_eos=True),
    ]
    requests = [(p, kinds[i % 3]) for i, p in enumerate(repetitive_prompts(6, seed=70 + k))]
    expected = alone(requests, speculate="off")
    fixed_k(k, shortest=1)  # drafts after a match of one token too: the model refuses many of them
    with make_engine(tiny) as engine:
        assert [replies(engine, [r])[0] for r in requests] == expected
        assert replies(engine, requests) == expected
        assert 0 < engine.step_stats().kept < engine.step_stats().drafted
        assert_every_block_back(engine)


def mixed_batch(seed: int) -> list[tuple[list[int], SamplingParams]]:
    """Greedy, seeded and penalised requests that draft, beside grammar-bound ones that never do (nor penalised ones
    with a draft model)."""
    prompts = repetitive_prompts(8, seed)
    kinds = [
        SamplingParams(max_tokens=30, ignore_eos=True),
        SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=7),
        SamplingParams(max_tokens=30, ignore_eos=True, temperature=1.0, repetition_penalty=1.3, seed=3),
        SamplingParams(max_tokens=30, temperature=0.7, seed=5, grammar=Grammar("regex", "[a-z ]{1,40}")),
        SamplingParams(max_tokens=30, ignore_eos=True, temperature=1.2, logit_bias=((207, 5.0),), seed=11),
    ]
    return [(p, kinds[i % len(kinds)]) for i, p in enumerate(prompts)]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("k", sweep([2, 5, 8], fast=(5,)))
def test_batches_beside_sessions_that_never_draft(tiny, alone, fixed_k, k, overlap):
    requests = mixed_batch(seed=10 + k)
    expected = alone(requests, speculate="off")
    fixed_k(k)
    with make_engine(tiny, overlap=overlap, max_batch_tokens=64, kv_tokens=40 * 16) as engine:
        assert replies(engine, requests) == expected
        assert engine.step_stats().drafted > 0
        assert_every_block_back(engine)


def assert_preempting_replies(engine, requests, expected) -> None:
    """The engine's replies, on a pool small enough that sequences are preempted: as expected, with drafts, and
    every block back at the end."""
    preempted = []
    preempt = engine.core.scheduler.preempt
    engine.core.scheduler.preempt = lambda seq: (preempted.append(seq.id), preempt(seq))
    assert replies(engine, requests) == expected
    assert preempted and engine.step_stats().drafted > 0
    assert_every_block_back(engine)


def test_a_small_pool_preempts_sequences_with_drafts(tiny, alone, fixed_k):
    requests = [(p, SamplingParams(max_tokens=60, ignore_eos=True)) for p in repetitive_prompts(10, seed=3)]
    expected = alone(requests, speculate="off")
    fixed_k(6)
    with make_engine(tiny, kv_tokens=14 * 16, block_size=16, overlap=True) as engine:
        assert_preempting_replies(engine, requests, expected)


def test_rejected_drafts_give_their_blocks_back_and_are_never_cached(tiny, fixed_k):
    """After each step the sequence holds the blocks of its tokens and no more, and every hashed block holds the
    tokens its sequence kept."""
    fixed_k(8)
    with make_engine(tiny, block_size=4) as engine:
        bm, scheduler = engine.core.block_manager, engine.core.scheduler
        seen = []
        drop = scheduler.drop_rejected

        def checked(seq):
            drop(seq)
            assert len(seq.table.block_ids) == bm.blocks_needed(seq.num_computed)
            for i, block_id in enumerate(seq.table.block_ids[: seq.table.num_hashed]):
                assert bm.blocks[block_id].token_ids in ((), tuple(seq.token_ids[i * 4 : i * 4 + 4]))
            seen.append(len(seq.token_ids))

        scheduler.drop_rejected = checked
        prompt = repetitive_prompts(1, seed=4)[0]
        replies(engine, [(prompt, SamplingParams(max_tokens=50, ignore_eos=True))])
        assert seen and 0 < engine.step_stats().kept < engine.step_stats().drafted
        assert_every_block_back(engine)


def test_stop_tokens_and_max_tokens_cut_a_run_of_kept_drafts(tiny, fixed_k):
    prompt = [5, 6, 7] * 10
    with make_engine(tiny, speculate="off") as engine:
        free = replies(engine, [(prompt, SamplingParams(max_tokens=40, ignore_eos=True))])[0]
    stop = free[len(free) // 2]
    fixed_k(8)
    with make_engine(tiny) as engine:
        for max_tokens in (1, 2, 9, 17):
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            assert replies(engine, [(prompt, params)])[0] == free[:max_tokens]
        params = SamplingParams(max_tokens=40, ignore_eos=True, stop_token_ids=(stop,))
        handle = engine.submit(None, params, prompt_ids=prompt)
        events = list(handle.events())
        tokens = [t for e in events for t in e.token_ids]
        assert tokens == free[: free.index(stop) + 1] and events[-1].finish_reason == "stop"
        assert_every_block_back(engine)


def target_distribution(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    """The oracle: softmax of the logits over temperature, kept to the top k (no ties in these logits)."""
    p = torch.softmax(logits.double() / temperature, -1)
    cut = p.topk(top_k).values[-1]
    p = torch.where(p >= cut, p, 0.0)
    return p / p.sum()


def chi_square_p(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """The p-value of Pearson's chi-square statistic (torch's regularised upper incomplete gamma)."""
    keep = expected > 0
    assert observed[~keep].sum() == 0
    stat = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    df = torch.tensor(float(keep.sum() - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, stat / 2))


def test_sampled_verification_keeps_the_target_distribution():
    """A draft d at position 1 of a vocabulary of 6, verified with many seeds: the first token out is distributed
    as the target's p1 (accepted with probability p1(d), else drawn from p1 without d), and after an accepted draft
    the next as p2. Each chi-square test fails by chance with probability 1e-4 (the seeds are fixed: it does not
    flake)."""
    vocab, n, temperature, top_k = 6, 20000, 0.9, 5
    p1_logits = torch.tensor([1.0, 2.0, 0.5, -1.0, 1.5, 0.0])
    p2_logits = torch.tensor([0.3, -0.5, 1.2, 0.9, 0.0, 2.0])
    p1, p2 = (target_distribution(x, temperature, top_k) for x in (p1_logits, p2_logits))
    for draft in (1, 3):  # the likeliest token, and one top-k rules out (never accepted)
        tables = SamplingTables.allocate(n, vocab, torch.device("cpu"))
        tables.floats[:, TEMPERATURE], tables.floats[:, TOP_P], tables.floats[:, MIN_P] = temperature, 1.0, 0.0
        tables.ints[:, TOP_K] = top_k
        tables.ints[:, SEED] = torch.tensor([as_int64(random.Random(s).getrandbits(64)) for s in range(n)])
        slots = torch.arange(n).repeat_interleave(2)  # each sequence's two rows: its draft's position and the next
        positions = torch.tensor([40, 41]).repeat(n)
        logits = torch.stack([p1_logits, p2_logits]).repeat(n, 1)
        tokens = sample_ref(logits, slots, positions, tables).view(n, 2).tolist()
        out = [t[: accepted([draft], t) + 1] for t in tokens]
        first = torch.bincount(torch.tensor([o[0] for o in out]), minlength=vocab).double()
        assert chi_square_p(first, n * p1) > 1e-4
        kept = [o for o in out if len(o) == 2]
        assert all(o[0] == draft for o in kept) and all(o[0] != draft for o in out if len(o) == 1)
        if draft == 1:  # the accept rate is p1(d), and after an accepted draft the next token follows p2
            rate = len(kept) / n
            assert abs(rate - p1[draft]) < 4 * (p1[draft] * (1 - p1[draft]) / n) ** 0.5
            second = torch.bincount(torch.tensor([o[1] for o in kept]), minlength=vocab).double()
            assert chi_square_p(second, len(kept) * p2) > 1e-4
        residual = p1.clone()
        residual[draft] = 0
        rejected = torch.bincount(torch.tensor([o[0] for o in out if len(o) == 1]), minlength=vocab).double()
        assert chi_square_p(rejected, rejected.sum() * residual / residual.sum()) > 1e-4


def test_draft_length_follows_acceptance_and_pauses_longer_each_time():
    length = speculation.DraftLength()
    assert 1 <= length.k(0) < speculation.MAX_DRAFT
    for _ in range(20):
        length.observe(8, 8, 10)
    assert length.k(10) == speculation.MAX_DRAFT  # every draft kept: the most
    pauses = []
    generated = 100
    for _ in range(4):
        while True:  # nothing kept: it pauses, and once the pause is over tries again
            length.observe(length.k(generated), 0, generated)
            if length.k(generated) == 0:
                break
            generated += 1
        start = generated
        while length.k(generated) == 0:
            generated += 1
        pauses.append(generated - start)
    assert pauses == [speculation.PAUSE_TOKENS << i for i in range(4)]


def test_speculate_flags_are_checked_before_the_model_loads():
    for args, message in (
        (["--speculate", "maybe"], "unknown --speculate 'maybe': one of off, ngram, draft"),
        (["--speculate", "draft"], "--speculate draft needs a draft model: add --draft MODEL"),
        (["--speculate", "off", "--draft", "x"], "--draft gives a draft model, which --speculate off does not use"),
    ):
        out = llamaterm("run", "--model", "no-such-model", *args, "hi")
        assert out.returncode == 2 and message in out.stderr, out.stderr


@pytest.fixture(scope="module")
def drafts(tmp_path_factory):
    """Draft models for the tiny target: another random model of its vocabulary (some drafts kept, some not), and
    two of other vocabularies: a small one, and one of the same size whose first two tokens trade places."""
    folder = tmp_path_factory.mktemp("drafts")
    other = write_tiny_llama(folder / "draft.gguf", n_layers=1, seed=1, context_length=512)
    small, swapped = byte_level_meta("gpt-2"), byte_level_meta("gpt-2")
    tokens = swapped["tokenizer.ggml.tokens"] = list(swapped["tokenizer.ggml.tokens"])
    tokens[0], tokens[1] = tokens[1], tokens[0]
    models = {"draft": other}
    for name, meta in (("small", small), ("swapped", swapped)):
        write_byte_level_gguf(folder / f"{name}-vocab.gguf", meta)
        models[name] = write_tiny_llama(folder / f"{name}.gguf", vocab_from=folder / f"{name}-vocab.gguf")
    models["swapped-target"] = write_tiny_llama(folder / "target.gguf", vocab_from=folder / "small-vocab.gguf")
    return models


def draft_engine(tiny, draft_path, **kwargs) -> Engine:
    ckpt, tokenizer = tiny
    draft = load_gguf(draft_path)
    model = Model(ckpt.config, ckpt.tensors, torch.device("cpu"), torch.float32)
    draft_model = Model(draft.config, draft.tensors, torch.device("cpu"), torch.float32)
    return Engine(EngineCore(model, tokenizer, EngineConfig(speculate="draft", **kwargs), draft=draft_model))


@pytest.mark.parametrize("k", sweep([1, 3, 8], fast=(3,)))
def test_a_draft_models_replies_are_those_without_speculation(tiny, alone, drafts, fixed_k, k):
    requests = [(p, SamplingParams(max_tokens=30, ignore_eos=True)) for p in repetitive_prompts(3, seed=20 + k)]
    requests += [
        (p, SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.9, seed=i))
        for i, (p, _) in enumerate(requests)
    ]
    expected = alone(requests, speculate="off")
    fixed_k(k)
    with draft_engine(tiny, drafts["draft"]) as engine:
        assert [replies(engine, [r])[0] for r in requests] == expected  # alone
        assert 0 < engine.step_stats().kept < engine.step_stats().drafted
        assert_every_block_back(engine)


@pytest.mark.slow  # (the fast lane batches a draft model's sequences in test_a_draft_models_steps_through_its_graphs)
@pytest.mark.parametrize("overlap", [False, True])
def test_a_draft_model_in_a_batch_beside_sessions_that_never_draft(tiny, alone, drafts, fixed_k, overlap):
    requests = mixed_batch(seed=30)
    expected = alone(requests, speculate="off")
    fixed_k(4)
    with draft_engine(tiny, drafts["draft"], overlap=overlap, max_batch_tokens=64, kv_tokens=20 * 16) as engine:
        assert_preempting_replies(engine, requests, expected)


def test_a_draft_model_reads_only_what_it_computed_for_the_tokens_there_now(tiny, drafts, fixed_k, monkeypatch):
    """The draft's cache keeps its K/V of the tokens the target keeps: after drafts are refused, a step that drafts
    nothing (every other one here, as when older sequences take a step's draft rows) must not leave the refused
    drafts' K/V counted as the draft's (it did, where the verification lowered only the target's count)."""
    written: dict[int, dict[int, int]] = {}  # by sequence: the token at each position of the draft's cache
    stale: list[tuple[int, int]] = []
    step, first_computed, length = DraftModel._step, DraftModel._first_computed, proposer.Proposer._draft_length
    turns = itertools.count()

    def recording_step(self, chunks):
        for seq, start, ids in chunks:
            written.setdefault(seq.id, {}).update(zip(range(start, start + len(ids)), ids, strict=True))
        return step(self, chunks)

    def checked_first_computed(seq):
        first = first_computed(seq)
        stale.extend((seq.id, q) for q in range(first) if written[seq.id].get(q) != seq.token_ids[q])
        return first

    monkeypatch.setattr(DraftModel, "_step", recording_step)
    monkeypatch.setattr(DraftModel, "_first_computed", staticmethod(checked_first_computed))
    monkeypatch.setattr(
        proposer.Proposer, "_draft_length", staticmethod(lambda *a: length(*a) if next(turns) % 2 else 0)
    )
    fixed_k(4)
    with draft_engine(tiny, drafts["draft"]) as engine:
        prompt = repetitive_prompts(1, seed=50)[0]
        replies(engine, [(prompt, SamplingParams(max_tokens=60, ignore_eos=True, temperature=0.8, seed=1))])
        assert 0 < engine.step_stats().kept < engine.step_stats().drafted
    assert not stale, stale[:5]


def test_a_draft_model_of_another_vocabulary_is_refused_by_name(drafts):
    for model, draft, why in (
        (drafts["draft"], drafts["small"], f"(size {len(byte_level_meta('gpt-2')['tokenizer.ggml.tokens'])} vs 49152)"),
        (drafts["swapped-target"], drafts["swapped"], "(token 0: "),
    ):
        with pytest.raises(LlamatermError) as e:
            Engine.from_model(EngineConfig(model=str(model), device="cpu", speculate="draft", draft=str(draft)))
        assert f"the draft model {draft}'s vocabulary differs from {Path(model).stem}'s {why}" in str(e.value)


@pytest.mark.cuda
@pytest.mark.parametrize("k", [1, 4, 8])
def test_greedy_drafts_on_the_gpu_through_graphs_and_overlapped_steps(tmp_path, fixed_k, k):
    """On CUDA the verifying steps replay from the graphs and the steps around them overlap: every token is the fp32
    CPU reference's argmax after the same prefix wherever its top two are apart (fp16 may break a near-tie either
    way), drafts are kept, and every block comes back."""
    path = write_tiny_llama(
        tmp_path / "tiny.gguf", vocab_from=None, vocab_size=512, hidden=256, n_heads=8, intermediate=512, seed=5
    )
    ckpt = load_gguf(path)
    cpu = Engine(EngineCore(Model(ckpt.config, ckpt.tensors, torch.device("cpu"), torch.float32), SyntheticTokenizer()))
    fixed_k(k)
    gpu = Engine(
        EngineCore(
            Model(ckpt.config, ckpt.tensors, torch.device("cuda"), torch.float16),
            SyntheticTokenizer(),
            EngineConfig(max_running=8, max_batch_tokens=64),
        )
    )
    try:
        assert gpu.core.runner.graphs is not None and gpu.core.overlap
        prompts = [[p % 512 for p in prompt] for prompt in repetitive_prompts(6, seed=40 + k)]
        requests = [(p, SamplingParams(max_tokens=40, ignore_eos=True)) for p in prompts]
        for prompt, generated in zip(prompts, replies(gpu, requests), strict=True):
            assert len(generated) == 40
            assert_greedy_choices(cpu, prompt, generated)
        assert gpu.step_stats().kept > 0
        assert_every_block_back(gpu)
    finally:
        gpu.shutdown()
        cpu.shutdown()


@pytest.mark.slow
def test_the_default_model_replies_with_drafts_as_without(tmp_path, fixed_k):
    """An editing request (the reply repeats the prompt's code), greedy, alone for every k, then in a batch with
    an open question beside a penalised request that never drafts, with prompt lookup and with a
    draft model (a random one of the default model's vocabulary: most drafts refused)."""
    edit = EditText.read("matrix.txt", (Path(__file__).parents[1] / "benchmarks/editing/matrix.txt").read_text())
    greedy = SamplingParams(max_tokens=32, ignore_eos=True)
    requests = [
        (edit.messages(), greedy),
        ([{"role": "user", "content": "What is the capital of France?"}], greedy),
        (
            edit.messages(),
            SamplingParams(max_tokens=32, ignore_eos=True, temperature=0.8, repetition_penalty=1.1, seed=1),
        ),
    ]

    def run(engine, batch):
        handles = [engine.submit(messages, params) for messages, params in batch]
        return [[t for e in h.events() for t in e.token_ids] for h in handles]

    with Engine.from_model(EngineConfig(device="cpu", speculate="off")) as engine:
        expected = [run(engine, [r])[0] for r in requests]
    with Engine.from_model(EngineConfig(device="cpu")) as engine:
        for k in range(1, 9):
            fixed_k(k)
            assert run(engine, requests[:1]) == expected[:1], k
        fixed_k(5)
        assert run(engine, requests) == expected
        assert engine.step_stats().kept > 0
        assert_every_block_back(engine)
    draft = write_tiny_llama(tmp_path / "draft.gguf", n_layers=1, seed=3)
    with Engine.from_model(EngineConfig(device="cpu", speculate="draft", draft=str(draft))) as engine:
        assert run(engine, requests) == expected
        assert engine.step_stats().drafted > 0
        assert_every_block_back(engine)


def test_sampled_replies_with_drafts_follow_the_models_distribution(tmp_path, fixed_k):
    """The engine on a model of 4 tokens, each of 4000 seeded requests sampling 3 tokens after a prompt that holds
    every token after its last two, so that prompt lookup drafts the second (the first comes from the prompt's
    prefill; the third would pass max_tokens): the triples follow p(t1) p(t2 | t1) p(t3 | t1 t2) from the model's
    logits (single prefills on a cache of their own), by a chi-square test failing by chance with probability 1e-4
    (the seeds are fixed: it does not flake)."""
    vocab, n, temperature = 4, 4000, 1.5
    path = write_tiny_llama(tmp_path / "t.gguf", vocab_from=None, vocab_size=vocab, seed=11, context_length=64)
    ckpt = load_gguf(path)
    fixed_k(1)
    prompt = [1, 2, 0, 1, 2, 1, 1, 2, 2, 1, 2, 3, 1, 2]
    model = Model(ckpt.config, ckpt.tensors, torch.device("cpu"), torch.float32)
    # rows for 64 sequences and a draft each, however many wait
    with Engine(EngineCore(model, SyntheticTokenizer(vocab), EngineConfig(speculate_tokens=128))) as engine:
        p = lambda ids: torch.softmax(our_last_logits(engine, prompt + ids).double() / temperature, -1)
        expected = torch.zeros(vocab, vocab, vocab, dtype=torch.float64)
        for a in range(vocab):
            for b in range(vocab):
                expected[a, b] = n * p([])[a] * p([a])[b] * p([a, b])
        params = [SamplingParams(max_tokens=3, ignore_eos=True, temperature=temperature, seed=i) for i in range(n)]
        handles = [engine.submit(None, sp, prompt_ids=prompt) for sp in params]
        triples = [[t for e in h.events() for t in e.token_ids] for h in handles]
        stats = engine.step_stats()
    assert stats.drafted == n and 0 < stats.kept < n  # every request drafted its second token; some were kept
    observed = torch.zeros(vocab, vocab, vocab, dtype=torch.float64)
    for a, b, c in triples:
        observed[a, b, c] += 1
    assert chi_square_p(observed.flatten(), expected.flatten()) > 1e-4


def test_a_draft_models_steps_through_its_graphs(tiny, alone, drafts, fixed_k, monkeypatch):
    """The draft model's steps through StepGraphs of its own (on the CPU, captures stubbed as in test_cuda_graph):
    eager until a bucket is captured between two draft steps, replayed after; the replies as without drafts."""
    monkeypatch.setattr(StepGraphs, "_record", record_without_running)
    requests = [(p, SamplingParams(max_tokens=30, ignore_eos=True)) for p in repetitive_prompts(4, seed=60)]
    expected = alone(requests, speculate="off")
    fixed_k(4)
    with draft_engine(tiny, drafts["draft"], max_running=4, max_batch_tokens=64) as engine:
        draft = engine.core.runner.proposer.draft
        max_blocks = -(-engine.max_context // engine.core.block_manager.block_size)
        draft.graphs = StepGraphs(draft._forward, draft._sample, torch.device("cpu"), 4, 64, max_blocks)
        assert replies(engine, requests) == expected
        assert engine.step_stats().drafted > 0
        assert sum(g.forward.replays for g in draft.graphs.graphs.values()) > 0  # captured, then replayed
        assert_every_block_back(engine)
