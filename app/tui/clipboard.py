"""Copying text: OSC 52 through the terminal, plus a file, since there is no way to tell whether the terminal
honoured OSC 52 (macOS Terminal.app and some tmux or SSH set-ups ignore it)."""

from __future__ import annotations

from pathlib import Path

from textual.app import App

from llamaterm.engine.store.model_store import data_dir


def fallback_path() -> Path:
    return data_dir() / "clipboard.txt"


def copy(app: App, text: str) -> Path | None:
    """Returns the fallback file, or None where it could not be written."""
    app.copy_to_clipboard(text)
    path = fallback_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    except OSError:
        return None
    return path
