"""The model store: checkpoints under the user's data directory, referred to by short names."""

import os
from pathlib import Path

from platformdirs import user_data_dir

from engine.errors import ModelNotFound

DEFAULT_MODEL = "default"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def data_dir() -> Path:
    """LLAMATERM_HOME overrides the platform's user data directory (tests use it to stay hermetic)."""
    return Path(os.environ.get("LLAMATERM_HOME") or user_data_dir("llamaterm", appauthor=False))


def models_dir() -> Path:
    return data_dir() / "models"


def default_model_path() -> Path:
    return models_dir() / "default" / DEFAULT_GGUF


def resolve_model(name: str | None) -> Path:
    """A model name (or None for the default) or a path to a .gguf file -> the checkpoint's path."""
    if name is None or name == DEFAULT_MODEL:
        path = default_model_path()
        if not path.exists():
            raise ModelNotFound(
                f"the default model is not installed (expected {path}).\n"
                "Run `make setup` (or `python -m engine.default_model`) to download it."
            )
        return path
    candidate = Path(name).expanduser()
    if candidate.exists():
        return candidate
    stored = models_dir() / name
    if stored.exists():
        return stored
    raise ModelNotFound(f"no model named {name!r}: it is neither a file nor in the store ({models_dir()}).")
