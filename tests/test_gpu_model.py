"""The whole model on the GPU (Triton kernels, fp16) against the CPU reference path (torch, fp32)."""

import pytest
import torch

from engine.engine import Engine
from engine.model import StepInput
from engine.sampling_params import SamplingParams
from engine.store import resolve_model
from tests.tiny_models import write_tiny_llama

pytestmark = pytest.mark.cuda

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a short poem about the moon and the tides."}],
]


def last_logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    model, n, bs = engine.model, len(ids), 16
    nb = -(-n // bs)
    cache = model.allocate_kv_cache(nb, bs)
    dev = model.device
    step = StepInput(
        input_ids=torch.tensor(ids, device=dev), positions=torch.arange(n, device=dev),
        slot_mapping=torch.arange(n, device=dev), block_tables=torch.arange(nb, dtype=torch.int32, device=dev)[None],
        context_lens=torch.tensor([n], device=dev), query_start_loc=torch.tensor([0, n], device=dev),
        logits_indices=torch.tensor([n - 1], device=dev),
    )
    return model.forward(step, cache)[0].cpu()


@pytest.fixture(scope="module", params=["tiny", "default"])
def engines(request, tmp_path_factory):
    if request.param == "tiny":
        path = str(write_tiny_llama(tmp_path_factory.mktemp("gpu") / "tiny.gguf", n_layers=4, hidden=256,
                                    n_heads=8, n_kv_heads=2, intermediate=512, context_length=512, seed=3))
    else:
        path = str(resolve_model(None))
    cpu, gpu = Engine.from_model(path, device="cpu"), Engine.from_model(path, device="cuda")
    yield cpu, gpu
    cpu.shutdown()
    gpu.shutdown()


@pytest.mark.parametrize("chat", PROMPTS)
def test_gpu_matches_cpu_reference(engines, chat):
    cpu, gpu = engines
    ids = cpu.tokenizer.encode_chat(chat)
    ref, out = last_logits(cpu, ids), last_logits(gpu, ids)
    span = (ref.max() - ref.min()).item()
    assert (out - ref).abs().max().item() <= 1e-2 * span  # fp16 activations against fp32
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    assert gpu.generate(chat, params)[1].seq.generated == cpu.generate(chat, params)[1].seq.generated


def test_gpu_batch_matches_solo(engines):
    _, gpu = engines
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    solo = [gpu.generate(c, params)[1].seq.generated for c in PROMPTS * 4]
    handles = [gpu.submit(c, params) for c in PROMPTS * 4]
    for h in handles:
        list(h.events())
    assert [h.seq.generated for h in handles] == solo
