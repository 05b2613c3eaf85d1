"""The servers on this machine: `llamaterm ps` lists them, `llamaterm stop` ends them, as ollama's `ps` and `stop`
and LM Studio's `lms ps` and `lms unload` do for their models.

Both read the servers' announcements (app/announcements.py); each server proves it is the one announced before it is
asked anything (and before a stop's signal goes to its pid). `ps` reads each one's /metrics with its local key;
`stop` sends it SIGTERM, its drain: the requests in flight finish (within its --shutdown-timeout), new ones get 503,
and the model is unloaded as the process exits. app/cli.py calls register(app).
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from typing import Annotated, Any

import typer

from llamaterm.app.announcements import (
    Announcement,
    Skipped,
    announcements,
    get,
    health,
    pid_alive,
    read_private,
    remove_if_unchanged,
)
from llamaterm.app.console import echo, fail, say
from llamaterm.app.durations import shown_duration

STOP_WAIT_S = 60.0  # a stopped server's drain and its engine's exit, at most (its --shutdown-timeout is 10 s)
METRIC = re.compile(r"^(\w+)\{[^}]*\} (\S+)$", re.M)


def ps(as_json: Annotated[bool, typer.Option("--json", help="Print a JSON list.")] = False):
    """List the servers running on this machine and their models.

    For each `llamaterm serve`: its sessions running and waiting, KV cache use, memory held, uptime, and when
    --keep-alive unloads its model.

    Example: llamaterm ps
    """
    rows = [row for found in live_servers() if (row := server_row(found)) is not None]
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        say("No llamaterm serve runs on this machine: `llamaterm serve` starts one.")
        return
    header = ("MODEL", "URL", "PID", "DEVICE", "CONTEXT", "RUNNING", "WAITING", "KV TOKENS", "MEMORY", "UP", "UNLOADS")
    table: list[tuple[str, ...]] = [header, *(shown_row(r) for r in rows)]
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    for line in table:
        echo("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip())


def stop(
    target: Annotated[
        str | None,
        typer.Argument(
            metavar="[MODEL|URL]",
            help="The server's model (as `llamaterm ps` or `run --model` names it) or its URL; none: the one running.",
            show_default=False,
        ),
    ] = None,
    every: Annotated[bool, typer.Option("--all", help="Stop every llamaterm serve on this machine.")] = False,
):
    """Stop a server on this machine cleanly.

    The requests in flight finish (new ones are refused), then the server exits and its model is unloaded.

    Examples: llamaterm stop   |   llamaterm stop default   |   llamaterm stop http://127.0.0.1:8001/v1   |
    llamaterm stop --all
    """
    if every and target:
        fail("give a MODEL or URL, or --all, not both", 2)
    servers = live_servers()
    chosen = servers if every or target is None else [s for s in servers if holds(s, target)]
    if not chosen:
        if target is None:
            fail("no llamaterm serve runs on this machine", 1)
        listed = "; `llamaterm ps` lists those running" if servers else ""
        fail(f"no llamaterm serve on this machine holds or listens at {target}{listed}", 1)
    if len(chosen) > 1 and not every:
        names = ", ".join(f"{model_names(s)} at {s.url}" for s in chosen)
        fail(f"{len(chosen)} servers run ({names}): name one by its model or URL, or give --all", 2)
    for found in chosen:
        stop_server(found)


def live_servers() -> list[Announcement]:
    """The announced servers, the stale announcements (their server gone) removed."""
    found = []
    for announced in announcements(lambda skipped: None):
        if not pid_alive(announced.pid):
            remove_if_unchanged(announced)
            continue
        found.append(announced)
    return found


def holds(found: Announcement, target: str) -> bool:
    """Whether `target` names the server: its URL (with or without /v1), or its model as ps, /v1/models or `run
    --model` names it (a store name, a path, the repo it came from)."""
    url = target.rstrip("/").removesuffix("/v1")
    if url == found.url.removesuffix("/v1"):
        return True
    from llamaterm.engine.errors import LlamatermError
    from llamaterm.engine.store.model_store import resolve_model

    try:
        path = str(resolve_model(target).resolve())
    except LlamatermError:
        path = None
    return any(target in (m.id, m.name, m.repo) or m.path == path for m in found.models)


def model_names(found: Announcement) -> str:
    return ", ".join(m.name or m.id for m in found.models)


def server_row(found: Announcement) -> dict[str, Any] | None:
    """What ps shows of a server: its announcement, /health and /metrics (None: it is gone)."""
    row: dict[str, Any] = {
        "model": model_names(found),
        "url": found.url,
        "pid": found.pid,
        "device": found.device,
        "started": found.started,
        "status": "not answering",
    }
    try:
        key = read_private(found.key_file, "its key file").strip()
        status, body = health(found, key)
        row["status"] = body.get("status", "?")
        if status == 200:
            row |= metrics(found, key)
    except Skipped as e:
        if e.stale:
            remove_if_unchanged(found)
            return None
        row["status"] = f"not answering ({e})"
    return row


def metrics(found: Announcement, key: str) -> dict[str, Any]:
    """The server's /metrics, read with its local key, as ps's fields."""
    status, text = get(found, "/metrics", key)
    values = {m[1]: float(m[2]) for m in METRIC.finditer(text)} if status == 200 and isinstance(text, str) else {}
    if not values:
        return {}
    whole = lambda name: int(values.get(name, 0))
    return {
        "loaded": bool(whole("llamaterm_model_loaded")),
        "context": whole("llamaterm_context_length"),
        "running": whole("llamaterm_requests_running"),
        "waiting": whole("llamaterm_requests_waiting"),
        "kv_blocks_used": whole("llamaterm_kv_blocks_used"),
        "kv_blocks_total": whole("llamaterm_kv_blocks_total"),
        "kv_tokens": whole("llamaterm_kv_tokens"),
        "memory_bytes": whole("llamaterm_memory_bytes"),
        "keep_alive_s": values.get("llamaterm_keep_alive_seconds", 0.0),
        "idle_s": values.get("llamaterm_idle_seconds", 0.0),
    }


def shown_row(r: dict[str, Any]) -> tuple[str, ...]:
    from llamaterm.engine.store.model_store import format_size

    server = (r["model"], r["url"], str(r["pid"]), r["device"])
    if "loaded" not in r:  # no figures: it drains, restarts its engine, or does not answer
        return (*server, "-", "-", "-", "-", "-", up(r["started"]), r["status"])
    loaded, used, total = r["loaded"], r["kv_blocks_used"], r["kv_blocks_total"]
    keep, idle = r["keep_alive_s"], r["idle_s"]
    unloads = "unloaded" if not loaded else "never" if not keep else "in " + shown_duration(round(max(0, keep - idle)))
    return (
        *server,
        str(r["context"]),
        str(r["running"]),
        str(r["waiting"]),
        f"{used * r['kv_tokens'] // total}/{r['kv_tokens']}" if loaded and total else "-",  # tokens, as blocks hold
        format_size(r["memory_bytes"]) if loaded else "-",
        up(r["started"]),
        unloads,
    )


def up(started: float) -> str:
    return shown_duration(max(0, round(time.time() - started)))


def stop_server(found: Announcement) -> None:
    """SIGTERM to a server that has proved it is the one announced, then its exit awaited."""
    try:
        key = read_private(found.key_file, "its key file").strip()
        health(found, key)
    except Skipped as e:
        if e.stale:
            remove_if_unchanged(found)
            say(f"The server at {found.url} had already stopped.")
            return
        fail(f"not stopping the server at {found.url} (pid {found.pid}): {e}", 1)
    os.kill(found.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_WAIT_S
    while pid_alive(found.pid):
        if time.monotonic() > deadline:
            fail(f"the server at {found.url} (pid {found.pid}) is still draining: `llamaterm stop` again ends it now")
        time.sleep(0.05)
    say(f"Stopped {model_names(found)} at {found.url} (pid {found.pid}).")


def register(app: typer.Typer) -> None:
    app.command()(ps)
    app.command()(stop)
