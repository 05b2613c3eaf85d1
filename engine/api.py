"""What the engine hands its callers (CLI and TUI alike): events per request and statistics."""

import queue
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Event:
    """One step of a request's stream. `text` is a UTF-8-safe delta; the last event has finished=True."""

    request_id: int
    text: str = ""
    token_ids: tuple[int, ...] = ()
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
    error: str | None = None


@dataclass(frozen=True)
class RequestStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    generated_tokens: int = 0
    ttft_s: float | None = None
    tokens_per_s: float = 0.0  # decode rate over a sliding window
    elapsed_s: float = 0.0
    context_tokens: int = 0  # prompt + generated so far
    max_context: int = 0
    finished: bool = False


@dataclass(frozen=True)
class EngineStats:
    model: str = ""
    device: str = ""
    running: int = 0
    waiting: int = 0
    batch_size: int = 0  # sequences in the last step
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    tokens_per_s: float = 0.0  # aggregate decode rate over a sliding window
    per_request: dict[int, RequestStats] = field(default_factory=dict)


class EventStream:
    """A request's events as they arrive, from `events_queue` (an unbounded queue the engine side fills)."""

    events_queue: queue.SimpleQueue

    def poll(self) -> list[Event]:
        """Every event queued since the last call, without blocking."""
        out = []
        while True:
            try:
                out.append(self.events_queue.get_nowait())
            except queue.Empty:
                return out

    def events(self) -> Iterator[Event]:
        """Blocks until each event arrives; ends after the finishing event."""
        while True:
            event = self.events_queue.get()
            yield event
            if event.finished:
                return
