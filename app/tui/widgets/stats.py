"""Live numbers, all as the engine measures them: one line per pane and the status bar of the screen."""

from __future__ import annotations

from textual.content import Content
from textual.widgets import Static

from llamaterm.engine.api import EngineClient, RequestStats


def request_lines(stats: RequestStats | None, queued: bool) -> str:
    if queued:
        return "queued: waiting for the model"
    if stats is None:
        return "ready"
    ttft = "–" if stats.ttft_s is None else f"{stats.ttft_s * 1000:.0f} ms"
    context = f"{stats.context_tokens}/{stats.max_context}" if stats.max_context else str(stats.context_tokens)
    return (
        f"{stats.tokens_per_s:.1f} tok/s · TTFT {ttft} · {stats.generated_tokens} tok\n"
        f"ctx {context} · cached {stats.cached_tokens}"
    )


def engine_line(engine: EngineClient) -> str:
    """A server says nothing of its KV cache, nor some of their context: a remote engine's line may have neither
    (kv_blocks_total 0, max_context 0)."""
    stats = engine.stats()
    ctx = f" │ ctx {engine.max_context}" if engine.max_context else ""
    kv = f" │ KV {stats.kv_blocks_used}/{stats.kv_blocks_total} blocks" if stats.kv_blocks_total else ""
    return (
        f"{stats.model} on {stats.device}{ctx} │ {stats.tokens_per_s:.1f} tok/s │ batch {stats.batch_size}"
        f"{kv} │ waiting {stats.waiting}"
    )


class PaneStats(Static):
    """The pane's request: tokens/s now, TTFT, tokens generated, context used / max, cached prefix tokens.
    Its size is fixed in the CSS, so an update repaints two lines instead of laying out the whole screen."""

    def show(self, stats: RequestStats | None, queued: bool) -> None:
        self.update(Content(request_lines(stats, queued)), layout=False)  # Content: no markup in the text


class StatusBar(Static):
    """Each engine: model and device, context, aggregate tokens/s, batch size, KV blocks, waiting requests (a line
    each), and a note that stays while it matters (the history is kept in memory only)."""

    note = ""

    def on_mount(self) -> None:
        self.update("loading model…" + self.note)

    def show(self, engines: list[EngineClient], failures: list[str]) -> None:
        """failures: each backend that did not load, and why."""
        if not engines and not failures:
            return  # still loading
        self.set_class(bool(failures), "-error")
        self.update(Content(" ┃ ".join(failures + [engine_line(e) for e in engines]) + self.note), layout=False)
