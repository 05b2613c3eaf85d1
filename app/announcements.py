"""Servers on this machine, announced for `run`: `llamaterm serve` writes where it listens, which models it holds and a
local key (servers_dir(): <pid>-<port>.json and .key, 0600); `run` and `chat --plain` send their request there once
the server proves it holds the key. A reader trusts only the user's own closed files (README's How it works).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import stat
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from platformdirs import user_runtime_dir

from llamaterm.engine.errors import LlamatermError

if TYPE_CHECKING:
    from llamaterm.app.remote import RemoteEngine

FORMAT = 1  # of the announcement's JSON
MAX_BYTES = 64 * 1024  # an announcement is a few hundred bytes
CONNECT_TIMEOUT_S = 0.25  # a loopback connection takes microseconds, and is refused at once where nothing listens
HEALTH_TIMEOUT_S = 2.0  # the server's event loop answers /health in milliseconds, whatever its engine is doing
CHALLENGE_CHARS = 64  # of a /health challenge (hex): the server reads no more
WILDCARDS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}  # a server on every address: reached on loopback

Note = Callable[[str], None]  # where a reader says what it skipped and why (--verbose)


@dataclass(frozen=True)
class ServedModel:
    id: str  # as the server's /v1/models names it
    path: str  # the checkpoint, resolved (a .gguf file, or a safetensors folder): what `run` matches
    name: str | None  # its name in the store
    repo: str | None  # the Hub repo it was pulled from


@dataclass(frozen=True)
class Announcement:
    url: str  # the API's base, .../v1
    port: int
    pid: int
    instance: str
    started: float  # time.time() once it answered
    device: str
    models: tuple[ServedModel, ...]
    file: Path  # where it was read from

    @property
    def key_file(self) -> Path:
        return self.file.with_suffix(".key")


def servers_dir() -> Path:
    with warnings.catch_warnings():  # platformdirs warns where XDG_RUNTIME_DIR is unset (and uses /tmp/runtime-UID)
        warnings.simplefilter("ignore")
        return Path(user_runtime_dir("llamaterm", appauthor=False)) / "servers"


def not_private(st: os.stat_result, what: str) -> str | None:
    """Why a file or folder with this lstat is not the user's alone, or None."""
    if st.st_uid != os.getuid():
        return f"{what} is owned by another user (uid {st.st_uid})"
    if st.st_mode & 0o077:
        return f"{what} is open to other users (mode {stat.S_IMODE(st.st_mode):03o})"
    return None


# ---- the server's side ----


def served_model(model: str | None, model_id: str) -> ServedModel:
    """How `run` names the model `serve --model MODEL` loaded (model_id: its /v1/models name)."""
    from llamaterm.engine.store.model_store import find_model, models_dir, resolve_model

    path = resolve_model(model).resolve()
    try:
        inside = path.relative_to(models_dir().resolve())
    except ValueError:  # a path outside the store
        return ServedModel(model_id, str(path), None, None)
    name = inside.parts[0]
    return ServedModel(model_id, str(path), name, find_model(name).manifest.get("repo"))


class Announcer:
    """A server's announcement: its local key and instance id from the start, written once it answers (write), and
    removed as it exits (remove)."""

    def __init__(self, host: str, port: int, device: str, models: list[ServedModel]):
        self.key = secrets.token_urlsafe(32)
        self.instance = secrets.token_hex(16)
        host = WILDCARDS.get(host, host)
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"
        self.port, self.device, self.models = port, device, models
        self.file = servers_dir() / f"{os.getpid()}-{port}.json"

    def write(self) -> None:
        """LlamatermError where the folder cannot be made the user's alone: the server then serves unannounced."""
        folder = private_folder(self.file.parent)
        data = {
            "format": FORMAT,
            "url": self.url,
            "port": self.port,
            "pid": os.getpid(),
            "instance": self.instance,
            "started": time.time(),
            "device": self.device,
            "models": [asdict(m) for m in self.models],
        }
        write_private(folder / self.file.with_suffix(".key").name, self.key)  # first: whoever sees the JSON has it
        write_private(self.file, json.dumps(data, indent=2) + "\n")

    def remove(self) -> None:
        remove(self.file)


def private_folder(folder: Path) -> Path:
    """The folder, made (with its missing parents) 0700; LlamatermError where it is another user's."""
    missing = [p for p in (folder, *folder.parents) if not p.exists()]
    try:
        for p in reversed(missing):
            p.mkdir(mode=0o700, exist_ok=True)
        st = folder.lstat()
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and st.st_mode & 0o077:
            folder.chmod(0o700)  # ours, made open by hand or an old umask
            st = folder.lstat()
    except OSError as e:
        raise LlamatermError(f"cannot make {folder}: {e.strerror or e}") from None
    problem = "it is not a folder" if not stat.S_ISDIR(st.st_mode) else not_private(st, str(folder))
    if problem:
        raise LlamatermError(problem)
    return folder


def write_private(path: Path, text: str) -> None:
    """Whole or not at all (a reader never sees half a file), readable by the user alone."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    tmp.replace(path)


def remove(file: Path) -> None:
    """An announcement and its key file."""
    for path in (file, file.with_suffix(".key")):
        path.unlink(missing_ok=True)


# ---- the client's side ----


class Skipped(Exception):
    """An announcement not used, and why. stale: the server is gone for sure, and its files may go."""

    def __init__(self, reason: str, stale: bool = False):
        super().__init__(reason)
        self.stale = stale


def read_private(path: Path, what: str = "it") -> str:
    """A file only the user can have written; Skipped otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # a link or a FIFO: not followed, not waited on
    except OSError as e:
        raise Skipped(f"cannot read {what} ({e.strerror or e})") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        problem = f"{what} is not a regular file" if not stat.S_ISREG(st.st_mode) else not_private(st, what)
        if problem:
            raise Skipped(problem)
        data = f.read(MAX_BYTES + 1)
    if len(data) > MAX_BYTES:
        raise Skipped(f"{what} is over {MAX_BYTES} bytes")
    try:
        return data.decode()
    except UnicodeDecodeError:
        raise Skipped(f"{what} is not UTF-8 text") from None


def read_announcement(file: Path) -> Announcement:
    """Skipped for a file that is not the user's alone, or not an announcement."""
    text = read_private(file)
    try:
        data = json.loads(text)
        models = tuple(ServedModel(**m) for m in data["models"])
        found = Announcement(
            data["url"], data["port"], data["pid"], data["instance"], data["started"], data["device"], models, file
        )
        assert data["format"] == FORMAT
        assert all(isinstance(getattr(found, k), str) for k in ("url", "instance", "device"))
        assert all(
            isinstance(getattr(found, k), int) and not isinstance(getattr(found, k), bool) for k in ("port", "pid")
        )
        assert isinstance(found.started, int | float) and found.pid > 0
        assert all(isinstance(m.id, str) and isinstance(m.path, str) for m in models)
    except (ValueError, KeyError, TypeError, AssertionError, RecursionError):
        raise Skipped("it is not an announcement llamaterm can read (damaged, or of another version)") from None
    return found


def announcements(note: Note) -> list[Announcement]:
    """The readable announcements, the oldest server first; what is skipped goes to `note`, the stale removed."""
    folder = servers_dir()
    try:
        st = folder.lstat()
    except FileNotFoundError:
        return []
    except OSError as e:
        note(f"cannot read {folder} ({e.strerror or e}): looking for no server")
        return []
    problem = "it is not a folder" if not stat.S_ISDIR(st.st_mode) else not_private(st, "it")
    if problem:
        note(f"skipped the servers' announcements in {folder}: {problem}")
        return []
    found = []
    for file in sorted(folder.glob("*.json")):
        try:
            found.append(read_announcement(file))
        except Skipped as e:
            note(f"skipped {file}: {e}")
    return sorted(found, key=lambda a: (a.started, a.port, a.instance))


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: not the user's server, which ran as the user
        return False
    return not zombie(pid)


def zombie(pid: int) -> bool:
    """A process that has exited and waits for its parent to read its exit code (Linux's /proc says)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def proof(key: str, challenge: str) -> str:
    """What only the holder of `key` can answer to `challenge`: an HMAC, which tells nothing of the key."""
    return hmac.new(key.encode(), challenge[:CHALLENGE_CHARS].encode(), hashlib.sha256).hexdigest()


def check_alive(found: Announcement, key: str) -> None:
    """Skipped unless the announced server answers, as itself, and takes requests."""
    status, body = health(found, key)
    if status != 200:
        raise Skipped(f"the server at {found.url.removesuffix('/v1')} takes no requests now ({body.get('status')})")


def health(found: Announcement, key: str) -> tuple[int, dict]:
    """The announced server's /health (its HTTP status and body), once it has proved it is that server; Skipped
    where it is gone, silent, or another. (http.client: a GET on loopback needs no more, and it loads at once.)"""
    if not pid_alive(found.pid):
        raise Skipped(f"its server (pid {found.pid}) is gone", stale=True)
    challenge = secrets.token_hex(CHALLENGE_CHARS // 2)
    status, body = get(found, f"/health?challenge={challenge}")  # no key: it goes only to a server that proves
    if not isinstance(body, dict) or not hmac.compare_digest(str(body.get("proof")), proof(key, challenge)):
        raise Skipped(f"another server answers at {found.url.removesuffix('/v1')}")  # (its pid lives: the files stay)
    return status, body


def get(found: Announcement, path: str, key: str | None = None) -> tuple[int, object]:
    """GET `path` of the announced server: (the HTTP status, the body: JSON, else text); Skipped where nothing
    answers."""
    import http.client
    from urllib.parse import urlsplit

    root = found.url.removesuffix("/v1")
    connection = http.client.HTTPConnection(urlsplit(root).hostname or "", found.port, timeout=CONNECT_TIMEOUT_S)
    try:
        connection.connect()
        assert connection.sock is not None
        connection.sock.settimeout(HEALTH_TIMEOUT_S)
        connection.request("GET", path, headers={"Authorization": f"Bearer {key}"} if key else {})
        reply = connection.getresponse()
        data = reply.read(MAX_BYTES)
    except ConnectionRefusedError:
        raise Skipped(f"nothing listens at {root}", stale=True) from None
    except (OSError, http.client.HTTPException) as e:
        raise Skipped(f"the server at {root} did not answer {path.split('?')[0]} ({type(e).__name__})") from None
    finally:
        connection.close()
    try:
        return reply.status, json.loads(data)
    except (ValueError, RecursionError):
        return reply.status, data.decode(errors="replace")


def remove_if_unchanged(found: Announcement) -> None:
    """A stale announcement's files, unless a new server has announced itself under the same name since (the
    same pid and port after a restart, as in a container)."""
    try:
        if read_announcement(found.file).instance != found.instance:
            return
    except Skipped:
        pass
    remove(found.file)


def find_server(model: str | None, device: str | None, note: Note) -> RemoteEngine | None:
    """A server announced on this machine that holds `model` (None: the default model) on `device` (None: any),
    alive and answering as itself, as an engine; None where there is none (each one skipped goes to `note`, with
    why). Of several, the one that started first."""
    from llamaterm.engine.store.model_store import resolve_model

    t = time.perf_counter()
    try:
        wanted = str(resolve_model(model).resolve())
    except LlamatermError:  # loading it here says what is wrong
        return None
    shown = model or "the default model"
    holding = []
    for found in announcements(note):
        held = next((m for m in found.models if m.path == wanted), None)
        if held is None:
            note(f"skipped the server at {found.url}: it holds {', '.join(m.id for m in found.models)}, not {shown}")
        elif device and found.device.split(":")[0] != device and found.device != device:
            note(f"skipped the server at {found.url}: it runs on {found.device}, not {device}")
        else:
            holding.append((found, held))
    for found, held in holding:
        try:
            engine = connect(found, held)
        except Skipped as e:
            note(f"skipped the server at {found.url} ({found.file}): {e}" + ("; removed it" if e.stale else ""))
            if e.stale:
                remove_if_unchanged(found)
            continue
        others = f" (of the {len(holding)} that hold it, the first started that answers)" if len(holding) > 1 else ""
        note(
            f"{held.id} on the server at {found.url}{others}: pid {found.pid}, {found.device}, announced in "
            f"{found.file}; found in {time.perf_counter() - t:.3f} s (--local loads the model here instead)"
        )
        return engine
    return None


def connect(found: Announcement, held: ServedModel) -> RemoteEngine:
    from llamaterm.app.remote import RemoteEngine

    key = read_private(found.key_file, f"its key file {found.key_file.name}").strip()
    check_alive(found, key)
    try:
        return RemoteEngine(found.url, held.id, key, token_ids=True)
    except LlamatermError as e:
        raise Skipped(str(e)) from None
