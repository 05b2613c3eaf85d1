"""`llamaterm run` through a server on this machine: serve's announcement (app/announcements.py), how `run` finds it,
and what it skips. The servers run the fake engine, in this process, or in a process of its own where a test kills
one mid-answer. The model they announce is a file that holds no model: a `run` that loaded it here would fail."""

import hashlib
import hmac
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx2
import pytest

from llamaterm.app.announcements import (
    Announcer,
    ServedModel,
    find_server,
    not_private,
    read_announcement,
    remove_if_unchanged,
    servers_dir,
    write_private,
)
from tests.support.cli import llamaterm
from tests.support.fake_engine import REPLY, FakeEngine, words
from tests.support.serve_support import app_server, free_port

QUICK_S = 0.5  # a stale announcement costs less than a user notices
pytestmark = pytest.mark.usefixtures("no_announcements")


@pytest.fixture
def model(tmp_path) -> Path:
    """What the servers announce, and `run --model` names."""
    path = tmp_path / "model.gguf"
    path.write_bytes(b"not a model")
    return path.resolve()


def announcer(path: Path, port: int | None = None, device: str = "cpu") -> Announcer:
    return Announcer("127.0.0.1", port or free_port(), device, [ServedModel("fake-llama", str(path), None, None)])


@contextmanager
def announced(path: Path, api_key: str | None = None, **fake) -> Iterator[tuple[Announcer, FakeEngine]]:
    """A server on the fake engine, announced as holding `path`."""
    engine, found = FakeEngine(**fake), announcer(path)
    with engine, app_server(engine, api_key, found):
        yield found, engine


def find(model: Path, device: str | None = None):
    """(the engine find_server gives, closed; what it noted)."""
    notes: list[str] = []
    engine = find_server(str(model), device, notes.append)
    if engine is not None:
        engine.shutdown()
    return engine, notes


def rewrite(found: Announcer, **changes) -> None:
    data = json.loads(found.file.read_text())
    write_private(found.file, json.dumps(data | changes))


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_serve_announces_a_private_file_and_a_key_it_takes(model):
    with announced(model, api_key="their-key") as (found, _):
        assert found.file.parent == servers_dir()
        for path in (found.file.parent, found.file, found.file.with_suffix(".key")):
            assert path.stat().st_uid == os.getuid() and path.stat().st_mode & 0o077 == 0, path
        data = json.loads(found.file.read_text())
        assert data["pid"] == os.getpid() and data["url"] == f"http://127.0.0.1:{found.port}/v1"
        assert data["models"] == [{"id": "fake-llama", "path": str(model), "name": None, "repo": None}]
        root = data["url"].removesuffix("/v1")
        local, theirs, wrong = ({"Authorization": f"Bearer {k}"} for k in (found.key, "their-key", "wrong"))
        assert found.file.with_suffix(".key").read_text() == found.key
        # asked with a challenge, the server proves it holds the local key (an HMAC of the challenge under it), so
        # run sends its key to no other process that took the port
        challenge = "c0ffee" * 4
        expected = hmac.new(found.key.encode(), challenge.encode(), hashlib.sha256).hexdigest()
        assert httpx2.get(f"{root}/health", params={"challenge": challenge}).json()["proof"] == expected
        assert "proof" not in httpx2.get(f"{root}/health").json()
        assert [httpx2.get(f"{root}/v1/models", headers=h).status_code for h in (local, theirs, wrong)] == [
            200,
            200,
            401,
        ]
    assert not found.file.exists() and not found.file.with_suffix(".key").exists()  # gone as the server stopped


def test_run_answers_from_the_server_without_importing_torch(model):
    with announced(model) as (_, engine):
        run = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "llamaterm.app", "run", "--model", str(model)]
            + ["--json", "--max-tokens", "5", "-v", "hi"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert run.returncode == 0, run.stderr
        shown = json.loads(run.stdout)
        reply = words(REPLY)[:5]
        assert shown["text"] == "".join(reply) and shown["finish_reason"] == "length"
        assert shown["token_ids"] == [engine.vocabulary.id_of(w) for w in reply]  # the server's engine's own ids
        assert not re.search(r"\|\s+torch$", run.stderr, re.M)
        assert "fake-llama on the server at http://127.0.0.1:" in run.stderr
        local = llamaterm("run", "--local", "--model", str(model), "hi")
        assert local.returncode == 1 and str(model) in local.stderr  # --local loaded (could not load) the file here


def test_a_stale_announcement_is_skipped_at_once_and_removed(model):
    gone, silent = announcer(model), announcer(model)  # a server that died; one whose port nothing listens on
    gone.write()
    rewrite(gone, pid=dead_pid())
    silent.file = silent.file.with_name(f"{os.getpid()}-1.json")  # written by the pid of this test: alive
    silent.write()
    t = time.perf_counter()
    engine, notes = find(model)
    assert engine is None and time.perf_counter() - t < QUICK_S
    assert any("is gone; removed it" in n for n in notes) and any("nothing listens" in n for n in notes), notes
    assert list(servers_dir().iterdir()) == []  # the JSON and the key files, both


def test_an_unreadable_announcement_is_skipped_and_the_good_one_used(model):
    with announced(model) as (found, _):
        for name, text in (("1-1.json", "{not json"), ("1-2.json", '{"format": 1}'), ("1-3.json", "[]")):
            write_private(servers_dir() / name, text)
        engine, notes = find(model)
        assert engine is not None and engine.base_url == found.url
        assert sum("not an announcement llamaterm can read" in n for n in notes) == 3, notes


def test_files_open_to_others_are_skipped(model):
    with announced(model) as (found, _):
        found.file.chmod(0o644)
        engine, notes = find(model)
        assert engine is None and any("is open to other users (mode 644)" in n for n in notes), notes
        found.file.chmod(0o600)
        found.file.with_suffix(".key").chmod(0o640)
        engine, notes = find(model)
        assert engine is None and any("its key file" in n and "mode 640" in n for n in notes), notes
        found.file.with_suffix(".key").chmod(0o600)
        servers_dir().chmod(0o755)
        engine, notes = find(model)
        assert engine is None and any("announcements in" in n and "open to other users" in n for n in notes), notes
        servers_dir().chmod(0o700)
        assert find(model)[0] is not None


def test_what_another_user_owns_is_not_private():
    st = os.stat_result((0o100600, 0, 0, 1, os.getuid() + 1, 0, 0, 0, 0, 0))
    assert not_private(st, "it") == f"it is owned by another user (uid {os.getuid() + 1})"
    assert not_private(os.stat_result((0o100600, 0, 0, 1, os.getuid(), 0, 0, 0, 0, 0)), "it") is None


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a file to another user")
def test_an_announcement_another_user_owns_is_skipped(model):
    with announced(model) as (found, _):
        os.chown(found.file, 65534, -1)
        engine, notes = find(model)
        assert engine is None and any("owned by another user (uid 65534)" in n for n in notes), notes


def test_another_server_on_the_announced_port_is_not_taken_for_it(model, tmp_path):
    other = tmp_path / "other.gguf"
    other.write_bytes(b"")
    with announced(other) as (there, _):  # holds another model, and answers on the port below
        impostor = announcer(model, port=there.port)  # an announcement of a server that has gone: another instance
        impostor.file = impostor.file.with_name(f"{os.getpid()}-1.json")
        impostor.write()
        engine, notes = find(model)
        assert engine is None
        assert any(f"it holds fake-llama, not {model}" in n for n in notes), notes
        # the announced pid lives (this process): its files stay, as that server may be coming up elsewhere
        assert any("another server answers" in n and "removed it" not in n for n in notes), notes
        assert impostor.file.exists() and there.file.exists()


def test_a_process_on_the_announced_port_that_cannot_prove_the_key_is_sent_no_key(model):
    """Another process on the announced address answers /health as a server would, but cannot prove it holds the
    key: run asks nothing more of it, and what it received holds no key."""
    listener = socket.create_server(("127.0.0.1", 0))
    received: list[bytes] = []

    def answer() -> None:
        with listener:
            conn, _ = listener.accept()
            with conn:
                received.append(conn.recv(65536))
                body = b'{"status": "ok", "model": "fake-llama", "proof": "0000"}'
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body)
                )

    threading.Thread(target=answer, daemon=True).start()
    found = announcer(model, port=listener.getsockname()[1])  # this process's pid: alive
    found.write()
    try:
        engine, notes = find(model)
        assert engine is None and any("another server answers" in n for n in notes), notes
        assert received and b"authorization" not in received[0].lower() and found.key.encode() not in received[0]
    finally:
        found.remove()


def test_a_stale_announcement_is_removed_only_if_no_new_server_took_its_name(model):
    """A server restarted with the same pid and port (a container's) announces under the same name: an earlier
    reader that found the old announcement stale leaves the new one."""
    old = announcer(model)
    old.write()
    found = read_announcement(old.file)
    new = announcer(model, port=old.port)
    new.file = old.file
    new.write()
    remove_if_unchanged(found)
    assert new.file.exists() and new.file.with_suffix(".key").exists()
    remove_if_unchanged(read_announcement(new.file))
    assert not new.file.exists() and not new.file.with_suffix(".key").exists()


def test_a_server_on_another_device_is_not_used(model):
    with announced(model):
        engine, notes = find(model, device="cuda")
        assert engine is None and any("it runs on cpu, not cuda" in n for n in notes), notes
        assert find(model, device="cpu")[0] is not None


def test_of_two_servers_the_one_started_first_is_used(model):
    with ExitStack() as stack:
        first, _ = stack.enter_context(announced(model))
        second, _ = stack.enter_context(announced(model))
        engine, notes = find(model)
        assert engine is not None and engine.base_url == first.url != second.url
        assert any(
            f"on the server at {first.url} (of the 2 that hold it, the first started that answers)" in n for n in notes
        ), notes


def test_a_server_that_goes_away_mid_answer_is_an_error_not_a_fallback(model):
    port = free_port()
    repo = Path(__file__).resolve().parents[2]
    server = subprocess.Popen([sys.executable, "-m", "tests.support.fake_server", str(model), str(port)], cwd=repo)
    try:
        file = servers_dir() / f"{server.pid}-{port}.json"
        deadline = time.monotonic() + 60
        while not file.exists():
            assert server.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        run = subprocess.Popen(
            [sys.executable, "-m", "llamaterm.app", "run", "--model", str(model), "--max-tokens", "2000", "go"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert run.stdout is not None
        started = run.stdout.read(4)  # the answer has begun
        server.kill()
        out, err = run.communicate(timeout=60)
    finally:
        server.kill()
        server.wait()
    assert started + out and set((started + out).split()) == {"word"}  # part of the server's answer, and no other
    assert run.returncode == 1
    assert len(err.splitlines()) == 1 and err.startswith("llamaterm: ") and "server" in err, err
