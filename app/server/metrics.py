"""/metrics: the engine's stats in Prometheus' text format."""

from __future__ import annotations

from llamaterm.engine.api import EngineStats

METRICS = [  # (name, help, EngineStats field)
    ("llamaterm_requests_running", "Requests decoding or prefilling now.", "running"),
    ("llamaterm_requests_waiting", "Requests queued for a place in the batch.", "waiting"),
    ("llamaterm_batch_size", "Sequences in the engine's last step.", "batch_size"),
    ("llamaterm_kv_blocks_used", "KV cache blocks held by requests.", "kv_blocks_used"),
    ("llamaterm_kv_blocks_total", "KV cache blocks in the pool.", "kv_blocks_total"),
    ("llamaterm_tokens_per_second", "Tokens generated per second, all requests together.", "tokens_per_s"),
]


def metrics_text(stats: EngineStats) -> str:
    """The engine's stats in Prometheus' text exposition format, a gauge each, labelled with the model."""
    lines = []
    for name, help, field in METRICS:
        lines += [
            f"# HELP {name} {help}",
            f"# TYPE {name} gauge",
            f'{name}{{model="{stats.model}"}} {getattr(stats, field)}',
        ]
    return "\n".join(lines) + "\n"
