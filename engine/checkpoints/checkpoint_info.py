"""What `llamaterm ls` and `llamaterm info` show about a checkpoint, read from its files without loading it.

GGUF: the metadata key-values and tensor infos, through checkpoints/gguf.py. Safetensors: config.json, the JSON header
of each *.safetensors file and tokenizer_config.json; nothing here unpickles.
"""

import json
import re
import struct
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llamaterm.engine.checkpoints.hf_files import chat_template_source
from llamaterm.engine.errors import ModelFormatError

# Native GGUF shards: `<prefix>-00001-of-00003.gguf`, numbered from 1 (llama.cpp's gguf-split).
SPLIT_GGUF = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
# Arrays longer than this (token lists, merges) are summarised as "[N items]" in `info`.
MAX_LISTED_ITEMS = 16


@dataclass
class CheckpointInfo:
    format: str  # "gguf" or "safetensors"
    quant: str | None  # "Q4_K_M", "BF16", "GPTQ-4bit", ...
    architecture: str | None  # "llama"
    parameters: int | None
    context_length: int | None
    tensor_types: dict[str, int] = field(default_factory=dict)  # type name -> tensor count
    chat_template: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)  # GGUF key-values or config.json


def is_first_gguf(path: str) -> bool:
    """A single .gguf file, or the first part of a split one."""
    m = SPLIT_GGUF.match(path)
    return path.endswith(".gguf") and (m is None or m["no"] == "00001")


def read_gguf(first: Path) -> CheckpointInfo:
    from gguf import LlamaFileType

    from llamaterm.engine.checkpoints.gguf import read_gguf_info

    info = read_gguf_info(first)  # the engine's own parser: checked reads, every part of a split file
    metadata = {
        key: f"[{len(value)} items]" if isinstance(value, list) and len(value) > MAX_LISTED_ITEMS else value
        for key, value in info["metadata"].items()
    }
    arch = metadata.get("general.architecture")
    try:
        file_type = LlamaFileType(metadata.get("general.file_type")).name  # MOSTLY_Q4_K_M, ALL_F32
        quant = file_type.removeprefix("MOSTLY_").removeprefix("ALL_")
    except ValueError:
        quant = None
    return CheckpointInfo(
        format="gguf",
        quant=quant,
        architecture=arch,
        parameters=info["n_params"],
        context_length=metadata.get(f"{arch}.context_length"),
        tensor_types=info["tensor_types"],
        chat_template=metadata.pop("tokenizer.chat_template", None),
        metadata=metadata,
    )


def safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a .safetensors file: a little-endian u64 length, then that many bytes of JSON."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > 100_000_000:
            raise ModelFormatError(f"{path}: implausible safetensors header length {n}")
        return json.loads(f.read(n))


def read_safetensors(folder: Path) -> CheckpointInfo:
    try:
        config = json.loads((folder / "config.json").read_text())
        headers = [safetensors_header(p) for p in sorted(folder.glob("*.safetensors"))]
    except (OSError, ValueError, struct.error) as e:
        raise ModelFormatError(f"{folder}: not a readable safetensors checkpoint ({e})") from e
    qconfig = config.get("quantization_config") or {}
    bits = qconfig.get("bits") or qconfig.get("w_bit")
    if qconfig.get("quant_method") and bits:
        quant = f"{qconfig['quant_method'].upper()}-{bits}bit"
    else:
        dtype = config.get("torch_dtype") or config.get("dtype")
        quant = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}.get(dtype)
    types: Counter[str] = Counter()
    parameters = 0
    for header in headers:
        for name, t in header.items():
            if name == "__metadata__":
                continue
            types[t["dtype"]] += 1
            numel = 1
            for d in t["shape"]:
                numel *= d
            if name.endswith(".qweight") and bits:
                parameters += numel * (32 // bits)  # GPTQ / AWQ pack 32 // bits weights into each int32
            elif not name.endswith((".qzeros", ".scales", ".g_idx")):  # quantization bookkeeping, not weights
                parameters += numel
    return CheckpointInfo(
        format="safetensors",
        quant=quant,
        architecture=config.get("model_type"),
        parameters=parameters,
        context_length=config.get("max_position_embeddings"),
        tensor_types=dict(types),
        chat_template=chat_template_source(folder),
        metadata=config,
    )


def read_checkpoint(path: Path) -> CheckpointInfo:
    """`path` is a .gguf file (the first part of a split one) or a safetensors folder."""
    if path.is_dir():
        return read_safetensors(path)
    return read_gguf(path)
