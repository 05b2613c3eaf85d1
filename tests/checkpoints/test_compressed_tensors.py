"""compressed-tensors pack-quantized checkpoints, packed by the compressed-tensors library itself: the loaded weights
equal its own dequantization, and a tiny Llama gives transformers' logits and tokens on the dequantized model."""

import json

import pytest
import torch
import transformers
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    apply_quantization_config,
)
from compressed_tensors.quantization.utils import calculate_qparams
from compressed_tensors.quantization.utils.helpers import is_module_quantized
from safetensors.torch import load_file

from llamaterm.engine.api import EngineConfig
from llamaterm.engine.checkpoints.checkpoint_info import read_safetensors
from llamaterm.engine.checkpoints.hf_config import COMPRESSED_TENSORS_SUPPORTED
from llamaterm.engine.checkpoints.safetensors_loader import load_safetensors
from llamaterm.engine.errors import ModelFormatError
from llamaterm.engine.serving.engine import Engine
from llamaterm.kernels.qweight import QuantWeight
from tests.support.engine_checks import greedy, our_last_logits
from tests.support.family_oracle import byte_level_bpe, hf_greedy, hf_logits
from tests.support.safetensors_files import gguf_name, write_dense

CONFIG = transformers.LlamaConfig(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
PROMPT = [5, 17, 200, 33, 99, 1, 250, 7, 64, 128, 300, 12, 45, 2, 9]


def pack(folder, dtype: torch.dtype, **weights) -> QuantizationScheme:
    """A random tiny Llama in `dtype` quantized as `weights` (compressed-tensors QuantizationArgs) with min-max
    scales from the library's calculate_qparams, compressed to pack-quantized and saved by the library."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(CONFIG).to(dtype).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * (0.2 if p.dim() == 1 else 0.05) + (1.0 if p.dim() == 1 else 0.0))
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(type="int", **weights))
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    for module in model.modules():
        if is_module_quantized(module):
            w = module.weight.data
            w = w.unflatten(-1, (-1, scheme.weights.group_size)) if scheme.weights.group_size else w[:, None]
            scale, zero = calculate_qparams(w.amin(-1), w.amax(-1), scheme.weights)
            module.weight_scale.data.copy_(scale.view_as(module.weight_scale))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.data.copy_(zero.view_as(module.weight_zero_point))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(folder)
    compressor.update_config(folder)
    return scheme


def library_dequantized(folder, scheme: QuantizationScheme) -> dict[str, torch.Tensor]:
    """The checkpoint's state dict with every packed linear dequantized by the library's own decompress, in fp32
    (its dequantize computes in the scale's dtype: fp32 scales make it the exact scale * (q - zero))."""
    raw = load_file(folder / "model.safetensors")
    dense = {k: v.float() for k, v in raw.items() if k.rpartition(".")[2] == "weight"}
    for module in {k.rpartition(".")[0] for k in raw if k.endswith(".weight_packed")}:
        parts = {k.rpartition(".")[2]: v for k, v in raw.items() if k.rpartition(".")[0] == module}
        parts["weight_scale"] = parts["weight_scale"].float()
        dense[f"{module}.weight"] = PackedQuantizationCompressor.decompress(parts, scheme)["weight"]
    return dense


SCHEMES = [  # compressed-tensors QuantizationArgs, and the dtype of the model (its scales' dtype)
    (dict(num_bits=4, strategy="group", group_size=32, symmetric=True), torch.bfloat16),  # W4A16
    (dict(num_bits=4, strategy="group", group_size=16, symmetric=False), torch.float16),  # W4A16_ASYM
    (dict(num_bits=4, strategy="channel", symmetric=False), torch.bfloat16),
    (dict(num_bits=8, strategy="channel", symmetric=True), torch.float16),  # W8A16
    (dict(num_bits=8, strategy="group", group_size=32, symmetric=False), torch.float32),
]


@pytest.mark.parametrize("weights, dtype", SCHEMES)
def test_loaded_weights_equal_the_library_dequantization(tmp_path, weights, dtype):
    scheme = pack(tmp_path, dtype, **weights)
    want = library_dequantized(tmp_path, scheme)
    ckpt = load_safetensors(tmp_path)
    assert set(ckpt.tensors) == {gguf_name(k) for k in want}
    for name, w in want.items():
        got = ckpt.tensors[gguf_name(name)]
        if name.endswith("_proj.weight"):
            assert isinstance(got, QuantWeight) and got.bits == weights["num_bits"], name
            assert (got.offsets is None) == weights["symmetric"], name
            got = got.dequantize()
        if dtype == torch.float32 and not weights["symmetric"]:  # fp32 scale * zero is one more rounding
            torch.testing.assert_close(got.float(), w, rtol=0, atol=2e-7 * w.abs().max().item())
        else:
            assert torch.equal(got.float(), w), name


@pytest.mark.parametrize("weights, dtype", [SCHEMES[1], SCHEMES[3]])
def test_tiny_llama_gives_transformers_tokens_on_the_dequantized_model(tmp_path, weights, dtype):
    scheme = pack(tmp_path, dtype, **weights)
    byte_level_bpe(tmp_path, CONFIG.vocab_size, ["<|im_start|>", "<|im_end|>"])
    model = transformers.LlamaForCausalLM(CONFIG).eval()
    model.load_state_dict(library_dequantized(tmp_path, scheme))
    engine = Engine.from_model(EngineConfig(model=str(tmp_path), device="cpu", kv_tokens=512))
    try:
        want = hf_logits(model, PROMPT)[-1]
        assert (our_last_logits(engine, PROMPT) - want).abs().max() <= 1e-4 * (want.max() - want.min())
        assert greedy(engine, PROMPT, 24) == hf_greedy(model, PROMPT, 24)
    finally:
        engine.shutdown()


def test_info_counts_the_packed_weights(tmp_path):
    pack(tmp_path, torch.bfloat16, num_bits=4, strategy="group", group_size=32, symmetric=False)
    info = read_safetensors(tmp_path)
    assert info.quant == "COMPRESSED-TENSORS-4bit"
    assert info.parameters == transformers.LlamaForCausalLM(CONFIG).num_parameters()


# --- refused by name ---------------------------------------------------------------------------------------


def ct_config(weights=None, **extra) -> dict:
    weights = weights or {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}
    group = {"targets": ["Linear"], "weights": weights, "input_activations": None, "output_activations": None}
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"group_0": group},
        "ignore": ["lm_head"],
        **extra,
    }


W8A8 = {
    "targets": ["Linear"],
    "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
    "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True},
}


@pytest.mark.parametrize(
    "qc, words",
    [
        (ct_config(format="float-quantized"), "format 'float-quantized'"),
        (ct_config(format="naive-quantized"), "format 'naive-quantized'"),
        (
            ct_config(
                {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}, format="pack-quantized"
            ),
            "float weights (e.g. FP8)",
        ),
        (ct_config(config_groups={"group_0": W8A8}), "activation quantization"),
        (
            ct_config(sparsity_config={"format": "sparse-24-bitmask", "sparsity_structure": "2:4"}),
            "sparsity (e.g. 2:4)",
        ),
        (ct_config(transform_config={"config_groups": {"r1": {}}}), "a weight transform"),
        (
            ct_config({"num_bits": 2, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}),
            "2-bit weights",
        ),
        (ct_config({"num_bits": 4, "type": "int", "symmetric": True, "strategy": "tensor"}), "the 'tensor' strategy"),
        (
            ct_config(
                {
                    "num_bits": 4,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "group",
                    "group_size": 32,
                    "actorder": "group",
                }
            ),
            "actorder: group",
        ),
        (ct_config(config_groups={}), "a config without config_groups"),
    ],
)
def test_unsupported_compressed_tensors_configs_are_refused_by_name(tmp_path, qc, words):
    write_dense(tmp_path, quantization_config=qc)
    with pytest.raises(ModelFormatError) as err:
        load_safetensors(tmp_path)
    message = str(err.value)
    assert words in message and COMPRESSED_TENSORS_SUPPORTED in message


def test_a_packed_weight_that_contradicts_its_config_is_refused(tmp_path):
    pack(tmp_path, torch.float16, num_bits=4, strategy="group", group_size=32, symmetric=True)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 16
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFormatError, match=r"weight_scale has shape \[\d+, \d+\], expected"):
        load_safetensors(tmp_path)
