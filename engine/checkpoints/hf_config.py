"""A Hugging Face config.json -> the ModelConfig the forward pass runs and the QuantScheme its weights are stored
in, refusing by name what llamaterm does not run. Values are read with checks (checkpoints/fields.py): a config.json
is untrusted input. The weights themselves are read and converted in checkpoints/safetensors_loader.py.
"""

import math
from dataclasses import dataclass, replace

from llamaterm.engine.checkpoints.architectures import HF_ARCHITECTURES, not_supported
from llamaterm.engine.checkpoints.config import MAX_LAYERS, ModelConfig, yarn_fields
from llamaterm.engine.checkpoints.fields import MISSING, reader
from llamaterm.engine.errors import ModelFormatError
from llamaterm.kernels.activation import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT

# Families whose config.json sliding_window applies (transformers' Llama ignores the key)
SLIDING_WINDOW_ARCHITECTURES = ("MistralForCausalLM", "MinistralForCausalLM", "MixtralForCausalLM", "GptOssForCausalLM")
# Mixtures of experts by class: whether the router's weights are renormalised over the chosen experts where the
# config does not say (norm_topk_prob), and the key of the experts' size
MOE_ARCHITECTURES = {
    "MixtralForCausalLM": (True, "intermediate_size"),
    "Qwen2MoeForCausalLM": (False, "moe_intermediate_size"),
    "Qwen3MoeForCausalLM": (False, "moe_intermediate_size"),
    "GptOssForCausalLM": (True, "intermediate_size"),
}

# A config.json value checked to be of a kind (checkpoints/fields.py): field(data, key, kind[, default], positive=);
# required unless a default is given. quant_field: the same in its quantization_config.
field = reader("config.json", MISSING)
quant_field = reader("config.json quantization_config", MISSING)
# transformers' config.json spellings of the MLP activations llamaterm runs
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
# Head sizes are 64 to 256; far beyond that, a config.json is damaged, not a model to run.
MAX_HEAD_DIM = 4096


@dataclass(frozen=True)
class QuantScheme:
    method: str  # "gptq", "awq", "compressed-tensors" or "mxfp4"
    bits: int
    group_size: int  # -1: one group spanning the whole input dimension
    zero_shift: int  # added to stored zeros: GPTQ v1 stores zero - 1 (AutoGPTQ's pack), v2 and AWQ store zero
    symmetric: bool = False  # compressed-tensors: no zero points stored


# compressed-tensors: what llamaterm reads, for its refusals
COMPRESSED_TENSORS_SUPPORTED = (
    "compressed-tensors pack-quantized W4A16 / W8A16 (integer weights, group or "
    "channel scales, symmetric or asymmetric)"
)


def model_config(hf: dict, name: str) -> ModelConfig:
    """config.json (as a dict) -> ModelConfig, refusing what the forward pass cannot run."""
    architectures = field(hf, "architectures", "strings", [])
    arch = architectures[0] if architectures else None
    if arch is None and hf.get("model_type") == "llama":
        arch = "LlamaForCausalLM"
    if arch not in HF_ARCHITECTURES:
        raise ModelFormatError(f"config.json: {not_supported(arch or hf.get('model_type'))}")
    family = HF_ARCHITECTURES[arch]
    size = lambda key, default=MISSING: field(hf, key, int, default, positive=True)
    n_heads = size("num_attention_heads")
    hidden_size = size("hidden_size")
    context_length = size("max_position_embeddings")
    n_layers = size("num_hidden_layers")
    if n_layers > MAX_LAYERS:
        raise ModelFormatError(
            f"config.json: num_hidden_layers = {n_layers} is beyond any model's (at most {MAX_LAYERS}); "
            "the file is damaged"
        )
    gemma = family == "gemma3"
    window, sliding_layers = None, None
    if arch in SLIDING_WINDOW_ARCHITECTURES:  # Llama ignores a sliding_window key; these read it
        window, sliding_layers = sliding_window(hf, n_layers)
    elif gemma:  # every sixth layer global, unless the config says otherwise (Gemma3TextConfig's default)
        window, sliding_layers = sliding_window(
            hf, n_layers, field(hf, "sliding_window_pattern", int, 6, positive=True)
        )
    elif family == "phi3":  # transformers' Phi-3 slides where its config gives a window (Phi-3-mini-4k: 2047)
        window = size("sliding_window", None)
    if family in ("qwen2", "qwen3") and field(hf, "use_sliding_window", bool, False):
        raise ModelFormatError("config.json: use_sliding_window (Qwen's window on its upper layers) is not supported")
    act = field(hf, "hidden_activation" if gemma else "hidden_act", str, "gelu_pytorch_tanh" if gemma else "silu")
    if arch != "GptOssForCausalLM" and ACTIVATIONS.get(act) != ("gelu_tanh" if gemma else "silu"):
        raise ModelFormatError(
            f"unsupported activation {act!r} for {arch} (llamaterm runs {', '.join(ACTIVATIONS)}, "
            "each where its family uses it)"
        )
    if field(hf, "attn_logit_softcapping", float, None) is not None:
        raise ModelFormatError("config.json: attn_logit_softcapping (Gemma 2's) is not supported")
    # Qwen3's and Gemma 3's config defaults differ from hidden / heads (transformers: 128, 256); their files say
    head_dim = size(
        "head_dim", MISSING if family in ("qwen3", "gemma3", "qwen3moe") else max(hidden_size // n_heads, 1)
    )
    partial = field(
        rope_params(hf), "partial_rotary_factor", float, field(hf, "partial_rotary_factor", float, 1.0), positive=True
    )
    config = ModelConfig(
        arch=family,
        name=name,
        n_layers=n_layers,
        hidden_size=hidden_size,
        intermediate_size=size("intermediate_size"),
        n_heads=n_heads,
        n_kv_heads=size("num_key_value_heads", n_heads),
        head_dim=head_dim,
        rope_dim=None if partial == 1 else int(head_dim * partial),
        vocab_size=size("vocab_size"),
        context_length=context_length,
        rms_norm_eps=float(field(hf, "rms_norm_eps", float, 1e-6, positive=True)),
        rope_theta=float(
            field(rope_params(hf), "rope_theta", float, field(hf, "rope_theta", float, 10000.0), positive=True)
        ),
        tie_word_embeddings=bool(field(hf, "tie_word_embeddings", bool, gemma)),  # transformers' defaults
        qkv_bias=family in ("qwen2", "qwen2moe") or bool(field(hf, "attention_bias", bool, False)),
        qk_norm=family in ("qwen3", "gemma3", "qwen3moe"),
        fused_projections=family == "phi3",
        sliding_window=window,
        sliding_layers=sliding_layers,
        **experts(hf, arch),
    )
    if gemma:
        config = replace(
            config,
            post_norms=True,
            activation="gelu_tanh",
            embedding_scale=hidden_size**0.5,
            attention_scale=field(hf, "query_pre_attn_scalar", float, positive=True) ** -0.5,
            rope_theta_sliding=float(
                field(
                    rope_params(hf, "sliding_attention"),
                    "rope_theta",
                    float,
                    field(hf, "rope_local_base_freq", float, 10000.0),
                    positive=True,
                )
            ),
            final_logit_softcap=field(hf, "final_logit_softcapping", float, None, positive=True),
        )
    return replace(config, **rope_scaling(hf, config))


def experts(hf: dict, arch: str) -> dict:
    """The ModelConfig fields of a mixture of experts (none for a dense class), refusing the variants that are not
    one: dense layers among the sparse ones (Qwen's mlp_only_layers, decoder_sparse_step)."""
    if arch not in MOE_ARCHITECTURES:
        return {}
    norm, size_key = MOE_ARCHITECTURES[arch]
    if field(hf, "mlp_only_layers", "ints", []) or field(hf, "decoder_sparse_step", int, 1) != 1:
        raise ModelFormatError(
            "config.json: dense MLP layers among the experts' (mlp_only_layers, decoder_sparse_step) are not supported"
        )
    n_experts = field(hf, "num_experts" if "num_experts" in hf else "num_local_experts", int, positive=True)
    shared = field(hf, "shared_expert_intermediate_size", int, None, positive=True)
    fields = dict(
        n_experts=n_experts,
        n_experts_used=field(hf, "num_experts_per_tok", int, positive=True),
        expert_intermediate_size=field(hf, size_key, int, positive=True),
        shared_expert_intermediate_size=shared,
        expert_weights_norm=bool(field(hf, "norm_topk_prob", bool, norm)),
    )
    if arch == "GptOssForCausalLM":
        swiglu = (
            field(hf, "swiglu_alpha", float, SWIGLU_OAI_ALPHA),
            field(hf, "swiglu_limit", float, SWIGLU_OAI_LIMIT),
        )
        if swiglu != (SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT):
            raise ModelFormatError(
                f"config.json: gpt-oss's SwiGLU with alpha {swiglu[0]} and limit {swiglu[1]} is not supported "
                f"(llamaterm runs gpt-oss's own, {SWIGLU_OAI_ALPHA} and {SWIGLU_OAI_LIMIT})"
            )
        fields |= dict(activation="swiglu_oai", moe_biases=True, o_bias=True, attention_sinks=True)
    return fields


def sliding_window(hf: dict, n_layers: int, pattern: int | None = None) -> tuple[int | None, tuple[bool, ...] | None]:
    """(window, which layers use it) as transformers reads them: `sliding_window` (absent: 4096, Mistral's,
    Ministral's and Gemma 3's default; null: none) and `layer_types` ("sliding_attention" or "full_attention" per
    layer; absent: every layer slides, or with a `pattern` of n, every nth layer is full, as Gemma 3's)."""
    window = field(hf, "sliding_window", int, 4096 if "sliding_window" not in hf else None, positive=True)
    layer_types = field(hf, "layer_types", "strings", None)
    if window is not None and layer_types is None and pattern is not None:
        return window, tuple((i + 1) % pattern != 0 for i in range(n_layers))
    if window is None or layer_types is None:
        return window, None
    kinds = {"sliding_attention": True, "full_attention": False}
    if len(layer_types) != n_layers or not set(layer_types) <= kinds.keys():
        raise ModelFormatError(
            f"config.json: layer_types must give one of {sorted(kinds)} for each of the {n_layers} layers"
        )
    return window, tuple(kinds[t] for t in layer_types)


def rope_params(hf: dict, layer_type: str = "full_attention") -> dict:
    """RoPE settings: transformers 5 writes `rope_parameters`, older ones `rope_theta` and `rope_scaling`. Gemma 3's
    have a set per layer type: the full-attention layers' unless `layer_type` says otherwise."""
    params = [hf.get(key) or {} for key in ("rope_parameters", "rope_scaling")]
    if not all(isinstance(p, dict) for p in params):
        raise ModelFormatError("config.json: rope_parameters and rope_scaling must be JSON objects")
    params = [
        p.get(layer_type) or {} if "full_attention" in p else {} if layer_type != "full_attention" else p
        for p in params
    ]
    if not all(isinstance(p, dict) for p in params):
        raise ModelFormatError(f"config.json: the RoPE settings of {layer_type} layers must be a JSON object")
    return {**params[0], **params[1]}


def rope_scaling(hf: dict, config: ModelConfig) -> dict:
    """The ModelConfig fields of the config's RoPE scaling: Llama 3's or LongRoPE (Phi-3's, once called "su")."""
    params = rope_params(hf)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return {}
    if config.head_dim > MAX_HEAD_DIM:  # checked before making head_dim / 2 factors
        raise ModelFormatError(
            f"config.json: head_dim {config.head_dim} is beyond any model's "
            f"(at most {MAX_HEAD_DIM}); the file is damaged"
        )
    if rope_type in ("longrope", "su"):
        return longrope(hf, params, config)
    if rope_type == "yarn":
        return yarn_fields(
            config,
            factor=field(params, "factor", float, positive=True),
            original=field(params, "original_max_position_embeddings", int, config.context_length, positive=True),
            beta_fast=field(params, "beta_fast", float, 32.0, positive=True),
            beta_slow=field(params, "beta_slow", float, 1.0, positive=True),
            truncate=bool(field(params, "truncate", bool, True)),
            attention_factor=field(params, "attention_factor", float, None, positive=True),
        )
    if rope_type == "linear":  # positions divided by factor: every frequency is
        return {"rope_freq_factors": (float(field(params, "factor", float, positive=True)),) * (config.rotary_dim // 2)}
    if rope_type != "llama3":
        raise ModelFormatError(
            f"unsupported rope scaling {rope_type!r}: llamaterm runs 'linear', 'llama3', 'yarn' and 'longrope'"
        )
    factor, low, high = (
        field(params, k, float, positive=True) for k in ("factor", "low_freq_factor", "high_freq_factor")
    )
    if low >= high:
        raise ModelFormatError(f"config.json: llama3 rope scaling has low_freq_factor {low} >= high_freq_factor {high}")
    old_context = field(params, "original_max_position_embeddings", float, config.context_length, positive=True)
    # Divisors of the inverse frequencies, as llama.cpp's rope_freqs (its llm_build_rope_factors): keep the
    # short wavelengths, divide the long ones by `factor`, blend in between.
    factors = []
    for inv_freq in config.inv_freq().tolist():
        wavelen = 2 * math.pi / inv_freq
        if wavelen < old_context / high:
            factors.append(1.0)
        elif wavelen > old_context / low:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1.0 / ((1 - smooth) / factor + smooth))
    return {"rope_freq_factors": tuple(factors)}


def longrope(hf: dict, params: dict, config: ModelConfig) -> dict:
    """LongRoPE as transformers computes it (_compute_longrope_parameters): short factors up to the original
    context, long ones past it; the attention factor sqrt(1 + ln(s) / ln(original)), s = context / original,
    unless the config gives one."""
    key = "original_max_position_embeddings"  # in the RoPE settings, or beside them (Phi-3.5)
    old = field(params if key in params else hf, key, int, positive=True)
    short, long = (tuple(float(x) for x in field(params, f"{k}_factor", "numbers")) for k in ("short", "long"))
    scale = field(params, "factor", float, config.context_length / old, positive=True)
    default = 1.0 if scale <= 1 else math.sqrt(1 + math.log(scale) / math.log(old))
    return {
        "rope_freq_factors": short,
        "rope_long_factors": long,
        "rope_long_from": old,
        "rope_attention_factor": float(field(params, "attention_factor", float, default, positive=True)),
    }


def quant_scheme(qc: dict | None) -> QuantScheme | None:
    """config.json quantization_config -> QuantScheme. Sym and act-order are read from zeros and g_idx."""
    if qc is None:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method == "compressed-tensors":
        return compressed_tensors_scheme(qc)
    if method == "mxfp4":  # gpt-oss's: the experts in MXFP4 (blocks of 32 with an E8M0 scale), the rest dense
        return QuantScheme("mxfp4", 4, 32, 0, True)
    bits = qc.get("bits", qc.get("w_bit"))  # AutoAWQ spells them w_bit and q_group_size
    group_size = qc.get("group_size", qc.get("q_group_size"))
    if method not in ("gptq", "awq"):
        raise ModelFormatError(
            f"unsupported quantization method {method!r}: llamaterm reads GPTQ, AWQ, compressed-tensors and MXFP4"
        )
    if not isinstance(group_size, int) or not (group_size == -1 or group_size > 0):
        raise ModelFormatError(f"{method} quantization_config has an invalid group_size {group_size!r}")
    if method == "gptq":
        fmt = qc.get("checkpoint_format") or qc.get("format") or "gptq"
        if fmt not in ("gptq", "gptq_v2"):
            raise ModelFormatError(f"unsupported GPTQ checkpoint format {fmt!r} (supported: gptq, gptq_v2)")
        if bits not in (4, 8):
            raise ModelFormatError(f"unsupported GPTQ bits {bits!r}: llamaterm reads 4 and 8")
        return QuantScheme("gptq", bits, group_size, 1 if fmt == "gptq" else 0)
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise ModelFormatError(f"unsupported AWQ version {version!r}: llamaterm reads the GEMM layout")
    if bits != 4:
        raise ModelFormatError(f"unsupported AWQ bits {bits!r}: the GEMM layout is 4-bit")
    if not qc.get("zero_point", True):
        raise ModelFormatError("AWQ without zero points is not supported")
    return QuantScheme("awq", 4, group_size, 0)


def compressed_tensors_scheme(qc: dict) -> QuantScheme:
    """A compressed-tensors quantization_config (as llm-compressor writes it) -> QuantScheme, refusing by name
    what is not integer weight-only quantization packed into int32 words."""
    if (fmt := quant_field(qc, "format", str, None)) != "pack-quantized":
        raise refuse_compressed(f"format {fmt!r}")
    for key, what in (
        ("sparsity_config", "sparsity (e.g. 2:4)"),
        ("transform_config", "a weight transform"),
        ("kv_cache_scheme", "KV-cache quantization"),
    ):
        if quant_field(qc, key, dict, None):
            raise refuse_compressed(what)
    schemes = {group_scheme(group, fmt) for group in quant_field(qc, "config_groups", dict).values()}
    if len(schemes) != 1:
        raise refuse_compressed("a mix of weight schemes" if schemes else "a config without config_groups")
    return schemes.pop()


def group_scheme(group: object, fmt: str) -> QuantScheme:
    """One of compressed-tensors' config_groups -> the QuantScheme of its weights."""
    group = group if isinstance(group, dict) else {}
    if quant_field(group, "format", str, fmt) != "pack-quantized":
        raise refuse_compressed(f"format {group['format']!r}")
    for key in ("input_activations", "output_activations"):
        if group.get(key) is not None:
            raise refuse_compressed("activation quantization (e.g. W8A8)")
    w = quant_field(group, "weights", dict)
    kind, bits = quant_field(w, "type", str, "int"), quant_field(w, "num_bits", int)
    strategy = quant_field(w, "strategy", str)
    if kind != "int":
        raise refuse_compressed(f"{kind} weights (e.g. FP8)")
    if bits not in (4, 8):
        raise refuse_compressed(f"{bits}-bit weights")
    if strategy not in ("group", "channel"):
        raise refuse_compressed(f"the {strategy!r} strategy")
    dynamic = quant_field(w, "dynamic", bool, False)
    if dynamic or quant_field(w, "actorder", str, None) not in (None, "weight", "static"):
        raise refuse_compressed("dynamic or activation-ordered groups (actorder: group)")
    group_size = quant_field(w, "group_size", int, positive=True) if strategy == "group" else -1
    return QuantScheme("compressed-tensors", bits, group_size, 0, quant_field(w, "symmetric", bool, True))


def refuse_compressed(what: str) -> ModelFormatError:
    return ModelFormatError(
        f"compressed-tensors {what} is not supported: llamaterm reads {COMPRESSED_TENSORS_SUPPORTED}"
    )
