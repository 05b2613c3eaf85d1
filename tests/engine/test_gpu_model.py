"""The whole model on the GPU (Triton kernels, fp16) against the CPU reference path (torch, fp32)."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from llamaterm.engine.api import EngineConfig
from llamaterm.engine.sampling_params import SamplingParams
from llamaterm.engine.serving.cuda_graph import StepGraphs
from llamaterm.engine.serving.engine import Engine
from llamaterm.engine.serving.model import StepLists
from llamaterm.engine.serving.model_runner import take_pending
from llamaterm.engine.serving.step_inputs import device_tensors
from llamaterm.engine.serving.synthetic_model import synthetic_model
from llamaterm.engine.store.model_store import resolve_model
from tests.support.engine_checks import assert_greedy_choices, assert_same_until_near_tie, logits_at
from tests.support.tiny_models import write_tiny_llama

pytestmark = pytest.mark.cuda

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a short poem about the moon and the tides."}],
]


@pytest.fixture(scope="module", params=["tiny", "default"])
def engines(request, tmp_path_factory):
    if request.param == "tiny":
        path = str(
            write_tiny_llama(
                tmp_path_factory.mktemp("gpu") / "tiny.gguf",
                n_layers=4,
                hidden=256,
                n_heads=8,
                n_kv_heads=2,
                intermediate=512,
                context_length=512,
                seed=3,
            )
        )
    else:
        path = str(resolve_model(None))
    cpu, gpu = (Engine.from_model(EngineConfig(model=path, device=d)) for d in ("cpu", "cuda"))
    yield cpu, gpu
    cpu.shutdown()
    gpu.shutdown()


@pytest.mark.parametrize("chat", PROMPTS)
def test_gpu_matches_cpu_reference(engines, chat):
    cpu, gpu = engines
    ids = cpu.tokenizer.encode_chat(chat)
    ref, out = logits_at(cpu, ids, len(ids) - 1)[0], logits_at(gpu, ids, len(ids) - 1)[0]
    span, error = (ref.max() - ref.min()).item(), (out - ref).abs().max().item()
    print(f"max logit error on the GPU: {error:.4f} (logit span {span:.1f})")  # the figure BENCHMARKS.md reports
    assert error <= 1e-2 * span  # fp16 activations against fp32
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    generated = gpu.generate(chat, params)[1].token_ids
    assert len(generated) == 32
    assert_greedy_choices(cpu, ids, generated)
    assert_same_until_near_tie(cpu, ids, generated, cpu.generate(chat, params)[1].token_ids)


def test_gpu_batch_matches_solo(engines):
    """A batch of 8 gives each sequence the tokens it gets alone, up to near-ties: the batch prefills all prompts
    in one step, whose larger M takes other tiles (another fp32 summation order), so every token is also checked
    against the fp32 reference."""
    cpu, gpu = engines
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    solo = [gpu.generate(c, params)[1].token_ids for c in PROMPTS * 4]
    handles = [gpu.submit(c, params) for c in PROMPTS * 4]
    for h in handles:
        list(h.events())
    for chat, h, alone in zip(PROMPTS * 4, handles, solo, strict=True):
        assert_greedy_choices(cpu, cpu.tokenizer.encode_chat(chat), h.token_ids)
        assert_greedy_choices(cpu, cpu.tokenizer.encode_chat(chat), alone)
    assert sum(h.token_ids == alone for h, alone in zip(handles, solo, strict=True)) >= 4


def paged_step(vocab: int, bs: int, lens: list[int], queries: list[int], gen: torch.Generator) -> StepLists:
    """Sequence i owns blocks 8i .. 8i + 7, has lens[i] tokens in cache after the step, queries[i] of them new
    (random ids); every row samples nothing."""
    s = StepLists([], [], [], [], [], [0], [], [], [], [], [])
    for i, (n, q) in enumerate(zip(lens, queries, strict=True)):
        s.input_ids += torch.randint(0, vocab, (q,), generator=gen).tolist()
        s.positions += range(n - q, n)
        s.slot_mapping += [8 * i * bs + p for p in range(n - q, n)]
        s.block_tables.append(list(range(8 * i, 8 * i + -(-n // bs))))
        s.context_lens.append(n)
        s.query_start_loc.append(s.query_start_loc[-1] + q)
        s.logits_indices.append(s.query_start_loc[-1] - 1)
        s.sampler_slots.append(-1)
        s.sample_positions.append(n)
    return s


def graphs_over_twin_caches():
    """The tiny shapes' random 4-bit model, two equal random KV caches, and StepGraphs whose forward pass runs over
    cache 0 with a sampler that takes the logits' argmax: the graphs' steps compare with the eager forward pass over
    cache 1. Returns (model, block size, caches, graphs)."""
    model, bs = synthetic_model("tiny", True, torch.device("cuda")), 16
    caches = [model.allocate_kv_cache(8 * 5, bs).normal_() for _ in range(2)]
    caches[1].copy_(caches[0])
    forward = lambda step: model.forward_pieces(step.inputs, caches[0])
    sample = lambda step, logits: logits.argmax(-1)
    graphs = StepGraphs(forward, sample, model.device, max_running=8, max_batch_tokens=64, max_blocks=8)
    return model, bs, caches, graphs


@pytest.mark.parametrize("name", ["smollm2-135m", "tiny-moe"])
def test_quantized_weights_held_once(name):
    """On CUDA each quantized weight is kept in the kernels' layout alone, made at load (so that the KV cache is
    sized after it): a model holds its weights' bytes once, not the packed form and the layout both."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    model = synthetic_model(name, True, torch.device("cuda"))
    held = torch.cuda.memory_allocated() - before
    quantized = model.quantized_weights()
    assert quantized and all(w.layout_only for w in quantized)
    layouts = sum(w.nbytes() for w in quantized)
    routers = sum(layer.mlp.router.numel() * 2 for layer in model.layers if hasattr(layer.mlp, "router"))
    assert layouts <= held <= 1.1 * layouts + routers


def test_step_graphs_match_eager():
    """Steps replayed from CUDA graphs give the eager forward pass's logits and write the same K/V: decodes, a
    prefill chunk beside decodes, each padded to its bucket after a larger step left its rows in the buffers. Each
    step runs eagerly over the padded buffers first, its bucket is then warmed and captured between steps (as the
    engine's background work does), and the same step replayed gives the same again. The engines above run every
    step through graphs (Engine's default), so the tests before this one check graph steps against the fp32
    reference. Random 4-bit weights: no model file needed."""
    model, bs, caches, graphs = graphs_over_twin_caches()
    assert not graphs.graphs and not graphs.warmed  # nothing before the first step
    gen = torch.Generator().manual_seed(0)
    step = lambda lens, queries: paged_step(model.config.vocab_size, bs, lens, queries, gen)
    steps = [
        step([37, 5, 100, 64, 17], [1, 1, 30, 1, 1]),  # 34 tokens: the 64 bucket
        step([38, 6, 101], [1, 1, 1]),  # decodes: the 4 bucket, over the 64 bucket's leftovers
        step([20, 102], [20, 1]),
    ]  # a new prompt beside a decode: the 32 bucket
    # the decodes' tokens 0 and 2 were sampled by a step still in flight: they come from its tokens on the device
    # (the reference gets those tokens as plain inputs)
    pending = torch.tensor([11, 222, 33], device=model.device)
    known = [dataclasses.replace(s, input_ids=list(s.input_ids)) for s in steps]
    known[1].input_ids[0], known[1].input_ids[2] = 33, 222
    steps[1].pending_rows, steps[1].pending_from = [0, 2], [2, 1]
    last = SimpleNamespace(tokens=SimpleNamespace(device_tokens=pending))  # as model_runner's LaunchedStep
    for s, k in zip(steps, known, strict=True):
        ref = model.forward(device_tensors(k, model.device).inputs, caches[1]).float()
        for captured in (False, True):
            bucket, device_step = graphs.prepare(s)
            take_pending(device_step, s, last)
            out = graphs.run_forward(bucket, device_step)
            tokens = graphs.run_sample(bucket, device_step, out)[: len(s.context_lens)]
            out = out[: len(s.context_lens)].float()
            assert (bucket in graphs.graphs) == captured
            assert out.shape == ref.shape == (len(s.context_lens), model.config.vocab_size)
            assert (out - ref).abs().max().item() <= 1e-3 * (ref.max() - ref.min()).item()
            assert (caches[0] - caches[1]).abs().max().item() <= 1e-2
            assert torch.equal(tokens, out.argmax(-1))
            if not captured:  # between two steps, as the engine does it: a warm run over padding (writes no KV)
                graphs.warm(bucket)
                assert (caches[0] - caches[1]).abs().max().item() <= 1e-2
                graphs.capture(bucket)
    assert sorted(graphs.graphs) == [4, 32, 64]
    assert graphs.wanted(idle=False) == [] and graphs.wanted(idle=True) == [1, 2, 8]  # the decode buckets left


def test_a_capture_open_between_live_steps_records_the_step_alone():
    """The background work records a bucket's graph a piece at a time, its capture open on a side stream while the
    engine's live steps run on their own between the pieces: eager steps and replays of another bucket. Those take
    effect at once (against the eager reference), and the graph, once replayed, is the bucket's step alone."""
    model, bs, caches, graphs = graphs_over_twin_caches()
    gen = torch.Generator().manual_seed(1)
    decode = paged_step(model.config.vocab_size, bs, [40, 7, 90], [1, 1, 1], gen)  # the 4 bucket, replayed
    prefill = paged_step(model.config.vocab_size, bs, [20, 33], [20, 1], gen)  # the 32 bucket, eager
    mixed = paged_step(model.config.vocab_size, bs, [60, 8, 91, 17], [30, 1, 1, 17], gen)  # the 64 bucket
    graphs.warm(4)
    graphs.capture(4)

    def live(s: StepLists) -> None:
        ref = model.forward(device_tensors(s, model.device).inputs, caches[1]).float()
        bucket, device_step = graphs.prepare(s)
        out = graphs.run_forward(bucket, device_step)
        graphs.run_sample(bucket, device_step, out)
        out = out[: len(s.context_lens)].float()
        assert (out - ref).abs().max().item() <= 1e-3 * (ref.max() - ref.min()).item()

    pieces = 0
    for job in (graphs._warm(64), graphs._capture(64)):
        for _ in job:  # a piece, then live steps as the engine runs them between pieces
            pieces += 1
            live(decode)
            live(prefill)
            assert (caches[0] - caches[1]).abs().max().item() <= 1e-2
    assert pieces >= 2 * len(model.layers) and sorted(graphs.graphs) == [4, 64]
    live(mixed)  # replayed from the graph recorded between the live steps
    assert (caches[0] - caches[1]).abs().max().item() <= 1e-2


def test_engine_replays_every_step_kind(engines):
    _, gpu = engines
    assert gpu.core.runner.graphs is not None and gpu.core.runner.graphs.buckets[-1] == 2048  # the step token budget
