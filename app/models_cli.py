"""The model store commands: `llamaterm pull / ls / rm / info`.

app/cli.py calls register(app). Heavy modules (huggingface_hub, gguf, torch) load inside the commands, so
`llamaterm --help` stays instant. Data goes to stdout; progress and diagnostics to stderr.
"""

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from llamaterm.app.console import echo, interrupts_held, say


def complete_model(incomplete: str) -> list[str]:
    """Shell completion of a model's name: the store's names that start with what is typed."""
    from llamaterm.engine.store.model_store import stored_names

    return [name for name in stored_names() if name.startswith(incomplete)]


def pull(
    ref: Annotated[
        str,
        typer.Argument(
            metavar="REPO[:QUANT] | PATH",
            help="A Hub repo (hf.co/ before it, as ollama takes it, is fine), with a GGUF quant if you like; or "
            "a .gguf file or safetensors folder on this machine.",
        ),
    ],
    revision: Annotated[
        str | None, typer.Option("--revision", "-r", help="Branch, tag or commit (default: the main branch).")
    ] = None,
    name: Annotated[str | None, typer.Option(help="Store it under this name instead of the derived one.")] = None,
    offline: Annotated[
        bool, typer.Option(help="Use the store's copy, never the network (HF_HUB_OFFLINE=1 does the same).")
    ] = False,
):
    """Download a model from the Hugging Face Hub into the store, or add one from this machine; print its name.

    GGUF repos: one quant, every part of a split file; without :QUANT, Q4_K_M or else the closest 4-bit.
    Safetensors repos: config, tokenizer and *.safetensors files; never pickles.
    An interrupted pull resumes when run again. Files are checked against the Hub's sha256 first.
    A PATH (a .gguf file, or a folder of safetensors weights) is checked as a download is, then linked into the store
    (copied where the store is on another disk).

    Examples:

      llamaterm pull bartowski/Llama-3.2-1B-Instruct-GGUF:q4_k_m

      llamaterm pull hf.co/bartowski/Llama-3.2-1B-Instruct-GGUF:Q8_0

      llamaterm pull HuggingFaceTB/SmolLM2-135M-Instruct --name smol

      llamaterm pull ./Qwen3-0.6B-Q8_0.gguf --name qwen3
    """
    with interrupts_held():
        from llamaterm.engine.store import hub
        from llamaterm.engine.store.local_import import import_checkpoint, is_path
        from llamaterm.engine.store.model_store import VALID_NAME, format_size

    if name is not None and not VALID_NAME.match(name):
        raise typer.BadParameter("use lowercase letters, digits, '.', '_' and '-'", param_hint="--name")
    local = is_path(ref)
    if local and not Path(ref).expanduser().exists():
        raise typer.BadParameter(f"no such file or folder: {ref}", param_hint="PATH")
    if local and (revision or offline):
        raise typer.BadParameter("a file on this machine has no revision, and needs no network", param_hint="PATH")
    if not local:
        try:
            hub.parse_ref(ref)
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="REPO[:QUANT]") from None
    try:
        if local:
            model = import_checkpoint(ref, name, say)
        else:
            model = hub.pull(ref, revision=revision, name=name, offline=offline, say=say)
    except KeyboardInterrupt:
        say("\ninterrupted: what was downloaded is kept; run the same command again to resume")
        raise typer.Exit(130) from None
    typer.echo(model.name)
    quant = model.manifest.get("quant") or model.manifest["format"]
    say(f"{model.name}: {quant}, {format_size(model.size_on_disk())}. Try: llamaterm run --model {model.name} Hi")


def ls(
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON list.")] = False,
):
    """List the models in the store: name, format, quant, architecture, parameters, context and size on disk."""
    from llamaterm.engine.checkpoints.architectures import family_of

    with interrupts_held():
        from llamaterm.engine.store.model_store import format_size, scan_store

    models, damaged = scan_store()
    for d in damaged:
        say(f"llamaterm: {d.name} is not a model llamaterm can read ({d.reason}): `llamaterm rm {d.name}` removes it")
    rows: list[dict[str, Any]] = [
        {
            "name": m.name,
            "format": m.manifest.get("format"),
            "quant": m.manifest.get("quant"),
            "architecture": m.manifest.get("architecture"),
            # the family it runs as (None: not supported); manifests written before families record none
            "family": m.manifest.get("family", family_of(m.manifest.get("architecture"))),
            "parameters": m.manifest.get("parameters"),
            "context_length": m.manifest.get("context_length"),
            "size": m.size_on_disk(),
            "repo": m.manifest.get("repo"),
            "path": str(m.checkpoint),
        }
        for m in models
    ]
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        say(
            "The store holds no model llamaterm can read: `llamaterm pull REPO[:QUANT]` downloads one."
            if damaged
            else "The store is empty: `llamaterm pull REPO[:QUANT]` downloads a model."
        )
        return
    table = [("NAME", "FORMAT", "QUANT", "ARCH", "PARAMS", "CONTEXT", "SIZE")]
    for r in rows:
        table.append(
            (
                r["name"],
                r["format"],
                r["quant"] or "-",
                shown_family(r["family"], r["architecture"]),
                format_count(r["parameters"]),
                str(r["context_length"] or "-"),
                format_size(r["size"]),
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for row in table:
        echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


def rm(
    name: Annotated[str, typer.Argument(help="The model's name (see llamaterm ls).", autocompletion=complete_model)],
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
):
    """Remove a model from the store and free its disk space."""
    from filelock import Timeout

    from llamaterm.engine.errors import LlamatermError

    with interrupts_held():
        from llamaterm.engine.store.model_store import (
            DamagedModel,
            StoredModel,
            find_model,
            folder_size,
            format_size,
            model_lock,
            remove_model,
        )

    model: StoredModel | DamagedModel
    try:
        model = find_model(name)
    except DamagedModel as damaged:  # a folder of that name, but no model in it: removed all the same
        model = damaged
    size = format_size(folder_size(model.folder))
    if not yes and not typer.confirm(f"Remove {model.name} ({size})?", err=True):
        raise typer.Exit(1)
    try:
        with model_lock(model.name).acquire(timeout=0):
            remove_model(model)
    except Timeout:
        raise LlamatermError(f"{model.name} is being pulled right now; remove it when that finishes") from None
    except OSError as e:  # a read-only store, or files of another user
        where = f" {e.filename}" if e.filename else ""
        raise LlamatermError(
            f"cannot remove {model.name}: {e.strerror or e}{where}; the store must be writable by you "
            "(LLAMATERM_HOME picks another)"
        ) from None
    say(f"Removed {model.name}, freeing {size}.")


def info(
    name: Annotated[
        str,
        typer.Argument(
            help="The model's name (see llamaterm ls), or a checkpoint's path.", autocompletion=complete_model
        ),
    ],
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
):
    """Show a model's metadata, tensor types and chat template."""
    with interrupts_held():
        from llamaterm.engine.checkpoints.chat_template import CHATML_TEMPLATE
        from llamaterm.engine.checkpoints.checkpoint_info import read_checkpoint
        from llamaterm.engine.checkpoints.sampling_defaults import DESCRIBED, model_sampling_defaults
        from llamaterm.engine.store.model_store import find_model, format_size

    path = Path(name).expanduser()
    if path.exists():
        ci = read_checkpoint(path)  # first: a path that is no checkpoint (say `/`) is an error, not a long walk
        manifest, checkpoint = {}, path
        size = sum(p.stat().st_size for p in [path, *(path.iterdir() if path.is_dir() else [])] if p.is_file())
    else:
        model = find_model(name)
        name, manifest, checkpoint, size = model.name, model.manifest, model.checkpoint, model.size_on_disk()
        ci = read_checkpoint(checkpoint)
    sampling = model_sampling_defaults(Path(checkpoint), ci.metadata)
    data: dict[str, Any] = {
        "name": name,
        "path": str(checkpoint),
        "format": ci.format,
        "quant": manifest.get("quant") or ci.quant,
        "architecture": ci.architecture,
        "family": ci.family,
        "parameters": ci.parameters,
        "active_parameters": ci.active_parameters,
        "experts": None if ci.experts is None else {"total": ci.experts[0], "active": ci.experts[1]},
        "context_length": ci.context_length,
        "size": size,
        "repo": manifest.get("repo"),
        "revision": manifest.get("revision"),
        "pulled_at": manifest.get("pulled_at"),
        "files": manifest.get("files"),
        "tensor_types": ci.tensor_types,
        "sampling_defaults": sampling.to_json(),  # what run, chat and serve sample with unless told otherwise
        "sampling_warnings": list(sampling.warnings),
        "chat_template": ci.chat_template,
        "metadata": ci.metadata,
    }
    if as_json:
        typer.echo(json.dumps(data, indent=2, default=str))
        return
    summary = {
        "name": name,
        "path": data["path"],
        "format": ci.format,
        "quant": data["quant"] or "-",
        "architecture": shown_family(ci.family, ci.architecture, why=True),
        "parameters": format_count(ci.parameters),
        "context": str(ci.context_length or "-"),
        "size": format_size(size),
    }
    if ci.experts is not None:  # a mixture: how many experts, how many a token takes, and the weights it reads
        summary["experts"] = f"{ci.experts[0]}, {ci.experts[1]} active a token"
        summary["parameters"] += f" ({format_count(ci.active_parameters)} active)"
    if data["repo"]:
        summary["repo"] = f"{data['repo']} @ {data['revision'][:12]}, pulled {data['pulled_at']}"
    summary["tensor types"] = ", ".join(f"{t} x{n}" for t, n in ci.tensor_types.items())
    for key, value in summary.items():
        echo(f"{key:<14}{value}")
    echo("\nsampling defaults (run, chat and serve use them unless told otherwise)")
    for key, default in sampling.values.items():
        echo(f"  {key:<20}{default.value:<8g}{DESCRIBED[default.source]}")
    for warning in sampling.warnings:
        echo(f"  warning: {warning}")
    echo("\nmetadata")
    for key, value in ci.metadata.items():
        text = json.dumps(value, default=str) if not isinstance(value, str) else value
        echo(f"  {key} = {text if len(text) <= 100 else text[:97] + '...'}")
    echo("\nchat template")
    echo(
        ci.chat_template.rstrip() if ci.chat_template else f"  (none: chats are formatted as ChatML)\n{CHATML_TEMPLATE}"
    )


def shown_family(family: str | None, architecture: str | None, why: bool = False) -> str:
    """The family a model runs as; one that does not run by its own name, and with `why`, what runs instead."""
    if family or not architecture:
        return family or "-"
    if not why:
        return f"{architecture} (unsupported)"
    from llamaterm.engine.checkpoints.architectures import not_supported

    return f"{architecture}: {not_supported(architecture)}"


def format_count(n: int | None) -> str:
    """Parameter counts as the field writes them: 135M, 1.24B."""
    if not n:
        return "-"
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)


def register(app: typer.Typer) -> None:
    app.command()(pull)
    app.command()(ls)
    app.command()(rm)
    app.command()(info)
