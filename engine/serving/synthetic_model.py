"""Models with random weights in real models' shapes, by name (`synthetic:NAME`, engine/synthetic.py), so speed
figures need no download: EngineCore.from_model makes them."""

import math
from dataclasses import dataclass, replace

import torch

from llamaterm.engine.checkpoints.config import ModelConfig, tensor_shapes, yarn_fields
from llamaterm.engine.errors import LlamatermError
from llamaterm.engine.serving.model import Model, Weight
from llamaterm.engine.synthetic import SYNTHETIC_PREFIX
from llamaterm.kernels.qweight import QuantWeight


@dataclass(frozen=True)
class QuantFormat:
    """How a synthetic model stores its matrices: bits, group size, affine (with offsets) or symmetric; the
    embedding (and a tied lm_head) may take another width, as in GGUF files; a mixture's experts may be MXFP4
    (gpt-oss's files: MXFP4 experts, Q8_0 elsewhere)."""

    bits: int
    group: int
    affine: bool
    embd_bits: int
    mxfp4_experts: bool = False


def _llama(name, layers, hidden, ffn, heads, kv, vocab, ctx, theta, head_dim=None, tied=False) -> ModelConfig:
    return ModelConfig(
        arch="llama",
        name=name,
        n_layers=layers,
        hidden_size=hidden,
        intermediate_size=ffn,
        n_heads=heads,
        n_kv_heads=kv,
        head_dim=head_dim or hidden // heads,
        vocab_size=vocab,
        context_length=ctx,
        rms_norm_eps=1e-5,
        rope_theta=theta,
        tie_word_embeddings=tied,
    )


def _gemma3(name, layers, hidden, ffn, heads, kv) -> ModelConfig:
    """Gemma 3's text model as its GGUF holds it: five 1024-token sliding layers to one global, x8 linear RoPE on
    the global ones."""
    return replace(
        _llama(name, layers, hidden, ffn, heads, kv, 262144, 131072, 1e6, head_dim=256, tied=True),
        arch="gemma3",
        qk_norm=True,
        post_norms=True,
        activation="gelu_tanh",
        embedding_scale=hidden**0.5,
        attention_scale=256**-0.5,
        rope_theta_sliding=1e4,
        rope_freq_factors=(8.0,) * 128,
        sliding_window=1024,
        sliding_layers=tuple(i % 6 < 5 for i in range(layers)),
    )


def _qwen3_moe(name, layers, hidden, heads, kv, experts, used, expert_ffn) -> ModelConfig:
    return replace(
        _llama(name, layers, hidden, 6144, heads, kv, 151936, 40960, 1e6, head_dim=128),
        arch="qwen3moe",
        rms_norm_eps=1e-6,
        qk_norm=True,
        n_experts=experts,
        n_experts_used=used,
        expert_intermediate_size=expert_ffn,
    )


def _gpt_oss(name, layers, experts) -> ModelConfig:
    """gpt-oss as its config.json has it: 128-token windows on every other layer, sinks, YaRN x32 of 4096."""
    c = replace(
        _llama(name, layers, 2880, 2880, 64, 8, 201088, 131072, 150000.0, head_dim=64),
        arch="gpt-oss",
        qkv_bias=True,
        o_bias=True,
        attention_sinks=True,
        moe_biases=True,
        activation="swiglu_oai",
        sliding_window=128,
        sliding_layers=tuple(i % 2 == 0 for i in range(layers)),
        n_experts=experts,
        n_experts_used=4,
        expert_intermediate_size=2880,
    )
    return replace(c, **yarn_fields(c, factor=32.0, original=4096, truncate=False))


# Random weights in real models' shapes, so speed figures need no download. 4-bit formats as their usual files.
SYNTHETIC: dict[str, tuple[ModelConfig, QuantFormat]] = {
    "llama3-8b": (
        _llama("Llama-3-8B shapes", 32, 4096, 14336, 32, 8, 128256, 8192, 500000.0),
        QuantFormat(4, 128, False, 4),
    ),
    "llama2-7b": (
        _llama("Llama-2-7B shapes", 32, 4096, 11008, 32, 32, 32000, 4096, 10000.0),
        QuantFormat(4, 128, False, 4),
    ),
    "smollm2-135m": (
        _llama("SmolLM2-135M shapes", 30, 576, 1536, 9, 3, 49152, 8192, 100000.0, tied=True),
        QuantFormat(4, 32, True, 8),
    ),  # the default model's Q4_1 with a Q8_0 embedding
    "tiny": (_llama("tiny test shapes", 2, 256, 512, 8, 2, 512, 1024, 10000.0), QuantFormat(4, 32, False, 4)),
    "qwen2.5-7b": (
        replace(_llama("Qwen2.5-7B shapes", 28, 3584, 18944, 28, 4, 152064, 32768, 1e6), arch="qwen2", qkv_bias=True),
        QuantFormat(4, 128, False, 4),
    ),
    "gemma3-4b": (_gemma3("Gemma-3-4B shapes", 34, 2560, 10240, 8, 4), QuantFormat(4, 128, False, 4)),
    "gemma3-12b": (_gemma3("Gemma-3-12B shapes", 48, 3840, 15360, 16, 8), QuantFormat(4, 128, False, 4)),
    # mixtures of experts: Q4_K_M's 4-bit (affine, groups of 32) throughout; gpt-oss as ggml-org's GGUF, MXFP4
    # experts and 8-bit groups of 32 elsewhere
    "qwen3-30b-a3b": (_qwen3_moe("Qwen3-30B-A3B shapes", 48, 2048, 32, 4, 128, 8, 768), QuantFormat(4, 32, True, 4)),
    "gpt-oss-20b": (_gpt_oss("gpt-oss-20b shapes", 24, 32), QuantFormat(8, 32, False, 8, mxfp4_experts=True)),
    "tiny-moe": (
        _qwen3_moe("tiny MoE test shapes", 2, 256, 8, 2, 8, 2, 128),
        QuantFormat(4, 32, True, 4),
    ),
}


def parse_synthetic(spec: str) -> tuple[str, bool]:
    """'synthetic:NAME' (4-bit) or 'synthetic:NAME:fp16' -> (NAME, quantized)."""
    name, _, fmt = spec.removeprefix(SYNTHETIC_PREFIX).partition(":")
    if name not in SYNTHETIC or fmt not in ("", "q4", "4bit", "fp16"):
        raise LlamatermError(
            f"unknown model {spec!r}: synthetic models are "
            f"{', '.join(SYNTHETIC_PREFIX + n for n in SYNTHETIC)}, with :fp16 or :q4 (the default)"
        )
    return name, fmt != "fp16"


def synthetic_model(name: str, quantized: bool, device: torch.device) -> Model:
    """Random weights made on the device: speed does not depend on their values."""
    config, fmt = SYNTHETIC[name]
    dtype = torch.float32 if device.type == "cpu" else torch.float16
    g = torch.Generator(device=device).manual_seed(0)

    def dense(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.randn(shape, generator=g, device=device, dtype=dtype) * 0.02

    def matrix(n: int, k: int, bits: int, mxfp4: bool) -> Weight:
        if not quantized:
            return dense((n, k))
        q = torch.randint(0, 1 << bits, (n, k), generator=g, dtype=torch.uint8, device=device)
        if mxfp4:  # powers of two, as E8M0 scales are
            powers = torch.randint(-8, -5, (n, k // 32), generator=g, device=device)
            return QuantWeight.from_values(q, torch.exp2(powers.float()).bfloat16(), None, 4, 32, codebook="e2m1")
        scales = (torch.rand(n, k // fmt.group, generator=g, device=device) * 2e-3 + 1e-3).half()
        offsets = -scales * (1 << (bits - 1)) if fmt.affine and bits == 4 else None
        return QuantWeight.from_values(q, scales, offsets, bits, fmt.group)

    tensors: dict[str, Weight] = {}
    for name_, shape in tensor_shapes(config).items():
        if name_ == "output.weight" and config.tie_word_embeddings:
            continue
        if len(shape) == 1 or name_.endswith(".bias"):  # norms, biases and sinks
            tensors[name_] = torch.ones(shape, device=device) if name_.endswith("norm.weight") else dense(shape)
        elif ".ffn_gate_inp" in name_:  # routers stay dense, as files keep them; random, so rows differ in experts
            tensors[name_] = dense(shape) * 50
        else:
            *outer, k = shape
            experts = "_exps." in name_
            bits = 4 if experts and fmt.mxfp4_experts else fmt.embd_bits if name_ == "token_embd.weight" else fmt.bits
            tensors[name_] = matrix(math.prod(outer), k, bits, experts and fmt.mxfp4_experts)
    return Model(config, tensors, device, dtype)
