"""Model hyper-parameters, read from GGUF metadata or a Hugging Face config.json, and the tensors they imply."""

from dataclasses import dataclass, fields

import torch

from llamaterm.engine.errors import ModelFormatError


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # the family, by its GGUF architecture name (checkpoints/architectures.py)
    name: str
    n_layers: int
    hidden_size: int
    intermediate_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int
    rms_norm_eps: float
    rope_theta: float
    # Llama-3 style frequency divisors (GGUF rope_freqs / config.json rope_scaling), head_dim // 2 values
    rope_freq_factors: tuple[float, ...] | None = None
    tie_word_embeddings: bool = False
    # Per-family features, as data the one forward pass (engine/serving/model.py) reads
    qkv_bias: bool = False  # q/k/v projections carry biases (Qwen2; Llama's attention_bias)
    qk_norm: bool = False  # an RMSNorm over each head of q and of k, before RoPE (Qwen3)

    def __post_init__(self):
        """Every reader builds a ModelConfig, so the checks that keep the forward pass sane live here once."""
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type in (int, "int") and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ModelFormatError(f"{f.name} = {value!r} is not a positive integer")
        if self.n_heads % self.n_kv_heads or self.head_dim % 2:
            raise ModelFormatError(f"inconsistent attention shape: {self.n_heads} heads, {self.n_kv_heads} kv "
                                   f"heads, head_dim {self.head_dim} (heads must be a multiple of kv heads, "
                                   "head_dim even)")

    def inv_freq(self) -> torch.Tensor:
        """RoPE inverse frequencies, computed the way Hugging Face does (fp32) so logits match it closely."""
        inv = 1.0 / (self.rope_theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim))
        if self.rope_freq_factors is not None:
            inv = inv / torch.tensor(self.rope_freq_factors, dtype=torch.float32)
        return inv


def tensor_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> shape ([out, in] for linears) of every tensor the model has, by llama.cpp's names. The
    lm_head ("output.weight") is listed whether or not it is tied to the embedding: readers decide whether it must
    be there."""
    q, kv, h, ffn = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, c.hidden_size, c.intermediate_size
    shapes = {"token_embd.weight": (c.vocab_size, h), "output_norm.weight": (h,), "output.weight": (c.vocab_size, h)}
    layer = {"attn_norm": (h,), "attn_q": (q, h), "attn_k": (kv, h), "attn_v": (kv, h), "attn_output": (h, q),
             "ffn_norm": (h,), "ffn_gate": (ffn, h), "ffn_up": (ffn, h), "ffn_down": (h, ffn)}
    layer = {f"{name}.weight": shape for name, shape in layer.items()}
    if c.qkv_bias:
        layer |= {f"attn_{p}.bias": layer[f"attn_{p}.weight"][:1] for p in "qkv"}
    if c.qk_norm:
        layer |= {"attn_q_norm.weight": (c.head_dim,), "attn_k_norm.weight": (c.head_dim,)}
    for i in range(c.n_layers):
        shapes |= {f"blk.{i}.{name}": shape for name, shape in layer.items()}
    return shapes
