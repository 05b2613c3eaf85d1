"""A seeded mutator for model files, and the harness that loads each mutant in a capped child process.

Seeds are real files: a GGUF with the default model's tokenizer metadata (49k tokens, its merges and chat
template) and a small-vocabulary GGUF (both written with GGUFWriter, tests/support/tiny_models.py), and a Hugging Face
folder (config.json, model.safetensors, tokenizer.json, generation_config.json). Mutations know the formats'
layouts, so most of them get past the first check: GGUF value types swapped for others of the same size, counts
and lengths set to extremes, tensor shapes, types and offsets changed, bytes flipped, files cut short, keys
rewritten with values of other types; JSON values anywhere in the JSON files, the safetensors header or its
index replaced with hostile ones.

Every case must end in success or a LlamatermError of one line; a traceback, a hang (CASE_TIMEOUT_S), a crash or
an allocation past the memory cap (tests/support/capped.py, which the worker sets) is a failure, reported with the seed
and case number that reproduce it.
"""

from __future__ import annotations

import json
import math
import random
import select
import shutil
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from gguf.constants import GGUFValueType as V
from safetensors.torch import load_file, save_file

from tests.support import ROOT
from tests.support.safetensors_files import write_dense
from tests.support.tiny_models import write_tiny_llama

CASE_TIMEOUT_S = 30
WORKER = "tests.support.fuzz_worker"  # run as a module, from ROOT

# GGUF value types by size, for swaps that keep the layout: the value is read, and then checked by meaning
SCALAR_SIZES = {
    V.UINT8: 1,
    V.INT8: 1,
    V.BOOL: 1,
    V.UINT16: 2,
    V.INT16: 2,
    V.UINT32: 4,
    V.INT32: 4,
    V.FLOAT32: 4,
    V.UINT64: 8,
    V.INT64: 8,
    V.FLOAT64: 8,
}
SAME_SIZE = {t: [u for u, n in SCALAR_SIZES.items() if n == size and u != t] for t, size in SCALAR_SIZES.items()}
EXTREME_INTS = [0, 1, 2, 3, 255, 2**15, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**53, 2**63 - 1, 2**63, 2**64 - 1]
HOSTILE_JSON = [
    None,
    True,
    False,
    0,
    -1,
    1.5,
    1e8,
    1e308,
    -1e308,
    10**12,
    2**63,
    2**64 + 1,
    "",
    "abc",
    "../x",
    "/etc/passwd",
    "\u0000",
    [],
    [1, 2],
    ["a"],
    {},
    {"a": 1},
    [[[[]]]],
    "x" * 10_000,
]


# --- seeds ---------------------------------------------------------------------------------------------------


def byte_level_tokenizer_json() -> dict:
    """A real tokenizer.json: byte-level BPE, one token per byte, two special tokens."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, pre_tokenizers
    from tokenizers.models import BPE

    backend = Backend(BPE(vocab={c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    return json.loads(backend.to_str())


def small_vocab_metadata() -> dict:
    """Tokenizer metadata of a byte-level GGUF vocabulary: 256 byte tokens, one merge, ChatML markers."""
    from tokenizers import pre_tokenizers

    tokens = sorted(pre_tokenizers.ByteLevel.alphabet()) + ["Ġt", "<|im_start|>", "<|im_end|>"]
    n = len(tokens)
    return {
        "tokenizer.ggml.model": ("gpt2", V.STRING),
        "tokenizer.ggml.pre": ("gpt-2", V.STRING),
        "tokenizer.ggml.tokens": (tokens, V.ARRAY),
        "tokenizer.ggml.token_type": ([1] * (n - 2) + [3, 3], V.ARRAY),
        "tokenizer.ggml.merges": (["Ġ t"], V.ARRAY),
        "tokenizer.ggml.bos_token_id": (n - 2, V.UINT32),
        "tokenizer.ggml.eos_token_id": (n - 1, V.UINT32),
        "tokenizer.chat_template": (
            "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
            "<|im_end|>\n{% endfor %}<|im_start|>assistant\n",
            V.STRING,
        ),
        "llama.vocab_size": (n, V.UINT32),
    }


@dataclass
class Seeds:
    gguf_default_vocab: bytes
    gguf_small_vocab: bytes
    folder: Path  # config.json, model.safetensors, tokenizer.json


def make_seeds(directory: Path) -> Seeds:
    default = write_tiny_llama(directory / "default-vocab.gguf", n_layers=1, qtype="Q8_0")
    small = write_tiny_llama(
        directory / "small-vocab.gguf",
        n_layers=1,
        qtype="Q8_0",
        vocab_from=None,
        vocab_size=len(small_vocab_metadata()["tokenizer.ggml.tokens"][0]),
        metadata=small_vocab_metadata(),
    )
    folder = directory / "hf"
    folder.mkdir()
    write_dense(folder)
    spec = byte_level_tokenizer_json()
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    # the weights' vocabulary as large as the tokenizer's
    vocab = len(spec["model"]["vocab"]) + len(spec["added_tokens"])
    tensors = load_file(folder / "model.safetensors")
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        tensors[name] = torch.randn(vocab, tensors[name].shape[1], generator=torch.Generator().manual_seed(0))
    save_file(tensors, folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text()) | {"vocab_size": vocab}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [vocab - 1], "bos_token_id": 0}))
    return Seeds(default.read_bytes(), small.read_bytes(), folder)


# --- GGUF mutations --------------------------------------------------------------------------------------


@dataclass
class Field:
    """Where a metadata value lies in the file, and what type the file says it has."""

    key: str
    type_at: int
    value_at: int
    type: int
    count_at: int | None = None  # arrays: the element count; strings: the byte length
    item_type_at: int | None = None  # arrays


@dataclass
class TensorInfo:
    """Where a tensor's description lies in the file."""

    name: str
    n_dims: int
    dims_at: int
    type_at: int
    offset_at: int


def gguf_fields(data: bytes) -> tuple[list[Field], list[TensorInfo], int]:
    """The metadata fields and tensor infos of a well-formed GGUF (a seed), and where the tensor data starts."""
    pos = 24
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)

    def string(at: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", data, at)
        return data[at + 8 : at + 8 + n].decode(), at + 8 + n

    def skip(vtype: int, at: int) -> int:
        if vtype in SCALAR_SIZES:
            return at + SCALAR_SIZES[vtype]
        if vtype == V.STRING:
            return string(at)[1]
        item, count = struct.unpack_from("<IQ", data, at)
        at += 12
        for _ in range(count):
            at = skip(item, at)
        return at

    fields = []
    for _ in range(n_kv):
        key, pos = string(pos)
        (vtype,) = struct.unpack_from("<I", data, pos)
        field = Field(key, pos, pos + 4, vtype)
        if vtype in (V.STRING, V.ARRAY):
            field.count_at = pos + 4 + (4 if vtype == V.ARRAY else 0)
            field.item_type_at = pos + 4 if vtype == V.ARRAY else None
        fields.append(field)
        pos = skip(vtype, pos + 4)
    tensors = []
    for _ in range(n_tensors):
        name, pos = string(pos)
        (n_dims,) = struct.unpack_from("<I", data, pos)
        type_at = pos + 4 + 8 * n_dims
        tensors.append(TensorInfo(name, n_dims, pos + 4, type_at, type_at + 4))
        pos = type_at + 12
    return fields, tensors, pos


def mutate_gguf(data: bytes, rng: random.Random) -> bytes:
    fields, tensors, end = gguf_fields(data)
    out = bytearray(data)
    u32 = lambda at, v: struct.pack_into("<I", out, at, v % 2**32)
    u64 = lambda at, v: struct.pack_into("<Q", out, at, v % 2**64)
    f = rng.choice(fields)
    t = rng.choice(tensors)
    kind = rng.choice(
        [
            "swap type",
            "extreme value",
            "count",
            "item type",
            "any type",
            "tensor dim",
            "tensor type",
            "tensor offset",
            "header counts",
            "flip bytes",
            "cut short",
        ]
    )
    if kind == "swap type" and f.type in SAME_SIZE:
        u32(f.type_at, rng.choice(SAME_SIZE[f.type]))
    elif kind == "extreme value" and f.type in SCALAR_SIZES:
        size = SCALAR_SIZES[f.type]
        value = rng.choice(EXTREME_INTS) % 2 ** (8 * size)
        out[f.value_at : f.value_at + size] = value.to_bytes(size, "little")
        if f.type in (V.FLOAT32, V.FLOAT64) and rng.random() < 0.5:
            special = rng.choice([math.nan, math.inf, -math.inf, 0.0, -1.0, 1e-45, 3e38])
            out[f.value_at : f.value_at + size] = struct.pack("<f" if size == 4 else "<d", special)
    elif kind == "count" and f.count_at is not None:
        (n,) = struct.unpack_from("<Q", data, f.count_at)
        u64(f.count_at, rng.choice([0, 1, n - 1, n + 1, 2 * n, *EXTREME_INTS]))
    elif kind == "item type" and f.item_type_at is not None:
        (item,) = struct.unpack_from("<I", data, f.item_type_at)
        u32(f.item_type_at, rng.choice(SAME_SIZE.get(item) or [V.UINT8, V.INT32, V.STRING, V.ARRAY, 13, 2**31]))
    elif kind == "any type":
        u32(f.type_at, rng.choice([*range(14), 2**31, 2**32 - 1]))
    elif kind == "tensor dim":
        u64(t.dims_at + 8 * rng.randrange(t.n_dims), rng.choice([0, 1, 31, 33, 2**16, 2**32, 2**62, 2**64 - 1]))
    elif kind == "tensor type":
        u32(t.type_at, rng.choice([*range(40), 2**31]))
    elif kind == "tensor offset":
        u64(t.offset_at, rng.choice([1, 32, 2**20, 2**40, 2**64 - 32]))
    elif kind == "header counts":
        u64(rng.choice([8, 16]), rng.choice(EXTREME_INTS))
    elif kind == "flip bytes":
        for _ in range(rng.randint(1, 8)):
            out[rng.randrange(end)] ^= 1 << rng.randrange(8)
    else:  # cut short
        del out[rng.randrange(len(out)) :]
    return bytes(out)


def rewrite_gguf_key(path: Path, rng: random.Random) -> Path | None:
    """A small-vocabulary GGUF written afresh with one key holding a value of another type (GGUFWriter)."""
    metadata = small_vocab_metadata()
    key = rng.choice(
        [
            *metadata,
            "general.architecture",
            "llama.block_count",
            "llama.embedding_length",
            "llama.attention.head_count",
            "llama.attention.head_count_kv",
            "llama.context_length",
            "llama.rope.freq_base",
            "llama.attention.layer_norm_rms_epsilon",
            "llama.rope.scaling.type",
            "llama.rope.scaling.factor",
            "split.count",
            "general.alignment",
        ]
    )
    metadata[key] = rng.choice(
        [
            ("abc", V.STRING),
            (-1, V.INT32),
            (0, V.UINT32),
            (2**40, V.UINT64),
            (1e30, V.FLOAT32),
            (True, V.BOOL),
            ([1, 2, 3], V.ARRAY),
            (["a", "b"], V.ARRAY),
            ([1.5], V.ARRAY),
            (3, V.UINT32),
            (7, V.UINT8),
            ("{{ 7**(7**9) }}", V.STRING),
            ("{% for i in range(99999) %}{{ i }}{% endfor %}", V.STRING),
            None,
        ]
    )
    try:
        return write_tiny_llama(path, n_layers=1, qtype="Q8_0", vocab_from=None, vocab_size=259, metadata=metadata)
    except Exception:  # GGUFWriter refused the value itself: not a case
        return None


# --- JSON mutations (config.json, tokenizer.json, the safetensors header and index) ------------------------


def mutate_json(value, rng: random.Random):
    """Replace one node anywhere in the tree (or add or drop a key) with a hostile value."""
    if isinstance(value, dict) and value and rng.random() < 0.75:
        key = rng.choice(list(value))
        action = rng.random()
        if action < 0.15:
            return {k: v for k, v in value.items() if k != key}
        if action < 0.25:
            return {
                **value,
                rng.choice(
                    [
                        "head_dim",
                        "rope_scaling",
                        "num_key_value_heads",
                        "quantization_config",
                        "sliding_window",
                        "added_tokens",
                        "__metadata__",
                    ]
                ): rng.choice(HOSTILE_JSON),
            }
        return {**value, key: mutate_json(value[key], rng)}
    if isinstance(value, list) and value and rng.random() < 0.75:
        i = rng.randrange(len(value))
        return [*value[:i], mutate_json(value[i], rng), *value[i + 1 :]]
    return rng.choice(HOSTILE_JSON + ([value * 2, -value, value + 1] if isinstance(value, int | float) else []))


def mutate_folder(seed: Path, folder: Path, rng: random.Random) -> None:
    shutil.copytree(seed, folder)
    target = rng.choice(["config.json", "tokenizer.json", "generation_config.json", "header", "index", "bytes"])
    if target.endswith(".json"):
        path = folder / target
        path.write_text(json.dumps(mutate_json(json.loads(path.read_text()), rng)))
    elif target == "header":
        path = folder / "model.safetensors"
        data = path.read_bytes()
        (n,) = struct.unpack_from("<Q", data)
        header = json.dumps(mutate_json(json.loads(data[8 : 8 + n]), rng)).encode()
        if rng.random() < 0.2:
            path.write_bytes(struct.pack("<Q", rng.choice(EXTREME_INTS)) + data[8:])
        else:
            path.write_bytes(struct.pack("<Q", len(header)) + header + data[8 + n :])
    elif target == "index":
        data = (folder / "model.safetensors").read_bytes()
        names = [k for k in json.loads(data[8 : 8 + struct.unpack_from("<Q", data)[0]]) if k != "__metadata__"]
        index = {"weight_map": dict.fromkeys(names, "model.safetensors")}
        (folder / "model.safetensors.index.json").write_text(json.dumps(mutate_json(index, rng)))
    else:
        path = folder / rng.choice(["config.json", "tokenizer.json", "model.safetensors"])
        data = bytearray(path.read_bytes())
        if rng.random() < 0.5:
            del data[rng.randrange(len(data)) :]
        else:
            for _ in range(rng.randint(1, 8)):
                data[rng.randrange(len(data))] = rng.randrange(256)
        path.write_bytes(bytes(data))


def make_case(seeds: Seeds, directory: Path, number: int, seed: int) -> Path | None:
    """Case `number` of the run with `seed`: a mutated checkpoint in `directory` (None: no case this time)."""
    rng = random.Random(f"{seed}:{number}")
    kind = rng.choice(["gguf small vocab"] * 4 + ["gguf default vocab", "gguf rewritten key"] + ["folder"] * 4)
    if kind == "folder":
        folder = directory / f"case-{number}"
        mutate_folder(seeds.folder, folder, rng)
        return folder
    path = directory / f"case-{number}.gguf"
    if kind == "gguf rewritten key":
        return rewrite_gguf_key(path, rng)
    path.write_bytes(
        mutate_gguf(seeds.gguf_small_vocab if kind == "gguf small vocab" else seeds.gguf_default_vocab, rng)
    )
    return path


# --- the harness -------------------------------------------------------------------------------------------


class Worker:
    """tests/support/fuzz_worker.py in a child process under the memory cap, restarted after a crash or a hang."""

    def __init__(self):
        self.process = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", WORKER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            cwd=ROOT,
        )
        assert self.read(120) == {"outcome": "ready"}

    def read(self, timeout: float) -> dict | None:
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        line = self.process.stdout.readline() if ready else ""
        return json.loads(line) if line else None

    def run(self, case: Path) -> dict:
        if self.process is None or self.process.poll() is not None:
            self.start()
        self.process.stdin.write(f"{case}\n")
        self.process.stdin.flush()
        result = self.read(CASE_TIMEOUT_S)
        if result is None:  # a hang, or the process died (a crash, or the kernel killed it for memory)
            alive = self.process.poll() is None
            self.stop()
            return {"outcome": "hang" if alive else f"crash (exit {self.process.returncode})", "message": ""}
        return result

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()


def failure(result: dict) -> str | None:
    """Why an outcome is not acceptable, or None."""
    if result["outcome"] == "ok":
        return None
    if result["outcome"] == "error":
        message = result["message"]
        return None if message and "\n" not in message and "Traceback" not in message else "error not one line"
    return result["outcome"]


def fuzz(directory: Path, seed: int, cases: int, seconds: float) -> tuple[int, list[str]]:
    """Run cases 1..`cases` of `seed`, or as many as fit in `seconds`; returns the number run and a description of
    each failure."""
    seeds = make_seeds(directory)
    worker = Worker()
    worker.start()
    deadline = time.monotonic() + seconds
    failures, number, ran = [], 0, 0
    try:
        while number < cases and time.monotonic() < deadline:
            number += 1
            case = make_case(seeds, directory, number, seed)
            if case is None:
                continue
            ran += 1
            result = worker.run(case)
            if why := failure(result):
                failures.append(f"seed {seed} case {number} ({case}): {why}\n{result['message'][-3000:]}")
            elif case.is_dir():
                shutil.rmtree(case)
            else:
                case.unlink()
    finally:
        worker.stop()
    return ran, failures
