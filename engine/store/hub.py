"""Pull models from the Hugging Face Hub into the store: `llamaterm pull REPO[:QUANT]`. huggingface_hub lists the repo;
the download is ours, so that it resumes: each file into `<file>.part` with a Range request, checked against the
Hub's hash, then renamed, and the model's folder renamed into the store whole.
"""

import errno
import hashlib
import os
import re
import shutil
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import httpx2
from filelock import Timeout
from huggingface_hub import HfApi, constants, get_session, get_token, hf_hub_url, hf_raise_for_status
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import build_hf_headers
from huggingface_hub.utils import tqdm as hf_tqdm

from llamaterm.engine.checkpoints.gguf_files import SPLIT_GGUF
from llamaterm.engine.errors import LlamatermError, ModelFormatError
from llamaterm.engine.store.model_store import (
    VALID_NAME,
    StoredModel,
    UnsafeFileName,
    describe_checkpoint,
    file_hash,
    format_size,
    install,
    list_models,
    model_lock,
    models_dir,
    parse_ref,
    place,
    write_manifest,
)

# Without a quant in the request, the first of these that the repo has: Q4_K_M, else the closest 4-bit.
PREFERRED_QUANTS = ("Q4_K_M", "Q4_K_S", "Q4_K_L", "Q4_K_XL", "IQ4_XS", "IQ4_NL", "Q4_1", "Q4_0")
# A quant label in a GGUF file name (the GGUF spec's naming convention): Q4_K_M, IQ4_XS, Q8_0, TQ1_0, MXFP4, BF16...
QUANT_LABEL = re.compile(r"^(I?Q\d+(_[A-Z0-9]+)*|TQ\d_\d|MXFP4(_MOE)?|BF16|F16|F32)$", re.IGNORECASE)
# What a safetensors model needs beside its *.safetensors: config and tokenizer files. Never pickles.
SAFETENSORS_EXTRAS = re.compile(
    r"^(config\.json|generation_config\.json|model\.safetensors\.index\.json|tokenizer.*\.json|tokenizer\.model"
    r"|special_tokens_map\.json|added_tokens\.json|vocab\.json|merges\.txt|chat_template\.jinja|chat_template\.json)$"
)
GIT_SHA = re.compile(r"^[0-9a-f]{40}$")
RETRIES = 3  # consecutive failed attempts, without a byte of progress, before giving up on a file
RETRY_DELAY_S = 1.0


class PullError(LlamatermError):
    pass


@dataclass(frozen=True)
class RemoteFile:
    path: str
    size: int
    sha256: str | None  # LFS files: the sha256 of the content
    blob_id: str | None  # other files: the git blob id, sha1("blob <size>\0" + content)


@dataclass
class PullPlan:
    repo: str
    revision: str | None  # as asked for (a branch, tag or commit); None for the default branch
    commit: str  # what it resolved to: every file is fetched at this commit
    format: str  # "gguf" or "safetensors"
    quant: str | None  # the GGUF quant label; None for safetensors (the manifest reads it from config.json)
    files: list[RemoteFile]
    name: str


def default_name(repo: str, quant: str | None) -> str:
    """'bartowski/Llama-3.2-1B-Instruct-GGUF', 'Q4_K_M' -> 'llama-3.2-1b-instruct-q4_k_m'."""
    base = re.sub(r"[-_.]gguf$", "", repo.split("/")[-1].lower())
    if quant and quant.lower() not in base:
        base = f"{base}-{quant.lower()}"
    return re.sub(r"[^a-z0-9._-]+", "-", base).strip("-._") or "model"


def quant_label(stem: str) -> str | None:
    """The last quant-like token of a GGUF file stem: 'Llama-3.2-1B-Instruct-Q4_K_M' -> 'Q4_K_M'."""
    labels = [t.upper() for t in re.split(r"[-./]", stem) if QUANT_LABEL.match(t)]
    return labels[-1] if labels else None


def gguf_units(paths: list[str]) -> dict[str, list[str]]:
    """A GGUF repo's downloadable units, by stem: each single file, and each complete set of split parts."""
    units: dict[str, list[str]] = {}
    for path in paths:
        if Path(path).name.lower().startswith("mmproj"):
            continue  # vision projectors, not language models
        m = SPLIT_GGUF.match(path)
        units.setdefault(m["prefix"] if m else path.removesuffix(".gguf"), []).append(path)
    for stem, parts in list(units.items()):
        parts.sort()
        m = SPLIT_GGUF.match(parts[0])
        if m and len(parts) != int(m["count"]):
            del units[stem]  # an incomplete upload: not something we can load
    return units


def pick_gguf(repo: str, units: dict[str, list[str]], quant: str | None) -> tuple[str, list[str]]:
    """(label, files) of the unit that `quant` names; without one, the preferred 4-bit quant."""
    labels = {stem: quant_label(stem) or Path(stem).name for stem in units}
    counts = Counter(labels.values())
    # What a user types to pick a unit: its quant label, or its file stem where several share a label.
    choice = {stem: label if counts[label] == 1 else Path(stem).name for stem, label in labels.items()}
    if quant:
        q = quant.lower().removesuffix(".gguf")
        stems = [s for s, label in labels.items() if label.lower() == q] or [
            s for s in units if Path(s).name.lower() == q
        ]
        if not stems:
            raise PullError(f"{repo} has no quant {quant}; it has: {', '.join(sorted(set(choice.values())))}")
    elif len(units) == 1:
        stems = list(units)
    else:
        stems = next(([s for s in units if labels[s] == q] for q in PREFERRED_QUANTS if q in labels.values()), [])
        stems = stems or [s for s in units if labels[s].startswith(("Q4", "IQ4"))]
        if not stems:
            raise PullError(
                f"{repo} has several GGUF files and no 4-bit one to pick by default; choose one: "
                + ", ".join(f"{repo}:{c}" for c in sorted(choice.values()))
            )
    if len(stems) > 1:
        raise PullError(
            f"several GGUF files of {repo} match; choose one: " + ", ".join(f"{repo}:{choice[s]}" for s in stems)
        )
    return labels[stems[0]], units[stems[0]]


def endpoint() -> str:
    # Read at call time: huggingface_hub reads HF_ENDPOINT once, when it is first imported.
    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def offline_mode() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").upper() in constants.ENV_VARS_TRUE_VALUES


def gated_message(repo: str) -> str:
    return (
        f"{repo} is gated: accept its conditions at {endpoint()}/{repo}, then log in here with "
        "`hf auth login` (or set HF_TOKEN)"
    )


@contextmanager
def hub_errors(repo: str, revision: str | None) -> Iterator[None]:
    """Turn huggingface_hub's exceptions into one-line messages that say what to do."""
    try:
        yield
    except GatedRepoError:
        raise PullError(gated_message(repo)) from None
    except RepositoryNotFoundError:
        raise PullError(
            f"no repo {repo} on {endpoint()} (if it is private, log in with `hf auth login` or set HF_TOKEN)"
        ) from None
    except RevisionNotFoundError:
        raise PullError(f"{repo} has no revision {revision!r}") from None
    except HfHubHTTPError as e:
        raise PullError(f"the Hub refused a request for {repo}: {str(e).strip().splitlines()[0]}") from None
    except httpx2.TransportError as e:
        raise PullError(f"cannot reach {endpoint()}: {e}") from None


def plan_pull(repo: str, quant: str | None, revision: str | None, name: str | None) -> PullPlan:
    """Ask the Hub what the repo holds and choose the files to fetch."""
    with hub_errors(repo, revision):
        info = HfApi(endpoint=endpoint()).model_info(
            repo, revision=revision, files_metadata=True, timeout=constants.HF_HUB_ETAG_TIMEOUT
        )
    if not isinstance(info.sha, str) or not GIT_SHA.match(info.sha):  # it names a folder in the store
        raise PullError(
            f"{endpoint()} answered {str(info.sha)[:60]!r} as the commit of {repo}, not a git commit id: "
            "refusing it (is HF_ENDPOINT a Hub?)"
        )
    if info.gated and get_token() is None:
        raise PullError(gated_message(repo))  # say so now, not after the first download fails
    remote = {
        s.rfilename: RemoteFile(s.rfilename, s.size or 0, s.lfs.sha256 if s.lfs else None, s.blob_id)
        for s in info.siblings or []
    }
    units = gguf_units([p for p in remote if p.endswith(".gguf")])
    top_level = [p for p in remote if "/" not in p]
    if units:
        label, paths = pick_gguf(repo, units, quant)
        fmt = "gguf"
    elif any(p.endswith(".safetensors") for p in top_level):
        if quant:
            raise PullError(f"{repo} has no GGUF files, so no quant {quant}; pull {repo} for its safetensors weights")
        if "config.json" not in remote:
            raise PullError(f"{repo} has safetensors weights but no config.json: llamaterm cannot load it")
        label, fmt = None, "safetensors"
        paths = [p for p in top_level if p.endswith(".safetensors") or SAFETENSORS_EXTRAS.match(p)]
    else:
        listed = ", ".join(sorted(remote)[:8]) + (", ..." if len(remote) > 8 else "") or "none"
        raise PullError(
            f"{repo} has no GGUF or safetensors weights (files: {listed}); "
            "llamaterm never loads pickled weights (*.bin, *.pt, *.pth)"
        )
    name = name or default_name(repo, label)
    if not VALID_NAME.match(name):
        raise PullError(f"{name!r} cannot be a model name: use lowercase letters, digits, '.', '_' and '-'")
    return PullPlan(repo, revision, info.sha, fmt, label, [remote[p] for p in sorted(paths)], name)


def pull(
    ref: str,
    *,
    revision: str | None = None,
    name: str | None = None,
    offline: bool = False,
    say: Callable[[str], None] = lambda message: None,
) -> StoredModel:
    """Make `ref` ('owner/name[:QUANT]') available in the store and return it; offline, only look there."""
    repo, quant = parse_ref(ref)
    if offline or offline_mode():
        return stored_copy(repo, quant, revision, name)
    plan = plan_pull(repo, quant, revision, name)
    lock = model_lock(plan.name)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        say(f"waiting for another pull of {plan.name} to finish")
        lock.acquire()
    try:
        existing = _stored(plan.name)
        if existing is None:
            return _download_and_install(plan, say)
        held = existing.manifest
        same_repo = (held.get("repo") or "").lower() == repo.lower()
        same_quant = plan.quant is None or held.get("quant") == plan.quant
        if not (same_repo and same_quant):
            source = held.get("repo") or "a local checkpoint"
            raise PullError(
                f"the store already has a model named {plan.name} (from {source}): pick another with --name"
            )
        if held.get("revision") == plan.commit:
            say(f"{plan.name} is up to date ({repo} at {plan.commit[:12]})")
            return existing
        return _download_and_install(plan, say)
    finally:
        lock.release()


def stored_copy(repo: str, quant: str | None, revision: str | None, name: str | None) -> StoredModel:
    """The store's copy of repo[:quant], for offline use."""
    found = [
        m
        for m in list_models()
        if (m.manifest.get("repo") or "").lower() == repo.lower()
        and (quant is None or (m.manifest.get("quant") or "").lower() == quant.lower())
        and (revision is None or revision in (m.manifest.get("revision"), m.manifest.get("requested_revision")))
        and (name is None or m.name == name)
    ]
    wanted = repo + (f":{quant}" if quant else "")
    if not found:
        raise PullError(f"offline, and {wanted} is not in the store: pull it once while online")
    if len(found) > 1:
        raise PullError(f"offline, and several copies of {wanted} are stored: {', '.join(m.name for m in found)}")
    return found[0]


def _stored(name: str) -> StoredModel | None:
    return next((m for m in list_models() if m.name == name), None)


def _download_and_install(plan: PullPlan, say: Callable[[str], None]) -> StoredModel:
    partial = models_dir() / ".partial"
    staging = partial / f"{plan.name}@{plan.commit}"
    try:
        dests = {f.path: place(staging, f.path) for f in plan.files}  # checked before anything is written
    except UnsafeFileName as e:
        raise PullError(f"{plan.repo} lists a file named {e}: refusing to pull it (is HF_ENDPOINT a Hub?)") from None
    for stale in partial.glob(f"{plan.name}@*"):
        if stale != staging:
            shutil.rmtree(stale)  # an interrupted pull of an older commit: its bytes are of no use now
    staging.mkdir(parents=True, exist_ok=True)
    _check_disk_space(plan, staging, dests)
    n, total = len(plan.files), format_size(sum(f.size for f in plan.files))
    say(f"pulling {plan.repo} ({plan.quant or plan.format}: {n} file{'s' * (n > 1)}, {total})")
    headers = build_hf_headers()
    with hub_errors(plan.repo, plan.revision):
        for f in plan.files:
            url = hf_hub_url(plan.repo, f.path, revision=plan.commit, endpoint=endpoint())
            _download(url, dests[f.path], f, headers, say)
    manifest = {
        "repo": plan.repo,
        "revision": plan.commit,
        "requested_revision": plan.revision,
        "format": plan.format,
        "quant": plan.quant,
        "files": [{"path": f.path, "size": f.size, "sha256": f.sha256 or file_hash(dests[f.path])} for f in plan.files],
        "pulled_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    try:
        described = describe_checkpoint(StoredModel(plan.name, staging, manifest).checkpoint)
    except ModelFormatError as e:  # the hub's bytes, verified: downloading them again gives the same
        shutil.rmtree(staging, ignore_errors=True)
        raise PullError(f"{plan.repo} at {plan.commit[:12]} holds no checkpoint llamaterm can read: {e}") from None
    manifest |= {**described, "quant": plan.quant or described["quant"]}  # the label the user chose wins
    write_manifest(staging, manifest)
    return install(staging, plan.name)


def _check_disk_space(plan: PullPlan, staging: Path, dests: dict[str, Path]) -> None:
    def missing(f: RemoteFile) -> int:
        final = dests[f.path]
        part = final.with_name(final.name + ".part")
        return 0 if final.exists() else f.size - (part.stat().st_size if part.exists() else 0)

    need = sum(missing(f) for f in plan.files)
    free = shutil.disk_usage(staging).free
    if need > free:
        raise PullError(
            f"not enough disk space to pull {plan.name}: it needs {format_size(need)} more, "
            f"and {models_dir()} has {format_size(free)} free"
        )


def _download(url: str, dest: Path, remote: RemoteFile, headers: dict[str, str], say: Callable[[str], None]) -> None:
    """Fetch one file to `dest` (resuming `dest.part`), verify it, then rename it into place."""
    if dest.exists():
        return  # fetched and verified by an earlier, interrupted run of this pull
    part = dest.with_name(dest.name + ".part")
    part.parent.mkdir(parents=True, exist_ok=True)
    if part.exists():
        say(f"resuming {remote.path} at {format_size(part.stat().st_size)}")
    try:
        with (
            open(part, "ab") as out,
            hf_tqdm(desc=remote.path, total=remote.size, initial=out.tell(), unit="B", unit_scale=True) as bar,
        ):
            failures = 0
            while out.tell() < remote.size:
                start = out.tell()
                try:
                    _stream(url, out, headers, bar, remote)
                except httpx2.TransportError as e:
                    failures = 0 if out.tell() > start else failures + 1
                    if failures >= RETRIES:
                        raise PullError(
                            f"network error while downloading {remote.path} ({e}); "
                            f"{format_size(out.tell())} of {format_size(remote.size)} kept: "
                            "run the same command again to resume"
                        ) from None
                    say(f"connection lost at {format_size(out.tell())} ({e}); resuming")
                    time.sleep(RETRY_DELAY_S)
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        part.unlink(missing_ok=True)  # leave the disk as we found it
        raise PullError(f"disk full while downloading {remote.path}: free some space and pull again") from None
    _verify(part, remote)
    part.replace(dest)


def _stream(url: str, out, headers: dict[str, str], bar, remote: RemoteFile) -> None:
    """Append the rest of the file at `url` to `out`, from its current length; never past the listed size."""
    offset = out.tell()
    request_headers = {**headers, "Range": f"bytes={offset}-"} if offset else headers
    with get_session().stream(
        "GET", url, headers=request_headers, timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT
    ) as response:
        hf_raise_for_status(response)
        if offset and response.status_code != 206:  # the server ignored the Range: start again
            out.seek(0)
            out.truncate()
            bar.reset(total=bar.total)
        for chunk in response.iter_bytes():
            if out.tell() + len(chunk) > remote.size:
                out.truncate(0)
                raise PullError(
                    f"the Hub sent more of {remote.path} than the {remote.size} bytes it listed; the "
                    "download was deleted: pull again"
                )
            out.write(chunk)
            bar.update(len(chunk))


def _verify(part: Path, remote: RemoteFile) -> None:
    expected: str | None  # the Hub's listing may lack a blob id
    if remote.sha256:
        kind, expected, actual = "sha256", remote.sha256, file_hash(part)
    else:
        blob = f"blob {part.stat().st_size}\0".encode()  # git hashes a header, then the content
        kind, expected, actual = "git blob id", remote.blob_id, file_hash(part, lambda: hashlib.sha1(blob))
    if actual != expected:
        part.unlink()
        raise PullError(
            f"{remote.path} is corrupt ({kind} {actual[:12]}..., the Hub says {str(expected)[:12]}...); "
            "the download was deleted: pull again to fetch it afresh"
        )
