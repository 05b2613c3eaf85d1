"""Model hyper-parameters, read from GGUF metadata or a Hugging Face config.json, and the tensors they imply."""

from dataclasses import dataclass, fields

import torch

from llamaterm.engine.errors import ModelFormatError

# Models have up to 126 layers: far beyond, a file is damaged, not a model to run (checked before a table of a
# flag per layer, a sliding window's pattern, is made)
MAX_LAYERS = 4096


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
    # Frequency divisors, rotary_dim // 2 values: Llama-3's (GGUF rope_freqs / config.json rope_scaling), or
    # LongRoPE's short factors
    rope_freq_factors: tuple[float, ...] | None = None
    tie_word_embeddings: bool = False
    # Per-family features, as data the one forward pass (engine/serving/model.py) reads
    qkv_bias: bool = False  # q/k/v projections carry biases (Qwen2; Llama's attention_bias)
    qk_norm: bool = False  # an RMSNorm over each head of q and of k, before RoPE (Qwen3)
    fused_projections: bool = False  # q/k/v as one attn_qkv, gate and up as one ffn_up of 2 x intermediate (Phi-3)
    rope_dim: int | None = None  # the dims of each head that RoPE rotates (Phi-4-mini: 96 of 128); None: all
    # LongRoPE (Phi-3.5, Phi-4-mini): tokens from position rope_long_from on take these divisors instead of the short
    # ones; rope_attention_factor scales the rotated dims of q and k (transformers multiplies cos and sin by it)
    rope_long_factors: tuple[float, ...] | None = None
    rope_long_from: int | None = None
    rope_attention_factor: float = 1.0
    # Gemma 3: norms on the attention and MLP outputs too, before their residual adds; GeGLU; the embedding times
    # sqrt(hidden); a softmax scale of its own (query_pre_attn_scalar ** -0.5); its sliding layers' own RoPE base;
    # a tanh cap on the logits where the config has one. (Its (1 + weight) norms are stored as such at load.)
    post_norms: bool = False
    activation: str = "silu"  # "silu" or "gelu_tanh"
    embedding_scale: float = 1.0
    attention_scale: float | None = None  # None: head_dim ** -0.5
    rope_theta_sliding: float | None = None  # None: rope_theta (without rope_freq_factors, which global layers take)
    final_logit_softcap: float | None = None
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
            raise ModelFormatError(
                f"inconsistent attention shape: {self.n_heads} heads, {self.n_kv_heads} kv "
                f"heads, head_dim {self.head_dim} (heads must be a multiple of kv heads, "
                "head_dim even)"
            )
        if not 0 < self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise ModelFormatError(
                f"RoPE rotates {self.rotary_dim} dims of a head of {self.head_dim}: it must be "
                "an even number, at most the head size"
            )
        for name in ("rope_freq_factors", "rope_long_factors"):
            factors = getattr(self, name)
            if factors is not None and len(factors) != self.rotary_dim // 2:
                raise ModelFormatError(
                    f"{len(factors)} RoPE {name.split('_')[1]} factors for {self.rotary_dim} "
                    f"rotated dims: there must be {self.rotary_dim // 2}"
                )
        if self.activation not in ("silu", "gelu_tanh"):
            raise ModelFormatError(f"unsupported activation {self.activation!r} (llamaterm runs silu and gelu_tanh)")
        if (self.rope_long_factors is None) != (self.rope_long_from is None):
            raise ModelFormatError("LongRoPE needs both its long factors and the original context length")
        window = self.sliding_window
        if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window <= 0):
            raise ModelFormatError(
                f"sliding_window = {window!r} is not a positive integer (the tokens each query "
                "sees; leave it out for full attention)"
            )
        if self.sliding_layers is not None and len(self.sliding_layers) != self.n_layers:
            raise ModelFormatError(
                f"the sliding-window layer pattern has {len(self.sliding_layers)} entries for {self.n_layers} layers"
            )

    def is_sliding(self, layer: int) -> bool:
        """Whether a layer is of the sliding kind (Gemma 3 gives those a RoPE base of their own), whatever its
        window spans."""
        return self.sliding_window is not None and (self.sliding_layers is None or self.sliding_layers[layer])

    def layer_window(self, layer: int) -> int | None:
        """The window of one layer's attention, or None for full attention. A window spanning the whole context
        is full attention, and runs as such."""
        window = self.sliding_window
        if window is None or not self.is_sliding(layer) or window >= self.context_length:
            return None
        return window

    def kv_window(self) -> int | None:
        """The trailing tokens that every layer still reads, so KV blocks before them can be freed; None when some
        layer reads the whole context."""
        windows: list[int] = []
        for i in range(self.n_layers):
            window = self.layer_window(i)
            if window is None:
                return None
            windows.append(window)
        return max(windows)

    @property
    def rotary_dim(self) -> int:
        return self.rope_dim or self.head_dim

    def inv_freq(self, long: bool = False, sliding: bool = False) -> torch.Tensor:
        """RoPE inverse frequencies [head_dim // 2] (the long ones of LongRoPE; a sliding layer's, with a base of its
        own), computed the way Hugging Face does (fp32) so logits match it closely. Past the rotated dims they are 0:
        see rotary_order."""
        dim, sliding_theta = self.rotary_dim, self.rope_theta_sliding if sliding else None
        own_base = sliding_theta is not None
        theta = sliding_theta if sliding_theta is not None else self.rope_theta
        inv = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
        factors = None if own_base else self.rope_long_factors if long else self.rope_freq_factors
        if factors is not None:
            inv = inv / torch.tensor(factors, dtype=torch.float32)
        return torch.cat([inv, torch.zeros((self.head_dim - dim) // 2)])

    def rotary_order(self) -> torch.Tensor | None:
        """Partial rotary (Phi-4-mini rotates 96 of 128 dims, pairing dim i with i + 48): the order of a head's
        q/k rows under which the full-width half-split RoPE, pairing i with i + 64, rotates the model's pairs and
        turns the other dims by frequency 0, which leaves them as they are. The first halves of the rotated and
        of the other dims, then their second halves. None when RoPE rotates the whole head."""
        if self.rotary_dim == self.head_dim:
            return None
        r, rest = self.rotary_dim // 2, (self.head_dim - self.rotary_dim) // 2
        first, second = torch.arange(r), torch.arange(r, 2 * r)
        rest_first = torch.arange(2 * r, 2 * r + rest)
        return torch.cat([first, rest_first, second, rest_first + rest])


def tensor_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> shape ([out, in] for linears) of every tensor the model has, by llama.cpp's names. The
    lm_head ("output.weight") is listed whether or not it is tied to the embedding: readers decide whether it must
    be there."""
    q, kv, h, ffn = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, c.hidden_size, c.intermediate_size
    shapes = {"token_embd.weight": (c.vocab_size, h), "output_norm.weight": (h,), "output.weight": (c.vocab_size, h)}
    layer = {
        "attn_norm": (h,),
        "attn_q": (q, h),
        "attn_k": (kv, h),
        "attn_v": (kv, h),
        "attn_output": (h, q),
        "ffn_norm": (h,),
        "ffn_gate": (ffn, h),
        "ffn_up": (ffn, h),
        "ffn_down": (h, ffn),
    }
    if c.fused_projections:
        del layer["attn_q"], layer["attn_k"], layer["attn_v"], layer["ffn_gate"]
        layer |= {"attn_qkv": (q + 2 * kv, h), "ffn_up": (2 * ffn, h)}
    layer = {f"{name}.weight": shape for name, shape in layer.items()}
    if c.qkv_bias:
        layer |= {f"attn_{p}.bias": layer[f"attn_{p}.weight"][:1] for p in "qkv"}
    if c.qk_norm:
        layer |= {"attn_q_norm.weight": (c.head_dim,), "attn_k_norm.weight": (c.head_dim,)}
    if c.post_norms:
        layer |= {"post_attention_norm.weight": (h,), "post_ffw_norm.weight": (h,)}
    for i in range(c.n_layers):
        shapes |= {f"blk.{i}.{name}": shape for name, shape in layer.items()}
    return shapes
