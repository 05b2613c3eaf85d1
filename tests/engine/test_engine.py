"""The engine on small random models: batching, preemption, prefix caching and cancellation never change what a
request generates; every block comes back; bad requests fail alone. With overlap=True, as on CUDA, each step is
launched before the last one's tokens are read (they reach the next step's inputs on the device)."""

import random
import threading
import time

import pytest
import torch

from llamaterm.engine.api import EngineConfig
from llamaterm.engine.checkpoints.gguf import load_gguf
from llamaterm.engine.checkpoints.tokenizer import Tokenizer
from llamaterm.engine.errors import RequestError
from llamaterm.engine.sampling_params import SamplingParams
from llamaterm.engine.serving.engine import Engine
from llamaterm.engine.serving.engine_core import EngineCore
from llamaterm.engine.serving.model import Model
from llamaterm.engine.serving.synthetic_model import SYNTHETIC, synthetic_model
from llamaterm.kernels.qweight import QuantWeight
from tests.support.tiny_engine import make_engine
from tests.support.tiny_models import write_tiny_llama


def run_alone(engine: Engine, prompt_ids, params) -> list[int]:
    handle = engine.submit(None, params, prompt_ids=prompt_ids)
    list(handle.events())
    return handle.token_ids


def random_requests(n: int, seed: int, max_prompt=60, max_new=24):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(3, 49000) for _ in range(rng.randint(1, max_prompt))]
        if i % 2:
            params = SamplingParams(
                max_tokens=rng.randint(1, max_new),
                temperature=rng.choice([0.7, 1.0, 1.3]),
                top_p=rng.choice([1.0, 0.9]),
                top_k=rng.choice([0, 50]),
                min_p=rng.choice([0.0, 0.05]),
                repetition_penalty=rng.choice([1.0, 1.2]),
                presence_penalty=rng.choice([0.0, 0.5]),
                frequency_penalty=rng.choice([0.0, 0.3]),
                seed=1000 + i,
                ignore_eos=True,
            )
        else:
            params = SamplingParams(max_tokens=rng.randint(1, max_new), ignore_eos=True)
        out.append((prompt, params))
    return out


@pytest.mark.parametrize("overlap", [False, True])
def test_batch_invariance_with_staggered_arrivals(tiny, alone, overlap):
    requests = random_requests(8, seed=1)
    expected = alone(requests)
    with make_engine(tiny, overlap=overlap, max_batch_tokens=64) as engine:
        handles = []
        for prompt, params in requests:
            handles.append(engine.submit(None, params, prompt_ids=prompt))
            time.sleep(0.005)
        for h in handles:
            list(h.events())
        assert [h.token_ids for h in handles] == expected
        assert engine.core.block_manager.num_free == engine.core.block_manager.num_blocks


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("prompt_len", [37, 48])  # a partial last block (copied by each fork), and none
def test_choices_forked_from_one_prefill_sample_as_if_alone(tiny, overlap, prompt_len):
    """n choices of one prompt (seeds 7 + i, as serve gives them; one greedy) submitted together: the prompt is
    computed once and the others fork from it, and each choice generates what it generates alone, with the same
    log-probabilities (which would move if a fork's copy of the partial last block were wrong)."""
    prompt = [(11 * t) % 40000 + 3 for t in range(prompt_len)]
    filters = dict(temperature=1.0, top_k=40, repetition_penalty=1.2, presence_penalty=0.3, ignore_eos=True)
    requests = [(prompt, SamplingParams(max_tokens=20, seed=7 + i, logprobs=0, **filters)) for i in range(4)]
    requests.append((prompt, SamplingParams(max_tokens=20, logprobs=0, ignore_eos=True)))

    def replies(engine: Engine, handles) -> list[list[tuple[int, float]]]:
        return [[(lp.token_id, lp.logprob) for e in h.events() for lp in e.logprobs] for h in handles]

    with make_engine(tiny) as engine:
        expected = [replies(engine, [engine.submit(None, sp, prompt_ids=p)])[0] for p, sp in requests]
    with make_engine(tiny, overlap=overlap, block_size=16) as engine:
        with engine.together():  # as serve submits a response's choices
            handles = [engine.submit(None, params, prompt_ids=p) for p, params in requests]
        for got, want in zip(replies(engine, handles), expected, strict=True):
            assert [t for t, _ in got] == [t for t, _ in want]
            assert [lp for _, lp in got] == pytest.approx([lp for _, lp in want], abs=1e-5)
        assert [h.stats().cached_tokens for h in handles] == [0] + [prompt_len] * 4  # computed once
        assert engine.core.block_manager.num_free == engine.core.block_manager.num_blocks


def test_an_empty_prompt_is_refused(tiny):
    """A reply samples from its prompt's last position: with no tokens, a request alone failed its step, and in a
    batch sampled from the row before it (another request's)."""
    with make_engine(tiny) as engine, pytest.raises(RequestError, match="empty"):
        engine.submit(None, SamplingParams(max_tokens=3), prompt_ids=[])


def test_a_request_submitted_as_the_engine_shuts_down_ends_as_cancelled(tiny):
    """A request the loop has not taken in yet when shutdown() stops it (submitted while a step ran) ends as
    cancelled, as those in flight do: its caller never waits for an event that would not come."""
    engine = make_engine(tiny)
    stepping, go_on = threading.Event(), threading.Event()
    launch = engine.core._launch

    def slow_launch():
        stepping.set()
        go_on.wait()
        return launch()

    engine.core._launch = slow_launch
    running = engine.submit(None, SamplingParams(max_tokens=400, ignore_eos=True), prompt_ids=[5, 6, 7])
    stepping.wait()
    queued = engine.submit(None, SamplingParams(max_tokens=5), prompt_ids=[8, 9])
    stopper = threading.Thread(target=engine.shutdown)
    stopper.start()
    while not engine.core._stopped:
        time.sleep(0.001)
    go_on.set()
    stopper.join(timeout=30)
    for handle in (running, queued):
        last = handle.events_queue.get(timeout=30)
        while not last.finished:
            last = handle.events_queue.get(timeout=30)
        assert last.finish_reason == "cancelled" and handle.stats().finished


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True])
def test_small_pool_preempts_and_recomputes(tiny, alone, overlap):
    prompts = [p for p, _ in random_requests(16, seed=2, max_prompt=50)]
    # penalties too: their token counts stay on the device through a preemption
    requests = [
        (
            p,
            SamplingParams(
                max_tokens=40, ignore_eos=True, temperature=i % 2, repetition_penalty=1 + i % 3 / 10, seed=i
            ),
        )
        for i, p in enumerate(prompts)
    ]
    expected = alone(requests)
    # 16 blocks: ~3 requests at a time
    with make_engine(tiny, overlap=overlap, kv_tokens=16 * 16, block_size=16) as engine:
        preempted = []
        preempt = engine.core.scheduler.preempt
        engine.core.scheduler.preempt = lambda seq: (preempted.append(seq.id), preempt(seq))
        handles = [engine.submit(None, sp, prompt_ids=p) for p, sp in requests]
        for h in handles:
            events = list(h.events())
            assert events[-1].finish_reason == "length"
        assert [h.token_ids for h in handles] == expected
        assert preempted  # the pool was too small: some sequences were recomputed
        assert engine.core.block_manager.num_free == engine.core.block_manager.num_blocks


@pytest.mark.parametrize("overlap", [False, True])
def test_next_turn_reuses_cached_prefix(tiny, overlap):
    ckpt, tokenizer = tiny
    turn1 = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper and the sea."}]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    with make_engine(tiny, overlap=overlap) as engine:
        reply, first = engine.generate(turn1, params)
        turn2 = turn1 + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And then?"}]
        _, second = engine.generate(turn2, params)
        assert first.stats().cached_tokens == 0
        assert second.stats().cached_tokens >= 16 * ((first.stats().prompt_tokens - 1) // 16)
        assert second.stats().cached_tokens > 0
        assert engine.core.block_manager.num_free == engine.core.block_manager.num_blocks
    with make_engine(tiny) as cold:
        _, cold_second = cold.generate(turn2, params)
        assert cold_second.stats().cached_tokens == 0
        assert cold_second.token_ids == second.token_ids


@pytest.mark.parametrize("overlap", [False, True])
def test_cancel_in_prefill_and_decode_frees_blocks_and_spares_others(tiny, alone, overlap):
    others = random_requests(3, seed=3)
    expected = alone(others)
    with make_engine(tiny, overlap=overlap, max_batch_tokens=32) as engine:
        long_prompt = list(range(100, 400))  # ten 32-token chunks of prefill
        in_prefill = engine.submit(None, SamplingParams(max_tokens=5), prompt_ids=long_prompt)
        in_decode = engine.submit(None, SamplingParams(max_tokens=400, ignore_eos=True), prompt_ids=[5, 6, 7])
        handles = [engine.submit(None, sp, prompt_ids=p) for p, sp in others]
        engine.cancel(in_prefill)
        while in_decode.stats().generated_tokens < 3:
            time.sleep(0.001)
        engine.cancel(in_decode)
        assert list(in_prefill.events())[-1].finish_reason == "cancelled"
        assert list(in_decode.events())[-1].finish_reason == "cancelled"
        assert in_decode.stats().generated_tokens < 400
        for h in handles:
            list(h.events())
        assert [h.token_ids for h in handles] == expected
        engine.cancel(in_decode)  # finished: a no-op
        engine.cancel(12345)  # unknown: a no-op
        time.sleep(0.05)
        assert engine.core.block_manager.num_free == engine.core.block_manager.num_blocks


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True])
def test_stress_random_arrivals_cancels_and_stop_strings(tiny, alone, overlap):
    rng = random.Random(4)
    requests = []
    for prompt, params in random_requests(200, seed=5, max_prompt=40, max_new=16):
        stop = tuple(rng.sample(["e", " the", "a", "\n", "ing"], rng.randint(0, 2)))
        requests.append((prompt, SamplingParams(**{**params.__dict__, "stop": stop})))
    expected = alone(requests)
    engine = make_engine(tiny, overlap=overlap, kv_tokens=64 * 16, max_batch_tokens=128)
    cancelled = set(rng.sample(range(200), 30))
    handles = {}

    def submitter():
        for i, (prompt, params) in enumerate(requests):
            handles[i] = engine.submit(None, params, prompt_ids=prompt)
            if rng.random() < 0.3:
                time.sleep(rng.random() * 0.004)
            if i in cancelled:
                engine.cancel(handles[i])

    with engine:
        t = threading.Thread(target=submitter)
        t.start()
        t.join()
        for i, h in handles.items():
            events = list(h.events())
            assert events[-1].finished
            if i not in cancelled:
                assert events[-1].finish_reason in ("stop", "length")
                assert h.token_ids == expected[i]
        assert engine.core.block_manager.num_free == engine.core.block_manager.num_blocks
        assert not engine.core.scheduler.running and not engine.core.scheduler.waiting


@pytest.mark.parametrize("overlap", [False, True])
def test_stop_strings_cut_the_text(tiny, overlap):
    _, tokenizer = tiny
    with make_engine(tiny, overlap=overlap) as engine:
        full, _ = engine.generate("Once upon a time", SamplingParams(max_tokens=30, ignore_eos=True), raw=True)
        stop = full[len(full) // 2 : len(full) // 2 + 2]
        assert stop and stop in full
        cut, h = engine.generate(
            "Once upon a time", SamplingParams(max_tokens=30, ignore_eos=True, stop=(stop,)), raw=True
        )
        assert cut == full[: full.index(stop)]
        assert list(h.poll()) == []


def test_a_token_that_holds_two_stop_strings_ends_the_text_at_the_first(tiny):
    _, tokenizer = tiny
    (token,) = tokenizer.encode('."', add_special=False)
    with make_engine(tiny, overlap=False) as engine:
        for stop in (('"', "."), (".", '"'), ('"',)):
            params = SamplingParams(max_tokens=1, logit_bias=((token, 100.0),), stop=stop)
            expected = '."'[: min('."'.index(s) for s in stop)]
            assert engine.generate("Hi", params, raw=True)[0] == expected, stop


@pytest.mark.parametrize("overlap", [False, True])
def test_bad_requests_fail_alone(tiny, overlap, monkeypatch):
    with make_engine(tiny, overlap=overlap, kv_tokens=20 * 16) as engine:
        with pytest.raises(RequestError, match="empty"):
            engine.submit("", SamplingParams(), raw=True)
        with pytest.raises(RequestError, match="context"):
            engine.submit(None, SamplingParams(), prompt_ids=[5] * 600)
        with pytest.raises(RequestError, match="KV cache pool"):
            engine.submit(None, SamplingParams(), prompt_ids=[5] * 400)
        # max_tokens past the pool is clamped, with finish reason "length"
        h = engine.submit(None, SamplingParams(max_tokens=10_000, ignore_eos=True), prompt_ids=[5] * 300)
        events = list(h.events())
        assert events[-1].finish_reason == "length" and h.stats().generated_tokens == 320 - 300
        # an exception while serving one request fails that request alone
        from llamaterm.engine.serving.detokenizer import IncrementalDetokenizer

        real_push = IncrementalDetokenizer.push

        def flaky(self, token_id):
            if self.stop == ("boom",):
                raise ValueError("detokenizer exploded")
            return real_push(self, token_id)

        monkeypatch.setattr(IncrementalDetokenizer, "push", flaky)
        bad = engine.submit(None, SamplingParams(max_tokens=5, stop=("boom",)), prompt_ids=[7, 8, 9])
        good = engine.submit(None, SamplingParams(max_tokens=5, ignore_eos=True), prompt_ids=[7, 8, 9])
        bad_events = list(bad.events())
        assert bad_events[-1].finish_reason == "error" and "exploded" in bad_events[-1].error
        assert list(good.events())[-1].finish_reason == "length" and good.stats().generated_tokens == 5
        assert engine.core.block_manager.num_free == engine.core.block_manager.num_blocks


@pytest.mark.parametrize("overlap", [False, True])
def test_a_request_whose_logits_are_nan_ends_alone(tmp_path, overlap):
    """A corrupt embedding row: every request whose prompt holds that token gets NaN logits and ends with an error
    that says so; the requests beside it in the batch go on, and get the tokens they get alone."""
    path = write_tiny_llama(tmp_path / "nan.gguf", n_layers=2, context_length=512, tie_embeddings=False)
    ckpt = load_gguf(path)
    tokenizer = Tokenizer.from_gguf_metadata(ckpt.metadata)
    model = Model(ckpt.config, ckpt.tensors, torch.device("cpu"), torch.float32)
    embd = model.token_embd
    (embd.scales if isinstance(embd, QuantWeight) else embd)[42] = float("nan")
    good = [
        ([5, 6, 7, 8], SamplingParams(max_tokens=12, ignore_eos=True)),
        ([9, 10, 11], SamplingParams(max_tokens=12, temperature=0.8, top_k=20, seed=3, ignore_eos=True)),
    ]
    with Engine(EngineCore(model, tokenizer, EngineConfig(overlap=overlap))) as engine:
        expected = [run_alone(engine, p, sp) for p, sp in good]
        bad = engine.submit(None, SamplingParams(max_tokens=12, temperature=0.8), prompt_ids=[5, 42, 7])
        handles = [engine.submit(None, sp, prompt_ids=p) for p, sp in good]
        last = list(bad.events())[-1]
        assert last.finish_reason == "error" and "NaN or infinite" in last.error
        assert [(list(h.events())[-1].finish_reason, h.token_ids) for h in handles] == [("length", e) for e in expected]
        assert engine.core.block_manager.num_free == engine.core.block_manager.num_blocks


def test_dense_prefill_weights_only_within_budget():
    """Model.keep_dense_weights keeps a dense copy of every block linear when all fit the budget, none otherwise."""
    c = SYNTHETIC["tiny"][0]
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    need = 4 * c.n_layers * (c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size)
    model = synthetic_model("tiny", True, torch.device("cpu"))  # fp32 activations on the CPU: 4 bytes a weight
    linears = [w for layer in model.layers for w in layer.matrices()]
    assert all(isinstance(w, QuantWeight) for w in linears)
    assert model.keep_dense_weights(need - 1) == 0
    assert all(w.kept_dense(torch.float32) is None for w in linears)
    assert model.keep_dense_weights(need) == need
    assert all(torch.equal(w.kept_dense(torch.float32), w.dequantize(torch.float32)) for w in linears)


def test_triton_hashes_its_library_beside_the_loading():
    """On CUDA the hash Triton keys its kernel cache by (of its 500 MB library) is computed on a thread while the
    block loads the model, and is ready when the block ends; elsewhere nothing happens."""
    from triton.runtime.cache import triton_key

    from llamaterm.engine.serving.engine_core import triton_cache_key_beside

    triton_key.cache_clear()
    with triton_cache_key_beside(torch.device("cpu")):
        assert "llamaterm-triton-key" not in {t.name for t in threading.enumerate()}
    assert triton_key.cache_info().currsize == 0
    with triton_cache_key_beside(torch.device("cuda")):  # (a device object: nothing here touches CUDA)
        assert "llamaterm-triton-key" in {t.name for t in threading.enumerate()}
    assert triton_key.cache_info().currsize == 1
    assert "llamaterm-triton-key" not in {t.name for t in threading.enumerate()}
