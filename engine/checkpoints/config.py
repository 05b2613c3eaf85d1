"""Model hyper-parameters, read from GGUF metadata or a Hugging Face config.json."""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # "llama"
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

    def inv_freq(self) -> torch.Tensor:
        """RoPE inverse frequencies, computed the way Hugging Face does (fp32) so logits match it closely."""
        inv = 1.0 / (self.rope_theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim))
        if self.rope_freq_factors is not None:
            inv = inv / torch.tensor(self.rope_freq_factors, dtype=torch.float32)
        return inv
