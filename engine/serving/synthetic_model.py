"""Models with random weights in real models' shapes, by name (`synthetic:NAME`, engine/synthetic.py), so speed
figures need no download: EngineCore.from_model makes them."""

from dataclasses import dataclass, replace

import torch

from llamaterm.engine.checkpoints.config import ModelConfig, tensor_shapes
from llamaterm.engine.errors import LlamatermError
from llamaterm.engine.serving.model import Model, Weight
from llamaterm.engine.synthetic import SYNTHETIC_PREFIX
from llamaterm.kernels.qweight import QuantWeight


@dataclass(frozen=True)
class QuantFormat:
    """How a synthetic model stores its matrices: bits, group size, affine (with offsets) or symmetric; the
    embedding (and a tied lm_head) may take another width, as in GGUF files."""

    bits: int
    group: int
    affine: bool
    embd_bits: int


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

    def matrix(n: int, k: int, bits: int) -> Weight:
        if not quantized:
            return torch.randn(n, k, generator=g, device=device, dtype=dtype) * 0.02
        q = torch.randint(0, 1 << bits, (n, k), generator=g, dtype=torch.uint8, device=device)
        scales = (torch.rand(n, k // fmt.group, generator=g, device=device) * 2e-3 + 1e-3).half()
        offsets = -scales * (1 << (bits - 1)) if fmt.affine and bits == 4 else None
        return QuantWeight.from_values(q, scales, offsets, bits, fmt.group)

    tensors: dict[str, Weight] = {}
    for name_, shape in tensor_shapes(config).items():
        if name_ == "output.weight" and config.tie_word_embeddings:
            continue
        if len(shape) == 1:
            tensors[name_] = torch.ones(shape, device=device)
        else:
            n, k = shape
            tensors[name_] = matrix(n, k, fmt.embd_bits if name_ == "token_embd.weight" else fmt.bits)
    return Model(config, tensors, device, dtype)
