"""A checkpoint on this machine added to the store under a name: `llamaterm pull ./model.gguf` (what ollama's `create`
does with a GGUF, and LM Studio's `lms import`).

It is checked as a download is: the files a model needs are taken (a .gguf file and every part of a split one; a
safetensors folder's weights, config and tokenizer files, never pickles), their sha256 goes in the manifest, and the
checkpoint must read as one llamaterm knows before the folder appears in the store, whole. The files are hard-linked
where the store is on the same file system (no second copy on disk), copied where not.
"""

import os
import shutil
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from filelock import Timeout

from llamaterm.engine.checkpoints.gguf_files import SPLIT_GGUF
from llamaterm.engine.errors import ModelFormatError
from llamaterm.engine.store import model_store as store
from llamaterm.engine.store.hub import SAFETENSORS_EXTRAS, PullError, default_name, quant_label


def is_path(ref: str) -> bool:
    """A reference to files on this machine rather than to a repo: it exists, or reads as a path."""
    return Path(ref).expanduser().exists() or ref.startswith(("/", "./", "../", "~")) or ref.endswith(".gguf")


def import_checkpoint(ref: str, name: str | None = None, say: Callable[[str], None] = lambda message: None):
    """The checkpoint at `ref` (a .gguf file, or a safetensors folder) in the store as `name` (default: from its
    file or folder name); returns the StoredModel."""
    source = Path(ref).expanduser().resolve()
    files, fmt = checkpoint_files(source, ref)
    name = name or default_name(stem(source), None)
    if not store.VALID_NAME.match(name):
        raise PullError(f"{name!r} cannot be a model name: use lowercase letters, digits, '.', '_' and '-' (--name)")
    lock = store.model_lock(name)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise PullError(f"{name} is being pulled or removed right now: try again when that finishes") from None
    try:
        existing = next((m for m in store.list_models() if m.name == name), None)
        if existing is not None:
            origin = existing.manifest.get("repo") or existing.manifest.get("source") or "a local checkpoint"
            raise PullError(f"the store already has a model named {name} (from {origin}): pick another with --name")
        return stage_and_install(source, files, fmt, name, say)
    finally:
        lock.release()


def checkpoint_files(source: Path, ref: str) -> tuple[list[Path], str]:
    """The files to take and the format: a .gguf file (with the other parts of a split one), or a safetensors
    folder's."""
    if not source.exists():
        raise PullError(f"no such file or folder: {ref} (give a .gguf file or a safetensors model folder)")
    if source.is_file():
        if source.suffix != ".gguf":
            raise PullError(f"{ref} is not a .gguf file: give a GGUF file, or a folder of safetensors weights")
        split = SPLIT_GGUF.match(source.name)
        if split is None:
            return [source], "gguf"
        if split["no"] != "00001":
            raise PullError(f"{ref} is part {int(split['no'])} of a split GGUF: give its first part, -00001-of-...")
        count = int(split["count"])
        parts = [source.with_name(f"{split['prefix']}-{i:05d}-of-{split['count']}.gguf") for i in range(1, count + 1)]
        missing = [p.name for p in parts if not p.is_file()]
        if missing:
            raise PullError(f"{ref} is split in {count} parts, and {', '.join(missing)} is not beside it")
        return parts, "gguf"
    weights = sorted(source.glob("*.safetensors"))
    if not weights or not (source / "config.json").is_file():
        ggufs = sorted(p.name for p in source.glob("*.gguf"))
        hint = f"; it holds {', '.join(ggufs[:3])}: give one of those files" if ggufs else ""
        raise PullError(f"{ref} is not a model folder llamaterm reads (config.json and *.safetensors){hint}")
    extras = [p for p in sorted(source.iterdir()) if p.is_file() and SAFETENSORS_EXTRAS.match(p.name)]
    return weights + extras, "safetensors"


def stem(source: Path) -> str:
    """The name a checkpoint is known by: its file's (a split one's without the part's number), or its folder's."""
    split = SPLIT_GGUF.match(source.name)
    return split["prefix"] if split else source.stem if source.is_file() else source.name


def stage_and_install(source: Path, files: list[Path], fmt: str, name: str, say: Callable[[str], None]):
    try:  # read where the user named it, so that what is wrong is said of that path
        described = store.describe_checkpoint(files[0] if fmt == "gguf" else source)
    except ModelFormatError as e:
        raise PullError(f"{source} holds no checkpoint llamaterm can read: {e}") from None
    staging = store.models_dir() / ".partial" / f"{name}@local"
    shutil.rmtree(staging, ignore_errors=True)  # an import interrupted before
    staging.mkdir(parents=True)
    try:
        size = sum(f.stat().st_size for f in files)
        say(f"importing {source} ({fmt}: {len(files)} file{'s' * (len(files) > 1)}, {store.format_size(size)})")
        linked = all([take(f, staging / f.name) for f in files])  # every file, whatever the first gave
        manifest = {
            "source": str(source),
            "format": fmt,
            "files": [
                {"path": f.name, "size": f.stat().st_size, "sha256": store.file_hash(staging / f.name)} for f in files
            ],
            "imported_at": datetime.now(UTC).isoformat(timespec="seconds"),
        }
        label = quant_label(stem(source)) if fmt == "gguf" else None  # as a pull names it: the file's label wins
        store.write_manifest(staging, manifest | described | {"quant": label or described["quant"]})
        if not linked:
            say(f"copied {store.format_size(size)} into the store (it is on another file system than {source})")
        return store.install(staging, name)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def take(source: Path, dest: Path) -> bool:
    """The file in the staging folder: hard-linked (True), or copied where the store is on another file system or
    links are refused."""
    try:
        os.link(source, dest)
        return True
    except OSError:
        free = shutil.disk_usage(dest.parent).free
        if source.stat().st_size > free:
            raise PullError(
                f"not enough disk space to import {source.name}: it needs {store.format_size(source.stat().st_size)}, "
                f"and {store.models_dir()} has {store.format_size(free)} free"
            ) from None
        shutil.copyfile(source, dest)
        return False
