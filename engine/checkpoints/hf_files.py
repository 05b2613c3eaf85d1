"""The small files of a Hugging Face model folder that sit beside the weights: read as untrusted JSON and text,
and the one place that decides which chat template a folder ships (the engine and `llamaterm info` both ask here).
"""

import json
from pathlib import Path

from llamaterm.engine.errors import ModelFormatError


def read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8") if path.is_file() else None
    except UnicodeDecodeError as err:
        raise ModelFormatError(
            f"{path}: not UTF-8 text (byte {err.start}); the file is damaged: re-download it"
        ) from None


def read_json(path: Path) -> dict:
    """A JSON object, or {} when the file is absent."""
    text = read_text(path)
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise ModelFormatError(f"{path}: not valid JSON ({err})") from err
    if not isinstance(value, dict):
        raise ModelFormatError(f"{path}: expected a JSON object")
    return value


def chat_template_source(folder: Path) -> str | None:
    """As transformers' AutoTokenizer picks it: chat_template.jinja, else tokenizer_config.json's; then, where
    AutoTokenizer would have none, chat_template.json's (the processor's file, which some repos ship alone). A list
    of named templates gives the one named "default", else the first."""
    template = (
        read_text(folder / "chat_template.jinja")
        or read_json(folder / "tokenizer_config.json").get("chat_template")
        or read_json(folder / "chat_template.json").get("chat_template")
    )
    if isinstance(template, list):  # [{"name": "default", "template": "..."}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    if template is not None and not isinstance(template, str):
        raise ModelFormatError(f"{folder}: the chat template is a {type(template).__name__}, not text")
    return template
