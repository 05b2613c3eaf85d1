"""A model's recommended sampling values, and where each came from: a safetensors folder's generation_config.json
(the keys vLLM reads from it), a GGUF's general.sampling.* (what llama.cpp's converter copies from that file), else
llama.cpp's own defaults. User-facing commands fill what the user left unset from them; the engine's own default
(SamplingParams) stays greedy.

These files only advise: a value of the wrong type or out of range is skipped with a warning that names the file
and the key (the value then comes from the next source), rather than refusing a model whose weights are fine, as
llama.cpp's converter skips a generation_config.json it cannot read.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llamaterm.engine.sampling_params import FLOAT32_MAX, INT64_END, MIN_REPETITION_PENALTY, SamplingParams

# where a value came from
GENERATION_CONFIG = "generation_config.json"
GGUF = "gguf"  # general.sampling.*
LLAMA_CPP = "llama.cpp"  # its defaults (common/common.h, common_params_sampling)
SERVER = "server"  # a remote server applies its own, unknown here
USER = "user"  # set by the user
DESCRIBED = {  # each source as `info` and the TUI show it
    GENERATION_CONFIG: "generation_config.json",
    GGUF: "the GGUF",
    LLAMA_CPP: "llama.cpp's default",
    SERVER: "the server's default",
    USER: "set by you",
}

# the SamplingParams fields a model may advise, with llama.cpp's defaults
LLAMA_CPP_VALUES: dict[str, float | int] = {
    "temperature": 0.8,
    "top_k": 40,
    "top_p": 0.95,
    "min_p": 0.05,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}
FIELDS = tuple(LLAMA_CPP_VALUES)
GENERATION_CONFIG_KEYS = {f: f for f in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")}
GGUF_KEYS = {  # gguf.constants.Keys.General.SAMPLING_*
    "temperature": "general.sampling.temp",
    "top_k": "general.sampling.top_k",
    "top_p": "general.sampling.top_p",
    "min_p": "general.sampling.min_p",
    "repetition_penalty": "general.sampling.penalty_repeat",
}
# what each field may hold, as SamplingParams bounds it (a default it refused would fail every request)
VALID: dict[str, tuple[str, Callable[[float], bool]]] = {
    "temperature": ("a number >= 0", lambda v: 0 <= v <= FLOAT32_MAX),
    "top_k": ("a whole number >= 0", lambda v: isinstance(v, int) and 0 <= v < INT64_END),
    "top_p": ("a number in (0, 1]", lambda v: 0 < v <= 1),
    "min_p": ("a number in [0, 1]", lambda v: 0 <= v <= 1),
    "repetition_penalty": (
        f"a number in [{MIN_REPETITION_PENALTY:g}, {FLOAT32_MAX:.3g}]",
        lambda v: MIN_REPETITION_PENALTY <= v <= FLOAT32_MAX,
    ),
}


@dataclass(frozen=True)
class SamplingDefault:
    value: float | int | None  # None: not known here (a server's own)
    source: str  # GENERATION_CONFIG, GGUF, LLAMA_CPP, SERVER or USER


@dataclass(frozen=True)
class SamplingDefaults:
    """Each of FIELDS with its value and source; `warnings`: what was skipped in the model's files, and why."""

    values: dict[str, SamplingDefault] = field(
        default_factory=lambda: {f: SamplingDefault(v, LLAMA_CPP) for f, v in LLAMA_CPP_VALUES.items()}
    )
    warnings: tuple[str, ...] = ()

    def resolve(self, given: Mapping[str, Any]) -> dict[str, SamplingDefault]:
        """Every field's value and source once the user's `given` values (None: not given) take precedence."""
        return {
            name: SamplingDefault(given[name], USER) if given.get(name) is not None else default
            for name, default in self.values.items()
        }

    def params(self, given: Mapping[str, Any]) -> SamplingParams:
        """SamplingParams from what the user gave (any SamplingParams field; None: not given), each of FIELDS not
        given taking its default here. A field without one (a server's) is left `unset`: a remote engine leaves it
        out of its request, for the server to fill."""
        resolved = {name: d.value for name, d in self.resolve(given).items()}
        chosen = {k: v for k, v in {**given, **resolved}.items() if v is not None}
        unset = frozenset(name for name, value in resolved.items() if value is None)
        return SamplingParams(**chosen, unset=unset)

    def to_json(self) -> dict[str, dict[str, Any]]:
        return {name: {"value": d.value, "source": d.source} for name, d in self.values.items()}


LLAMA_CPP_DEFAULTS = SamplingDefaults()
SERVER_DEFAULTS = SamplingDefaults({f: SamplingDefault(None, SERVER) for f in FIELDS})


def from_values(found: Mapping[str, Any], source: str, where: str, keys: Mapping[str, str]) -> SamplingDefaults:
    """The valid values among `found` (field -> value as the file gives it, under `keys`' names), llama.cpp's for
    the rest."""
    values, warnings = dict(LLAMA_CPP_DEFAULTS.values), []
    for name, value in found.items():
        expected, valid = VALID[name]
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if number and name == "top_k" and isinstance(value, float) and value.is_integer():
            value = int(value)  # GGUF writes it as int32; a JSON 40.0 means 40 too
        if number and valid(value):
            values[name] = SamplingDefault(value, source)
        else:
            shown = json.dumps(value) if isinstance(value, str | int | float | bool) else type(value).__name__
            warnings.append(
                f"{where}: {keys[name]} = {shown[:40]} is not {expected}: ignored, "
                f"{name} defaults to llama.cpp's {LLAMA_CPP_VALUES[name]}"
            )
    return SamplingDefaults(values, tuple(warnings))


def from_generation_config(folder: Path) -> SamplingDefaults:
    """A Hugging Face folder's generation_config.json; without one, llama.cpp's defaults. do_sample is not read
    (as vLLM and llama.cpp's converter do not): a file that gives a temperature advises it."""
    path = folder / GENERATION_CONFIG
    try:
        if not path.is_file():
            return LLAMA_CPP_DEFAULTS
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:  # unreadable, not UTF-8, not JSON
        problem = f"{path}: not a readable JSON file ({type(e).__name__}): ignored, sampling takes llama.cpp's defaults"
        return SamplingDefaults(warnings=(problem,))
    if not isinstance(config, dict):
        return SamplingDefaults(warnings=(f"{path}: not a JSON object: ignored, sampling takes llama.cpp's defaults",))
    found = {name: config[key] for name, key in GENERATION_CONFIG_KEYS.items() if config.get(key) is not None}
    return from_values(found, GENERATION_CONFIG, str(path), GENERATION_CONFIG_KEYS)


def from_gguf(metadata: Mapping[str, Any], where: str) -> SamplingDefaults:
    """A GGUF's general.sampling.* keys (numbers arrive as numpy scalars), llama.cpp's defaults for the rest."""
    import numpy as np  # here: a client of a server (RemoteEngine's SERVER_DEFAULTS) loads no numpy

    found = {}
    for name, key in GGUF_KEYS.items():
        value = metadata.get(key)
        if isinstance(value, float | np.floating):  # llama.cpp writes float32: 0.95 as written, not 0.949999988
            value = float(str(np.float32(value)))
        elif isinstance(value, np.integer):
            value = int(value)
        if value is not None:
            found[name] = value
    return from_values(found, GGUF, where, GGUF_KEYS)


def model_sampling_defaults(path: Path, gguf_metadata: Mapping[str, Any]) -> SamplingDefaults:
    """A checkpoint's: a folder's generation_config.json, or a GGUF's metadata (already read, with `path`)."""
    return from_generation_config(path) if path.is_dir() else from_gguf(gguf_metadata, str(path))
