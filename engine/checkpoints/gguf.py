"""GGUF checkpoints (llama.cpp's format) -> Checkpoint.

The container is parsed here rather than with gguf.GGUFReader: GGUFReader trusts the counts and lengths in
the file (an absurd array length makes it loop for ever, a short file gives silently short arrays) and
takes seconds to decode a 49k-token vocabulary. This parser checks every read against the end of the file and
keeps numeric arrays as numpy views of the mapped file (a list of Python ints costs eight times the bytes). The
gguf package still supplies the type ids and block sizes; its dequantizers are the tests' oracle. The
container: the GGUF spec (ggml's docs/gguf.md); block layouts: ggml's ggml-common.h and ggml-quants.c.

Quantized tensors become QuantWeight: Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 exactly; Q4_K, Q5_K (group 32) and Q6_K
(group 16) with each super-block scale times sub-block scale rounded once to fp16. The converter's q/k row
permutation of Llama models is undone, so rows are in Hugging Face order and the model applies half-split (NeoX)
RoPE, as llama.cpp does for the other families, whose rows the converter leaves in that order.
"""

from __future__ import annotations

import dataclasses
import math
import struct
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from llamaterm.engine.checkpoints.architectures import GGUF_ARCHITECTURES, not_supported
from llamaterm.engine.checkpoints.checkpoint import Checkpoint
from llamaterm.engine.checkpoints.config import (
    EXPERT_TENSORS,
    MAX_LAYERS,
    MERGED_GATE_UP,
    ModelConfig,
    tensor_shapes,
    yarn_fields,
)
from llamaterm.engine.checkpoints.fields import MISSING, read, reader
from llamaterm.engine.checkpoints.gguf_files import SPLIT_GGUF
from llamaterm.engine.errors import ModelFormatError
from llamaterm.kernels.qweight import QuantWeight

REDOWNLOAD = "Re-download it (or re-convert it with a current llama.cpp)."

_V = GGUFValueType
_SCALAR_FORMATS: dict[int, str] = {  # keyed by int: the type ids read from the file are plain ints
    _V.UINT8: "<B",
    _V.INT8: "<b",
    _V.UINT16: "<H",
    _V.INT16: "<h",
    _V.UINT32: "<I",
    _V.INT32: "<i",
    _V.UINT64: "<Q",
    _V.INT64: "<q",
    _V.FLOAT32: "<f",
    _V.FLOAT64: "<d",
    _V.BOOL: "<?",
}
_MAX_ARRAY_NESTING = 4  # the spec allows arrays of arrays; real files use none


def _bad(path: Path, problem: str, advice: str = REDOWNLOAD) -> ModelFormatError:
    return ModelFormatError(f"{path}: {problem}. {advice}")


# ------------------------------------------------------------------------------------------------------------
# Container


@dataclasses.dataclass
class RawTensor:
    name: str
    type: GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order: (rows, row length) for a matrix, i.e. the GGUF dims reversed
    data: np.ndarray  # uint8 view of the file, mapped read-only


@dataclasses.dataclass
class GGUFFile:
    path: Path
    metadata: dict[str, object]
    tensors: dict[str, RawTensor]


_U64 = struct.Struct("<Q")


class _Reader:
    """A cursor over the mapped file; every read is checked against the end of the file."""

    def __init__(self, path: Path, buf: np.ndarray):
        # buf.data, not memoryview(buf): numpy types an array as a buffer from Python 3.12 only
        self.path, self.mv, self.pos = path, buf.data, 0

    def take(self, n: int, what: str) -> memoryview:
        if self.pos + n > len(self.mv):
            raise _bad(
                self.path, f"the file is truncated: {what} at byte {self.pos} runs past its end ({len(self.mv)} bytes)"
            )
        self.pos += n
        return self.mv[self.pos - n : self.pos]

    def scalar(self, fmt: str, what: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def count(self, item_size: int, what: str) -> int:
        """A u64 element count, checked against the bytes left so that absurd counts fail at once."""
        n = self.scalar("<Q", what)
        if n * item_size > (left := len(self.mv) - self.pos):
            raise _bad(
                self.path,
                f"the file is truncated or corrupt: {what} claims {n} entries, more than the "
                f"{left} bytes left can hold",
            )
        return n

    def string(self, what: str) -> str:
        data = self.take(self.count(1, what), what)
        try:
            return str(data, "utf-8")
        except UnicodeDecodeError:
            raise _bad(self.path, f"{what} is not valid UTF-8") from None

    def value(self, vtype: int, what: str, depth: int = 0) -> object:
        if vtype in _SCALAR_FORMATS:
            return self.scalar(_SCALAR_FORMATS[vtype], what)
        if vtype == GGUFValueType.STRING:
            return self.string(what)
        if vtype != GGUFValueType.ARRAY or depth >= _MAX_ARRAY_NESTING:
            raise _bad(self.path, f"{what} has an unknown value type {vtype} (or arrays nested too deep)")
        itype = self.scalar("<I", what)
        if itype in _SCALAR_FORMATS:
            dtype = np.dtype(_SCALAR_FORMATS[itype])
            n = self.count(dtype.itemsize, what)
            return np.frombuffer(self.take(n * dtype.itemsize, what), dtype=dtype)  # a view: no copy
        n = self.count(8 if itype == GGUFValueType.STRING else 12, what)  # smallest string / array header
        if itype == GGUFValueType.STRING:
            return self.strings(n, what)
        return [self.value(itype, what, depth + 1) for _ in range(n)]

    def strings(self, n: int, what: str) -> list[str]:
        """n strings in a row (a vocabulary: 50k-250k of them), read as string() reads one, in one loop."""
        mv, pos, end, out = self.mv, self.pos, len(self.mv), []
        try:
            for _ in range(n):
                if pos + 8 > end:
                    break
                size = _U64.unpack_from(mv, pos)[0]
                pos += 8
                if size > end - pos:
                    break
                out.append(str(mv[pos : pos + size], "utf-8"))
                pos += size
        except UnicodeDecodeError:
            raise _bad(self.path, f"{what} is not valid UTF-8") from None
        if len(out) < n:
            raise _bad(self.path, f"the file is truncated: {what} at byte {pos} runs past its end ({end} bytes)")
        self.pos = pos
        return out


def read_gguf_file(path: Path) -> GGUFFile:
    """Parse one GGUF file: metadata and tensor descriptions with byte views of their data (memory mapped)."""
    buf = _map(path)
    r = _Reader(path, buf)
    n_tensors, n_keys = _header(r, buf)
    metadata: dict[str, object] = {}
    for i in range(n_keys):
        key = r.string(f"metadata key {i}")
        if key in metadata:
            raise _bad(path, f"metadata key {key!r} appears twice")
        metadata[key] = r.value(r.scalar("<I", f"the type of {key}"), f"metadata value {key!r}")
    alignment = metadata.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise _bad(path, f"general.alignment = {alignment!r} is not a power of two")
    infos = [_tensor_info(r, i) for i in range(n_tensors)]
    data_start = -(-r.pos // alignment) * alignment
    tensors: dict[str, RawTensor] = {}
    for name, dims, type_id, offset in infos:
        if name in tensors:
            raise _bad(path, f"tensor {name!r} appears twice")
        tensors[name] = _tensor(path, buf, name, dims, type_id, data_start + offset, alignment)
    return GGUFFile(path, metadata, tensors)


def _map(path: Path) -> np.ndarray:
    """The file's bytes, mapped read-only."""
    try:
        if path.stat().st_size == 0:
            raise _bad(path, "the file is empty")
        return np.memmap(path, dtype=np.uint8, mode="r")
    except FileNotFoundError:
        raise _bad(path, "no such file", "Check the path, or download the model again.") from None
    except OSError as err:
        raise ModelFormatError(f"{path}: cannot read it ({err.strerror or err}).") from None


def _header(r: _Reader, buf: np.ndarray) -> tuple[int, int]:
    """The magic bytes and a version llamaterm reads -> (tensor count, metadata key count)."""
    magic = bytes(r.take(4, "the magic bytes")) if len(buf) >= 4 else b""
    if magic != b"GGUF":
        raise _bad(
            r.path,
            f"not a GGUF file (it starts with {bytes(buf[:4])!r}, not b'GGUF')",
            "llamaterm loads llama.cpp GGUF models (*.gguf): check the path, or re-download the file.",
        )
    version = r.scalar("<I", "the version")
    if version not in (2, 3):
        problem = (
            "a big-endian GGUF file, which llamaterm does not read"
            if version & 0xFFFF == 0
            else f"GGUF version {version}; llamaterm reads versions 2 and 3"
        )
        raise _bad(r.path, problem, "Download a little-endian GGUF of version 3 (current llama.cpp writes it).")
    n_tensors = r.count(24, "the tensor count")  # a tensor info takes at least 24 bytes
    return n_tensors, r.count(13, "the metadata key count")  # a key/value pair takes at least 13 bytes


def _tensor_info(r: _Reader, i: int) -> tuple[str, list[int], int, int]:
    """Tensor i's (name, GGUF dims, type id, offset in the data section)."""
    name = r.string(f"the name of tensor {i}")
    n_dims = r.scalar("<I", f"the rank of tensor {name!r}")
    if not 1 <= n_dims <= 4:
        raise _bad(r.path, f"tensor {name!r} has {n_dims} dimensions (GGUF allows 1 to 4)")
    dims = [r.scalar("<Q", f"the shape of tensor {name!r}") for _ in range(n_dims)]
    type_id = r.scalar("<I", f"the type of tensor {name!r}")
    return name, dims, type_id, r.scalar("<Q", f"the offset of tensor {name!r}")


def _tensor(
    path: Path, buf: np.ndarray, name: str, dims: list[int], type_id: int, start: int, alignment: int
) -> RawTensor:
    """A tensor of a known type whose rows are whole blocks, viewed at `start` in the file (the data section
    starts aligned, so `start` is aligned where the tensor's offset is)."""
    if type_id not in GGML_QUANT_SIZES:  # GGML_QUANT_SIZES is keyed by the enum, whose members equal ints
        raise _bad(
            path,
            f"tensor {name!r} has an unknown type id {type_id} (new format or corrupt file)",
            "Update llamaterm, or download a GGUF quantized with a common type (Q4_K_M, Q8_0).",
        )
    ggml_type = GGMLQuantizationType(type_id)
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    if min(dims) == 0:
        raise _bad(path, f"tensor {name!r} has shape {dims}, with an empty dimension")
    if dims[0] % block_size:
        raise _bad(
            path,
            f"tensor {name!r} has shape {dims}, whose rows are not a whole number of "
            f"{ggml_type.name} blocks of {block_size} values",
        )
    n_bytes = math.prod(dims) // block_size * type_size
    if start % alignment or start + n_bytes > len(buf):
        raise _bad(
            path,
            f"tensor {name!r} lies at bytes {start}..{start + n_bytes}, misaligned or "
            f"beyond the end of the file ({len(buf)} bytes): the file is truncated or corrupt",
        )
    return RawTensor(name, ggml_type, tuple(reversed(dims)), buf[start : start + n_bytes])


def read_gguf_parts(path: Path) -> GGUFFile:
    """Read a model, following a split model (`name-00001-of-00003.gguf`) to all of its parts.

    The returned metadata is the first part's (the others carry only split keys); tensors are merged.
    """
    first = read_gguf_file(path)
    split_key = lambda f, key, default=None: read(f.metadata, key, int, default, where=str(f.path))
    count = split_key(first, "split.count", 1)
    if count == 1:
        return first
    no, shard = split_key(first, "split.no"), SPLIT_GGUF.fullmatch(path.name)
    if no != 0 or not shard or int(shard["no"]) != 1 or int(shard["count"]) != count:
        raise _bad(
            path,
            f"this is part {no!r} (counting from 0) of a model split into {count!r} files",
            "Load the first part, the file named like <name>-00001-of-000NN.gguf.",
        )
    parts = [path.with_name(f"{shard['prefix']}-{i:05d}-of-{count:05d}.gguf") for i in range(2, count + 1)]
    missing = [p.name for p in parts if not p.exists()]
    if missing:
        raise ModelFormatError(
            f"{path}: the model is split into {count} files and these are missing: "
            f"{', '.join(missing)}. Download every part into {path.parent}."
        )
    tensors = dict(first.tensors)
    for no, part_path in enumerate(parts, start=1):
        part = read_gguf_file(part_path)
        if (split_key(part, "split.no"), split_key(part, "split.count")) != (no, count):
            raise _bad(
                part_path,
                f"its split keys do not say part {no} of {count} (counting from 0)",
                "The parts come from different models or downloads: download every part again.",
            )
        if repeated := sorted(tensors.keys() & part.tensors.keys()):
            raise _bad(part_path, f"it repeats tensors of earlier parts: {', '.join(repeated[:3])}")
        tensors.update(part.tensors)
    expected = split_key(first, "split.tensors.count", len(tensors))
    if expected != len(tensors):
        raise _bad(path, f"the parts hold {len(tensors)} tensors, the metadata promises {expected}")
    return GGUFFile(path, first.metadata, tensors)


def read_gguf_info(path: str | Path) -> dict:
    """Metadata and tensor statistics, nothing converted (cheap: for `llamaterm info` and `ls`)."""
    f = read_gguf_parts(Path(path))
    return {
        "path": str(path),
        "architecture": f.metadata.get("general.architecture"),
        "metadata": f.metadata,
        "n_tensors": len(f.tensors),
        "n_params": sum(math.prod(t.shape) for t in f.tensors.values()),
        # a mixture's routed experts, and the input embedding when it is not the lm_head: what `info`'s count of
        # active parameters leaves out (ModelConfig.active_parameters)
        "n_expert_params": sum(math.prod(t.shape) for name, t in f.tensors.items() if "_exps." in name),
        "n_embedding_params": math.prod(f.tensors["token_embd.weight"].shape)
        if "token_embd.weight" in f.tensors and "output.weight" in f.tensors
        else 0,
        "n_bytes": sum(t.data.nbytes for t in f.tensors.values()),
        "n_expert_bytes": sum(t.data.nbytes for name, t in f.tensors.items() if "_exps." in name),
        "tensor_types": dict(Counter(t.type.name for t in f.tensors.values()).most_common()),
    }


# ------------------------------------------------------------------------------------------------------------
# Hyper-parameters and the expected tensors


def _config(f: GGUFFile) -> ModelConfig:
    meta, path = f.metadata, f.path
    arch = read(meta, "general.architecture", str, where=str(path))
    if arch not in GGUF_ARCHITECTURES:
        raise _bad(path, not_supported(arch), "Pick a model of one of those families.")
    required = MISSING

    def get(key: str, default: object = required, kind: type = int):
        return kind(read(meta, f"{arch}.{key}", kind, default, where=str(path), positive=True))

    hidden, n_heads = get("embedding_length"), get("attention.head_count")
    n_kv_heads = get("attention.head_count_kv", n_heads)
    # llama.cpp's defaults: a head is hidden / heads wide unless key_length says otherwise; RoPE rotates all of it
    # unless rope.dimension_count says less (Phi-4-mini)
    head_dim = get("attention.key_length", max(hidden // n_heads, 1))
    rope_dim = get("rope.dimension_count", head_dim)
    if get("attention.value_length", head_dim) != head_dim:
        raise _bad(
            path,
            f"{arch}.attention.value_length differs from key_length {head_dim}, which llamaterm does not run",
            "Pick a standard model of the family.",
        )
    n_layers = get("block_count")
    if n_layers > MAX_LAYERS:
        raise _bad(f.path, f"{arch}.block_count = {n_layers} is beyond any model's (at most {MAX_LAYERS})")
    # llama.cpp disables Phi-3's window (its GGUFs carry the config's, which the models were not run with there);
    # Gemma 3's and gpt-oss's patterns, left out of their GGUFs, are llama.cpp's: every sixth layer global, every
    # other layer sliding
    window, sliding_layers = (
        (None, None) if arch == "phi3" else _sliding_window(f, arch, n_layers, SLIDING_PERIODS.get(arch))
    )
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab_size = get("vocab_size", len(tokens) if isinstance(tokens, list) and tokens else required)
    fields = dict(
        arch=arch,
        name=str(meta.get("general.name") or path.stem),
        n_layers=n_layers,
        hidden_size=hidden,
        intermediate_size=get("feed_forward_length"),
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        rope_dim=None if rope_dim == head_dim else rope_dim,
        vocab_size=vocab_size,
        context_length=get("context_length"),
        rms_norm_eps=get("attention.layer_norm_rms_epsilon", kind=float),
        rope_theta=get("rope.freq_base", 10000.0, float),
        tie_word_embeddings="output.weight" not in f.tensors,
        # Qwen2 always has them; a Llama has them when it was trained with attention_bias
        qkv_bias=arch == "qwen2" or "blk.0.attn_q.bias" in f.tensors,
        qk_norm=arch in ("qwen3", "gemma3", "qwen3moe"),
        fused_projections=arch == "phi3",
        sliding_window=window,
        sliding_layers=sliding_layers,
        **_experts(f, arch),
    )
    if arch == "gpt-oss":
        fields |= dict(
            o_bias=True, attention_sinks=True, moe_biases=True, activation="swiglu_oai", expert_weights_norm=True
        )
    if arch == "gemma3":  # the converter stores its norms as 1 + weight already; the rest as llama.cpp defaults it
        fields |= dict(
            post_norms=True,
            activation="gelu_tanh",
            embedding_scale=hidden**0.5,
            # query_pre_attn_scalar is no GGUF key: llama.cpp's scale is 27B's (62 layers) or head_dim's
            attention_scale=(hidden // n_heads if n_layers == 62 else head_dim) ** -0.5,
            rope_theta_sliding=get("rope.freq_base_swa", 10000.0, float),
            final_logit_softcap=read(
                meta, f"{arch}.final_logit_softcapping", float, None, where=str(path), positive=True
            ),
        )
    try:
        return ModelConfig(**fields)
    except ModelFormatError as e:  # the checks every reader shares
        raise _bad(path, str(e)) from None


# The period of a family's sliding-window layers where its GGUFs leave the pattern out (llama.cpp's set_swa_pattern)
SLIDING_PERIODS = {"gemma3": 6, "gpt-oss": 2}
# Whether the router's weights are renormalised over the chosen experts, where a GGUF does not say
# (llama.cpp's build_moe_ffn calls: Qwen3-MoE, Mixtral and gpt-oss do, Qwen2-MoE does not)
EXPERT_WEIGHTS_NORM = {"qwen2moe": False}


def _experts(f: GGUFFile, arch: str) -> dict:
    """The ModelConfig fields of a mixture of experts ({arch}.expert_count and its kin); none for a dense model. A
    file with expert tensors and no expert count, or with an old Mixtral's tensor per expert, is named as such."""

    def get(key: str, default: object = MISSING, kind: type = int):
        return read(f.metadata, f"{arch}.{key}", kind, default, where=str(f.path), positive=kind is int)

    n_experts = get("expert_count", 0)
    if not n_experts:
        if "blk.0.ffn_gate_exps.weight" in f.tensors or "blk.0.ffn_gate_inp.weight" in f.tensors:
            raise _bad(f.path, f"it holds experts (blk.0.ffn_gate_exps) but no {arch}.expert_count")
        if "blk.0.ffn_gate.0.weight" in f.tensors:
            raise _bad(
                f.path,
                "it stores each expert as a tensor of its own, the layout of llama.cpp's Mixtral GGUFs before "
                "March 2024",
                "Download a GGUF converted since (experts in one tensor per layer: ffn_gate_exps).",
            )
        return {}
    shared = get("expert_shared_feed_forward_length", None)
    return dict(
        n_experts=n_experts,
        n_experts_used=get("expert_used_count"),
        # Mixtral's files give the experts' size as the feed-forward length
        expert_intermediate_size=get("expert_feed_forward_length", get("feed_forward_length")),
        shared_expert_intermediate_size=shared,
        expert_weights_norm=bool(
            read(
                f.metadata, f"{arch}.expert_weights_norm", bool, EXPERT_WEIGHTS_NORM.get(arch, True), where=str(f.path)
            )
        ),
    )


def _sliding_window(
    f: GGUFFile, arch: str, n_layers: int, period: int | None
) -> tuple[int | None, tuple[bool, ...] | None]:
    """(window, which layers use it) from {arch}.attention.sliding_window (0 or absent: none, as llama.cpp reads
    it) and .sliding_window_pattern: a bool per layer (true: sliding), or a period n (every nth layer is global, as
    llama.cpp's set_swa_pattern); absent: the family's period, else every layer slides."""
    where, key = str(f.path), f"{arch}.attention.sliding_window"
    window = read(f.metadata, key, int, 0, where=where)
    if window < 0:
        raise _bad(f.path, f"{key} = {window} is negative (0 means no sliding window)")
    if isinstance(f.metadata.get(f"{key}_pattern"), int | np.integer):
        period = read(f.metadata, f"{key}_pattern", int, where=where, positive=True)
        pattern = None
    else:
        pattern = read(f.metadata, f"{key}_pattern", "bools", None, where=where)
    if window and pattern is None and period is not None:
        return window, tuple(i % period < period - 1 for i in range(n_layers))
    if window == 0 or pattern is None:
        return window or None, None
    if len(pattern) != n_layers:
        raise _bad(f.path, f"{key}_pattern has {len(pattern)} entries for {n_layers} layers")
    return int(window), tuple(bool(x) for x in pattern)


# Tensors of RoPE frequency divisors, rotary_dim // 2 each: Llama 3's, LongRoPE's (Phi-3)
ROPE_FACTORS = ("rope_freqs.weight", "rope_factors_short.weight", "rope_factors_long.weight")


def _rope_scaling(f: GGUFFile, c: ModelConfig) -> dict:
    """The ModelConfig fields of RoPE scaling: Llama-3's comes baked into the rope_freqs tensor, linear scaling is
    one factor for all, LongRoPE (Phi-3) has short and long factor tensors. Called once the tensors have been
    checked against the config, which bounds their shapes."""
    arch, half = c.arch, c.rotary_dim // 2
    meta, get = f.metadata, reader(str(f.path))

    def factors(name: str) -> list[float] | None:
        if (t := f.tensors.get(name)) is None:
            return None
        if t.type != GGMLQuantizationType.F32:
            raise _bad(f.path, f"{name} is {t.type.name}, not F32")
        values = t.data.view(np.float32).tolist()
        if not all(0 < x < math.inf for x in values):
            raise _bad(f.path, f"{name} holds values that are not positive and finite")
        return values

    freqs, short, long = map(factors, ROPE_FACTORS)
    if (short is None) != (long is None):
        raise _bad(f.path, "it has one of rope_factors_short and rope_factors_long but not the other")
    if short is not None and long is not None:  # both or neither: checked above
        # llama.cpp's defaults: the original context is the trained one, the attention factor 1
        return dict(
            rope_freq_factors=tuple(short),
            rope_long_factors=tuple(long),
            rope_long_from=int(get(meta, f"{arch}.rope.scaling.original_context_length", int, c.context_length)),
            rope_attention_factor=float(get(meta, f"{arch}.rope.scaling.attn_factor", float, 1.0, positive=True)),
        )
    legacy_linear = get(meta, f"{arch}.rope.scale_linear", float, positive=True)  # the old spelling of linear scaling
    scaling = get(meta, f"{arch}.rope.scaling.type", str, "none" if legacy_linear is None else "linear")
    if scaling == "linear":
        factor = get(meta, f"{arch}.rope.scaling.factor", float, legacy_linear, positive=True)
        if factor is None:
            raise _bad(f.path, f"{arch}.rope.scaling.factor is missing for linear RoPE scaling")
        freqs = [x * factor for x in (freqs or [1.0] * half)]
    elif scaling == "yarn":
        return yarn_fields(
            c,
            factor=get(meta, f"{arch}.rope.scaling.factor", float, MISSING, positive=True),
            original=get(meta, f"{arch}.rope.scaling.original_context_length", int, c.context_length, positive=True),
            beta_fast=get(meta, f"{arch}.rope.scaling.yarn_beta_fast", float, 32.0, positive=True),
            beta_slow=get(meta, f"{arch}.rope.scaling.yarn_beta_slow", float, 1.0, positive=True),
            # gpt-oss's own RoPE (and transformers') does not round YaRN's correction range; others' configs do
            truncate=arch != "gpt-oss",
        )
    elif scaling != "none":
        raise _bad(
            f.path,
            f"RoPE scaling {scaling!r} is not supported (only linear, Llama-3, YaRN and LongRoPE are)",
            "Pick a model without that context extension.",
        )
    return dict(rope_freq_factors=None if freqs is None else tuple(freqs))


def _expected_shapes(c: ModelConfig, merged: bool) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """Every tensor the GGUF may hold, with its numpy shape; and the names that must be there. merged: the experts'
    gate and up come as one tensor a layer (MERGED_GATE_UP)."""
    shapes = tensor_shapes(c)
    if merged:
        gate, up = EXPERT_TENSORS[:2]
        for i in range(c.n_layers):
            for part in ("weight", "bias"):
                names = [f"blk.{i}.{t}.{part}" for t in (gate, up)]
                if names[0] in shapes:
                    e, n, *k = shapes[names[0]]
                    shapes[f"blk.{i}.{MERGED_GATE_UP}.{part}"] = (e, 2 * n, *k)
                    del shapes[names[0]], shapes[names[1]]
    required = set(shapes) - {"output.weight"}  # no output: tied to the embedding
    return shapes | {name: (c.rotary_dim // 2,) for name in ROPE_FACTORS}, required


# gpt-oss's GGUFs name the norm before the MLP as the one after attention (transformers' post_attention_layernorm,
# which the other families' files call ffn_norm)
NORM_NAMES = {"gpt-oss": (".post_attention_norm.", ".ffn_norm.")}


def _check_tensors(f: GGUFFile, c: ModelConfig) -> None:
    if c.n_layers * 6 > len(f.tensors):  # a block has at least 6 tensors; checked before per-layer tables
        raise _bad(f.path, f"{c.arch}.block_count = {c.n_layers}, but there are {len(f.tensors)} tensors")
    shapes, required = _expected_shapes(c, f"blk.0.{MERGED_GATE_UP}.weight" in f.tensors)
    if missing := sorted(required - f.tensors.keys()):
        raise _bad(f.path, f"tensors are missing: {', '.join(missing[:5])}{' ...' if missing[5:] else ''}")
    for name, t in f.tensors.items():
        if name not in shapes:
            raise _bad(
                f.path,
                f"tensor {name!r} is not part of a {c.arch} model",
                "It is a variant llamaterm does not run: pick a standard model of the family.",
            )
        if t.shape != shapes[name]:
            raise _bad(f.path, f"tensor {name!r} has shape {t.shape}; the metadata implies {shapes[name]}")
        if t.type in _UNPACK and len(t.shape) == 1:
            raise _bad(
                f.path,
                f"tensor {name!r} is a vector quantized as {t.type.name}; llamaterm expects "
                "vectors in F32, F16 or BF16",
            )
        if t.type not in _DENSE and t.type not in _UNPACK:
            supported = ", ".join(x.name for x in _DENSE | _UNPACK)
            raise _bad(
                f.path,
                f"tensor {name!r} has type {t.type.name}, which llamaterm does not support (supported: {supported})",
                "Download a GGUF quantized with a supported type, e.g. Q4_K_M, Q4_0 or Q8_0.",
            )


# ------------------------------------------------------------------------------------------------------------
# Tensor conversion, in numpy: its uint8 arithmetic is several times faster than torch's on the CPU.
# Each unpacker takes blocks uint8 [rows, n_blocks, type_size] and returns q uint8 [rows, n_blocks,
# block_size] (4-bit types: already packed in QuantWeight's layout, block_size / 2 bytes), scales and offsets (or
# None) [rows, n_blocks, groups per block], bits and group size.

_DENSE = {
    GGMLQuantizationType.F32: torch.float32,
    GGMLQuantizationType.F16: torch.float16,
    GGMLQuantizationType.BF16: torch.bfloat16,
}
_SHIFTS = np.arange(8, dtype=np.uint8)


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The fp16 field at byte `at` of every block."""
    return np.ascontiguousarray(blocks[..., at : at + 2]).view(np.float16)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Legacy 32-value blocks: the low nibbles of the 16 bytes are values 0..15, the high nibbles 16..31."""
    return np.concatenate((qs & 0xF, qs >> 4), axis=-1)


def _packed_halves(qs: np.ndarray) -> np.ndarray:
    """4-bit values whose bytes hold value j in the low nibble and value j + n in the high one, n bytes a run (the
    last axis: the legacy blocks' 16 bytes, Q4_K's 32-byte chunks) -> QuantWeight's packing, value 2i in byte i's
    low nibble and 2i + 1 in its high one. Each little-endian uint16 of bytes 2i, 2i + 1 gives packed byte i (their
    low nibbles) and byte n / 2 + i (their high ones)."""
    w = np.ascontiguousarray(qs).view(np.uint16)
    low, high = (w & 0xF) | ((w >> 4) & 0xF0), ((w >> 4) & 0xF) | ((w >> 8) & 0xF0)
    return np.concatenate((low, high), axis=-1).astype(np.uint8)


def _bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1 fifth bits: value e's bit is bit e of the little-endian 32-bit qh."""
    return ((qh[..., None] >> _SHIFTS) & 1).reshape(*qh.shape[:-1], -1)


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K: each 32-byte chunk holds one 32-value sub-block in its low nibbles, the next in its high."""
    qs = qs.reshape(*qs.shape[:-1], -1, 1, 32)
    return np.concatenate((qs & 0xF, qs >> 4), axis=-2).reshape(*qs.shape[:-3], -1)


def _k_affine(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: w = (d*sc)*q - dmin*m per 32 values, with 6-bit sc and m packed in 12 bytes
    (llama.cpp get_scale_min_k4). Each product is exact in fp32 and rounded once, to fp16."""
    lo, mid, hi = blocks[..., 4:8], blocks[..., 8:12], blocks[..., 12:16]
    sc = np.concatenate((lo & 63, (hi & 0xF) | (lo >> 6) << 4), axis=-1)
    m = np.concatenate((mid & 63, (hi >> 4) | (mid >> 6) << 4), axis=-1)
    d, dmin = _f16(blocks, 0).astype(np.float32)[..., None], _f16(blocks, 2).astype(np.float32)[..., None]
    return (d * sc).astype(np.float16), (-(dmin * m)).astype(np.float16)


def _q5_k(b):
    qh = b[..., 16:48]  # bit j of byte l is the fifth bit of value 32*j + l
    high = ((qh[..., None, :] >> _SHIFTS[:, None]) & 1).reshape(*qh.shape[:-1], -1)
    return _k_nibbles(b[..., 48:176]) | high << 4, *_k_affine(b), 8, 32


def _q6_k(b):
    # value 128h + 32k + l: low 4 bits from ql[64h + 32(k%2) + l] (low nibble for k < 2), high 2 bits from
    # qh[32h + l] >> 2k; the signed q6 - 32 is stored re-centred, as q6 + 96 in 8 bits.
    ql = b[..., 0:128].reshape(*b.shape[:-1], 2, 2, 32)
    low = np.concatenate((ql & 0xF, ql >> 4), axis=-2)
    high = (b[..., 128:192].reshape(*b.shape[:-1], 2, 1, 32) >> (2 * _SHIFTS[:4, None])) & 3
    scales = _f16(b, 208).astype(np.float32)[..., None] * b[..., 192:208].view(np.int8)
    return (low | high << 4).reshape(*b.shape[:-1], -1) + 96, scales.astype(np.float16), None, 8, 16


_UNPACK = {
    # w = d*(q - 8)
    GGMLQuantizationType.Q4_0: lambda b: (_packed_halves(b[..., 2:18]), _f16(b, 0), None, 4, 32),
    # w = d*q + m
    GGMLQuantizationType.Q4_1: lambda b: (_packed_halves(b[..., 4:20]), _f16(b, 0), _f16(b, 2), 4, 32),
    # w = d*(q5 - 16), q5 stored as q5 + 112 in 8 bits
    GGMLQuantizationType.Q5_0: lambda b: (
        (_nibbles(b[..., 6:22]) | _bits(b[..., 2:6]) << 4) + 112,
        _f16(b, 0),
        None,
        8,
        32,
    ),
    # w = d*q5 + m
    GGMLQuantizationType.Q5_1: lambda b: (
        _nibbles(b[..., 8:24]) | _bits(b[..., 4:8]) << 4,
        _f16(b, 0),
        _f16(b, 2),
        8,
        32,
    ),
    # w = d*q8, the int8 q8 stored as q8 + 128
    GGMLQuantizationType.Q8_0: lambda b: (b[..., 2:34] ^ 0x80, _f16(b, 0), None, 8, 32),
    GGMLQuantizationType.Q4_K: lambda b: (
        _packed_halves(b[..., 16:144].reshape(*b.shape[:-1], 4, 32)),
        *_k_affine(b),
        4,
        32,
    ),
    GGMLQuantizationType.Q5_K: _q5_k,
    GGMLQuantizationType.Q6_K: _q6_k,
    # MXFP4: w = E2M1[q] * 2**(e - 127), an E8M0 exponent byte e and 16 bytes of codes a block
    GGMLQuantizationType.MXFP4: lambda b: (_packed_halves(b[..., 1:17]), _e8m0(b[..., 0]), None, 4, 32),
}
CODEBOOKS = {GGMLQuantizationType.MXFP4: "e2m1"}


def _e8m0(e: np.ndarray) -> np.ndarray:
    """E8M0 exponents -> the fp32 powers of two 2**(e - 127) they stand for; 255 is NaN (caught as corrupt)."""
    bits = e.astype(np.uint32) << 23  # e as an fp32 exponent field, mantissa 0: 2**(e - 127) for e >= 1
    bits[e == 0] = 0x00400000  # 2**-127, an fp32 subnormal
    bits[e == 255] = 0x7FC00000
    return bits.view(np.float32)


def convert_tensor(t: RawTensor) -> torch.Tensor | QuantWeight:
    """A float tensor in its own dtype, or a quantized matrix as QuantWeight, made in numpy on one thread (torch's
    ops over its threads took as long on two cores, and many times longer where another process kept one busy)."""
    if t.type in _DENSE:
        # copied: the mapping is read-only (a private writable one would be charged as committed memory)
        return torch.from_numpy(np.array(t.data)).view(_DENSE[t.type]).view(t.shape)
    *outer, cols = t.shape  # a stack of experts [E, N, K] is the matrix [E * N, K]
    rows = math.prod(outer)
    block_size, type_size = GGML_QUANT_SIZES[t.type]
    q, scales, offsets, bits, group = _UNPACK[t.type](t.data.reshape(rows, cols // block_size, type_size))
    as_rows = lambda x: torch.from_numpy(np.ascontiguousarray(x).reshape(rows, -1))
    codebook = CODEBOOKS.get(t.type)
    return QuantWeight(
        as_rows(q),
        as_rows(scales).to(torch.bfloat16) if codebook else as_rows(scales),  # powers of two: exact in bf16
        None if offsets is None else as_rows(offsets),
        bits,
        group,
        (rows, cols),
        codebook=codebook,
    )


def hf_row_order(n_rows: int, n_head: int) -> np.ndarray:
    """For each Hugging Face q/k row, the GGUF row holding it: the converter interleaved the two halves of
    every head, so HF row j*h/2 + i of a head is GGUF row 2i + j (LlamaModel.permute in llama.cpp's
    convert_hf_to_gguf.py)."""
    return np.arange(n_rows).reshape(n_head, -1, 2).swapaxes(1, 2).reshape(-1)


def _unpermute(t: RawTensor, n_head: int) -> RawTensor:
    """Reorder whole rows (or bias elements) of the raw bytes; exact for every type (blocks lie in rows)."""
    rows = t.data.reshape(t.shape[0], -1)
    return dataclasses.replace(t, data=rows[hf_row_order(t.shape[0], n_head)].reshape(-1))


# ------------------------------------------------------------------------------------------------------------


def load_gguf(path: str | Path) -> Checkpoint:
    """Load a GGUF model of a supported family; the first part of a split model loads all parts. Any problem with the
    file raises ModelFormatError."""
    f = read_gguf_parts(Path(path))
    config = _config(f)
    if config.arch in NORM_NAMES:
        old, new = NORM_NAMES[config.arch]
        f.tensors = {name.replace(old, new): t for name, t in f.tensors.items()}
    _check_tensors(f, config)
    scaling = _rope_scaling(f, config)
    try:
        config = dataclasses.replace(config, **scaling)
    except ModelFormatError as e:  # the checks every reader shares
        raise _bad(f.path, str(e)) from None
    tensors = {}
    for name, t in f.tensors.items():
        if name in ROPE_FACTORS:  # already in the config
            continue
        if config.arch == "llama" and (".attn_q." in name or ".attn_k." in name):  # the one family permuted
            t = _unpermute(t, config.n_heads if ".attn_q." in name else config.n_kv_heads)
        tensors[name] = w = convert_tensor(t)
        if isinstance(w, QuantWeight) and not all(x.isfinite().all() for x in (w.scales, w.offsets) if x is not None):
            what = "an MXFP4 scale byte of 255 (NaN)" if w.codebook else "scales that are NaN or beyond the fp16 range"
            raise _bad(f.path, f"tensor {name!r} has {what} (corrupt)")
    return Checkpoint(config=config, tensors=tensors, metadata=f.metadata, path=f.path)
