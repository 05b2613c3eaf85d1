"""Model hyper-parameters, read from GGUF metadata or a Hugging Face config.json, and the tensors they imply."""

from dataclasses import dataclass, fields

import torch

from llamaterm.engine.errors import ModelFormatError


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
    # Sliding-window attention: a query at position p sees keys p - sliding_window + 1 .. p (transformers'
    # sliding_window_overlay). sliding_layers says which layers use it (Gemma 3 interleaves sliding and global
    # layers); None: every layer does. No window: every layer sees the whole context.
    sliding_window: int | None = None
    sliding_layers: tuple[bool, ...] | None = None

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
        window = self.sliding_window
        if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window <= 0):
            raise ModelFormatError(f"sliding_window = {window!r} is not a positive integer (the tokens each query "
                                   "sees; leave it out for full attention)")
        if self.sliding_layers is not None and len(self.sliding_layers) != self.n_layers:
            raise ModelFormatError(f"the sliding-window layer pattern has {len(self.sliding_layers)} entries for "
                                   f"{self.n_layers} layers")

    def layer_window(self, layer: int) -> int | None:
        """The window of one layer's attention, or None for full attention. A window spanning the whole context
        is full attention, and runs as such."""
        window = self.sliding_window
        if window is None or window >= self.context_length:
            return None
        return window if self.sliding_layers is None or self.sliding_layers[layer] else None

    def kv_window(self) -> int | None:
        """The trailing tokens that every layer still reads, so KV blocks before them can be freed; None when some
        layer reads the whole context."""
        windows = [self.layer_window(i) for i in range(self.n_layers)]
        return None if None in windows else max(windows)

    def inv_freq(self) -> torch.Tensor:
        """RoPE inverse frequencies, computed the way Hugging Face does (fp32) so logits match it closely."""
        inv = 1.0 / (self.rope_theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim))
        if self.rope_freq_factors is not None:
            inv = inv / torch.tensor(self.rope_freq_factors, dtype=torch.float32)
        return inv


def weight_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """GGUF module name -> weight shape ([out, in] for linears) of every module a Llama model has. The lm_head
    ("output") is listed whether or not it is tied to the embedding: readers decide whether it must be there."""
    q, kv, h, ffn = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, c.hidden_size, c.intermediate_size
    shapes = {"token_embd": (c.vocab_size, h), "output_norm": (h,), "output": (c.vocab_size, h)}
    layer = {"attn_norm": (h,), "attn_q": (q, h), "attn_k": (kv, h), "attn_v": (kv, h), "attn_output": (h, q),
             "ffn_norm": (h,), "ffn_gate": (ffn, h), "ffn_up": (ffn, h), "ffn_down": (h, ffn)}
    for i in range(c.n_layers):
        shapes |= {f"blk.{i}.{name}": shape for name, shape in layer.items()}
    return shapes
