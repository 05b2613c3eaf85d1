"""Each model family against transformers: a tiny random model built with transformers' own class, loaded from
safetensors (same logits within 1e-4 of their range, same greedy tokens) and converted to GGUF by llama.cpp's
converter (same greedy tokens). tests/family_oracle.py builds the models and runs the oracles."""

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import transformers

from llamaterm.engine.api import EngineConfig
from llamaterm.engine.sampling_params import SamplingParams
from llamaterm.engine.serving.engine import Engine
from tests.family_oracle import byte_level_bpe, convert_to_gguf, hf_greedy, hf_logits, save_tiny_model
from tests.test_fidelity import our_last_logits
from tests.test_gpu_model import assert_greedy_choices

VOCAB = 384
PROMPT = [5, 17, 200, 33, 99, 1, 250, 7, 64, 128, 300, 12, 45, 46, 47, 48, 301, 2, 9]
GREEDY_STEPS = 24


@dataclass
class Family:
    model_cls: type
    config: transformers.PretrainedConfig
    pre: str  # the GGUF pre-tokenizer llama.cpp's converter would detect for the family's real tokenizer
    pre_split: str | None = None  # the family's pre-tokenizer regex, for the test tokenizer
    prompt: list[int] = field(default_factory=lambda: PROMPT)


def small(**kw) -> dict:
    """Shapes shared by every tiny family model: GQA, 2 layers, head_dim 16, a vocabulary of VOCAB."""
    return dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5, **kw)


QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")  # Qwen2.5's tokenizer.json

FAMILIES = {
    "llama": Family(transformers.LlamaForCausalLM, transformers.LlamaConfig(**small(tie_word_embeddings=False)),
                    "llama-bpe"),
    # Qwen2.5-0.5B / 1.5B / 3B tie their embeddings, 7B does not; q/k/v biases either way
    "qwen2": Family(transformers.Qwen2ForCausalLM, transformers.Qwen2Config(**small(tie_word_embeddings=True)),
                    "qwen2", QWEN2_SPLIT),
    "qwen2-untied": Family(transformers.Qwen2ForCausalLM,
                           transformers.Qwen2Config(**small(tie_word_embeddings=False, rope_theta=1e6)), "qwen2",
                           QWEN2_SPLIT),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_model(request, tmp_path_factory):
    """(family, transformers model, safetensors folder, GGUF file) for one family."""
    fam = FAMILIES[request.param]
    folder = tmp_path_factory.mktemp(request.param) / "hf"
    model = save_tiny_model(fam.model_cls, fam.config, folder)
    byte_level_bpe(folder, VOCAB, ["<|im_start|>", "<|im_end|>"], fam.pre_split)
    gguf = convert_to_gguf(folder, folder.parent / f"{request.param}.f32.gguf", pre=fam.pre)
    return fam, model, folder, gguf


def ours(path: Path) -> Engine:
    return Engine.from_model(EngineConfig(model=str(path), device="cpu", kv_tokens=1024))


def greedy(engine: Engine, ids: list[int], steps: int) -> list[int]:
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    handle = engine.submit(None, params, prompt_ids=ids)
    return [t for event in handle.events() for t in event.token_ids]


def test_safetensors_logits_and_greedy_match_transformers(family_model):
    fam, model, folder, _ = family_model
    engine = ours(folder)
    try:
        want = hf_logits(model, fam.prompt)[-1]
        got = our_last_logits(engine, fam.prompt)
        assert (got - want).abs().max() <= 1e-4 * (want.max() - want.min())
        assert greedy(engine, fam.prompt, GREEDY_STEPS) == hf_greedy(model, fam.prompt, GREEDY_STEPS)
    finally:
        engine.shutdown()


def test_gguf_from_llama_cpp_converter_gives_transformers_tokens(family_model):
    fam, model, _, gguf = family_model
    engine = ours(gguf)
    try:
        assert greedy(engine, fam.prompt, GREEDY_STEPS) == hf_greedy(model, fam.prompt, GREEDY_STEPS)
    finally:
        engine.shutdown()


def test_transformers_reads_the_same_logits_from_the_converted_gguf(family_model):
    """The converter is the oracle for the GGUF path, so check it: transformers' own GGUF reader on its output
    gives the original model's logits (where transformers can read that architecture from GGUF)."""
    fam, model, _, gguf = family_model
    arch = type(model).__name__
    try:
        back = fam.model_cls.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    except (ValueError, KeyError, NotImplementedError) as e:
        pytest.fail(f"transformers cannot read {arch} from GGUF ({e}); drop this check for the family and say why")
    want = hf_logits(model, fam.prompt)
    assert torch.allclose(hf_logits(back, fam.prompt), want, atol=1e-4 * float(want.max() - want.min()))


@pytest.mark.cuda
@pytest.mark.parametrize("source", ["safetensors", "gguf"])
def test_gpu_gives_the_cpu_paths_greedy_tokens(family_model, source):
    """The family's tiny model on the GPU (Triton kernels, fp16): every token it picks is the fp32 CPU path's argmax
    (or within fp16 noise of it, which assert_greedy_choices reports), and so the same greedy tokens."""
    fam, _, folder, gguf = family_model
    path = folder if source == "safetensors" else gguf
    cpu, gpu = ours(path), Engine.from_model(EngineConfig(model=str(path), device="cuda", kv_tokens=1024))
    try:
        got = greedy(gpu, fam.prompt, GREEDY_STEPS)
        assert_greedy_choices(cpu, fam.prompt, got)
        assert got == greedy(cpu, fam.prompt, GREEDY_STEPS)
    finally:
        cpu.shutdown()
        gpu.shutdown()
