"""/metrics: the engine's stats and the server's own figures in Prometheus' text format."""

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
SERVER_METRICS = {  # name: help, for the values Service.gauges gives
    "llamaterm_model_loaded": "1 while the model is loaded; 0 once --keep-alive has unloaded it.",
    "llamaterm_context_length": "The most tokens a sequence holds: --ctx, or the model's own.",
    "llamaterm_memory_bytes": "Memory the engine holds: a GPU's that torch reserved; on the CPU, weights and KV cache.",
    "llamaterm_kv_tokens": "Tokens the KV cache pool holds.",
    "llamaterm_keep_alive_seconds": "How long the server stays idle before it unloads the model (0: never).",
    "llamaterm_idle_seconds": "Seconds since the server's last request ended (0 while one runs).",
}


def metrics_text(stats: EngineStats, server: dict[str, float]) -> str:
    """The engine's stats and the server's figures in Prometheus' text exposition format, a gauge each, labelled
    with the model."""
    values = [(name, help, getattr(stats, field)) for name, help, field in METRICS]
    values += [(name, help, server[name]) for name, help in SERVER_METRICS.items()]
    lines = []
    for name, help, value in values:
        lines += [f"# HELP {name} {help}", f"# TYPE {name} gauge", f'{name}{{model="{stats.model}"}} {value}']
    return "\n".join(lines) + "\n"
