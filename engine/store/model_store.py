"""The model store: checkpoints under the user's data directory, referred to by short names.

Layout of models_dir():
    <name>/                 one folder per model: its files and a manifest, llamaterm.json
    .partial/<name>@<commit>/  downloads in progress (hub.py); invisible to ls and resolve
    .locks/<name>.lock      held while a model is pulled or removed: concurrent pulls leave one good copy
    .trash/                 folders on their way out: renamed here first so they vanish from the store at once
"""

import difflib
import hashlib
import json
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from platformdirs import user_data_dir

from llamaterm.engine.checkpoints.gguf_files import is_first_gguf
from llamaterm.engine.errors import LlamatermError, ModelFormatError, ModelNotFound

if TYPE_CHECKING:
    from filelock import FileLock

DEFAULT_MODEL = "default"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MANIFEST = "llamaterm.json"
# Store names: what `pull` derives from a repo and quant, or what --name gives.
VALID_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]*$")

# The Hub's own rule for a repo id's parts (huggingface_hub's validate_repo_id): letters, digits, '-', '_', '.',
# not at either end '-' or '.', and no '--' or '..'; 96 characters in all
_REPO_PART = re.compile(r"(?!.*(?:--|\.\.))[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?")
_QUANT = re.compile(r"[A-Za-z0-9_.-]+")


# what may stand before a repo's name, as ollama takes `hf.co/OWNER/REPO:QUANT` and a browser's address bar gives it
HUB_PREFIXES = ("https://huggingface.co/", "https://hf.co/", "huggingface.co/", "hf.co/")


def parse_ref(ref: str) -> tuple[str, str | None]:
    """'owner/name[:QUANT]', or 'hf.co/owner/name[:QUANT]' as ollama takes it -> (repo, quant). ValueError for
    anything else."""
    given = ref
    for prefix in HUB_PREFIXES:
        ref = ref.removeprefix(prefix)
    repo, colon, quant = ref.partition(":")
    parts = repo.split("/")
    if (
        len(parts) != 2
        or len(repo) > 96
        or not all(_REPO_PART.fullmatch(p) for p in parts)
        or (colon and not _QUANT.fullmatch(quant))
    ):
        raise ValueError(
            f"{given!r} is not a model reference: expected OWNER/NAME or OWNER/NAME:QUANT, in letters, digits, '-', "
            "'_' and '.' (as the Hugging Face Hub names repos)"
        )
    return repo, quant or None


def data_dir() -> Path:
    """LLAMATERM_HOME overrides the platform's user data directory (tests use it to stay hermetic)."""
    return Path(os.environ.get("LLAMATERM_HOME") or user_data_dir("llamaterm", appauthor=False))


def models_dir() -> Path:
    return data_dir() / "models"


def default_model_path() -> Path:
    return models_dir() / "default" / DEFAULT_GGUF


@dataclass
class StoredModel:
    name: str
    folder: Path
    manifest: dict[str, Any]  # repo, revision, format, quant, architecture, parameters, files, ...

    @property
    def checkpoint(self) -> Path:
        """What the loader takes: the .gguf file (the first part of a split one) or the safetensors folder."""
        if self.manifest["format"] == "safetensors":
            return self.folder
        firsts = sorted(f["path"] for f in self.manifest["files"] if is_first_gguf(f["path"]))
        return self.folder / firsts[0]

    def size_on_disk(self) -> int:
        return folder_size(self.folder)


def folder_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def file_hash(path: Path, new=hashlib.sha256) -> str:
    """The hex digest of a file's bytes; `new` makes the hash object (it may be primed, as git's blob id is)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, new).hexdigest()


def format_size(n: float) -> str:
    """Bytes in decimal units, as the Hub shows file sizes: '807.7 MB'."""
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


class UnsafeFileName(LlamatermError):
    pass


def place(folder: Path, name: str) -> Path:
    """Where the file `name` (from a Hub listing or a manifest: untrusted) lies in a model folder.

    The one check that keeps downloads inside the store: a relative path of plain names joined by '/', so no
    absolute path, no '..', no backslash or drive letter (which Windows would take as separators)."""
    parts = name.split("/")
    if any(part in ("", ".", "..") or any(c in part for c in "\\:\0") for part in parts):
        raise UnsafeFileName(f"{name!r} is not a safe file name: it would land outside {folder}")
    return folder.joinpath(*parts)


def model_lock(name: str) -> "FileLock":
    from filelock import FileLock  # pull and rm take it; loading a model (and `run`'s look for a server) does not

    locks = models_dir() / ".locks"
    locks.mkdir(parents=True, exist_ok=True)
    return FileLock(locks / f"{name}.lock")


def write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    tmp = folder / f".{MANIFEST}.{uuid.uuid4().hex[:8]}"
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    tmp.replace(folder / MANIFEST)


def describe_checkpoint(checkpoint: Path) -> dict[str, Any]:
    """The manifest fields that `ls` shows, read once from the files so `ls` stays fast."""
    from llamaterm.engine.checkpoints.checkpoint_info import read_checkpoint  # numpy: not for resolving a name

    info = read_checkpoint(checkpoint)
    return {
        "format": info.format,
        "quant": info.quant,
        "architecture": info.architecture,
        "family": info.family,
        "parameters": info.parameters,
        "context_length": info.context_length,
    }


class DamagedModel(ModelFormatError):
    """A folder in the store that holds no model llamaterm can read; `rm` still removes it."""

    def __init__(self, name: str, folder: Path, reason: str):
        super().__init__(
            f"the stored model {name!r} is damaged ({reason}): `llamaterm rm {name}` removes it, then pull it again"
        )
        self.name, self.folder, self.reason = name, folder, reason


def _adopt(folder: Path) -> dict[str, Any]:
    """A manifest for a folder that `pull` did not write (the default model, a copied-in checkpoint), cached.
    Raises DamagedModel for a folder without a readable checkpoint.

    Only top-level files count: the default model's installer stages its download in a subfolder.
    """
    firsts = sorted(p for p in folder.glob("*.gguf") if is_first_gguf(p.name))
    if firsts:
        files = list(folder.glob("*.gguf"))
        checkpoint = firsts[0]
    elif (folder / "config.json").exists() and any(folder.glob("*.safetensors")):
        files = [p for p in folder.iterdir() if p.is_file() and p.name != MANIFEST]
        checkpoint = folder
    else:
        raise DamagedModel(
            folder.name, folder, f"no usable {MANIFEST}, and no .gguf file or config.json with *.safetensors beside it"
        )
    try:
        manifest = describe_checkpoint(checkpoint)
    except (ModelFormatError, OSError) as e:  # a damaged checkpoint is left out of the listing, not fatal to it
        raise DamagedModel(folder.name, folder, str(e)) from None
    manifest["files"] = [{"path": p.name, "size": p.stat().st_size} for p in sorted(files)]
    try:
        write_manifest(folder, manifest)
    except OSError:
        pass  # a read-only store still lists; it just reads the checkpoint again next time
    return manifest


def stored_names() -> list[str]:
    """The store's model names as its folders give them, none read: what shell completion offers, at once."""
    root = models_dir()
    return sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")) if root.is_dir() else []


def list_models() -> list[StoredModel]:
    return scan_store()[0]


def scan_store() -> tuple[list[StoredModel], list[DamagedModel]]:
    """The stored models, and the folders that hold none llamaterm can read (each a model's name all the same)."""
    root = models_dir()
    if not root.is_dir():
        return [], []
    models, damaged = [], []
    for folder in sorted(root.iterdir()):
        if folder.name.startswith(".") or not folder.is_dir():
            continue
        try:
            manifest = json.loads((folder / MANIFEST).read_text())
        except (OSError, ValueError):  # none, unreadable or not JSON: rebuilt from the files
            manifest = None
        try:
            if not _usable(manifest):  # `{}`, `[]`, a file list that leaves the folder: rebuilt from the files too
                manifest = _adopt(folder)
        except DamagedModel as e:
            damaged.append(e)
            continue
        models.append(StoredModel(folder.name, folder, manifest))
    return models, damaged


def _usable(manifest) -> bool:
    """A manifest that `ls`, `rm` and the loader can rely on: a format, and files that lie inside the folder."""
    if not isinstance(manifest, dict) or manifest.get("format") not in ("gguf", "safetensors"):
        return False
    files = manifest.get("files")
    if not isinstance(files, list) or not all(isinstance(f, dict) and isinstance(f.get("path"), str) for f in files):
        return False
    try:
        for f in files:
            place(Path("."), f["path"])
    except UnsafeFileName:
        return False
    return manifest["format"] == "safetensors" or any(is_first_gguf(f["path"]) for f in files)


def find_model(name: str) -> StoredModel:
    """A stored model by name (case-insensitive); DamagedModel for a folder of that name that holds none, or
    ModelNotFound that suggests the close names."""
    found, damaged = scan_store()
    models = {m.name.lower(): m for m in found}
    if name.lower() in models:
        return models[name.lower()]
    for d in damaged:
        if d.name.lower() == name.lower():
            raise d
    raise ModelNotFound(f"no model named {name!r} in the store.{_suggestions(name, list(models))}")


def _suggestions(name: str, names: list[str]) -> str:
    key = name.lower()
    close = [n for n in names if key in n] + difflib.get_close_matches(key, names, n=3, cutoff=0.5)
    close = list(dict.fromkeys(close))[:5]
    if close:
        return f" Did you mean: {', '.join(close)}?"
    if names:
        return " `llamaterm ls` lists the stored models."
    return " The store is empty: `llamaterm pull REPO` downloads a model."


def resolve_model(name: str | None) -> Path:
    """A model name (or None for the default) or a path to a checkpoint -> the checkpoint's path."""
    if name is None or name == DEFAULT_MODEL:
        path = default_model_path()
        if not path.exists():
            raise ModelNotFound(
                f"the default model is not installed (expected {path}).\n"
                "Run `make setup` (or `python -m llamaterm.engine.store.default_model`) to download it."
            )
        return path
    candidate = Path(name).expanduser()
    if candidate.exists():
        return candidate
    if name.startswith(("/", "./", "../", "~")) or name.endswith(".gguf"):  # a path, not a store's name
        raise ModelNotFound(
            f"no such file or folder: {name} (a model is a .gguf file, a model folder or a stored name)"
        )
    if "/" in name:  # a Hub reference, as `pull` took it
        return pulled(name).checkpoint
    return find_model(name).checkpoint


def pulled(ref: str) -> StoredModel:
    """The stored model that `llamaterm pull REF` brought (OWNER/NAME[:QUANT], hf.co/ before it or not)."""
    try:
        repo, quant = parse_ref(ref)
    except ValueError as e:
        raise ModelNotFound(f"{e}; or a stored name, or a path") from None
    found = [
        m
        for m in list_models()
        if (m.manifest.get("repo") or "").lower() == repo.lower()
        and (quant is None or (m.manifest.get("quant") or "").lower() == quant.lower())
    ]
    if not found:
        raise ModelNotFound(f"{ref} is not in the store: `llamaterm pull {ref}` downloads it")
    if len(found) > 1:
        raise ModelNotFound(f"the store holds several models of {ref}: name one, {', '.join(m.name for m in found)}")
    return found[0]


def install(staged: Path, name: str) -> StoredModel:
    """Move a complete, verified folder into the store as `name`, replacing any older copy.

    The caller holds model_lock(name).

    Each rename is atomic, so readers see the old model or the new one, never a mix of files.
    """
    dest = models_dir() / name
    if dest.exists():
        _discard(dest)
    staged.replace(dest)
    return StoredModel(name, dest, json.loads((dest / MANIFEST).read_text()))


def remove_model(model: StoredModel | DamagedModel) -> None:
    """Remove a stored model's folder. Hold model_lock(model.name)."""
    _discard(model.folder)


def _discard(folder: Path) -> None:
    trash = models_dir() / ".trash"
    trash.mkdir(parents=True, exist_ok=True)
    doomed = trash / f"{folder.name}-{uuid.uuid4().hex[:8]}"
    folder.replace(doomed)  # gone from the store in one step, even if the deletion below is interrupted
    shutil.rmtree(doomed)
