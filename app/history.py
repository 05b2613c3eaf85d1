"""Conversation history in SQLite, each message saved as it happens: a killed app keeps every earlier one.

The file lives in the user's data directory, in WAL mode (a crash mid-write leaves the last committed state),
with its schema version in `PRAGMA user_version` and one migration script per version step. A file we cannot
read (corrupt) or must not write (made by a newer llamaterm) is moved aside, never overwritten. A file we may not
write now (locked by another program, read-only, on a full disk) is left exactly as it is: the history goes on in
memory, from a copy of what the file held, and nothing of this session is lost while the app runs. Each such
problem is reported through `History.problem` and, as it happens, to `History.on_problem`.
"""

from __future__ import annotations

import json
import re
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from llamaterm.engine.store.model_store import data_dir

# MIGRATIONS[i] takes the schema from version i to version i + 1; append, never edit a released step.
MIGRATIONS = [
    """
    CREATE TABLE conversations (
        id INTEGER PRIMARY KEY,
        title TEXT NOT NULL,
        settings TEXT NOT NULL DEFAULT '{}',  -- JSON: system prompt and sampling values
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL
    );
    CREATE TABLE messages (
        id INTEGER PRIMARY KEY,
        conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
        role TEXT NOT NULL CHECK (role IN ('user', 'assistant')),
        content TEXT NOT NULL,
        finish_reason TEXT,
        stats TEXT,  -- JSON: the engine's request stats for a finished reply
        created_at REAL NOT NULL
    );
    CREATE INDEX messages_by_conversation ON messages(conversation_id, id);
    CREATE INDEX conversations_by_update ON conversations(updated_at);
    """,
]
SCHEMA_VERSION = len(MIGRATIONS)
BUSY_TIMEOUT_MS = 5000  # how long a write waits for another llamaterm holding the file
# SQLite result codes (the low byte of sqlite_errorcode) that mean the file itself is damaged
CORRUPT_CODES = {11, 26}  # SQLITE_CORRUPT, SQLITE_NOTADB


def default_path() -> Path:
    return data_dir() / "history.db"


class UnusableHistory(Exception):
    """The file exists but we may not use it; `reason` names the backup ("corrupt" or "newer")."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


@dataclass
class StoredMessage:
    id: int
    role: str
    content: str
    finish_reason: str | None = None
    stats: dict | None = None
    created_at: float = 0.0


@dataclass
class Conversation:
    id: int
    title: str
    settings: dict
    created_at: float
    updated_at: float
    messages: list[StoredMessage] = field(default_factory=list)
    message_count: int = 0


class History:
    def __init__(self, conn: sqlite3.Connection, path: Path | None, problem: str | None = None):
        self.conn = conn
        self.path = path  # None: in memory, nothing persists
        self.problem = problem  # a message for the user when the file on disk could not be used
        self.on_problem: Callable[[str], None] | None = None  # told when writing to the file fails mid-session

    @classmethod
    def open(cls, path: Path | None = None) -> History:
        path = path or default_path()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                return cls(connect(path), path)
            except UnusableHistory as e:
                backup = move_aside(path, e.reason)
                problem = f"History {path} {e}; it was moved to {backup} and a new history was started."
            return cls(connect(path), path, problem)
        except (OSError, sqlite3.Error) as e:  # locked, read-only, no space: the file is left as it is
            return cls(memory_copy(path), None, _in_memory_message(path, e))

    def close(self) -> None:
        self.conn.close()

    def _write(self, work: Callable[[sqlite3.Connection], object]):
        """Run `work` in one transaction. When the file refuses it, go on in memory from a copy of the file."""
        try:
            return _transaction(self.conn, work)
        except sqlite3.Error as e:
            if self.path is None:  # already in memory: nothing to fall back to
                raise
            self.problem = _in_memory_message(self.path, e)
            self.conn.close()
            self.conn, self.path = memory_copy(self.path), None
            if self.on_problem is not None:
                self.on_problem(self.problem)
            return _transaction(self.conn, work)

    # ---- writes (each commits at once) ----

    def create_conversation(self, title: str, settings: dict) -> int:
        now = time.time()
        return self._write(
            lambda c: (
                c.execute(
                    "INSERT INTO conversations (title, settings, created_at, updated_at) VALUES (?, ?, ?, ?)",
                    (title, json.dumps(settings), now, now),
                ).lastrowid
            )
        )

    def update_conversation(
        self, conversation_id: int, *, title: str | None = None, settings: dict | None = None
    ) -> None:
        def work(c: sqlite3.Connection) -> None:
            if title is not None:
                c.execute("UPDATE conversations SET title = ? WHERE id = ?", (title, conversation_id))
            if settings is not None:
                c.execute("UPDATE conversations SET settings = ? WHERE id = ?", (json.dumps(settings), conversation_id))

        self._write(work)

    def add_message(
        self, conversation_id: int, role: str, content: str, finish_reason: str | None = None, stats: dict | None = None
    ) -> int:
        now = time.time()

        def work(c: sqlite3.Connection) -> int:
            cur = c.execute(
                "INSERT INTO messages (conversation_id, role, content, finish_reason, stats, created_at)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (conversation_id, role, content, finish_reason, _dumps(stats), now),
            )
            c.execute("UPDATE conversations SET updated_at = ? WHERE id = ?", (now, conversation_id))
            assert cur.lastrowid is not None  # an INSERT always sets it
            return cur.lastrowid

        return self._write(work)

    def update_message(
        self, message_id: int, content: str, finish_reason: str | None = None, stats: dict | None = None
    ) -> None:
        self._write(
            lambda c: c.execute(
                "UPDATE messages SET content = ?, finish_reason = ?, stats = ? WHERE id = ?",
                (content, finish_reason, _dumps(stats), message_id),
            )
        )

    def delete_messages_from(self, conversation_id: int, message_id: int) -> None:
        """Drop a message and everything after it (regenerate, edit and resend)."""
        self._write(
            lambda c: c.execute(
                "DELETE FROM messages WHERE conversation_id = ? AND id >= ?", (conversation_id, message_id)
            )
        )

    # ---- reads ----

    def search(self, text: str = "", limit: int = 200) -> list[Conversation]:
        """Conversations whose title or any message contains `text`, newest first."""
        pattern = f"%{_escape_like(text)}%"
        rows = self.conn.execute(
            """
            SELECT c.id, c.title, c.settings, c.created_at, c.updated_at,
                   (SELECT COUNT(*) FROM messages m WHERE m.conversation_id = c.id)
            FROM conversations c
            WHERE :text = '' OR c.title LIKE :pattern ESCAPE '\\' OR EXISTS (
                SELECT 1 FROM messages m
                WHERE m.conversation_id = c.id AND m.content LIKE :pattern ESCAPE '\\')
            ORDER BY c.updated_at DESC, c.id DESC LIMIT :limit
            """,
            {"text": text, "pattern": pattern, "limit": limit},
        ).fetchall()
        return [
            Conversation(id, title, _json_object(settings), created, updated, message_count=count)
            for id, title, settings, created, updated, count in rows
        ]

    def recent_prompts(self, limit: int = 100) -> list[str]:
        """The user's last `limit` prompts, of every conversation, oldest first (what ↑ recalls in the prompt)."""
        rows = self.conn.execute(
            "SELECT content FROM messages WHERE role = 'user' ORDER BY id DESC LIMIT ?", (limit,)
        ).fetchall()
        return [content for (content,) in reversed(rows)]

    def load(self, conversation_id: int) -> Conversation:
        row = self.conn.execute(
            "SELECT id, title, settings, created_at, updated_at FROM conversations WHERE id = ?",
            (conversation_id,),
        ).fetchone()
        if row is None:
            raise KeyError(f"no conversation {conversation_id}")
        messages = [
            StoredMessage(id, role, content, reason, _json_object(stats) if stats else None, created)
            for id, role, content, reason, stats, created in self.conn.execute(
                "SELECT id, role, content, finish_reason, stats, created_at FROM messages"
                " WHERE conversation_id = ? ORDER BY id",
                (conversation_id,),
            )
        ]
        conv = Conversation(row[0], row[1], _json_object(row[2]), row[3], row[4], messages)
        conv.message_count = len(messages)
        return conv


def connect(path: Path | str) -> sqlite3.Connection:
    """Open, check, migrate and make sure the file takes writes. Raises UnusableHistory for a corrupt file or one
    from a newer schema, sqlite3.Error for one that cannot be used now (locked, read-only)."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")  # a second llamaterm writing the same file
        try:
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            check = conn.execute("PRAGMA quick_check").fetchone()[0]
        except sqlite3.DatabaseError as e:
            if not _is_corrupt(e):  # locked by another program: not the file's fault, and it stays as it is
                raise
            raise UnusableHistory("corrupt", f"is corrupt ({e})") from e
        if check != "ok":
            raise UnusableHistory("corrupt", f"is corrupt ({check})")
        if version > SCHEMA_VERSION:
            raise UnusableHistory(
                "newer",
                f"was written by a newer llamaterm (schema {version}; this one reads up to {SCHEMA_VERSION})",
            )
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA synchronous = NORMAL")  # with WAL: survives an app crash
        conn.execute("PRAGMA foreign_keys = ON")
        migrate(conn, version)
        # A read-only file opens and reads; find out now rather than at the first message
        _transaction(conn, lambda c: c.execute(f"PRAGMA user_version = {SCHEMA_VERSION}"))
    except BaseException:
        conn.close()
        raise
    return conn


def memory_copy(path: Path) -> sqlite3.Connection:
    """An in-memory history holding what the file holds (read without writing it), or an empty one when the file
    cannot be read now or its contents cannot be used (corrupt, newer, a migration that fails on them)."""
    conn = sqlite3.connect(":memory:", isolation_level=None)
    try:
        source = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
        try:
            source.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            image = bytearray(source.serialize())  # not backup(): it retries a locked file for ever
        finally:
            source.close()
        if image:
            image[18:20] = b"\x01\x01"  # the header's WAL marks (2, 2): an in-memory copy keeps a plain journal
            conn.deserialize(bytes(image))
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION or conn.execute("PRAGMA quick_check").fetchone()[0] != "ok":
            raise sqlite3.DatabaseError("unusable contents")
        migrate(conn, version)
        conn.execute("PRAGMA foreign_keys = ON")
    except (OSError, sqlite3.Error):
        conn.close()
        conn = sqlite3.connect(":memory:", isolation_level=None)
        migrate(conn, 0)  # without foreign keys: the session's messages may belong to conversations of the file
    return conn


def _transaction(conn: sqlite3.Connection, work: Callable[[sqlite3.Connection], object]):
    conn.execute("BEGIN IMMEDIATE")
    try:
        result = work(conn)
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    return result


def _is_corrupt(e: sqlite3.Error) -> bool:
    return (getattr(e, "sqlite_errorcode", 0) & 0xFF) in CORRUPT_CODES


def _in_memory_message(path: Path, e: Exception) -> str:
    return (
        f"History {path} cannot be opened for writing ({e}); it is left as it was, and this session's "
        "conversations are kept in memory only, until llamaterm quits."
    )


def migrate(conn: sqlite3.Connection, version: int) -> None:
    """Apply each missing step in its own transaction, so a failed step leaves the previous version intact."""
    for target in range(version + 1, SCHEMA_VERSION + 1):
        try:
            script = MIGRATIONS[target - 1]
            conn.executescript(f"BEGIN IMMEDIATE;\n{script};\nPRAGMA user_version = {target};\nCOMMIT;")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise


def move_aside(path: Path, reason: str) -> Path:
    """Rename the database (and its WAL and shared-memory files) to a backup name that does not exist yet."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    backup = path.with_name(f"{path.name}.{reason}-{stamp}.bak")
    n = 1
    while backup.exists():
        n += 1
        backup = path.with_name(f"{path.name}.{reason}-{stamp}-{n}.bak")
    for suffix in ("-wal", "-shm"):
        side = path.with_name(path.name + suffix)
        if side.exists():
            side.rename(backup.with_name(backup.name + suffix))
    path.rename(backup)
    return backup


def to_markdown(conv: Conversation) -> str:
    lines = [f"# {conv.title}", ""]
    if conv.settings.get("system"):
        lines += [f"> System: {conv.settings['system']}", ""]
    for m in conv.messages:
        lines += [f"## {'You' if m.role == 'user' else 'Assistant'}", "", m.content, ""]
    return "\n".join(lines)


def to_json(conv: Conversation) -> str:
    data = {
        "id": conv.id,
        "title": conv.title,
        "settings": conv.settings,
        "created_at": conv.created_at,
        "updated_at": conv.updated_at,
        "messages": [
            {
                "role": m.role,
                "content": m.content,
                "finish_reason": m.finish_reason,
                "stats": m.stats,
                "created_at": m.created_at,
            }
            for m in conv.messages
        ],
    }
    return json.dumps(data, indent=2, ensure_ascii=False) + "\n"


def export_file(conv: Conversation, fmt: str, directory: Path | None = None) -> Path:
    """Write a conversation as Markdown ("md") or JSON ("json"); returns the file's path."""
    directory = directory or data_dir() / "exports"
    directory.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^A-Za-z0-9]+", "-", conv.title).strip("-").lower()[:40] or "conversation"
    path = directory / f"{slug}-{conv.id}.{fmt}"
    path.write_text(to_markdown(conv) if fmt == "md" else to_json(conv), encoding="utf-8")
    return path


def _json_object(text: str) -> dict:
    """A JSON object saved in the history; a damaged one reads as empty rather than failing the whole list."""
    try:
        value = json.loads(text)
    except (TypeError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _dumps(value: dict | None) -> str | None:
    return None if value is None else json.dumps(value)


def _escape_like(text: str) -> str:
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
