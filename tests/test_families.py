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
    gguf_window: bool = False  # have llama.cpp's converter write the sliding window it leaves out for the family


def small(**kw) -> dict:
    """Shapes shared by every tiny family model: GQA, 2 layers, head_dim 16, a vocabulary of VOCAB."""
    return dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5, **kw)


FAMILIES = {
    "llama": Family(transformers.LlamaForCausalLM, transformers.LlamaConfig(**small(tie_word_embeddings=False)),
                    "llama-bpe"),
    # a window of 8, far shorter than the 19-token prompt and its 24 greedy tokens
    "mistral": Family(transformers.MistralForCausalLM, transformers.MistralConfig(**small(sliding_window=8)),
                      "llama-bpe", gguf_window=True),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_model(request, tmp_path_factory):
    """(family, transformers model, safetensors folder, GGUF file) for one family."""
    fam = FAMILIES[request.param]
    folder = tmp_path_factory.mktemp(request.param) / "hf"
    model = save_tiny_model(fam.model_cls, fam.config, folder)
    byte_level_bpe(folder, VOCAB, ["<|im_start|>", "<|im_end|>"], fam.pre_split)
    gguf = convert_to_gguf(folder, folder.parent / f"{request.param}.f32.gguf", pre=fam.pre,
                           sliding_window=fam.gguf_window)
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
    if fam.gguf_window:  # transformers' GGUF reader leaves the window out, as the converter does: the weights are
        back.config.sliding_window = fam.config.sliding_window  # what this checks
    want = hf_logits(model, fam.prompt)
    assert torch.allclose(hf_logits(back, fam.prompt), want, atol=1e-4 * float(want.max() - want.min()))


# --- sliding windows beyond the FAMILIES harness ------------------------------------------------------------


def test_ministral_interleaved_sliding_and_full_layers_match_transformers(tmp_path):
    """MinistralForCausalLM's layer_types: a window in one layer, full attention in the other (llama.cpp's
    converter has no Ministral, so safetensors only). A full layer reads every key: no block is ever freed."""
    config = transformers.MinistralConfig(**small(sliding_window=8, layer_types=["sliding_attention",
                                                                                 "full_attention"]))
    model = save_tiny_model(transformers.MinistralForCausalLM, config, tmp_path)
    byte_level_bpe(tmp_path, VOCAB, ["<|im_start|>", "<|im_end|>"])
    engine = ours(tmp_path)
    try:
        assert [engine.model.config.layer_window(i) for i in range(2)] == [8, None]
        assert engine.block_manager.window is None
        want = hf_logits(model, PROMPT)[-1]
        assert (our_last_logits(engine, PROMPT) - want).abs().max() <= 1e-4 * (want.max() - want.min())
        assert greedy(engine, PROMPT, GREEDY_STEPS) == hf_greedy(model, PROMPT, GREEDY_STEPS)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("family_model", ["mistral"], indirect=True)
def test_sliding_window_caps_kv_use_of_a_long_generation(family_model):
    """A pool of 64 tokens runs a 19-token prompt through 200 greedy tokens: a sequence holds its window's blocks
    (and one step's), never its whole length, and still gives transformers' tokens."""
    fam, model, folder, _ = family_model
    window, steps, block_size = fam.config.sliding_window, 200, 16
    engine = Engine.from_model(EngineConfig(model=str(folder), device="cpu", kv_tokens=64, block_size=block_size,
                                            max_batch_tokens=16))
    try:
        assert engine.block_manager.num_blocks == 4
        params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
        handle = engine.submit(None, params, prompt_ids=fam.prompt)
        tokens, most = [], 0
        for event in handle.events():
            tokens += event.token_ids
            most = max(most, engine.stats().kv_blocks_used)
        assert tokens == hf_greedy(model, fam.prompt, steps)
        assert most <= -(-(window + 16) // block_size) + 1
    finally:
        engine.shutdown()


# --- on the GPU (the lead runs these on an H200) ------------------------------------------------------------


@pytest.mark.cuda
def test_family_on_the_gpu_gives_the_cpu_tokens(family_model):
    """Triton kernels in fp16 against the CPU path in fp32: every greedy token is the fp32 argmax after the same
    prefix, or within fp16 noise of it (tests/test_gpu_model.py)."""
    fam, _, folder, _ = family_model
    cpu, gpu = (Engine.from_model(EngineConfig(model=str(folder), device=d, kv_tokens=1024)) for d in ("cpu", "cuda"))
    try:
        assert_greedy_choices(cpu, fam.prompt, greedy(gpu, fam.prompt, 4 * GREEDY_STEPS))
    finally:
        cpu.shutdown()
        gpu.shutdown()


@pytest.mark.cuda
def test_sliding_window_caps_kv_use_of_a_long_chat_on_the_gpu(tmp_path):
    """Eight turns of a chat, each resending the whole conversation, through a pool of 256 tokens: the chat grows to
    1600 tokens (100 blocks), while the engine holds at most the window's blocks and one step's, prefix-caches the
    window across turns, and picks the fp32 CPU path's tokens."""
    window, block_size, turn_prompt, turn_reply = 64, 16, 40, 160
    config = transformers.MistralConfig(**small(sliding_window=window) | dict(
        hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=4096))
    save_tiny_model(transformers.MistralForCausalLM, config, tmp_path)
    byte_level_bpe(tmp_path, VOCAB, ["<|im_start|>", "<|im_end|>"])
    cpu = Engine.from_model(EngineConfig(model=str(tmp_path), device="cpu"))
    # steps of at most 64 tokens: a sequence's window and one step fit the small pool (Engine.sequence_limit)
    gpu = Engine.from_model(EngineConfig(model=str(tmp_path), device="cuda", kv_tokens=256, block_size=block_size,
                                         max_batch_tokens=64))
    try:
        gen, chat, most = torch.Generator().manual_seed(0), [], 0
        params = SamplingParams(max_tokens=turn_reply, temperature=0.0, ignore_eos=True)
        for _ in range(8):
            chat += torch.randint(0, VOCAB, (turn_prompt,), generator=gen).tolist()
            handle = gpu.submit(None, params, prompt_ids=chat)
            reply = []
            for event in handle.events():
                reply += event.token_ids
                most = max(most, gpu.stats().kv_blocks_used)
            assert_greedy_choices(cpu, chat, reply)
            assert handle.stats().cached_tokens >= len(chat) - turn_prompt - block_size  # the window, cached
            chat += reply
        assert len(chat) == 8 * (turn_prompt + turn_reply) > 6 * gpu.pool_tokens()
        # the window, one turn's new tokens and the uncomputed tail of the last reply, a block of alignment
        assert most <= -(-(window + turn_prompt + block_size) // block_size) + 1
    finally:
        cpu.shutdown()
        gpu.shutdown()
