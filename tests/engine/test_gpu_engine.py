"""The engine on the GPU where its CUDA graphs meet awkward work: requests arriving while a graph is being
captured, more sequences than the largest batch bucket, prompts longer than any prefill bucket, and the GPU out
of memory at start-up. Tokens are checked against the fp32 CPU reference (tests/support/engine_checks.py)."""

import gc
import random
import threading
import time

import pytest
import torch

from llamaterm.engine.api import EngineConfig
from llamaterm.engine.checkpoints.gguf import load_gguf
from llamaterm.engine.errors import LlamatermError
from llamaterm.engine.sampling_params import SamplingParams
from llamaterm.engine.serving.engine import Engine
from llamaterm.engine.serving.engine_core import EngineCore
from llamaterm.engine.serving.model import Model
from llamaterm.engine.serving.synthetic_model import synthetic_model
from llamaterm.engine.synthetic import SyntheticTokenizer
from tests.support.engine_checks import assert_greedy_choices
from tests.support.tiny_models import write_tiny_llama

pytestmark = pytest.mark.cuda


def small_llama(tmp_path, seed: int):
    """A 2-layer Llama of 512 tokens, GQA, random weights: the engine's awkward cases at a small size."""
    path = write_tiny_llama(
        tmp_path / "tiny.gguf",
        vocab_from=None,
        vocab_size=512,
        n_layers=2,
        hidden=256,
        n_heads=8,
        n_kv_heads=2,
        intermediate=512,
        context_length=1024,
        seed=seed,
    )
    return load_gguf(path)


def test_requests_during_captures_and_steps_past_the_buckets(tmp_path):
    ckpt = small_llama(tmp_path, seed=5)
    cpu = Engine(EngineCore(Model(ckpt.config, ckpt.tensors, torch.device("cpu"), torch.float32), SyntheticTokenizer()))
    # 4 sequences at most and 64 tokens a step: 12 requests queue, and the long prompts run in chunks
    gpu = Engine(
        EngineCore(
            Model(ckpt.config, ckpt.tensors, torch.device("cuda"), torch.float16),
            SyntheticTokenizer(),
            EngineConfig(max_running=4, max_batch_tokens=64),
        )
    )
    captured_at_start = set(gpu.core.runner.graphs.graphs)  # (serve first: none, unless the loop idled already)
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 512) for _ in range(n)] for n in (1, 5, 17, 40, 64, 65, 100, 300, 700, 3, 9, 129)]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    handles: dict[int, object] = {}

    def submit(part: int) -> None:  # three callers at once, while the engine captures graphs for new step sizes
        for i in range(part, len(prompts), 3):
            handles[i] = gpu.submit(None, params, prompt_ids=prompts[i])

    try:
        threads = [threading.Thread(target=submit, args=(p,)) for p in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for i, prompt in enumerate(prompts):
            events = list(handles[i].events())
            assert events[-1].finish_reason == "length", events[-1]
            generated = [t for e in events for t in e.token_ids]
            assert len(generated) == 16
            assert_greedy_choices(cpu, prompt, generated)
        assert set(gpu.core.runner.graphs.graphs) > captured_at_start  # graphs captured while requests streamed
        assert gpu.core.block_manager.num_free == gpu.core.block_manager.num_blocks
    finally:
        gpu.shutdown()
        cpu.shutdown()


def test_the_same_tokens_before_and_after_the_graphs_are_captured():
    """A fresh engine answers at once, its steps eager until their buckets' graphs exist (captured between its
    steps); once idle, it captures the rest. Asked again, sampled with a seed, every step replayed from a graph:
    the same tokens (the same kernels over the same padded buffers). One request at a time, prompts of 12 tokens
    (no full block, so no prefix-cache hit): the same step sizes both times."""
    model = synthetic_model("smollm2-135m", True, torch.device("cuda"))
    # one token a step (no drafts, which random weights' repeated tokens would take several a step): the decodes
    # use bucket 1
    config = EngineConfig(max_running=8, kv_tokens=8192, speculate="off")
    gpu = Engine(EngineCore(model, SyntheticTokenizer(model.config.vocab_size), config))
    graphs = gpu.core.runner.graphs
    params = SamplingParams(max_tokens=48, temperature=0.8, seed=7, ignore_eos=True)
    prompts = [list(range(100 + 12 * i, 112 + 12 * i)) for i in range(3)]
    run = lambda p: [t for e in gpu.submit(None, params, prompt_ids=p).events() for t in e.token_ids]
    try:
        before = [run(p) for p in prompts]
        assert 1 in graphs.graphs  # captured between the first request's steps
        deadline = time.monotonic() + 60
        while gpu.core.runner.background_pending(idle=True):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert {1, 2, 4, 8} <= set(graphs.graphs)
        assert [run(p) for p in prompts] == before
    finally:
        gpu.shutdown()


def test_seeded_sampling_alone_and_in_a_batch_on_the_gpu(tmp_path):
    """Seeded requests with every filter and penalty sample the tokens they sample alone when batched with greedy
    and other seeded ones, through the graphs and overlapped steps; a batch's other tile shapes may move a logit
    by a rounding, so a near-tie may differ: most sequences must match whole."""
    ckpt = small_llama(tmp_path, seed=7)
    rng = random.Random(1)
    requests = []
    for i in range(8):
        prompt = [rng.randrange(1, 512) for _ in range(rng.randint(3, 40))]
        params = (
            SamplingParams(max_tokens=24, ignore_eos=True)
            if i % 3 == 0
            else SamplingParams(
                max_tokens=24,
                ignore_eos=True,
                temperature=0.9,
                top_k=40,
                top_p=0.95,
                min_p=0.05,
                repetition_penalty=1.1,
                presence_penalty=0.3,
                seed=100 + i,
            )
        )
        requests.append((prompt, params))
    with Engine(
        EngineCore(Model(ckpt.config, ckpt.tensors, torch.device("cuda"), torch.float16), SyntheticTokenizer())
    ) as gpu:
        alone = [gpu.generate(None, p, prompt_ids=ids)[1].token_ids for ids, p in requests]
        handles = [gpu.submit(None, p, prompt_ids=ids) for ids, p in requests]
        for h in handles:
            list(h.events())
        together = [h.token_ids for h in handles]
    assert all(len(t) == 24 for t in together)
    assert sum(a == t for a, t in zip(alone, together, strict=True)) >= 6, (alone, together)


@pytest.mark.parametrize("prompt_len", [37, 48])  # forks copy a partial last block, or none
def test_forked_choices_on_the_gpu_sample_as_if_alone(tmp_path, prompt_len):
    """n choices of one prompt submitted together fork from its one prefill (a chunk of no tokens in the graphs'
    step, the partial last block copied): each samples what it samples alone (most whole, as above)."""
    ckpt = small_llama(tmp_path, seed=9)
    prompt = [(7 * t) % 511 + 1 for t in range(prompt_len)]
    filters = dict(temperature=0.9, top_k=40, repetition_penalty=1.1, ignore_eos=True)
    params = [SamplingParams(max_tokens=24, seed=100 + i, **filters) for i in range(5)]
    with Engine(
        EngineCore(Model(ckpt.config, ckpt.tensors, torch.device("cuda"), torch.float16), SyntheticTokenizer())
    ) as gpu:
        alone = [gpu.generate(None, p, prompt_ids=prompt)[1].token_ids for p in params]
        with gpu.together():
            handles = [gpu.submit(None, p, prompt_ids=prompt) for p in params]
        for h in handles:
            list(h.events())
        assert [h.stats().cached_tokens for h in handles[1:]] == [prompt_len] * 4  # forks
        together = [h.token_ids for h in handles]
    assert sum(a == t for a, t in zip(alone, together, strict=True)) >= 4, (alone, together)


def test_out_of_memory_at_start_up_says_which_kv_tokens_to_try():
    gc.collect()  # earlier tests' pools, so that what is reserved now is this test's
    torch.cuda.empty_cache()
    model = synthetic_model("tiny", True, torch.device("cuda"))
    total = torch.cuda.get_device_properties(0).total_memory
    # the allocator may take only what is in use and 256 MB more: the default pool (most of the free memory) fails
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + (256 << 20)) / total)
    try:
        with pytest.raises(LlamatermError, match=r"ran out of memory .*give a smaller --kv-tokens \(e\.g\. \d+\)"):
            Engine(EngineCore(model, SyntheticTokenizer()))
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    with Engine(
        EngineCore(model, SyntheticTokenizer(), EngineConfig(kv_tokens=4096))
    ) as engine:  # the advice works, in the same process
        assert engine.generate(None, SamplingParams(max_tokens=4), prompt_ids=[5, 6, 7])[1].stats().generated_tokens
