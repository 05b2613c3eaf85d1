"""Load a Hugging Face checkpoint directory (config.json + *.safetensors) into a Checkpoint.

Covers dense fp16 / bf16 / fp32 weights, GPTQ (4/8-bit, v1 and v2 zero points, act-order g_idx), AWQ GEMM
4-bit (AutoGPTQ's and AutoAWQ's packers) and compressed-tensors pack-quantized W4A16 / W8A16 (llm-compressor's).
Quantized linears become QuantWeight (w = scale * q + offset, with offset = -scale * zero rounded once to fp16
for GPTQ and AWQ, kept exact for compressed-tensors, or no offset when every zero is 2**(bits-1), which is exact);
everything else stays a torch tensor in the dtype it was stored in. Tensors are renamed to the GGUF names the
model uses; Hugging Face q/k rows are already in the half-split (NeoX) RoPE order the model expects.
Weights are read with `safetensors` only: pickled *.bin files can run code when loaded and are refused.
"""

import json
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from llamaterm.engine.checkpoints.architectures import HF_ARCHITECTURES, not_supported
from llamaterm.engine.checkpoints.checkpoint import Checkpoint
from llamaterm.engine.checkpoints.config import ModelConfig, tensor_shapes
from llamaterm.engine.checkpoints.fields import MISSING, read
from llamaterm.engine.errors import ModelFormatError, ModelNotFound
from llamaterm.kernels.qweight import QuantWeight

DENSE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Families whose config.json sliding_window applies (transformers' Llama ignores the key)
SLIDING_WINDOW_ARCHITECTURES = ("MistralForCausalLM", "MinistralForCausalLM")

TOP_MODULES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
LAYER_MODULES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.qkv_proj": "attn_qkv",  # Phi-3's fused q/k/v
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",  # Gemma 3's is a norm after attention: GEMMA_LAYER_MODULES
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",  # Phi-3's fused gate and up, as llama.cpp names it
    "mlp.down_proj": "ffn_down",
}
# Gemma 3 norms each block's input, its attention's output, the MLP's input and its output
GEMMA_LAYER_MODULES = LAYER_MODULES | {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
# transformers' config.json spellings of the MLP activations llamaterm runs
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
# A RoPE buffer that older transformers versions saved with the weights; it is recomputed from the config.
IGNORED_TENSOR = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")

# Head sizes are 64 to 256; far beyond that, a config.json is damaged, not a model to run.
MAX_HEAD_DIM = 4096

# AutoAWQ packs output column 8c + AWQ_ORDER[i] into nibble i of word c: column j is in nibble REVERSE[j].
AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]


@dataclass(frozen=True)
class QuantScheme:
    method: str  # "gptq", "awq" or "compressed-tensors"
    bits: int
    group_size: int  # -1: one group spanning the whole input dimension
    zero_shift: int  # added to stored zeros: GPTQ v1 stores zero - 1 (AutoGPTQ's pack), v2 and AWQ store zero
    symmetric: bool = False  # compressed-tensors: no zero points stored


# compressed-tensors: what llamaterm reads, for its refusals
COMPRESSED_TENSORS_SUPPORTED = (
    "compressed-tensors pack-quantized W4A16 / W8A16 (integer weights, group or "
    "channel scales, symmetric or asymmetric)"
)


def load_safetensors(model_dir: Path) -> Checkpoint:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelNotFound(f"{model_dir} is not a directory (a safetensors checkpoint is a model folder)")
    hf = read_config_json(model_dir)
    config = model_config(hf, model_dir.name)
    scheme = quant_scheme(hf.get("quantization_config"))
    tensors = convert_tensors(read_tensors(model_dir), config, scheme)
    return Checkpoint(config, tensors, hf, model_dir)


# --- config.json -----------------------------------------------------------------------------------------


def read_config_json(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    if not path.is_file():
        raise ModelFormatError(f"{model_dir} has no config.json: it is not a Hugging Face model directory")
    try:
        hf = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ModelFormatError(f"{path} is not valid JSON ({err})") from None
    if not isinstance(hf, dict):
        raise ModelFormatError(f"{path} does not hold a JSON object")
    return hf


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
    if ACTIVATIONS.get(act) != ("gelu_tanh" if gemma else "silu"):
        raise ModelFormatError(
            f"unsupported activation {act!r} for {arch} (llamaterm runs {', '.join(ACTIVATIONS)}, "
            "each where its family uses it)"
        )
    if field(hf, "attn_logit_softcapping", float, None) is not None:
        raise ModelFormatError("config.json: attn_logit_softcapping (Gemma 2's) is not supported")
    # Qwen3's and Gemma 3's config defaults differ from hidden / heads (transformers: 128, 256); their files say
    head_dim = size("head_dim", MISSING if family in ("qwen3", "gemma3") else max(hidden_size // n_heads, 1))
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
        qkv_bias=family == "qwen2" or bool(field(hf, "attention_bias", bool, False)),
        qk_norm=family in ("qwen3", "gemma3"),
        fused_projections=family == "phi3",
        sliding_window=window,
        sliding_layers=sliding_layers,
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


def field(hf: dict, key: str, kind, default=MISSING, *, positive: bool = False):
    """A config.json value checked to be of `kind` (see checkpoints/fields.py)."""
    return read(hf, key, kind, default, where="config.json", positive=positive)


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
    if rope_type in ("longrope", "su"):
        return longrope(hf, params, config)
    if rope_type == "linear":  # positions divided by factor: every frequency is
        return {"rope_freq_factors": (float(field(params, "factor", float, positive=True)),) * (config.rotary_dim // 2)}
    if rope_type != "llama3":
        raise ModelFormatError(
            f"unsupported rope scaling {rope_type!r}: llamaterm runs 'linear', 'llama3' and 'longrope'"
        )
    if config.head_dim > MAX_HEAD_DIM:  # checked before making head_dim / 2 factors
        raise ModelFormatError(
            f"config.json: head_dim {config.head_dim} is beyond any model's "
            f"(at most {MAX_HEAD_DIM}); the file is damaged"
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
    bits = qc.get("bits", qc.get("w_bit"))  # AutoAWQ spells them w_bit and q_group_size
    group_size = qc.get("group_size", qc.get("q_group_size"))
    if method not in ("gptq", "awq"):
        raise ModelFormatError(
            f"unsupported quantization method {method!r}: llamaterm reads GPTQ, AWQ and compressed-tensors"
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
    get = lambda data, key, kind, default=MISSING, positive=False: read(
        data, key, kind, default, where="config.json quantization_config", positive=positive
    )

    def refuse(what: str) -> ModelFormatError:
        return ModelFormatError(
            f"compressed-tensors {what} is not supported: llamaterm reads {COMPRESSED_TENSORS_SUPPORTED}"
        )

    if (fmt := get(qc, "format", str, None)) != "pack-quantized":
        raise refuse(f"format {fmt!r}")
    for key, what in (
        ("sparsity_config", "sparsity (e.g. 2:4)"),
        ("transform_config", "a weight transform"),
        ("kv_cache_scheme", "KV-cache quantization"),
    ):
        if get(qc, key, dict, None):
            raise refuse(what)
    groups = get(qc, "config_groups", dict)
    schemes = set()
    for group in groups.values():
        group = group if isinstance(group, dict) else {}
        if get(group, "format", str, fmt) != "pack-quantized":
            raise refuse(f"format {group['format']!r}")
        for key in ("input_activations", "output_activations"):
            if group.get(key) is not None:
                raise refuse("activation quantization (e.g. W8A8)")
        w = get(group, "weights", dict)
        kind, bits, strategy = get(w, "type", str, "int"), get(w, "num_bits", int), get(w, "strategy", str)
        if kind != "int":
            raise refuse(f"{kind} weights (e.g. FP8)")
        if bits not in (4, 8):
            raise refuse(f"{bits}-bit weights")
        if strategy not in ("group", "channel"):
            raise refuse(f"the {strategy!r} strategy")
        if get(w, "dynamic", bool, False) or get(w, "actorder", str, None) not in (None, "weight", "static"):
            raise refuse("dynamic or activation-ordered groups (actorder: group)")
        group_size = get(w, "group_size", int, positive=True) if strategy == "group" else -1
        schemes.add(QuantScheme("compressed-tensors", bits, group_size, 0, get(w, "symmetric", bool, True)))
    if len(schemes) != 1:
        raise refuse("a mix of weight schemes" if schemes else "a config without config_groups")
    return schemes.pop()


# --- safetensors files -----------------------------------------------------------------------------------


def is_file_name(name: str) -> bool:
    """A plain file name: no folder part, no '..', no absolute path, on any OS."""
    return name not in ("", ".", "..") and not any(c in name for c in "/\\\0:")


def read_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    index_path = model_dir / "model.safetensors.index.json"
    weight_map = None
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as err:
            raise ModelFormatError(f"{index_path} is not a valid safetensors index ({err})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise ModelFormatError(f"{index_path}: weight_map is not an object of tensor name -> file name")
        files = sorted(set(weight_map.values()))
        if outside := [f for f in files if not is_file_name(f)]:  # a shard is a file beside the index
            raise ModelFormatError(
                f"{index_path} points outside the model folder ({outside[0]!r}): refusing "
                "to read it; the index is damaged or hostile"
            )
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        if any(model_dir.glob("*.bin")) or any(model_dir.glob("*.pt")):
            raise ModelFormatError(
                f"{model_dir} holds only PyTorch pickle weights (*.bin, *.pt), which can run code when "
                "loaded; llamaterm reads *.safetensors only. Download the safetensors version of the model."
            )
        raise ModelFormatError(f"{model_dir} has no *.safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        path = model_dir / file
        try:
            listed = path.is_file()
        except OSError:  # a name the file system cannot hold (too long)
            listed = False
        if not listed:
            raise ModelFormatError(f"{str(path)[:200]} is listed in {index_path.name} but missing: download it again")
        try:
            with safe_open(path, framework="pt") as f:
                for key in f.keys():
                    if key in tensors:
                        raise ModelFormatError(f"tensor {key!r} appears in more than one file ({file})")
                    tensors[key] = f.get_tensor(key)
        except SafetensorError as err:
            raise ModelFormatError(f"{path} is corrupt or truncated ({err}): download it again") from None
    if weight_map is not None and (missing := sorted(set(weight_map) - set(tensors))):
        raise ModelFormatError(f"tensors in {index_path.name} are missing from their files: {missing[:5]}")
    return tensors


# --- names and shapes ------------------------------------------------------------------------------------


def gguf_module(hf_module: str, family: str) -> str | None:
    layer_modules = GEMMA_LAYER_MODULES if family == "gemma3" else LAYER_MODULES
    if hf_module in TOP_MODULES:
        return TOP_MODULES[hf_module]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf_module)
    if m and m[2] in layer_modules:
        return f"blk.{int(m[1])}.{layer_modules[m[2]]}"
    return None


def convert_tensors(
    raw: dict[str, torch.Tensor], config: ModelConfig, scheme: QuantScheme | None
) -> dict[str, torch.Tensor | QuantWeight]:
    # Group tensors by module: "model.layers.0.mlp.up_proj.qweight" -> "blk.0.ffn_up" part "qweight".
    modules: dict[str, tuple[str, dict[str, torch.Tensor]]] = {}
    for name, tensor in raw.items():
        if IGNORED_TENSOR.fullmatch(name):
            continue
        hf_module, _, part = name.rpartition(".")
        module = gguf_module(hf_module, config.arch)
        if module is None:
            raise ModelFormatError(f"unexpected tensor {name!r}: not part of a {config.arch} model")
        modules.setdefault(module, (hf_module, {}))[1][part] = tensor
    if config.n_layers * 6 > len(modules):  # a block has at least 6 modules; checked before per-layer tables
        raise ModelFormatError(
            f"config.json: num_hidden_layers = {config.n_layers}, but the checkpoint holds only {len(raw)} tensors"
        )
    if config.tie_word_embeddings:
        modules.pop("output", None)  # transformers ignores a stored lm_head when the embedding is tied
    shapes = tensor_shapes(config)
    if config.tie_word_embeddings:
        del shapes["output.weight"]
    wanted = {name.rpartition(".")[0] for name in shapes}
    if missing := [name for name in wanted if name not in modules]:
        raise ModelFormatError(f"the checkpoint lacks tensors for {missing[:5]} (from config.json)")
    tensors: dict[str, torch.Tensor | QuantWeight] = {}
    for module, (hf_module, parts) in modules.items():
        if module not in wanted:
            layers = config.n_layers
            raise ModelFormatError(f"unexpected tensors {hf_module}.* ({layers} layers in config.json)")
        shape = shapes[f"{module}.weight"]
        if "bias" in parts and f"{module}.bias" not in shapes:
            raise ModelFormatError(
                f"{hf_module}.bias is not part of a {config.arch} model as config.json describes "
                "it (llamaterm runs biases of q/k/v only: Qwen2's, or Llama's attention_bias)"
            )
        if "bias" not in parts and f"{module}.bias" in shapes:
            raise ModelFormatError(f"{hf_module}.bias is missing: the checkpoint is incomplete")
        if "bias" in parts:
            tensors[f"{module}.bias"] = dense(parts.pop("bias"), shapes[f"{module}.bias"], f"{hf_module}.bias")
        if parts.keys() & {"qweight", "weight_packed"} and len(shape) == 2 and module != "token_embd":
            if scheme is None:
                raise ModelFormatError(f"{hf_module} is quantized but config.json has no quantization_config")
            convert = {"gptq": gptq_weight, "awq": awq_weight, "compressed-tensors": packed_weight}[scheme.method]
            tensors[f"{module}.weight"] = convert(parts, shape, scheme, hf_module)
        elif set(parts) == {"weight"}:
            weight = dense(parts["weight"], shape, f"{hf_module}.weight")
            if config.arch == "gemma3" and module.endswith("norm"):  # Gemma3RMSNorm scales by 1 + weight, in fp32
                weight = weight.float() + 1
            tensors[f"{module}.weight"] = weight
        else:
            raise ModelFormatError(f"unexpected tensors for {hf_module}: {sorted(parts)}")
    return tensors


def dense(t: torch.Tensor, shape: tuple[int, ...], name: str) -> torch.Tensor:
    if t.dtype not in DENSE_DTYPES:
        raise ModelFormatError(f"{name} has dtype {t.dtype}; dense weights must be fp16, bf16 or fp32")
    check_shape(t, shape, name)
    return t


def check_shape(t: torch.Tensor, shape: tuple[int, ...], name: str) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ModelFormatError(f"{name} has shape {list(t.shape)}, expected {list(shape)} from config.json")


# --- GPTQ and AWQ ----------------------------------------------------------------------------------------


def quant_parts(parts: dict, names: set[str], hf_module: str, scheme: QuantScheme) -> None:
    if set(parts) != names:
        found, wanted = sorted(parts), sorted(names)
        raise ModelFormatError(f"{hf_module} has tensors {found}; {scheme.method} uses {wanted}")
    for name in names - {"scales"}:
        if parts[name].dtype != torch.int32:
            raise ModelFormatError(f"{hf_module}.{name} has dtype {parts[name].dtype}, expected int32")
    if parts["scales"].dtype != torch.float16:
        raise ModelFormatError(f"{hf_module}.scales has dtype {parts['scales'].dtype}, expected float16")


def group_count(k: int, scheme: QuantScheme) -> tuple[int, int]:
    """(group size, groups): a group size that does not divide k leaves a short last group (GPTQModel writes
    group 128 for 576-wide layers)."""
    group_size = k if scheme.group_size == -1 else scheme.group_size
    return group_size, -(-k // group_size)


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Split every int32 into 32 // bits fields, lowest bits first, laid out one after another along `dim`."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    fields = (packed.unsqueeze(-1) >> shifts) & (2**bits - 1)  # [rows, cols, fields]
    rows, cols = packed.shape
    if dim == 0:
        return fields.permute(0, 2, 1).reshape(rows * fields.shape[-1], cols)
    return fields.reshape(rows, cols * fields.shape[-1])


def gptq_weight(parts: dict, shape: tuple[int, int], scheme: QuantScheme, hf_module: str) -> QuantWeight:
    n, k = shape
    bits, per_word = scheme.bits, 32 // scheme.bits
    quant_parts(parts, {"qweight", "qzeros", "scales", "g_idx"}, hf_module, scheme)
    group_size, groups = group_count(k, scheme)
    if k % per_word or n % per_word:
        raise ModelFormatError(f"{hf_module}: shape {[n, k]} does not pack into int32 words of {bits} bits")
    check_shape(parts["qweight"], (k // per_word, n), f"{hf_module}.qweight")
    check_shape(parts["qzeros"], (groups, n // per_word), f"{hf_module}.qzeros")
    check_shape(parts["scales"], (groups, n), f"{hf_module}.scales")
    check_shape(parts["g_idx"], (k,), f"{hf_module}.g_idx")
    q = unpack_int32(parts["qweight"], bits, dim=0)  # [K, N], packed along the input dimension
    zeros = unpack_int32(parts["qzeros"], bits, dim=1) + scheme.zero_shift  # [G, N], packed along the output
    g_idx = parts["g_idx"].long()
    in_range = g_idx.min() >= 0 and g_idx.max() < groups
    sizes = (torch.arange(k) // group_size).bincount()  # group_size each, the last one what is left
    if not in_range or not torch.equal(torch.bincount(g_idx, minlength=groups), sizes):
        raise ModelFormatError(
            f"{hf_module}.g_idx does not assign {group_size} input channels to each of {groups} groups (the last "
            f"one {sizes[-1]})"
        )
    perm = None
    if not torch.equal(g_idx, torch.arange(k) // group_size):
        # Act-order: sort input channels by group so groups are contiguous; the model gathers x[:, perm].
        perm = torch.argsort(g_idx, stable=True)
        q = q[perm]
    return quant_weight(q.T, parts["scales"].T, zeros.T, bits, group_size, perm)


def awq_weight(parts: dict, shape: tuple[int, int], scheme: QuantScheme, hf_module: str) -> QuantWeight:
    n, k = shape
    quant_parts(parts, {"qweight", "qzeros", "scales"}, hf_module, scheme)
    group_size, groups = group_count(k, scheme)
    if n % 8:
        raise ModelFormatError(f"{hf_module}: output size {n} is not a multiple of 8")
    check_shape(parts["qweight"], (k, n // 8), f"{hf_module}.qweight")
    check_shape(parts["qzeros"], (groups, n // 8), f"{hf_module}.qzeros")
    check_shape(parts["scales"], (groups, n), f"{hf_module}.scales")

    def unpack(packed: torch.Tensor) -> torch.Tensor:  # [rows, N / 8] -> [rows, N] in logical column order
        nibbles = unpack_int32(packed, 4, dim=1).view(packed.shape[0], n // 8, 8)
        return nibbles[..., AWQ_REVERSE_ORDER].reshape(packed.shape[0], n)

    q, zeros = unpack(parts["qweight"]), unpack(parts["qzeros"])
    return quant_weight(q.T, parts["scales"].T, zeros.T, 4, group_size)


def packed_weight(parts: dict, shape: tuple[int, int], scheme: QuantScheme, hf_module: str) -> QuantWeight:
    """compressed-tensors pack-quantized: weight_packed int32 [N, K / per word] holds the values along K, lowest bits
    first, as q + 2**(bits-1) (the signed q in unsigned form); weight_zero_point, asymmetric only, holds the zeros
    the same way along N [N / per word, G]; w = scale * (q - zero) (its pack_to_int32 and dequantize)."""
    n, k = shape
    bits, per_word = scheme.bits, 32 // scheme.bits
    names = {"weight_packed", "weight_scale", "weight_shape"} | (set() if scheme.symmetric else {"weight_zero_point"})
    if set(parts) != names:
        kind = "symmetric" if scheme.symmetric else "asymmetric"
        raise ModelFormatError(
            f"{hf_module} has tensors {sorted(parts)}; {kind} compressed-tensors uses {sorted(names)}"
        )
    for name, dtypes in (
        ("weight_packed", (torch.int32,)),
        ("weight_zero_point", (torch.int32,)),
        ("weight_shape", (torch.int32, torch.int64)),
        ("weight_scale", DENSE_DTYPES),
    ):
        if name in parts and parts[name].dtype not in dtypes:
            raise ModelFormatError(f"{hf_module}.{name} has dtype {parts[name].dtype}, expected one of {dtypes}")
    if parts["weight_shape"].tolist() != [n, k]:
        raise ModelFormatError(
            f"{hf_module}.weight_shape is {parts['weight_shape'].tolist()}, expected {[n, k]} from config.json"
        )
    group_size, groups = group_count(k, scheme)
    check_shape(parts["weight_packed"], (n, -(-k // per_word)), f"{hf_module}.weight_packed")
    check_shape(parts["weight_scale"], (n, groups), f"{hf_module}.weight_scale")
    scales = parts["weight_scale"]
    if not scales.isfinite().all():
        raise ModelFormatError(f"{hf_module}.weight_scale holds values that are not finite: the file is damaged")
    q = unpack_int32(parts["weight_packed"], bits, dim=1)[:, :k]
    if scheme.symmetric:
        return QuantWeight.from_values(q, narrowest(scales), None, bits, group_size)
    check_shape(parts["weight_zero_point"], (-(-n // per_word), groups), f"{hf_module}.weight_zero_point")
    zeros = unpack_int32(parts["weight_zero_point"], bits, dim=0)[:n]
    # exact in fp32 for fp16 and bf16 scales (at most 11 + 8 significant bits), and so is scale * q + offset
    offsets = -scales.float() * zeros
    return QuantWeight.from_values(q, narrowest(scales), narrowest(offsets), bits, group_size)


def narrowest(t: torch.Tensor) -> torch.Tensor:
    """fp16 where it holds every value exactly, else fp32: exact, and as few bytes as that allows."""
    half = t.half()
    return half if torch.equal(half.float(), t.float()) else t.float()


def quant_weight(q, scales, zeros, bits: int, group_size: int, perm=None) -> QuantWeight:
    """q [N, K], scales and zeros [N, G] with w = scale * (q - zero) -> QuantWeight."""
    if (zeros == 2 ** (bits - 1)).all():
        offsets = None  # symmetric: QuantWeight's own centring, exact
    else:
        # scale * zero is exact in fp32 (11 + 9 significant bits); rounding it to fp16 is the inexact step.
        offsets = (-scales.float() * zeros).half().contiguous()
    return QuantWeight.from_values(q.contiguous(), scales.contiguous(), offsets, bits, group_size, perm)
