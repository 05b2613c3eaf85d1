"""Load a Hugging Face checkpoint directory (config.json + *.safetensors) into a Checkpoint: the config through
checkpoints/hf_config.py, the weights here.

Covers dense fp16 / bf16 / fp32 weights, GPTQ (4/8-bit, v1 and v2 zero points, act-order g_idx), AWQ GEMM
4-bit (AutoGPTQ's and AutoAWQ's packers) and compressed-tensors pack-quantized W4A16 / W8A16 (llm-compressor's).
Quantized linears become QuantWeight (w = scale * q + offset, with offset = -scale * zero rounded once to fp16
for GPTQ and AWQ, kept exact for compressed-tensors, or no offset when every zero is 2**(bits-1), which is exact);
everything else stays a torch tensor in the dtype it was stored in. Tensors are renamed to the GGUF names the
model uses; Hugging Face q/k rows are already in the half-split (NeoX) RoPE order the model expects.
Weights are read with `safetensors` only: pickled *.bin files can run code when loaded and are refused.
"""

import json
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from llamaterm.engine.checkpoints.checkpoint import Checkpoint
from llamaterm.engine.checkpoints.config import EXPERT_TENSORS, ModelConfig, tensor_shapes
from llamaterm.engine.checkpoints.hf_config import QuantScheme, model_config, quant_scheme
from llamaterm.engine.checkpoints.hf_files import read_json
from llamaterm.engine.errors import ModelFormatError, ModelNotFound
from llamaterm.kernels.qweight import QuantWeight

DENSE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
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
    # mixtures of experts: the router (Qwen's gate, Mixtral's, gpt-oss's router), Qwen2-MoE's shared expert and its
    # gate, gpt-oss's attention sinks (a parameter of its own: named here as a module's weight)
    "mlp.gate": "ffn_gate_inp",
    "block_sparse_moe.gate": "ffn_gate_inp",
    "mlp.router": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "self_attn.sinks": "attn_sinks",
}
# Gemma 3 norms each block's input, its attention's output, the MLP's input and its output
GEMMA_LAYER_MODULES = LAYER_MODULES | {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
# A RoPE buffer that older transformers versions saved with the weights; it is recomputed from the config.
IGNORED_TENSOR = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")

# AutoAWQ packs output column 8c + AWQ_ORDER[i] into nibble i of word c: column j is in nibble REVERSE[j].
AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]


def load_safetensors(model_dir: Path) -> Checkpoint:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelNotFound(f"{model_dir} is not a directory (a safetensors checkpoint is a model folder)")
    if not (model_dir / "config.json").is_file():
        raise ModelFormatError(f"{model_dir} has no config.json: it is not a Hugging Face model directory")
    hf = read_json(model_dir / "config.json")
    config = model_config(hf, model_dir.name)
    scheme = quant_scheme(hf.get("quantization_config"))
    raw = read_tensors(model_dir)
    experts = expert_stacks(raw, config, scheme) if config.is_moe else {}
    tensors = convert_tensors(raw, config, scheme, set(experts))
    return Checkpoint(config, tensors | experts, hf, model_dir)


# --- safetensors files -----------------------------------------------------------------------------------


def is_file_name(name: str) -> bool:
    """A plain file name: no folder part, no '..', no absolute path, on any OS."""
    return name not in ("", ".", "..") and not any(c in name for c in "/\\\0:")


def read_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    index_path = model_dir / "model.safetensors.index.json"
    weight_map = read_weight_map(index_path) if index_path.is_file() else None
    if weight_map is not None:
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise no_weights(model_dir)
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        read_shard(model_dir / file, index_path.name, tensors)
    if weight_map is not None and (missing := sorted(set(weight_map) - set(tensors))):
        raise ModelFormatError(f"tensors in {index_path.name} are missing from their files: {missing[:5]}")
    return tensors


def read_weight_map(index_path: Path) -> dict[str, str]:
    """A sharded checkpoint's index: tensor name -> the file beside the index that holds it."""
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as err:
        raise ModelFormatError(f"{index_path} is not a valid safetensors index ({err})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise ModelFormatError(f"{index_path}: weight_map is not an object of tensor name -> file name")
    if outside := [f for f in sorted(set(weight_map.values())) if not is_file_name(f)]:
        raise ModelFormatError(
            f"{index_path} points outside the model folder ({outside[0]!r}): refusing "
            "to read it; the index is damaged or hostile"
        )
    return weight_map


def no_weights(model_dir: Path) -> ModelFormatError:
    if any(model_dir.glob("*.bin")) or any(model_dir.glob("*.pt")):
        return ModelFormatError(
            f"{model_dir} holds only PyTorch pickle weights (*.bin, *.pt), which can run code when "
            "loaded; llamaterm reads *.safetensors only. Download the safetensors version of the model."
        )
    return ModelFormatError(f"{model_dir} has no *.safetensors files")


def read_shard(path: Path, index_name: str, tensors: dict[str, torch.Tensor]) -> None:
    """Adds one file's tensors to `tensors`; a name already there is a damaged checkpoint."""
    try:
        listed = path.is_file()
    except OSError:  # a name the file system cannot hold (too long)
        listed = False
    if not listed:
        raise ModelFormatError(f"{str(path)[:200]} is listed in {index_name} but missing: download it again")
    try:
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                if key in tensors:
                    raise ModelFormatError(f"tensor {key!r} appears in more than one file ({path.name})")
                tensors[key] = f.get_tensor(key)
    except SafetensorError as err:
        raise ModelFormatError(f"{path} is corrupt or truncated ({err}): download it again") from None


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
    raw: dict[str, torch.Tensor],
    config: ModelConfig,
    scheme: QuantScheme | None,
    done: frozenset[str] | set[str] = frozenset(),
) -> dict[str, torch.Tensor | QuantWeight]:
    """Every tensor but those already converted (`done`: the experts, by their GGUF names)."""
    modules = group_modules(raw, config)
    shapes = {name: shape for name, shape in tensor_shapes(config).items() if name not in done}
    if config.tie_word_embeddings:
        modules.pop("output", None)  # transformers ignores a stored lm_head when the embedding is tied
        del shapes["output.weight"]
    wanted = {name.rpartition(".")[0] for name in shapes}
    if missing := [name for name in wanted if name not in modules]:
        raise ModelFormatError(f"the checkpoint lacks tensors for {missing[:5]} (from config.json)")
    tensors: dict[str, torch.Tensor | QuantWeight] = {}
    for module, (hf_module, parts) in modules.items():
        if module not in wanted:
            layers = config.n_layers
            raise ModelFormatError(f"unexpected tensors {hf_module}.* ({layers} layers in config.json)")
        tensors |= convert_module(module, hf_module, parts, shapes, config, scheme)
    return tensors


def group_modules(raw: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, tuple[str, dict[str, torch.Tensor]]]:
    """Tensors by module, GGUF name -> (Hugging Face name, parts): "model.layers.0.mlp.up_proj.qweight" is part
    "qweight" of "blk.0.ffn_up"."""
    modules: dict[str, tuple[str, dict[str, torch.Tensor]]] = {}
    for name, tensor in raw.items():
        if IGNORED_TENSOR.fullmatch(name):
            continue
        if name.endswith(".self_attn.sinks"):  # gpt-oss's sinks: a parameter, not a module's weight
            name += ".weight"
        hf_module, _, part = name.rpartition(".")
        module = gguf_module(hf_module, config.arch)
        if module is None:
            raise ModelFormatError(f"unexpected tensor {name!r}: not part of a {config.arch} model")
        modules.setdefault(module, (hf_module, {}))[1][part] = tensor
    if config.n_layers * 6 > len(modules):  # a block has at least 6 modules; checked before per-layer tables
        raise ModelFormatError(
            f"config.json: num_hidden_layers = {config.n_layers}, but the checkpoint holds only {len(raw)} tensors"
        )
    return modules


def convert_module(
    module: str,
    hf_module: str,
    parts: dict[str, torch.Tensor],
    shapes: dict[str, tuple[int, ...]],
    config: ModelConfig,
    scheme: QuantScheme | None,
) -> dict[str, torch.Tensor | QuantWeight]:
    """One module's weight, and its bias where the model has one, by their GGUF names."""
    shape, has_bias = shapes[f"{module}.weight"], f"{module}.bias" in shapes
    if "bias" in parts and not has_bias:
        raise ModelFormatError(
            f"{hf_module}.bias is not part of a {config.arch} model as config.json describes "
            "it (llamaterm runs the biases of q/k/v, Qwen2's or Llama's attention_bias, and gpt-oss's)"
        )
    if "bias" not in parts and has_bias:
        raise ModelFormatError(f"{hf_module}.bias is missing: the checkpoint is incomplete")
    out: dict[str, torch.Tensor | QuantWeight] = {}
    if has_bias:
        out[f"{module}.bias"] = dense(parts.pop("bias"), shapes[f"{module}.bias"], f"{hf_module}.bias")
    if parts.keys() & {"qweight", "weight_packed"} and len(shape) == 2 and module != "token_embd":
        if scheme is None:
            raise ModelFormatError(f"{hf_module} is quantized but config.json has no quantization_config")
        convert = {"gptq": gptq_weight, "awq": awq_weight, "compressed-tensors": packed_weight}[scheme.method]
        out[f"{module}.weight"] = convert(parts, shape, scheme, hf_module)
    elif set(parts) == {"weight"}:
        weight = dense(parts["weight"], shape, f"{hf_module}.weight")
        if config.arch == "gemma3" and module.endswith("norm"):  # Gemma3RMSNorm scales by 1 + weight, in fp32
            weight = weight.float() + 1
        out[f"{module}.weight"] = weight
    else:
        raise ModelFormatError(f"unexpected tensors for {hf_module}: {sorted(parts)}")
    return out


def dense(t: torch.Tensor, shape: tuple[int, ...], name: str) -> torch.Tensor:
    if t.dtype not in DENSE_DTYPES:
        raise ModelFormatError(f"{name} has dtype {t.dtype}; dense weights must be fp16, bf16 or fp32")
    check_shape(t, shape, name)
    return t


def check_shape(t: torch.Tensor, shape: tuple[int, ...], name: str) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ModelFormatError(f"{name} has shape {list(t.shape)}, expected {list(shape)} from config.json")


# --- mixtures of experts -----------------------------------------------------------------------------------

# An expert's matrix in a file of one module per expert: Qwen-MoE's mlp.experts.E.gate_proj, Mixtral's
# block_sparse_moe.experts.E.w1 (gate), w3 (up) and w2 (down)
EXPERT_MODULE = re.compile(
    r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.(\w+)"
)
EXPERT_KINDS = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1, "down_proj": 2, "w2": 2}  # EXPERT_TENSORS' order
# gpt-oss's experts, one tensor a layer: gate and up interleaved (gate rows even, up rows odd), dense [E, in, out]
# (x @ w) or MXFP4 blocks [E, out, in / 32, 16] with E8M0 scales [E, out, in / 32]; and their biases
FUSED_EXPERTS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?")


def expert_stacks(
    raw: dict[str, torch.Tensor], config: ModelConfig, scheme: QuantScheme | None
) -> dict[str, torch.Tensor | QuantWeight]:
    """The routed experts of every layer, each kind stacked in one tensor by its GGUF name (dense [E, out, in], or
    a QuantWeight [E * out, in]); their tensors are taken out of `raw`."""
    per_expert: dict[tuple[int, int], dict[int, dict[str, torch.Tensor]]] = {}
    fused: dict[int, dict[str, torch.Tensor]] = {}
    for name in list(raw):
        if m := EXPERT_MODULE.fullmatch(name):
            layer, expert, kind = int(m[1]), int(m[2]), EXPERT_KINDS[m[3]]
            per_expert.setdefault((layer, kind), {}).setdefault(expert, {})[m[4]] = raw.pop(name)
        elif m := FUSED_EXPERTS.fullmatch(name):
            fused.setdefault(int(m[1]), {})[m[2] + (m[3] or "")] = raw.pop(name)
    shapes = tensor_shapes(config)
    out: dict[str, torch.Tensor | QuantWeight] = {}
    for (layer, kind), experts in per_expert.items():
        name = f"blk.{layer}.{EXPERT_TENSORS[kind]}.weight"
        out[name] = stack_experts(experts, shapes.get(name), config, scheme, name)
    for layer, parts in fused.items():
        out |= gpt_oss_experts(layer, parts, shapes, scheme)
    return out


def stack_experts(
    experts: dict[int, dict[str, torch.Tensor]],
    shape: tuple[int, ...] | None,
    config: ModelConfig,
    scheme: QuantScheme | None,
    name: str,
) -> torch.Tensor | QuantWeight:
    """One layer's experts of one kind, from a module per expert, stacked."""
    if shape is None:
        raise ModelFormatError(f"unexpected expert tensors for {name} (more layers than config.json has)")
    n_experts, n, k = shape
    if sorted(experts) != list(range(n_experts)):
        raise ModelFormatError(
            f"{name}: the checkpoint holds experts {sorted(experts)[:8]}..., config.json says {n_experts} experts"
        )
    one: dict[str, tuple[int, ...]] = {"expert.weight": (n, k)}
    weights = [
        convert_module("expert", f"{name} (expert {e})", experts[e], one, config, scheme)["expert.weight"]
        for e in range(n_experts)
    ]
    if all(isinstance(w, torch.Tensor) for w in weights):
        return torch.stack(weights)  # type: ignore[arg-type]
    if not all(isinstance(w, QuantWeight) and w.perm is None for w in weights):
        raise ModelFormatError(
            f"{name}: experts quantized with act-order (GPTQ desc_act) or partly dense are not supported"
        )
    try:
        return QuantWeight.cat(weights)  # type: ignore[arg-type]
    except ValueError:
        raise ModelFormatError(f"{name}: its experts are quantized in different formats") from None


def gpt_oss_experts(
    layer: int, parts: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]], scheme: QuantScheme | None
) -> dict[str, torch.Tensor | QuantWeight]:
    """gpt-oss's experts of one layer (FUSED_EXPERTS), de-interleaved into gate and up as llama.cpp's converter
    does: dense weights transposed to [E, out, in], MXFP4 blocks repacked into QuantWeight (their nibble order,
    value 2j low and 2j + 1 high, is QuantWeight's)."""
    gate, up, down = (f"blk.{layer}.{t}" for t in EXPERT_TENSORS)
    if f"{gate}.weight" not in shapes:
        raise ModelFormatError(f"unexpected expert tensors of layer {layer} (more layers than config.json has)")
    where = f"model.layers.{layer}.mlp.experts"
    mxfp4 = scheme is not None and scheme.method == "mxfp4"
    wanted = {"gate_up_proj", "down_proj"}
    wanted = {f"{w}_{p}" for w in wanted for p in ("blocks", "scales")} if mxfp4 else wanted
    wanted |= {"gate_up_proj_bias", "down_proj_bias"}
    if set(parts) != wanted:
        raise ModelFormatError(f"{where} has tensors {sorted(parts)}; a gpt-oss layer has {sorted(wanted)}")
    out: dict[str, torch.Tensor | QuantWeight] = {}
    for name, t, rows in ((gate, parts["gate_up_proj_bias"], 0), (up, parts["gate_up_proj_bias"], 1)):
        out[f"{name}.bias"] = dense(t[:, rows::2], shapes[f"{name}.bias"], f"{where}.gate_up_proj_bias")
    out[f"{down}.bias"] = dense(parts["down_proj_bias"], shapes[f"{down}.bias"], f"{where}.down_proj_bias")
    if not mxfp4:
        gate_up = parts["gate_up_proj"].transpose(1, 2)
        out[f"{gate}.weight"] = dense(gate_up[:, 0::2], shapes[f"{gate}.weight"], f"{where}.gate_up_proj")
        out[f"{up}.weight"] = dense(gate_up[:, 1::2], shapes[f"{up}.weight"], f"{where}.gate_up_proj")
        out[f"{down}.weight"] = dense(
            parts["down_proj"].transpose(1, 2), shapes[f"{down}.weight"], f"{where}.down_proj"
        )
        return out
    blocks, scales = parts["gate_up_proj_blocks"], parts["gate_up_proj_scales"]
    for name, rows in ((gate, 0), (up, 1)):
        out[f"{name}.weight"] = mxfp4_weight(blocks[:, rows::2], scales[:, rows::2], shapes[f"{name}.weight"], where)
    out[f"{down}.weight"] = mxfp4_weight(
        parts["down_proj_blocks"], parts["down_proj_scales"], shapes[f"{down}.weight"], where
    )
    return out


def mxfp4_weight(blocks: torch.Tensor, scales: torch.Tensor, shape: tuple[int, ...], where: str) -> QuantWeight:
    """MXFP4 blocks uint8 [E, N, K / 32, 16] and E8M0 exponents uint8 [E, N, K / 32] -> QuantWeight [E * N, K]:
    w = E2M1[code] * 2**(e - 127)."""
    e, n, k = shape
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ModelFormatError(f"{where}: MXFP4 blocks and scales must be uint8, not {blocks.dtype} and {scales.dtype}")
    check_shape(blocks, (e, n, k // 32, 16), f"{where} blocks")
    check_shape(scales, (e, n, k // 32), f"{where} scales")
    if (scales == 255).any():
        raise ModelFormatError(f"{where}: an MXFP4 scale byte is 255 (NaN): the file is damaged; download it again")
    powers = torch.ldexp(torch.ones(()), scales.reshape(e * n, -1).int() - 127).to(torch.bfloat16)  # exact
    return QuantWeight(blocks.reshape(e * n, k // 2).contiguous(), powers, None, 4, 32, (e * n, k), codebook="e2m1")


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
