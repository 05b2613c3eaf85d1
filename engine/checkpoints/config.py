"""Model hyper-parameters, read from GGUF metadata or a Hugging Face config.json, and the tensors they imply."""

import math
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
    # A mixture of experts (Qwen2-MoE, Qwen3-MoE, Mixtral, gpt-oss): each layer's MLP is n_experts experts of
    # expert_intermediate_size, of which a router picks n_experts_used per token; their outputs are summed by the
    # router's softmax weights, renormalised over the chosen ones where expert_weights_norm. Qwen2-MoE adds a shared
    # expert of shared_expert_intermediate_size that every token takes, gated by a sigmoid of its own.
    n_experts: int | None = None
    n_experts_used: int | None = None
    expert_intermediate_size: int | None = None
    shared_expert_intermediate_size: int | None = None
    expert_weights_norm: bool = True
    # gpt-oss: biases on the router and the experts and on the attention's output; attention sinks (a learned logit
    # per query head that joins each row's softmax, kernels/attention.py)
    moe_biases: bool = False
    o_bias: bool = False
    attention_sinks: bool = False

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
        if self.activation not in ("silu", "gelu_tanh", "swiglu_oai"):
            raise ModelFormatError(
                f"unsupported activation {self.activation!r} (llamaterm runs silu, gelu_tanh and gpt-oss's swiglu)"
            )
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
        self._check_experts()

    def _check_experts(self) -> None:
        sizes = ("n_experts", "n_experts_used", "expert_intermediate_size", "shared_expert_intermediate_size")
        for name in sizes:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ModelFormatError(f"{name} = {value!r} is not a positive integer")
        if self.n_experts is None:
            if any(getattr(self, name) is not None for name in sizes[1:]) or self.moe_biases:
                raise ModelFormatError("expert settings are given for a model without experts (no expert count)")
            return
        if self.n_experts_used is None or self.expert_intermediate_size is None:
            raise ModelFormatError(
                f"a mixture of {self.n_experts} experts needs the count used per token and the experts' size"
            )
        if self.n_experts_used > self.n_experts:
            raise ModelFormatError(
                f"{self.n_experts_used} experts used per token, of only {self.n_experts} (the expert count)"
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
    def is_moe(self) -> bool:
        return self.n_experts is not None

    def active_parameters(self) -> int:
        """The weights one token multiplies with: all but the experts its router leaves out and the input embedding
        (a lookup; tied to the lm_head, it counts as that)."""
        shapes = tensor_shapes(self)
        if self.tie_word_embeddings:
            del shapes["output.weight"]
        else:
            del shapes["token_embd.weight"]
        total = sum(math.prod(shape) for shape in shapes.values())
        if self.n_experts is not None and self.n_experts_used is not None:
            routed = sum(math.prod(shape) for name, shape in shapes.items() if "_exps." in name)
            total -= routed - routed * self.n_experts_used // self.n_experts
        return total

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
    """GGUF tensor name -> shape ([out, in] for linears; [experts, out, in] for a layer's stacked experts) of every
    tensor the model has, by llama.cpp's names. The lm_head ("output.weight") is listed whether or not it is tied to
    the embedding: readers decide whether it must be there. Experts' gate and up come as two tensors; a file may
    hold them merged instead (MERGED_GATE_UP)."""
    q, kv, h, ffn = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, c.hidden_size, c.intermediate_size
    shapes = {"token_embd.weight": (c.vocab_size, h), "output_norm.weight": (h,), "output.weight": (c.vocab_size, h)}
    layer = {
        "attn_norm": (h,),
        "attn_q": (q, h),
        "attn_k": (kv, h),
        "attn_v": (kv, h),
        "attn_output": (h, q),
        "ffn_norm": (h,),
    }
    layer |= _mlp_shapes(c)
    if c.fused_projections:
        del layer["attn_q"], layer["attn_k"], layer["attn_v"], layer["ffn_gate"]
        layer |= {"attn_qkv": (q + 2 * kv, h), "ffn_up": (2 * ffn, h)}
    if c.attention_sinks:
        layer["attn_sinks"] = (c.n_heads,)
    layer = {f"{name}.weight": shape for name, shape in layer.items()}
    if c.qkv_bias:
        layer |= {f"attn_{p}.bias": layer[f"attn_{p}.weight"][:1] for p in "qkv"}
    if c.o_bias:
        layer["attn_output.bias"] = (h,)
    if c.moe_biases:  # a bias per output of the router and of each expert's matrices
        layer |= {f"{name}.bias": layer[f"{name}.weight"][:-1] for name in ("ffn_gate_inp", *EXPERT_TENSORS)}
    if c.qk_norm:
        layer |= {"attn_q_norm.weight": (c.head_dim,), "attn_k_norm.weight": (c.head_dim,)}
    if c.post_norms:
        layer |= {"post_attention_norm.weight": (h,), "post_ffw_norm.weight": (h,)}
    for i in range(c.n_layers):
        shapes |= {f"blk.{i}.{name}": shape for name, shape in layer.items()}
    return shapes


# A layer's routed experts by llama.cpp's names: gate, up and down, each [experts, out, in]
EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
MERGED_GATE_UP = "ffn_gate_up_exps"  # gate and up in one tensor, each expert's gate rows first (newer converters)


def _mlp_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """A layer's MLP tensors: the dense gated MLP, or the router, the routed experts and a shared expert."""
    h, ffn = c.hidden_size, c.intermediate_size
    if c.n_experts is None or c.expert_intermediate_size is None:
        return {"ffn_gate": (ffn, h), "ffn_up": (ffn, h), "ffn_down": (h, ffn)}
    e, ffe = c.n_experts, c.expert_intermediate_size
    shapes = {
        "ffn_gate_inp": (e, h),
        "ffn_gate_exps": (e, ffe, h),
        "ffn_up_exps": (e, ffe, h),
        "ffn_down_exps": (e, h, ffe),
    }
    if (sff := c.shared_expert_intermediate_size) is not None:
        shapes |= {"ffn_gate_shexp": (sff, h), "ffn_up_shexp": (sff, h), "ffn_down_shexp": (h, sff)}
        shapes["ffn_gate_inp_shexp"] = (1, h)  # the shared expert's gate: one logit a token
    return shapes


def yarn_fields(
    c: ModelConfig,
    factor: float,
    original: int,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    truncate: bool = True,
    attention_factor: float | None = None,
) -> dict:
    """The ModelConfig fields of YaRN RoPE scaling, as transformers computes it (_compute_yarn_parameters): each
    frequency blends its extrapolated and its interpolated (divided by `factor`) self by a ramp over the dims
    between the correction range of beta_fast and beta_slow rotations in the original context (rounded outward
    where `truncate`), and q and k are scaled by 0.1 ln(factor) + 1 unless a factor is given."""
    dim, base = c.rotary_dim, c.rope_theta

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high += 0.001 if low == high else 0  # as transformers, against a zero-width ramp
    ramps = [min(max((i - low) / (high - low), 0.0), 1.0) for i in range(dim // 2)]
    if attention_factor is None:
        attention_factor = 0.1 * math.log(factor) + 1 if factor > 1 else 1.0
    return {
        "rope_freq_factors": tuple(1 / (r / factor + 1 - r) for r in ramps),
        "rope_attention_factor": attention_factor,
    }
