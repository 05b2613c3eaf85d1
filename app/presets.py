"""Presets: named sets of a system prompt and sampling values, as ollama's Modelfile gives a model its SYSTEM and
PARAMETER lines, kept in presets.toml in the user's config directory:

    [coder]
    system = "You are a careful programmer: answer with the code first."
    temperature = 0.2
    top_p = 0.9

`--preset NAME` on run, chat and serve takes one (a flag given beside it wins), the pane settings' Preset fills the
dialog from one, and `llamaterm presets` lists them. The file is read when a command asks for a preset; a mistake in
it is one line naming the file, the preset and the key.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from platformdirs import user_config_path

from llamaterm.engine.checkpoints.sampling_defaults import FIELDS, USER, SamplingDefault, SamplingDefaults
from llamaterm.engine.errors import LlamatermError, RequestError
from llamaterm.engine.sampling_params import SamplingParams

# the sampling values a user sets by name (in a preset, with the line chat's /set) and the type of each (a float may be
# written as an integer: 1 for 1.0)
SAMPLING_TYPES = {name: float for name in FIELDS} | {"top_k": int, "max_tokens": int, "seed": int}
KEYS = ["system", *SAMPLING_TYPES]


class PresetError(LlamatermError):
    pass


@dataclass(frozen=True)
class Preset:
    name: str
    system: str | None = None
    sampling: dict[str, Any] | None = None  # SamplingParams fields, checked

    def fill(self, given: dict[str, Any]) -> dict[str, Any]:
        """The sampling values a command was given (None: not given), the preset's where it gave none."""
        return {**given, **{k: v for k, v in (self.sampling or {}).items() if given.get(k) is None}}

    def server_defaults(self, model: SamplingDefaults) -> SamplingDefaults:
        """The model's sampling defaults with the preset's in their place: a server's requests fill from them what
        they leave out (max_tokens and seed stay each request's own)."""
        ours = {k: SamplingDefault(v, USER) for k, v in (self.sampling or {}).items() if k in FIELDS}
        return SamplingDefaults({**model.values, **ours}, model.warnings)


def presets_file() -> Path:
    return user_config_path("llamaterm", appauthor=False) / "presets.toml"


def load_presets() -> dict[str, Preset]:
    """Every preset in the file, checked; none where there is no file."""
    path = presets_file()
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else "not UTF-8 text"
        raise PresetError(f"cannot read {path}: {reason}") from None
    try:
        tables = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise PresetError(f"{path} is not TOML ({e}): fix it, or move it away") from None
    return {name: checked(path, name, table) for name, table in tables.items()}


def checked(path: Path, name: str, table: object) -> Preset:
    where = f"{path}: [{name}]"
    if not isinstance(table, dict):
        raise PresetError(f"{where}: a preset is a table, [NAME] and its keys below it")
    unknown = sorted(set(table) - set(KEYS))
    if unknown:
        raise PresetError(f"{where}: unknown key {unknown[0]!r}: a preset takes {', '.join(KEYS)}")
    system = table.get("system")
    if system is not None and not isinstance(system, str):
        raise PresetError(f"{where}: system must be a string")
    sampling: dict[str, Any] = {}
    for key, kind in SAMPLING_TYPES.items():
        value = table.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | kind):
            raise PresetError(f"{where}: {key} must be a {'whole number' if kind is int else 'number'}, not {value!r}")
        sampling[key] = kind(value)
    try:
        SamplingParams(**sampling)
    except RequestError as e:
        raise PresetError(f"{where}: {e}") from None
    return Preset(name, system, sampling)


def find_preset(name: str) -> Preset:
    found = load_presets()
    if name not in found:
        listed = f"it has {', '.join(found)}" if found else "it holds none"
        raise PresetError(f"no preset named {name!r} in {presets_file()} ({listed}): `llamaterm presets` lists them")
    return found[name]
