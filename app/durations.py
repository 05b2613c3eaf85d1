"""Durations as ollama's keep_alive writes them (30s, 5m, 1h30m), read and shown: serve --keep-alive, llamaterm ps."""

import re

UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")


def parse_duration(text: str) -> float:
    """Seconds of a duration as ollama's keep_alive writes one: 30s, 5m, 1h30m, 500ms, or a number of seconds.
    ValueError for anything else (a negative one too: here 0 is forever)."""
    text = text.strip().lower()
    parts = DURATION.findall(text)
    if "".join(n + unit for n, unit in parts) == text and parts:
        return sum(float(n) * UNITS[unit] for n, unit in parts)
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1
    if not 0 <= seconds < float("inf"):
        raise ValueError(f"{text!r} is not a duration: give one as 30s, 5m, 1h30m, or 0 to keep the model loaded")
    return seconds


def shown_duration(seconds: float) -> str:
    """'5m', '1h30m', '45s', '0.5s'."""
    whole = int(seconds)
    if whole != seconds or whole < 60:
        return f"{seconds:g}s"
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return "".join(f"{n}{unit}" for n, unit in ((hours, "h"), (minutes, "m"), (secs, "s")) if n)
