"""The SQLite conversation store: WAL, migrations, files it must not use, and a crash mid-reply."""

import signal
import sqlite3
import subprocess
import sys
import textwrap
import time

import pytest

from llamaterm.app import history
from llamaterm.app.history import SCHEMA_VERSION, History, to_json, to_markdown
from tests.support.locked_files import EXCLUSIVE, WRITING, held_by_another_process, read_only_file


@pytest.fixture
def db_path(tmp_path):
    return tmp_path / "history.db"


def test_new_file_is_wal_and_current_version(db_path):
    h = History.open(db_path)
    assert h.problem is None and h.path == db_path
    assert h.conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert h.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    h.close()


def test_messages_round_trip_search_and_truncate(db_path):
    h = History.open(db_path)
    a = h.create_conversation("Rust lifetimes", {"system": "be brief", "temperature": 0.5})
    b = h.create_conversation("Cooking", {})
    h.add_message(a, "user", "what is 'a?")
    reply = h.add_message(a, "assistant", "")
    h.update_message(reply, "A lifetime.", "stop", {"tokens_per_s": 12.5})
    second = h.add_message(b, "user", "100% rye bread_recipe")
    h.add_message(b, "assistant", "Mix.")
    h.update_conversation(b, title="Bread")

    conv = h.load(a)
    assert [(m.role, m.content, m.finish_reason) for m in conv.messages] == [
        ("user", "what is 'a?", None),
        ("assistant", "A lifetime.", "stop"),
    ]
    assert conv.messages[1].stats == {"tokens_per_s": 12.5} and conv.settings["system"] == "be brief"

    assert [c.title for c in h.search()] == ["Bread", "Rust lifetimes"]
    assert [c.title for c in h.search("LIFETIME")] == ["Rust lifetimes"]  # title or content, any case
    assert [c.title for c in h.search("100%")] == ["Bread"]  # LIKE wildcards are literal
    assert h.search("e_b") == [] and h.search("xyz") == []  # "_" would match "rye bread"
    assert h.search("bread")[0].message_count == 2

    h.delete_messages_from(b, second)
    assert h.load(b).messages == []
    h.close()


def test_exports(db_path):
    h = History.open(db_path)
    cid = h.create_conversation("T", {"system": "S"})
    h.add_message(cid, "user", "Q")
    h.add_message(cid, "assistant", "```py\nx = 1\n```", "stop")
    conv = h.load(cid)
    assert to_markdown(conv) == "# T\n\n> System: S\n\n## You\n\nQ\n\n## Assistant\n\n```py\nx = 1\n```\n"
    assert '"finish_reason": "stop"' in to_json(conv) and '"system": "S"' in to_json(conv)
    h.close()


def test_older_schema_is_migrated_in_place(db_path, monkeypatch):
    h = History.open(db_path)
    cid = h.create_conversation("kept", {})
    h.add_message(cid, "user", "hello")
    h.close()

    step = "ALTER TABLE conversations ADD COLUMN pinned INTEGER NOT NULL DEFAULT 0"
    monkeypatch.setattr(history, "MIGRATIONS", [*history.MIGRATIONS, step])
    monkeypatch.setattr(history, "SCHEMA_VERSION", SCHEMA_VERSION + 1)
    h = History.open(db_path)
    assert h.problem is None
    assert h.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION + 1
    assert h.conn.execute("SELECT title, pinned FROM conversations").fetchall() == [("kept", 0)]
    assert h.load(cid).messages[0].content == "hello"
    h.close()


def test_failed_migration_leaves_the_file_as_it_was(db_path, monkeypatch):
    h = History.open(db_path)
    for _ in range(2):
        h.create_conversation("same title", {})
    h.close()
    # A step this file's data breaks (and a fresh file does not).
    step = "CREATE UNIQUE INDEX one_per_title ON conversations(title)"
    monkeypatch.setattr(history, "MIGRATIONS", [*history.MIGRATIONS, step])
    monkeypatch.setattr(history, "SCHEMA_VERSION", SCHEMA_VERSION + 1)
    h = History.open(db_path)
    assert h.path is None and "cannot be opened" in h.problem  # runs in memory, reports, touches nothing
    h.close()
    with sqlite3.connect(db_path) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert conn.execute("SELECT COUNT(*) FROM conversations").fetchone()[0] == 2


def test_corrupt_file_is_backed_up_not_overwritten(db_path):
    garbage = b"this is not a database" * 100
    db_path.write_bytes(garbage)
    h = History.open(db_path)
    assert "corrupt" in h.problem and h.path == db_path
    backups = list(db_path.parent.glob("history.db.corrupt-*.bak"))
    assert len(backups) == 1 and backups[0].read_bytes() == garbage
    assert str(backups[0]) in h.problem
    h.create_conversation("fresh", {})  # the new file works
    h.close()


def test_newer_version_is_refused_and_backed_up(db_path):
    h = History.open(db_path)
    h.create_conversation("from the future", {})
    h.conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    h.close()

    h = History.open(db_path)
    assert "newer llamaterm" in h.problem
    assert h.search() == []  # a new, empty history
    h.close()
    (backup,) = db_path.parent.glob("history.db.newer-*.bak")
    with sqlite3.connect(backup) as conn:  # untouched: same version, same rows
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION + 1
        assert conn.execute("SELECT title FROM conversations").fetchall() == [("from the future",)]


def test_kill_mid_reply_loses_no_earlier_message(db_path):
    # A writer that behaves like the app: messages saved one by one, then a reply updated as it streams.
    writer = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from llamaterm.app.history import History
        h = History.open(Path({str(db_path)!r}))
        cid = h.create_conversation("crash", {{}})
        for i in range(20):
            h.add_message(cid, "user" if i % 2 == 0 else "assistant", f"message {{i}}")
        reply = h.add_message(cid, "assistant", "")
        print("ready", flush=True)
        text = ""
        while True:
            text += "token "
            h.update_message(reply, text)
    """)
    proc = subprocess.Popen([sys.executable, "-c", writer], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.3)  # let it commit partial replies, then kill it without warning
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    h = History.open(db_path)
    assert h.problem is None
    assert h.conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    (conv,) = h.search()
    messages = h.load(conv.id).messages
    assert [m.content for m in messages[:20]] == [f"message {i}" for i in range(20)]
    assert messages[20].content.startswith("token ")  # the partial reply up to its last write
    h.close()


# --- files we may not write now: locked, read-only; files half written ------------------------------------


def saved_history(db_path) -> int:
    h = History.open(db_path)
    cid = h.create_conversation("kept", {"system": "S"})
    h.add_message(cid, "user", "first question")
    h.close()
    return cid


@pytest.fixture
def short_busy_timeout(monkeypatch):
    monkeypatch.setattr(history, "BUSY_TIMEOUT_MS", 200)


def test_a_file_locked_by_another_process_is_left_alone(db_path, short_busy_timeout):
    # It was moved aside as "corrupt" after 5 s.
    saved_history(db_path)
    before = db_path.read_bytes()
    with held_by_another_process(db_path, EXCLUSIVE):
        h = History.open(db_path)
        assert h.path is None and "database is locked" in h.problem and "in memory" in h.problem
        cid = h.create_conversation("this session", {})
        h.add_message(cid, "user", "still works")
        assert [m.content for m in h.load(cid).messages] == ["still works"]
    assert list(db_path.parent.glob("*.bak")) == []
    assert db_path.read_bytes() == before
    assert [c.title for c in History.open(db_path).search()] == ["kept"]


def test_a_read_only_file_is_read_and_the_session_kept_in_memory(db_path):
    # It opened silently and the TUI crashed on the first send.
    cid = saved_history(db_path)
    before = db_path.read_bytes()
    with read_only_file(db_path):
        h = History.open(db_path)
        assert h.path is None and "readonly" in h.problem and "in memory" in h.problem
        assert [c.title for c in h.search()] == ["kept"]  # what the file holds is still there to read
        h.add_message(cid, "assistant", "an answer")
        assert [m.content for m in h.load(cid).messages] == ["first question", "an answer"]
        assert db_path.read_bytes() == before


def test_a_write_refused_mid_session_goes_on_in_memory(db_path, short_busy_timeout):
    cid = saved_history(db_path)
    h = History.open(db_path)
    told = []
    h.on_problem = told.append
    with held_by_another_process(db_path, WRITING):
        h.add_message(cid, "assistant", "an answer")  # the file is busy past the timeout
    assert h.path is None and len(told) == 1 and "database is locked" in told[0]
    h.add_message(cid, "user", "next question")
    assert [m.content for m in h.load(cid).messages] == ["first question", "an answer", "next question"]
    assert len(told) == 1  # said once
    on_disk = History.open(db_path)
    assert [m.content for m in on_disk.load(cid).messages] == ["first question"]  # the file as it was


def test_a_settings_value_that_is_not_json_does_not_break_search(db_path):
    cid = saved_history(db_path)
    with sqlite3.connect(db_path) as conn:
        conn.execute("UPDATE conversations SET settings = 'not json {' WHERE id = ?", (cid,))
        conn.execute("UPDATE messages SET stats = '[1, 2' WHERE conversation_id = ?", (cid,))
    h = History.open(db_path)
    (conv,) = h.search("first")
    assert conv.title == "kept" and conv.settings == {}
    assert h.load(cid).messages[0].stats == {}


def test_a_half_written_file_is_kept_aside_whole(db_path):
    """A copy cut off halfway: moved aside byte for byte, never overwritten, and the user is told where."""
    saved_history(db_path)
    h = History.open(db_path)
    for i in range(200):
        h.create_conversation(f"padding {i}" * 20, {})
    h.close()
    with sqlite3.connect(db_path) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    half = db_path.read_bytes()[: db_path.stat().st_size // 2]
    db_path.write_bytes(half)
    h = History.open(db_path)
    (backup,) = db_path.parent.glob("history.db.corrupt-*.bak")
    assert backup.read_bytes() == half and str(backup) in h.problem
    h.create_conversation("fresh", {})
    assert [c.title for c in h.search()] == ["fresh"]
