"""Small random Llama models written as real GGUF files (with gguf.GGUFWriter), for engine tests.

Matrices are quantized with gguf.quants.quantize where gguf can; for the types gguf-py only dequantizes
(the K-quants) they are random valid blocks. q/k rows get the permutation convert_hf_to_gguf.py applies, so
a loader has to undo it. The tokenizer metadata is copied from the default model: a real 49152-token
tokenizer with its chat template, while hidden = 64 keeps the file small.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from gguf import GGUFWriter
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, RopeScalingType
from gguf.gguf_writer import GGUFValue
from gguf.quants import quantize

from llamaterm.engine.checkpoints.gguf import read_gguf_info
from llamaterm.engine.store.model_store import resolve_model

# The fp16 scale fields of each block layout (byte offsets, ggml-common.h); random bytes elsewhere are valid.
FP16_FIELDS = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "IQ4_NL": (0,),
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
    "IQ4_XS": (0,),
}
# What llama.cpp's quantizer substitutes when rows are not whole 256-value blocks (ggml-quants.c).
K_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
# Writer methods for the tokenizer keys a GGUF carries, so each value keeps its GGUF type.
_TOKENIZER_KEYS = {
    "tokenizer.ggml.model": GGUFWriter.add_tokenizer_model,
    "tokenizer.ggml.pre": GGUFWriter.add_tokenizer_pre,
    "tokenizer.ggml.tokens": GGUFWriter.add_token_list,
    "tokenizer.ggml.token_type": GGUFWriter.add_token_types,
    "tokenizer.ggml.scores": GGUFWriter.add_token_scores,
    "tokenizer.ggml.merges": GGUFWriter.add_token_merges,
    "tokenizer.ggml.bos_token_id": GGUFWriter.add_bos_token_id,
    "tokenizer.ggml.eos_token_id": GGUFWriter.add_eos_token_id,
    "tokenizer.ggml.unknown_token_id": GGUFWriter.add_unk_token_id,
    "tokenizer.ggml.padding_token_id": GGUFWriter.add_pad_token_id,
    "tokenizer.ggml.add_bos_token": GGUFWriter.add_add_bos_token,
    "tokenizer.ggml.add_eos_token": GGUFWriter.add_add_eos_token,
    "tokenizer.ggml.add_space_prefix": GGUFWriter.add_add_space_prefix,
    "tokenizer.chat_template": GGUFWriter.add_chat_template,
}


def random_blocks(qtype: str, rows: int, cols: int, rng: np.random.Generator, scale: float = 1.0) -> np.ndarray:
    """Random quantized rows uint8 [rows, bytes per row]: random bytes with finite fp16 scales of magnitude
    `scale` (times 0.5..1, random sign). Every bit pattern of the other fields is a valid block."""
    block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    blocks = rng.integers(0, 256, size=(rows, cols // block_size, type_size), dtype=np.uint8)
    for at in FP16_FIELDS[qtype]:
        d = scale * rng.uniform(0.5, 1.0, blocks.shape[:2]) * rng.choice([-1.0, 1.0], blocks.shape[:2])
        blocks[..., at : at + 2] = d.astype(np.float16)[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)


def converter_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute: interleave the two halves of every head's rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@functools.cache
def _tokenizer_metadata(path: Path) -> dict[str, object]:
    metadata = read_gguf_info(path)["metadata"]
    return {
        key: value.tolist() if isinstance(value, np.ndarray) else value  # GGUFWriter takes lists
        for key, value in metadata.items()
        if key in _TOKENIZER_KEYS
    }


def _add_matrix(writer: GGUFWriter, name: str, w: np.ndarray, qtype: str, rng: np.random.Generator) -> None:
    ggml_type = GGMLQuantizationType[qtype]
    block_size = GGML_QUANT_SIZES[ggml_type][0]
    if w.shape[1] % block_size:
        if qtype not in K_FALLBACK:
            raise ValueError(f"{name}: rows of {w.shape[1]} values do not fit {qtype} blocks of {block_size}")
        ggml_type = GGMLQuantizationType[K_FALLBACK[qtype]]
    try:
        data = quantize(w, ggml_type)
    except NotImplementedError:  # gguf-py only dequantizes this type: random blocks of about w's magnitude
        data = random_blocks(ggml_type.name, *w.shape, rng, scale=1e-4)
    writer.add_tensor(name, data, raw_dtype=ggml_type)


def write_tiny_llama(
    path: str | Path,
    *,
    n_layers: int = 2,
    hidden: int = 64,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    intermediate: int = 128,
    qtype: str = "Q4_1",
    vocab_from: str | Path | None = "default",
    vocab_size: int = 256,
    seed: int = 0,
    tie_embeddings: bool = True,
    attention_bias: bool = False,
    rope_freqs: Sequence[float] | None = None,
    rope_theta: float = 10000.0,
    rope_scaling: tuple[str, float] | None = None,
    context_length: int = 256,
    split_max_tensors: int = 0,
    metadata: dict[str, tuple[object, GGUFValueType] | None] | None = None,
) -> Path:
    """Write a random Llama GGUF with every matrix in `qtype` (F32, F16, BF16 or a quantized type) and F32
    norms, and return its path.

    vocab_from: the GGUF whose tokenizer to copy (a path, or "default" for the default model); with None the
        file has no tokenizer and `vocab_size` tokens.
    attention_bias: write F32 q/k/v biases (as Hugging Face Llama's attention_bias, less its o_proj bias).
    rope_freqs: head_dim / 2 values, written as Llama-3's rope_freqs.weight.
    rope_scaling: (type, factor), e.g. ("linear", 4.0), written as the rope.scaling keys.
    split_max_tensors: split the model into parts of at most that many tensors (`name-00001-of-0000N.gguf`);
        the first part's path is returned.
    metadata: key -> (value, GGUF type) to write instead of what the model would have (any type: for tests of
        hostile files), or None to leave the key out.
    """
    path = Path(path)
    rng = np.random.default_rng(seed)
    head_dim = hidden // n_heads
    tokenizer = _tokenizer_metadata(resolve_model(str(vocab_from))) if vocab_from is not None else {}
    n_vocab = len(tokenizer["tokenizer.ggml.tokens"]) if tokenizer else vocab_size

    writer = GGUFWriter(path, "llama", split_max_tensors=split_max_tensors)
    writer.add_name("tiny-llama")
    writer.add_block_count(n_layers)
    writer.add_context_length(context_length)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(n_heads)
    writer.add_head_count_kv(n_kv_heads)
    writer.add_rope_freq_base(rope_theta)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(n_vocab)
    writer.add_quantization_version(2)
    if rope_scaling is not None:
        writer.add_rope_scaling_type(RopeScalingType(rope_scaling[0]))
        writer.add_rope_scaling_factor(rope_scaling[1])
    for key, value in tokenizer.items():
        _TOKENIZER_KEYS[key](writer, value)
    for key, typed in (metadata or {}).items():
        writer.kv_data[0].pop(key, None)
        if typed is not None:
            writer.kv_data[0][key] = GGUFValue(*typed)

    def matrix(name: str, rows: int, cols: int, permute_heads: int = 0) -> None:
        w = rng.normal(0.0, 0.02, size=(rows, cols)).astype(np.float32)  # Hugging Face row order
        _add_matrix(writer, name, converter_permute(w, permute_heads) if permute_heads else w, qtype, rng)
        if attention_bias and name.split(".")[-2] in ("attn_q", "attn_k", "attn_v"):
            b = rng.normal(0.0, 0.02, size=rows).astype(np.float32)
            writer.add_tensor(
                name.replace(".weight", ".bias"), converter_permute(b, permute_heads) if permute_heads else b
            )

    def norm(name: str) -> None:
        writer.add_tensor(name, (1.0 + rng.normal(0.0, 0.1, size=hidden)).astype(np.float32))

    matrix("token_embd.weight", n_vocab, hidden)
    for i in range(n_layers):
        norm(f"blk.{i}.attn_norm.weight")
        matrix(f"blk.{i}.attn_q.weight", n_heads * head_dim, hidden, permute_heads=n_heads)
        matrix(f"blk.{i}.attn_k.weight", n_kv_heads * head_dim, hidden, permute_heads=n_kv_heads)
        matrix(f"blk.{i}.attn_v.weight", n_kv_heads * head_dim, hidden)
        matrix(f"blk.{i}.attn_output.weight", hidden, n_heads * head_dim)
        norm(f"blk.{i}.ffn_norm.weight")
        matrix(f"blk.{i}.ffn_gate.weight", intermediate, hidden)
        matrix(f"blk.{i}.ffn_up.weight", intermediate, hidden)
        matrix(f"blk.{i}.ffn_down.weight", hidden, intermediate)
    norm("output_norm.weight")
    if not tie_embeddings:
        matrix("output.weight", n_vocab, hidden)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))

    first_part = writer.format_shard_names(path)[0]
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return first_part
