"""Mixtures of experts beyond the families' harness (tests/checkpoints/test_families.py): experts in every quantized
format a GGUF holds them in, against transformers on the values gguf-py dequantizes; a batch against each sequence
alone; what `info` shows; and files that cannot run, named as such before any weight is converted."""

import re
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize

from llamaterm.engine.api import EngineConfig
from llamaterm.engine.checkpoints.gguf import load_gguf, read_gguf_file
from llamaterm.engine.errors import ModelFormatError
from llamaterm.engine.sampling_params import Grammar, SamplingParams
from llamaterm.engine.serving.engine import Engine
from tests.support.cli import llamaterm
from tests.support.engine_checks import greedy, our_last_logits
from tests.support.family_oracle import (
    byte_level_bpe,
    convert_to_gguf,
    hf_greedy,
    hf_logits,
    rewrite_gguf,
    save_tiny_model,
)
from tests.support.tiny_models import FP16_FIELDS, random_blocks

pytestmark = pytest.mark.slow  # transformers' models, llama.cpp's converter

VOCAB, HIDDEN, EXPERT_FF, N_EXPERTS = 384, 256, 256, 8  # rows of 256: whole K-quant blocks
PROMPT = [5, 17, 200, 33, 99, 1, 250, 7, 64, 128, 300, 12, 45, 46, 47, 48, 301, 2, 9]
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)


@pytest.fixture(scope="module")
def qwen3moe(tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    """A tiny Qwen3-MoE (transformers' class; 8 experts, 2 a token) and llama.cpp's f32 GGUF of it."""
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        num_experts=N_EXPERTS,
        num_experts_per_tok=2,
        moe_intermediate_size=EXPERT_FF,
        norm_topk_prob=True,
        tie_word_embeddings=False,
    )
    folder = tmp_path_factory.mktemp("qwen3moe") / "hf"
    model = save_tiny_model(transformers.Qwen3MoeForCausalLM, config, folder)
    byte_level_bpe(folder, VOCAB, ["<|im_start|>", "<|im_end|>"], QWEN2_SPLIT)
    return model, convert_to_gguf(folder, folder.parent / "f32.gguf", pre="qwen2")


def random_experts(qtype: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Valid random blocks whose values are of the size of a trained model's (|w| under about 0.2). A K-quant's
    super-block scales are powers of two, so that llamaterm's one rounding of each scale product to fp16
    (checkpoints/gguf.py) is exact and the check can be tight."""
    if qtype == "MXFP4":  # an E8M0 exponent byte, then 16 bytes of 4-bit codes (values up to 6)
        blocks = rng.integers(0, 256, size=(rows, cols // 32, 17), dtype=np.uint8)
        blocks[..., 0] = rng.integers(119, 123, size=blocks.shape[:2])  # 2**-8 .. 2**-5
        return blocks.reshape(rows, -1)
    scale = {"Q4_K": 2**-12, "Q5_K": 2**-13, "Q6_K": 2**-16, "Q8_0": 1e-3}.get(qtype, 1e-2)
    blocks = random_blocks(qtype, rows, cols, rng, scale)
    if qtype.endswith("_K"):
        blocks = blocks.reshape(rows, cols // 256, -1)
        for at in FP16_FIELDS[qtype]:
            sign = rng.choice([-1.0, 1.0], blocks.shape[:2])
            blocks[..., at : at + 2] = (scale * sign).astype(np.float16)[..., None].view(np.uint8)
        blocks = blocks.reshape(rows, -1)
    return blocks


# Each file's types for the experts' gate, up and down: Q4_K_M's mix (Q6_K down), the other K-quants, the legacy
# quants and MXFP4 (gpt-oss's)
FORMATS = {
    "Q4_K_M": ("Q4_K", "Q4_K", "Q6_K"),
    "Q5_K+Q8_0": ("Q5_K", "Q5_K", "Q8_0"),
    "Q4_0+Q4_1+Q5_1": ("Q4_0", "Q4_1", "Q5_1"),
    "Q5_0": ("Q5_0", "Q5_0", "Q5_0"),
    "MXFP4": ("MXFP4", "MXFP4", "MXFP4"),
}


@pytest.mark.parametrize("types", FORMATS.values(), ids=list(FORMATS))
def test_quantized_experts_match_transformers_on_their_values(qwen3moe, tmp_path, types):
    """The GGUF's experts rewritten in the file's formats; transformers' model given the values gguf-py's own
    dequantizers read from those bytes: the same logits and greedy tokens."""
    model, f32 = qwen3moe
    rng, replaced, values = np.random.default_rng(7), {}, {}
    for layer in range(2):
        for kind, qtype in zip(("gate", "up", "down"), types, strict=True):
            name = f"blk.{layer}.ffn_{kind}_exps.weight"
            rows, cols = N_EXPERTS * (HIDDEN if kind == "down" else EXPERT_FF), EXPERT_FF if kind == "down" else HIDDEN
            data = random_experts(qtype, rows, cols, rng)
            replaced[name] = (data.reshape(N_EXPERTS, rows // N_EXPERTS, -1), GGMLQuantizationType[qtype])
            values[name] = torch.from_numpy(dequantize(data, GGMLQuantizationType[qtype]).copy())
    path = rewrite_gguf(f32, tmp_path / "q.gguf", tensors=replaced)
    oracle = transformers.Qwen3MoeForCausalLM(model.config).float().eval()
    oracle.load_state_dict(model.state_dict())
    with torch.no_grad():
        for layer in range(2):
            experts = oracle.model.layers[layer].mlp.experts
            v = {
                k: values[f"blk.{layer}.ffn_{k}_exps.weight"].view(N_EXPERTS, -1, HIDDEN if k != "down" else EXPERT_FF)
                for k in ("gate", "up", "down")
            }
            experts.gate_up_proj.copy_(torch.cat([v["gate"], v["up"]], dim=1))
            experts.down_proj.copy_(v["down"])
    engine = Engine.from_model(EngineConfig(model=str(path), device="cpu", kv_tokens=1024))
    try:
        want = hf_logits(oracle, PROMPT)[-1]
        assert (our_last_logits(engine, PROMPT) - want).abs().max() <= 1e-4 * (want.max() - want.min())
        assert greedy(engine, PROMPT, 16) == hf_greedy(oracle, PROMPT, 16)
    finally:
        engine.shutdown()


def test_a_batch_gives_each_sequence_its_tokens_alone(qwen3moe):
    """Eight prompts in one batch (rows routed to different experts in each step) decode as each does alone."""
    _, path = qwen3moe
    engine = Engine.from_model(EngineConfig(model=str(path), device="cpu", kv_tokens=2048))
    try:
        prompts = [[(7 * i + 13 * j) % VOCAB for j in range(5 + 3 * i)] for i in range(8)]
        alone = [greedy(engine, p, 12) for p in prompts]
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        handles = [engine.submit(None, params, prompt_ids=p) for p in prompts]
        together = [[t for event in h.events() for t in event.token_ids] for h in handles]
        assert together == alone
    finally:
        engine.shutdown()


def test_info_shows_experts_and_active_parameters(qwen3moe):
    _, path = qwen3moe
    shown = llamaterm("info", str(path))
    assert shown.returncode == 0, shown.stderr
    assert f"experts       {N_EXPERTS}, 2 active a token" in shown.stdout
    config = load_gguf(path).config
    active = config.active_parameters()
    routed = 2 * 3 * N_EXPERTS * HIDDEN * EXPERT_FF
    assert (
        active
        == sum(int(np.prod(t.shape)) for n, t in read_gguf_file(path).tensors.items() if n != "token_embd.weight")
        - routed * (N_EXPERTS - 2) // N_EXPERTS
    )
    assert f"({active / 1e6:.3g}M active)" in shown.stdout


# ---- files that cannot run ----


def load_error(path: Path) -> str:
    with pytest.raises(ModelFormatError) as err:
        load_gguf(path)
    return str(err.value)


@pytest.mark.parametrize(
    "value, problem",
    [
        (16, r"tensor 'blk\.0\.ffn_\w+\.weight' has shape \(8, 256(, 256)?\); the metadata implies \(16, 256"),
        (0, r"qwen3moe\.expert_count = 0 is not a positive integer"),
    ],
)
def test_expert_count_that_does_not_match_the_tensors(qwen3moe, tmp_path, value, problem):
    keys = {"qwen3moe.expert_count": (value, GGUFValueType.UINT32)}
    assert re.search(problem, load_error(rewrite_gguf(qwen3moe[1], tmp_path / "e.gguf", keys)))


@pytest.mark.parametrize("used, problem", [(9, "9 experts used per token, of only 8"), (0, "expert_used_count = 0")])
def test_experts_used_beyond_the_count_or_none(qwen3moe, tmp_path, used, problem):
    keys = {"qwen3moe.expert_used_count": (used, GGUFValueType.UINT32)}
    message = load_error(rewrite_gguf(qwen3moe[1], tmp_path / "u.gguf", keys))
    assert problem in message and "u.gguf" in message


def test_router_of_the_wrong_shape(qwen3moe, tmp_path):
    router = np.zeros((N_EXPERTS - 1, HIDDEN), dtype=np.float32).view(np.uint8)
    path = rewrite_gguf(qwen3moe[1], tmp_path / "r.gguf", tensors={"blk.1.ffn_gate_inp.weight": (router, 0)})
    assert "tensor 'blk.1.ffn_gate_inp.weight' has shape (7, 256); the metadata implies (8, 256)" in load_error(path)


def test_mxfp4_block_with_a_nan_scale(qwen3moe, tmp_path):
    data = random_experts("MXFP4", N_EXPERTS * EXPERT_FF, HIDDEN, np.random.default_rng(0))
    data.reshape(N_EXPERTS * EXPERT_FF, -1, 17)[3, 2, 0] = 255  # E8M0's NaN
    tensor = (data.reshape(N_EXPERTS, EXPERT_FF, -1), GGMLQuantizationType.MXFP4)
    path = rewrite_gguf(qwen3moe[1], tmp_path / "n.gguf", tensors={"blk.0.ffn_up_exps.weight": tensor})
    message = load_error(path)
    assert "n.gguf" in message and "'blk.0.ffn_up_exps.weight' has an MXFP4 scale byte of 255 (NaN)" in message


def test_experts_without_an_expert_count(qwen3moe, tmp_path):
    """A file whose metadata lost its expert count: named as such, not as tensors a dense model lacks."""
    path = rewrite_gguf(qwen3moe[1], tmp_path / "x.gguf", keys={"qwen3moe.expert_count": (None, None)})
    assert "it holds experts (blk.0.ffn_gate_exps) but no qwen3moe.expert_count" in load_error(path)


def test_a_model_larger_than_the_gpu_is_refused_with_its_sizes(qwen3moe):
    """Before any weight is read: the bytes the file's tensors take, and of them the experts', against what the GPU
    has free (Engine.from_model asks this with the GPU's free memory)."""
    from llamaterm.engine.checkpoints.checkpoint_info import weight_bytes
    from llamaterm.engine.errors import LlamatermError
    from llamaterm.engine.serving.device import check_weights_fit

    path = qwen3moe[1]
    total, experts = weight_bytes(path)
    tensors = read_gguf_file(path).tensors.values()
    assert total == sum(t.data.nbytes for t in tensors) and experts == 2 * 3 * N_EXPERTS * HIDDEN * EXPERT_FF * 4
    check_weights_fit(path.name, (total, experts), total)
    with pytest.raises(LlamatermError) as err:
        check_weights_fit(path.name, (total, experts), total - 1)
    gib = lambda n: f"{n / 2**30:.1f} GiB"
    assert f"its weights take {gib(total)}, {gib(experts)} of them its experts, and {gib(total - 1)}" in str(err.value)
    assert "--device cpu" in str(err.value)


def test_the_engine_around_experts_works_unchanged(qwen3moe):
    """Speculation, prefix caching, grammars and sampling, on a mixture: ngram drafts verified by the experts give
    the tokens of plain decoding, a repeated prompt is served from the prefix cache, a grammar holds."""
    _, path = qwen3moe
    plain = Engine.from_model(EngineConfig(model=str(path), device="cpu", kv_tokens=1024, speculate="off"))
    drafted = Engine.from_model(EngineConfig(model=str(path), device="cpu", kv_tokens=1024, speculate="ngram"))
    try:
        prompt = PROMPT * 3  # repeats for the drafts to find
        assert greedy(drafted, prompt, 32) == greedy(plain, prompt, 32)
        handle = drafted.submit(None, SamplingParams(max_tokens=4, temperature=0.0), prompt_ids=prompt)
        list(handle.events())
        assert handle.stats().cached_tokens >= len(prompt) // 16 * 16 - 16
        params = SamplingParams(max_tokens=8, temperature=0.9, seed=3, grammar=Grammar("regex", "[0-9]{5}"))
        text = "".join(event.text for event in drafted.submit(None, params, prompt_ids=PROMPT).events())
        assert re.fullmatch("[0-9]{5}", text), text
    finally:
        plain.shutdown()
        drafted.shutdown()
