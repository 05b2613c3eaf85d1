"""What `llamaterm ls` and `llamaterm info` show about a checkpoint, read from its files without loading it.

GGUF: the metadata key-values and tensor infos, through checkpoints/gguf.py. Safetensors: config.json, the JSON header
of each *.safetensors file and tokenizer_config.json; nothing here unpickles.
"""

import json
import math
import struct
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from llamaterm.engine.checkpoints.architectures import family_of
from llamaterm.engine.checkpoints.fields import reader
from llamaterm.engine.checkpoints.hf_files import chat_template_source
from llamaterm.engine.errors import ModelFormatError, reading_model

# Arrays longer than this (token lists, merges) are summarised as "[N items]" in `info`.
MAX_LISTED_ITEMS = 16


@dataclass
class CheckpointInfo:
    format: str  # "gguf" or "safetensors"
    quant: str | None  # "Q4_K_M", "BF16", "GPTQ-4bit", ...
    architecture: str | None  # as the file names it: GGUF's "llama", config.json's model_type "mistral"
    parameters: int | None
    context_length: int | None
    tensor_types: dict[str, int] = field(default_factory=dict)  # type name -> tensor count
    chat_template: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)  # GGUF key-values or config.json
    family: str | None = None  # the family llamaterm runs it as (architectures.py); None: not supported
    experts: tuple[int, int] | None = None  # a mixture of experts: (experts a layer, experts a token takes)
    active_parameters: int | None = None  # the weights a token multiplies with (ModelConfig.active_parameters)


def active(parameters: int, expert_params: int, embedding_params: int, experts: tuple[int, int] | None) -> int:
    """All parameters but the input embedding (a lookup, unless tied to the lm_head) and the routed experts a token
    does not take."""
    unused = 0 if experts is None else expert_params - expert_params * experts[1] // experts[0]
    return parameters - embedding_params - unused


def read_gguf(first: Path) -> CheckpointInfo:
    from gguf import LlamaFileType

    from llamaterm.engine.checkpoints.gguf import read_gguf_info

    info = read_gguf_info(first)  # the engine's own parser: checked reads, every part of a split file
    meta, get = info["metadata"], reader(str(first))
    arch = get(meta, "general.architecture", str)
    try:
        file_type = LlamaFileType(get(meta, "general.file_type", int)).name  # MOSTLY_Q4_K_M, ALL_F32
        quant = file_type.removeprefix("MOSTLY_").removeprefix("ALL_")
    except ValueError:
        quant = None
    n_experts, used = get(meta, f"{arch}.expert_count", int), get(meta, f"{arch}.expert_used_count", int)
    experts = (n_experts, used) if n_experts and used else None
    return CheckpointInfo(
        format="gguf",
        quant=quant,
        architecture=arch,
        parameters=info["n_params"],
        experts=experts,
        active_parameters=active(info["n_params"], info["n_expert_params"], info["n_embedding_params"], experts),
        context_length=get(meta, f"{arch}.context_length", int),
        tensor_types=info["tensor_types"],
        chat_template=get(meta, "tokenizer.chat_template", str),
        metadata={key: _shown(value) for key, value in meta.items() if key != "tokenizer.chat_template"},
        family=family_of(arch),
    )


def _shown(value):
    """A metadata value as `info` lists it: long arrays summarised, numpy arrays as lists."""
    if isinstance(value, list | np.ndarray) and len(value) > MAX_LISTED_ITEMS:
        return f"[{len(value)} items]"
    return value.tolist() if isinstance(value, np.ndarray) else value


def safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a .safetensors file: a little-endian u64 length, then that many bytes of JSON."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > 100_000_000:
            raise ModelFormatError(f"{path}: implausible safetensors header length {n}")
        header = json.loads(f.read(n))
    entries = header.items() if isinstance(header, dict) else [(None, None)]
    for name, t in entries:
        if name != "__metadata__" and not (
            isinstance(t, dict)
            and isinstance(t.get("dtype"), str)
            and isinstance(t.get("shape"), list)
            and all(isinstance(d, int) and d >= 0 for d in t["shape"])
        ):
            raise ModelFormatError(
                f"{path}: the safetensors header does not describe tensor {name!r} (a dtype and "
                "a shape); the file is damaged: re-download it"
            )
    return header


def read_safetensors(folder: Path) -> CheckpointInfo:
    try:
        config = json.loads((folder / "config.json").read_text())
        headers = [safetensors_header(p) for p in sorted(folder.glob("*.safetensors"))]
    except (OSError, ValueError, struct.error) as e:
        raise ModelFormatError(f"{folder}: not a readable safetensors checkpoint ({e})") from e
    if not isinstance(config, dict):
        raise ModelFormatError(f"{folder / 'config.json'} does not hold a JSON object")
    get = reader(str(folder / "config.json"))
    qconfig = get(config, "quantization_config", dict) or {}
    # compressed-tensors gives bits per config group: its first group's weights
    group = next(iter((get(qconfig, "config_groups", dict) or {}).values()), None)
    weights = (get(group, "weights", dict) if isinstance(group, dict) else None) or {}
    bits = get(qconfig, "bits", int) or get(qconfig, "w_bit", int) or get(weights, "num_bits", int)
    quant: str | None
    if (method := get(qconfig, "quant_method", str)) and bits:
        quant = f"{method.upper()}-{bits}bit"
    else:
        dtype = get(config, "torch_dtype", str) or get(config, "dtype", str)
        quant = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}.get(dtype)
    types: Counter[str] = Counter()
    parameters = expert_params = embedding = 0
    for header in headers:
        for name, t in header.items():
            if name == "__metadata__":
                continue
            types[t["dtype"]] += 1
            n = weights_in(name, math.prod(t["shape"]), bits)
            parameters += n
            expert_params += n if ".experts." in name and not name.endswith("_bias") else 0
            embedding += n if name == "model.embed_tokens.weight" else 0
    n_experts = get(config, "num_experts", int) or get(config, "num_local_experts", int)
    used = get(config, "num_experts_per_tok", int)
    experts = (n_experts, used) if n_experts and used else None
    tied = get(config, "tie_word_embeddings", bool)
    return CheckpointInfo(
        format="safetensors",
        quant=quant,
        architecture=get(config, "model_type", str),
        parameters=parameters,
        experts=experts,
        active_parameters=active(parameters, expert_params, 0 if tied else embedding, experts),
        context_length=get(config, "max_position_embeddings", int),
        tensor_types=dict(types),
        chat_template=chat_template_source(folder),
        metadata=config,
        family=family_of((get(config, "architectures", "strings") or [None])[0] or get(config, "model_type", str)),
    )


def weights_in(name: str, numel: int, bits: int | None) -> int:
    """The weights a safetensors tensor of `numel` elements holds: quantization bookkeeping holds none."""
    if name.endswith((".qweight", ".weight_packed")) and bits and 0 < bits <= 32:
        return numel * (32 // bits)  # GPTQ / AWQ / compressed-tensors: 32 // bits weights an int32
    if name.endswith("_blocks"):  # MXFP4 (gpt-oss): two 4-bit values a byte
        return 2 * numel
    bookkeeping = (".qzeros", ".scales", ".g_idx", ".weight_scale", ".weight_zero_point", ".weight_shape", "_scales")
    return 0 if name.endswith(bookkeeping) else numel


def weight_bytes(path: Path) -> tuple[int, int]:
    """(bytes of all tensors, bytes of a mixture's routed experts) as the checkpoint stores them, from its headers
    alone: the least the weights take in memory (llamaterm's formats take as much or a little more)."""
    with reading_model(path):
        if not path.is_dir():
            from llamaterm.engine.checkpoints.gguf import read_gguf_info

            info = read_gguf_info(path)
            return info["n_bytes"], info["n_expert_bytes"]
        total = experts = 0
        for header in map(safetensors_header, sorted(path.glob("*.safetensors"))):
            for name, t in header.items():
                offsets = t.get("data_offsets") if name != "__metadata__" else None
                size = offsets[1] - offsets[0] if isinstance(offsets, list) and len(offsets) == 2 else 0
                total += size
                experts += size if ".experts." in name else 0
        return total, experts


def read_checkpoint(path: Path) -> CheckpointInfo:
    """`path` is a .gguf file (the first part of a split one) or a safetensors folder."""
    with reading_model(path):
        return read_safetensors(path) if path.is_dir() else read_gguf(path)
