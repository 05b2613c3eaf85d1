"""A Hugging Face Hub look-alike on 127.0.0.1 for tests: point HF_ENDPOINT at `HubServer().url`.

It serves what huggingface_hub and engine.hub ask for:
    GET  /api/models/{repo}[/revision/{rev}]      model info; with ?blobs=true each sibling has size, blobId, lfs
    HEAD/GET /{repo}/resolve/{rev}/{path}          the file, with Range, ETag, X-Repo-Commit, X-Linked-Size
and the Hub's error headers (X-Error-Code: RepoNotFound, GatedRepo, RevisionNotFound, EntryNotFound), which
huggingface_hub turns into its exception types.

Faults to inject: `drop_after[path] = n` drops the connection once, after n bytes of that file; `outage_after[path]
= n` does the same and then refuses every request (the network is down); `corrupt` flips one byte of the files it
names; `bytes_per_s` slows every download; `extra_bytes` appends that many bytes to every file it serves (more
than listed). A hostile Hub: `commit_override` is answered as the commit of every repo, and `after_info` runs after
each model-info response (to change the repo between the listing and the downloads). `requests` logs (method, path,
Range header) for the tests to check.

The server runs in a daemon thread on a random port and stops by itself after `lifetime_s` (or at `stop()`).
"""

import hashlib
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

# Files the Hub stores with Git LFS (every weight format); the rest are plain git blobs.
LFS_SUFFIXES = (".gguf", ".safetensors", ".bin", ".pt", ".pth")
CHUNK = 16 * 1024


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(data: bytes) -> bytes:
    oid = hashlib.sha256(data).hexdigest()
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{oid}\nsize {len(data)}\n".encode()


@dataclass
class Repo:
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # commit sha -> files
    branches: dict[str, str] = field(default_factory=dict)  # branch -> commit sha
    gated: bool = False

    def commit_for(self, revision: str) -> str | None:
        return self.branches.get(revision) or (revision if revision in self.commits else None)


class HubServer:
    def __init__(self, lifetime_s: float = 300):
        self.repos: dict[str, Repo] = {}
        self.tokens: set[str] = set()  # bearer tokens that may read gated repos
        self.requests: list[tuple[str, str, str | None]] = []
        self.drop_after: dict[str, int] = {}
        self.outage_after: dict[str, int] = {}
        self.corrupt: set[str] = set()
        self.bytes_per_s: float | None = None
        self.extra_bytes = 0
        self.commit_override: str | None = None
        self.after_info = None  # called with the repo id after each model-info response
        self.down = False
        self._lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.httpd.daemon_threads = True
        self.httpd.hub = self
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self._timer = threading.Timer(lifetime_s, self.stop)
        self._timer.daemon = True
        self._timer.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def add_repo(self, repo_id: str, files: dict[str, bytes], *, gated: bool = False, branch: str = "main") -> str:
        """Publish `files` as the head of `branch`; returns the commit sha."""
        repo = self.repos.setdefault(repo_id, Repo())
        repo.gated = gated
        digest = hashlib.sha1(repo_id.encode() + branch.encode())
        for path in sorted(files):
            digest.update(path.encode() + hashlib.sha256(files[path]).digest())
        commit = digest.hexdigest()
        repo.commits[commit] = dict(files)
        repo.branches[branch] = commit
        return commit

    def gets(self, path: str) -> list[str | None]:
        """The Range headers of the GET requests for a repo file path (e.g. 'org/repo/resolve/.../x.gguf')."""
        return [r for method, p, r in self.requests if method == "GET" and p.endswith("/" + path)]

    def stop(self) -> None:
        self._timer.cancel()
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> "HubServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the Hub; every response carries a Content-Length

    @property
    def hub(self) -> HubServer:
        return self.server.hub

    def log_message(self, *args) -> None:
        pass

    def do_HEAD(self) -> None:
        self._route(head=True)

    def do_GET(self) -> None:
        self._route(head=False)

    def _route(self, head: bool) -> None:
        path = unquote(urlsplit(self.path).path)
        with self.hub._lock:
            self.hub.requests.append((self.command, path, self.headers.get("Range")))
        if self.hub.down:
            self.close_connection = True  # no response at all: what a dead link looks like to the client
            return
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            revision = parts[5] if len(parts) >= 6 and parts[4] == "revision" else "main"
            self._model_info("/".join(parts[2:4]), revision)
        elif len(parts) >= 5 and parts[2] == "resolve":
            self._resolve("/".join(parts[:2]), parts[3], "/".join(parts[4:]), head)
        else:
            self._error(404, None, "Not found")

    def _error(self, status: int, code: str | None, message: str) -> None:
        body = json.dumps({"error": message}).encode()
        self.send_response(status)
        if code:
            self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _find(self, repo_id: str, revision: str) -> tuple[Repo, str] | None:
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            # The Hub answers 401 for a repo that does not exist (or is private) when not logged in.
            self._error(401, "RepoNotFound", "Repository not found")
            return None
        commit = repo.commit_for(revision)
        if commit is None:
            self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
            return None
        return repo, commit

    def _model_info(self, repo_id: str, revision: str) -> None:
        found = self._find(repo_id, revision)
        if found is None:
            return
        repo, commit = found
        siblings = []
        for name, data in sorted(repo.commits[commit].items()):
            sibling = {"rfilename": name, "size": len(data)}
            if name.endswith(LFS_SUFFIXES):
                pointer = lfs_pointer(data)
                sibling["blobId"] = git_blob_id(pointer)
                sibling["lfs"] = {
                    "size": len(data),
                    "sha256": hashlib.sha256(data).hexdigest(),
                    "pointerSize": len(pointer),
                }
            else:
                sibling["blobId"] = git_blob_id(data)
            siblings.append(sibling)
        info = {
            "_id": commit[:24],
            "id": repo_id,
            "modelId": repo_id,
            "author": repo_id.split("/")[0],
            "sha": self.hub.commit_override or commit,
            "lastModified": "2025-01-01T00:00:00.000Z",
            "createdAt": "2025-01-01T00:00:00.000Z",
            "private": False,
            "gated": "manual" if repo.gated else False,
            "disabled": False,
            "tags": [],
            "siblings": siblings,
        }
        body = json.dumps(info).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        if self.hub.after_info is not None:
            self.hub.after_info(repo_id)

    def _resolve(self, repo_id: str, revision: str, name: str, head: bool) -> None:
        found = self._find(repo_id, revision)
        if found is None:
            return
        repo, commit = found
        if repo.gated and self.headers.get("Authorization", "").removeprefix("Bearer ") not in self.hub.tokens:
            self._error(401, "GatedRepo", f"Access to model {repo_id} is restricted. You must be authenticated.")
            return
        data = repo.commits[commit].get(name)
        if data is None:
            self._error(404, "EntryNotFound", f"{name} does not exist on {revision}")
            return
        lfs = name.endswith(LFS_SUFFIXES)
        etag = hashlib.sha256(data).hexdigest() if lfs else git_blob_id(data)
        data += b"\0" * self.hub.extra_bytes
        if name in self.hub.corrupt:
            data = data[: len(data) // 2] + bytes([data[len(data) // 2] ^ 0xFF]) + data[len(data) // 2 + 1 :]
        start, end = 0, len(data) - 1
        range_header = self.headers.get("Range")
        if range_header:
            first, _, last = range_header.removeprefix("bytes=").partition("-")
            start, end = int(first), int(last) if last else len(data) - 1
            if start >= len(data):
                self._error(416, None, "Range not satisfiable")
                return
        self.send_response(206 if range_header else 200)
        self.send_header("Content-Length", str(end - start + 1))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", f'"{etag}"')
        self.send_header("X-Repo-Commit", commit)
        if lfs:
            self.send_header("X-Linked-Etag", f'"{etag}"')
            self.send_header("X-Linked-Size", str(len(data)))
        if range_header:
            self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
        self.end_headers()
        if not head:
            self._send_body(name, data[start : end + 1])

    def _send_body(self, name: str, body: bytes) -> None:
        hub = self.hub
        with hub._lock:
            cut = hub.drop_after.pop(name, None)
            outage = hub.outage_after.pop(name, None)
        if outage is not None:
            cut = outage
        sent = 0
        while sent < len(body):
            if cut is not None and sent >= cut:
                hub.down = hub.down or outage is not None
                self.close_connection = True  # the client gets fewer bytes than Content-Length promised
                return
            n = min(CHUNK, len(body) - sent, (cut - sent) if cut is not None else CHUNK)
            try:
                self.wfile.write(body[sent : sent + n])
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                return  # the client went away (a test killed it)
            sent += n
            if hub.bytes_per_s:
                time.sleep(n / hub.bytes_per_s)
