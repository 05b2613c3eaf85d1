"""The GGUF loader against independent oracles: gguf-py's reader and dequantizers, transformers' GGUF
config and q/k reverse permutation."""

import re
import struct
from collections import Counter
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType
from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor, load_gguf_checkpoint

from llamaterm.engine.checkpoints.architectures import GGUF_ARCHITECTURES
from llamaterm.engine.checkpoints.gguf import RawTensor, convert_tensor, load_gguf, read_gguf_file, read_gguf_info
from llamaterm.engine.errors import ModelFormatError
from llamaterm.engine.store.model_store import resolve_model
from llamaterm.kernels.qweight import QuantWeight
from tests.support.tiny_models import FP16_FIELDS, random_blocks, write_tiny_llama

EXACT = {
    "Q4_0": (4, 32, False),
    "Q4_1": (4, 32, True),
    "Q5_0": (8, 32, False),
    "Q5_1": (8, 32, True),
    "Q8_0": (8, 32, False),
}  # qtype -> QuantWeight bits, group size, has offsets (block layouts in ggml-common.h)
K_QUANTS = {"Q4_K": (4, 32, True), "Q5_K": (8, 32, True), "Q6_K": (8, 16, False)}
K_QUANT_BYTES = {"Q4_K": slice(16, 144), "Q5_K": slice(16, 176)}  # qh and qs: zeroed, w = the group offset


# ---------------------------------------------------------------------------------------------------------------
# Block conversions against gguf.quants.dequantize


def as_float(w) -> torch.Tensor:
    return w.dequantize() if isinstance(w, QuantWeight) else w.float()


def convert(qtype: str, data: np.ndarray, rows: int, cols: int):
    return convert_tensor(RawTensor("w", GGMLQuantizationType[qtype], (rows, cols), data))


def reference(qtype: str, data: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(data, GGMLQuantizationType[qtype]).copy())


@pytest.mark.parametrize("scale", [1.0, 1e-6])  # 1e-6: fp16 subnormal scales
@pytest.mark.parametrize("qtype", EXACT)
def test_legacy_quants_are_bit_exact(qtype, scale):
    rows, cols = 16, 512
    data = random_blocks(qtype, rows, cols, np.random.default_rng(1), scale)
    w = convert(qtype, data, rows, cols)
    assert isinstance(w, QuantWeight) and w.shape == (rows, cols)
    assert (w.bits, w.group_size, w.offsets is not None) == EXACT[qtype]
    assert torch.equal(w.dequantize(), reference(qtype, data))


@pytest.mark.parametrize("qtype", K_QUANTS)
def test_k_quants_are_exact_when_scale_products_fit_fp16(qtype):
    # d and dmin powers of two: d*sc and dmin*m are exact in fp16, so nothing may differ at all
    rows, cols = 8, 1024
    rng = np.random.default_rng(2)
    data = random_blocks(qtype, rows, cols, rng).reshape(rows, cols // 256, -1)
    for at in FP16_FIELDS[qtype]:
        d = 2.0 ** rng.integers(-8, 1, data.shape[:2]) * rng.choice([-1.0, 1.0], data.shape[:2])
        data[..., at : at + 2] = d.astype(np.float16)[..., None].view(np.uint8)
    data = data.reshape(rows, -1)
    w = convert(qtype, data, rows, cols)
    assert (w.bits, w.group_size, w.offsets is not None) == K_QUANTS[qtype]
    assert torch.equal(w.dequantize(), reference(qtype, data))


@pytest.mark.parametrize("scale", [1.0, 1e-3, 1e-6])
@pytest.mark.parametrize("qtype", K_QUANTS)
def test_k_quants_within_fp16_rounding_of_scale_products(qtype, scale):
    rows, cols = 8, 1024
    data = random_blocks(qtype, rows, cols, np.random.default_rng(3), scale)
    expected = reference(qtype, data)
    # the oracle's group offsets -dmin*m: the same blocks with every q zero (zero for symmetric Q6_K)
    offsets = torch.zeros_like(expected)
    if qtype in K_QUANT_BYTES:
        zeroed = data.reshape(rows, cols // 256, -1).copy()
        zeroed[..., K_QUANT_BYTES[qtype]] = 0
        offsets = reference(qtype, zeroed.reshape(rows, -1))
    # fp16 rounding of scale and offset (2^-11 relative, 2^-25 absolute when subnormal), plus fp32 rounding
    tol = 2**-11 * ((expected - offsets).abs() + offsets.abs()) + 2**-25 * 64 + 2**-23 * expected.abs()
    assert ((convert(qtype, data, rows, cols).dequantize() - expected).abs() <= tol).all()


@pytest.mark.parametrize("qtype, dtype", [("F32", torch.float32), ("F16", torch.float16), ("BF16", torch.bfloat16)])
def test_float_tensors_stay_in_their_dtype(qtype, dtype):
    values = torch.randn(8, 64, generator=torch.Generator().manual_seed(4)).to(dtype)
    data = values.view(torch.uint8).numpy()
    w = convert(qtype, data, 8, 64)
    assert w.dtype == dtype
    assert torch.equal(w.float(), reference(qtype, data.view(np.float16) if qtype == "F16" else data))


# ---------------------------------------------------------------------------------------------------------------
# The default model against gguf.GGUFReader and transformers (slow where a test loads its weights)


@pytest.fixture(scope="module")
def default_path() -> Path:
    return resolve_model(None)


@pytest.fixture(scope="module")
def reader(default_path):
    return gguf.GGUFReader(default_path)


@pytest.fixture(scope="module")
def checkpoint(default_path):
    return load_gguf(default_path)


@pytest.fixture(scope="module")
def hf_config(default_path) -> dict:
    return load_gguf_checkpoint(str(default_path), return_tensors=False)["config"]


@pytest.mark.slow
def test_metadata_matches_gguf_reader(checkpoint, reader):
    expected = {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    # numeric arrays stay numpy views of the file
    as_lists = {key: v.tolist() if isinstance(v, np.ndarray) else v for key, v in checkpoint.metadata.items()}
    assert as_lists == expected
    assert isinstance(checkpoint.metadata["tokenizer.ggml.token_type"], np.ndarray)
    assert len(checkpoint.metadata["tokenizer.ggml.tokens"]) == 49152


@pytest.mark.slow
def test_tensor_table_matches_gguf_reader(default_path, reader):
    ours = read_gguf_file(default_path).tensors
    assert list(ours) == [t.name for t in reader.tensors]
    for t in reader.tensors:
        assert ours[t.name].type == t.tensor_type
        assert ours[t.name].shape == tuple(reversed(t.shape.tolist()))
        assert np.array_equal(ours[t.name].data, t.data.view(np.uint8).reshape(-1))


def test_info_counts_tensor_types(default_path, reader):
    info = read_gguf_info(default_path)
    assert info["architecture"] == "llama"
    assert info["tensor_types"] == dict(Counter(t.tensor_type.name for t in reader.tensors))
    assert info["n_tensors"] == len(reader.tensors) == 272
    assert info["n_params"] == sum(int(t.n_elements) for t in reader.tensors)


@pytest.mark.slow
def test_default_model_config_matches_transformers(checkpoint, hf_config):
    c = checkpoint.config
    assert (
        c.n_layers,
        c.hidden_size,
        c.intermediate_size,
        c.n_heads,
        c.n_kv_heads,
        c.head_dim,
        c.vocab_size,
        c.context_length,
        c.rope_theta,
        c.rms_norm_eps,
        c.tie_word_embeddings,
    ) == (
        hf_config["num_hidden_layers"],
        hf_config["hidden_size"],
        hf_config["intermediate_size"],
        hf_config["num_attention_heads"],
        hf_config["num_key_value_heads"],
        hf_config["head_dim"],
        hf_config["vocab_size"],
        hf_config["max_position_embeddings"],
        hf_config["rope_theta"],
        hf_config["rms_norm_eps"],
        hf_config["tie_word_embeddings"],
    )
    assert (c.n_layers, c.hidden_size, c.n_heads, c.n_kv_heads, c.head_dim, c.vocab_size, c.rope_theta) == (
        30,
        576,
        9,
        3,
        64,
        49152,
        100000.0,
    )
    assert c.tie_word_embeddings and "output.weight" not in checkpoint.tensors
    assert c.rope_freq_factors is None


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    ["blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight", "blk.29.attn_k.weight", "token_embd.weight"],
)
def test_weights_match_transformers_gguf_conversion(checkpoint, reader, hf_config, name):
    # transformers un-permutes q/k rows (ReversePermute) after gguf's dequantizer; v and the rest stay as stored
    (t,) = [t for t in reader.tensors if t.name == name]
    processor = LlamaTensorProcessor(config=hf_config)
    expected = processor.process(gguf.quants.dequantize(t.data, t.tensor_type), name).weights
    assert torch.equal(checkpoint.tensors[name].dequantize(), torch.from_numpy(np.array(expected)))


# ---------------------------------------------------------------------------------------------------------------
# Tiny models written by tests/support/tiny_models.py round-trip


def expected_tensors(path: Path, n_heads: int, n_kv_heads: int) -> dict[str, torch.Tensor]:
    """The oracle: gguf's reader and dequantizer, with transformers' q/k reverse permutation."""
    processor = LlamaTensorProcessor(config={"num_attention_heads": n_heads, "num_key_value_heads": n_kv_heads})
    return {
        t.name: torch.from_numpy(
            np.array(processor.process(gguf.quants.dequantize(t.data, t.tensor_type), t.name).weights)
        )
        for t in gguf.GGUFReader(path).tensors
    }


@pytest.mark.parametrize("qtype", [*EXACT, "F32", "F16", "BF16"])
def test_tiny_model_round_trips(tmp_path, qtype):
    rope_freqs = np.linspace(1.0, 8.0, 8, dtype=np.float32)
    path = write_tiny_llama(
        tmp_path / "tiny.gguf",
        qtype=qtype,
        vocab_from=None,
        vocab_size=320,
        tie_embeddings=False,
        attention_bias=True,
        rope_freqs=rope_freqs,
        rope_theta=500000.0,
        context_length=512,
    )
    ckpt = load_gguf(path)
    c = ckpt.config
    assert (
        c.arch,
        c.n_layers,
        c.hidden_size,
        c.intermediate_size,
        c.n_heads,
        c.n_kv_heads,
        c.head_dim,
        c.vocab_size,
        c.context_length,
        c.rope_theta,
        c.tie_word_embeddings,
    ) == ("llama", 2, 64, 128, 4, 2, 16, 320, 512, 500000.0, False)
    assert c.rope_freq_factors == tuple(rope_freqs.tolist())
    expected = expected_tensors(path, 4, 2)
    assert set(ckpt.tensors) == set(expected) - {"rope_freqs.weight"}
    assert "blk.1.attn_k.bias" in ckpt.tensors  # un-permuted like the weight rows
    for name, w in ckpt.tensors.items():
        assert torch.equal(as_float(w), expected[name].float()), name


def test_tiny_k_quant_model_round_trips(tmp_path):
    path = write_tiny_llama(tmp_path / "tiny.gguf", qtype="Q4_K", hidden=256, intermediate=512, vocab_from=None)
    ckpt = load_gguf(path)
    for name, w in expected_tensors(path, 4, 2).items():
        ours = as_float(ckpt.tensors[name])
        assert torch.allclose(ours, w, rtol=0, atol=2**-9 * w.abs().max().item()), name


def test_tiny_model_with_small_rows_falls_back_like_llama_cpp(tmp_path):
    # 64-value rows cannot hold a 256-value K-quant block: llama.cpp stores Q6_K tensors as Q8_0 then
    info = read_gguf_info(write_tiny_llama(tmp_path / "tiny.gguf", qtype="Q6_K", vocab_from=None))
    assert set(info["tensor_types"]) == {"Q8_0", "F32"}


def test_tiny_model_carries_the_default_tokenizer(tmp_path, reader):
    ckpt = load_gguf(write_tiny_llama(tmp_path / "tiny.gguf"))
    assert ckpt.config.vocab_size == 49152 and ckpt.config.tie_word_embeddings
    for key in (
        "tokenizer.ggml.model",
        "tokenizer.ggml.pre",
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.merges",
        "tokenizer.ggml.token_type",
        "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id",
        "tokenizer.chat_template",
    ):
        value = ckpt.metadata[key]
        assert (value.tolist() if isinstance(value, np.ndarray) else value) == reader.fields[key].contents(), key


def test_linear_rope_scaling_divides_every_frequency(tmp_path):
    path = write_tiny_llama(tmp_path / "tiny.gguf", vocab_from=None, rope_scaling=("linear", 4.0))
    assert load_gguf(path).config.rope_freq_factors == (4.0,) * 8


SWA_KEYS = {"window": "llama.attention.sliding_window", "pattern": "llama.attention.sliding_window_pattern"}
U32, ARRAY = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.ARRAY  # as llama.cpp's GGUFWriter types them


def window_gguf(tmp_path, **typed) -> Path:
    """A tiny model with the sliding-window keys given as (value, GGUF type)."""
    return write_tiny_llama(tmp_path / "swa.gguf", vocab_from=None, metadata={SWA_KEYS[k]: v for k, v in typed.items()})


def test_sliding_window_keys(tmp_path):
    c = load_gguf(window_gguf(tmp_path, window=(8, U32))).config
    assert (c.sliding_window, c.kv_window(), [c.layer_window(i) for i in range(2)]) == (8, 8, [8, 8])
    c = load_gguf(window_gguf(tmp_path, window=(8, U32), pattern=([False, True], ARRAY))).config
    assert ([c.layer_window(i) for i in range(2)], c.kv_window()) == ([None, 8], None)
    assert load_gguf(window_gguf(tmp_path, window=(0, U32))).config.sliding_window is None  # llama.cpp: 0 is none
    assert load_gguf(window_gguf(tmp_path)).config.sliding_window is None


@pytest.mark.parametrize(
    "typed, problem",
    [
        ({"window": ("8", gguf.GGUFValueType.STRING)}, "sliding_window = '8' is not an integer"),
        ({"window": (-8, gguf.GGUFValueType.INT32)}, "sliding_window = -8 is negative"),
        ({"window": (8, U32), "pattern": ([True] * 3, ARRAY)}, "sliding_window_pattern has 3 entries for 2 layers"),
        ({"window": (8, U32), "pattern": ([1, 0], ARRAY)}, "sliding_window_pattern = .* is not an array of true/false"),
    ],
)
def test_bad_sliding_window_keys(tmp_path, typed, problem):
    assert re.search(problem, load_error(window_gguf(tmp_path, **typed)))


def test_split_model_loads_all_parts(tmp_path):
    whole = load_gguf(write_tiny_llama(tmp_path / "whole.gguf", vocab_from=None))
    first = write_tiny_llama(tmp_path / "split.gguf", vocab_from=None, split_max_tensors=8)
    assert first.name == "split-00001-of-00003.gguf"
    split = load_gguf(first)
    assert split.config == whole.config
    assert set(split.tensors) == set(whole.tensors)
    for name, w in whole.tensors.items():
        assert torch.equal(as_float(split.tensors[name]), as_float(w)), name


def test_split_model_names_a_missing_part(tmp_path):
    first = write_tiny_llama(tmp_path / "split.gguf", vocab_from=None, split_max_tensors=8)
    (tmp_path / "split-00003-of-00003.gguf").unlink()
    with pytest.raises(ModelFormatError, match="missing: split-00003-of-00003.gguf"):
        load_gguf(first)
    with pytest.raises(ModelFormatError, match="Load the first part"):
        load_gguf(tmp_path / "split-00002-of-00003.gguf")


# ---------------------------------------------------------------------------------------------------------------
# Bad input: every problem is a ModelFormatError naming the file and the problem


@pytest.fixture(scope="module")
def tiny_bytes(tmp_path_factory) -> bytes:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny.gguf", vocab_from=None).read_bytes()


def corrupt(path: Path, data: bytes, after: bytes | None = None, skip: int = 0, fmt: str = "", value=0) -> Path:
    """Write `data` to path with `value` packed at `skip` bytes after the first occurrence of `after`."""
    data = bytearray(data)
    if after is not None:
        struct.pack_into(fmt, data, data.index(after) + len(after) + skip, value)
    path.write_bytes(data)
    return path


def write_metadata_only(path: Path, arch: str, add_keys) -> Path:
    writer = gguf.GGUFWriter(path, arch)
    add_keys(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def load_error(path: Path) -> str:
    with pytest.raises(ModelFormatError) as err:
        load_gguf(path)
    assert str(path) in str(err.value)
    return str(err.value)


def test_missing_file(tmp_path):
    assert "no such file" in load_error(tmp_path / "absent.gguf")


def test_not_a_gguf_file(tmp_path):
    (tmp_path / "model.gguf").write_bytes(b"PK\x03\x04" + bytes(100))
    assert "not a GGUF file" in load_error(tmp_path / "model.gguf")
    (tmp_path / "empty.gguf").write_bytes(b"")
    assert "empty" in load_error(tmp_path / "empty.gguf")


@pytest.mark.parametrize(
    "keep, problem", [(3, "not a GGUF file"), (100, "the file is truncated"), (-1000, "beyond the end of the file")]
)  # magic, metadata, data
def test_truncated_file(tmp_path, tiny_bytes, keep, problem):
    message = load_error(corrupt(tmp_path / "t.gguf", tiny_bytes[:keep]))
    assert problem in message and "re-download" in message.lower()


def test_absurd_counts(tmp_path, tiny_bytes):
    assert "claims" in load_error(corrupt(tmp_path / "a.gguf", tiny_bytes, b"GGUF", 4, "<Q", 2**62))
    assert "claims" in load_error(corrupt(tmp_path / "b.gguf", tiny_bytes, b"GGUF", 12, "<Q", 2**40))
    data = write_metadata_only(tmp_path / "c.gguf", "llama", lambda w: w.add_array("general.tags", ["a", "b"]))
    data = data.read_bytes()  # the tag count follows the value type and the element type
    assert "claims" in load_error(corrupt(tmp_path / "c.gguf", data, b"general.tags", 8, "<Q", 2**61))
    message = load_error(corrupt(tmp_path / "d.gguf", tiny_bytes, b"llama.block_count", 4, "<I", 10**9))
    assert "block_count" in message


def test_absurd_shapes(tmp_path, tiny_bytes):
    name = b"blk.0.attn_q.weight"  # tensor info: name, n_dims u32, dims u64 x n_dims, type u32, offset u64
    message = load_error(corrupt(tmp_path / "a.gguf", tiny_bytes, name, 4, "<Q", 65))
    assert "whole number of Q4_1 blocks" in message
    message = load_error(corrupt(tmp_path / "b.gguf", tiny_bytes, name, 4 + 16 + 4, "<Q", 2**40))
    assert "beyond the end of the file" in message
    message = load_error(corrupt(tmp_path / "c.gguf", tiny_bytes, b"llama.embedding_length", 4, "<I", 128))
    assert "shape" in message and "token_embd.weight" in message


@pytest.mark.parametrize(
    "arch, named",
    [
        ("mamba", "the architecture 'mamba'"),
        ("deepseek2", "DeepSeek V2/V3 (multi-head latent attention), 'deepseek2',"),
    ],
)
def test_unknown_architecture(tmp_path, arch, named):
    message = load_error(write_metadata_only(tmp_path / "m.gguf", arch, lambda w: w.add_block_count(2)))
    assert f"{named} is not supported" in message
    assert all(f"({family})" in message for family in GGUF_ARCHITECTURES)  # and what is


@pytest.mark.parametrize("qtype", ["IQ4_NL", "Q2_K"])
def test_unsupported_tensor_type(tmp_path, qtype):
    path = write_tiny_llama(tmp_path / "t.gguf", qtype=qtype, hidden=256, intermediate=256, vocab_from=None)
    message = load_error(path)
    assert f"'token_embd.weight' has type {qtype}" in message
    assert "supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K" in message
