"""Conversations on disk: one SQLite file (stdlib sqlite3, WAL), a schema version, migrations.

No Qt, no torch. Used from the GUI thread only (writes are a few rows at a time).

Durability: every write is one transaction; the journal is WAL with
``synchronous=FULL``, so a crash or ``kill -9`` (or a power cut) loses at most the
transaction in progress and never earlier messages. A user message is written as
soon as it is sent; a reply when it finishes or is stopped, with its stats as JSON.

Schema versions live in ``PRAGMA user_version``; :data:`MIGRATIONS` holds one
script per version, applied in order inside one transaction each. To change the
schema, append a script; never edit a published one.
"""
from __future__ import annotations

import json
import sqlite3
import sys
import time
from array import array
from dataclasses import dataclass, field
from pathlib import Path

from desktop.chat import export
from models.paths import PRIVATE_DIR_MODE, private_file

__all__ = ["Conversation", "StoredMessage", "Store", "MIGRATIONS", "DEFAULT_TITLE"]

DEFAULT_TITLE = "New chat"

#: One SQL script per schema version (index 0 upgrades version 0 -> 1, ...).
MIGRATIONS: tuple[str, ...] = (
    """
    CREATE TABLE conversations (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        title TEXT NOT NULL,
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL
    );
    CREATE TABLE messages (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
        role TEXT NOT NULL CHECK (role IN ('system', 'user', 'assistant')),
        content TEXT NOT NULL,
        created_at REAL NOT NULL,
        finish_reason TEXT,
        stats TEXT
    );
    CREATE INDEX messages_by_conversation ON messages(conversation_id, id);
    """,
    """
    ALTER TABLE conversations ADD COLUMN model TEXT NOT NULL DEFAULT '';
    """,
    # A reply's token ids as the model wrote them (int32 little-endian), and which model's
    # tokenizer they belong to: the next prompt reuses them instead of re-tokenizing.
    """
    ALTER TABLE messages ADD COLUMN token_ids BLOB;
    ALTER TABLE messages ADD COLUMN token_model TEXT NOT NULL DEFAULT '';
    """,
)
SCHEMA_VERSION = len(MIGRATIONS)


@dataclass(frozen=True)
class Conversation:
    """A conversation's row. Times are seconds since the epoch."""

    id: int
    title: str
    created_at: float
    updated_at: float
    model: str = ""


@dataclass(frozen=True)
class StoredMessage:
    """A message as stored. ``stats`` is the reply's figures (empty for user messages).

    ``token_ids``: a reply's token ids as the model wrote them (``None``: unknown, e.g. a
    reply written before schema 3, or one whose ids were not its text); ``token_model``:
    the model (its path) whose tokenizer they belong to.
    """

    id: int
    role: str
    content: str
    created_at: float
    finish_reason: str | None = None
    stats: dict = field(default_factory=dict)
    token_ids: tuple[int, ...] | None = field(default=None, repr=False)
    token_model: str = ""


def _pack(ids) -> bytes | None:
    if ids is None:
        return None
    a = array("i", ids)
    if sys.byteorder == "big":
        a.byteswap()
    return a.tobytes()


def _unpack(blob: bytes | None) -> tuple[int, ...] | None:
    if blob is None:
        return None
    a = array("i")
    a.frombytes(blob)
    if sys.byteorder == "big":
        a.byteswap()
    return tuple(a)


class SchemaTooNewError(RuntimeError):
    """The file was written by a newer attnchat (its schema version is past ours)."""


class Store:
    """The conversation database.

    Args:
        path: the SQLite file (created with its folder if missing), or ``":memory:"``.

    Raises:
        sqlite3.DatabaseError: the file is not a database.
        SchemaTooNewError: the file's schema is newer than this program's.
    """

    def __init__(self, path: str | Path):
        self.path = path
        if path != ":memory:":
            # 0600 before SQLite opens it: SQLite gives the -wal and -shm files the
            # database's mode. Older files are repaired. The folder is made private when
            # created here; desktop.app.open_store repairs the data folder itself.
            Path(path).parent.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR_MODE)
            for suffix in ("", "-wal", "-shm"):
                private_file(Path(f"{path}{suffix}"), create=not suffix)
        # isolation_level=None: we open transactions ourselves (BEGIN IMMEDIATE).
        self._db = sqlite3.connect(str(path), isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("PRAGMA foreign_keys=ON")
        self._migrate()

    # ---- schema --------------------------------------------------------------------------
    @property
    def schema_version(self) -> int:
        return self._db.execute("PRAGMA user_version").fetchone()[0]

    def _migrate(self) -> None:
        version = self.schema_version
        if version > SCHEMA_VERSION:
            raise SchemaTooNewError(
                f"{self.path} was written by a newer attnchat (schema {version}, this one knows "
                f"{SCHEMA_VERSION}); update attnchat")
        for v in range(version, SCHEMA_VERSION):
            with self._tx():
                for statement in _statements(MIGRATIONS[v]):
                    self._db.execute(statement)
                self._db.execute(f"PRAGMA user_version={v + 1}")

    def _tx(self):
        return _Transaction(self._db)

    def close(self) -> None:
        self._db.close()

    # ---- conversations -------------------------------------------------------------------
    def create_conversation(self, title: str = DEFAULT_TITLE, model: str = "") -> Conversation:
        now = time.time()
        with self._tx():
            cur = self._db.execute(
                "INSERT INTO conversations(title, created_at, updated_at, model) VALUES (?, ?, ?, ?)",
                (title, now, now, model))
        return Conversation(cur.lastrowid, title, now, now, model)

    def conversations(self) -> list[Conversation]:
        """All conversations, most recently updated first."""
        rows = self._db.execute(
            "SELECT id, title, created_at, updated_at, model FROM conversations "
            "ORDER BY updated_at DESC, id DESC").fetchall()
        return [Conversation(*r) for r in rows]

    def conversation(self, conv_id: int) -> Conversation | None:
        row = self._db.execute(
            "SELECT id, title, created_at, updated_at, model FROM conversations WHERE id=?",
            (conv_id,)).fetchone()
        return Conversation(*row) if row else None

    def rename(self, conv_id: int, title: str) -> None:
        with self._tx():
            self._db.execute("UPDATE conversations SET title=? WHERE id=?", (title, conv_id))

    def delete(self, conv_id: int) -> None:
        with self._tx():
            self._db.execute("DELETE FROM messages WHERE conversation_id=?", (conv_id,))
            self._db.execute("DELETE FROM conversations WHERE id=?", (conv_id,))

    # ---- messages ------------------------------------------------------------------------
    def messages(self, conv_id: int) -> list[StoredMessage]:
        rows = self._db.execute(
            "SELECT id, role, content, created_at, finish_reason, stats, token_ids, token_model FROM messages "
            "WHERE conversation_id=? ORDER BY id", (conv_id,)).fetchall()
        return [StoredMessage(r[0], r[1], r[2], r[3], r[4], json.loads(r[5]) if r[5] else {}, _unpack(r[6]), r[7])
                for r in rows]

    def add_message(self, conv_id: int, role: str, content: str, *, finish_reason: str | None = None,
                    stats: dict | None = None, token_ids=None, token_model: str = "") -> StoredMessage:
        """Append a message (one transaction) and touch the conversation."""
        with self._tx():
            return self._insert(conv_id, role, content, finish_reason, stats, token_ids, token_model)

    def replace_last_reply(self, conv_id: int, content: str, *, finish_reason: str | None = None,
                           stats: dict | None = None, token_ids=None, token_model: str = "") -> StoredMessage:
        """Regenerate's save: drop the trailing assistant messages and append the new reply, atomically."""
        with self._tx():
            self._drop_trailing(conv_id, roles=("assistant",))
            return self._insert(conv_id, "assistant", content, finish_reason, stats, token_ids, token_model)

    def edit_message(self, conv_id: int, message_id: int, content: str) -> StoredMessage:
        """Edit-and-resend's save for any user message: drop message ``message_id`` and every
        message after it, and append ``content`` as a new user message, in one transaction
        (a crash leaves the conversation as it was before or after, never half of it).

        Raises:
            KeyError: the conversation has no message ``message_id``.
            ValueError: message ``message_id`` is not a user message.
        """
        with self._tx():
            row = self._db.execute("SELECT role FROM messages WHERE id=? AND conversation_id=?",
                                   (message_id, conv_id)).fetchone()
            if row is None:
                raise KeyError(f"conversation {conv_id} has no message {message_id}")
            if row[0] != "user":
                raise ValueError(f"message {message_id} is a {row[0]} message; only your own messages can be edited")
            self._db.execute("DELETE FROM messages WHERE conversation_id=? AND id>=?", (conv_id, message_id))
            return self._insert(conv_id, "user", content, None, None)

    def undo_send(self, conv_id: int, message_id: int, *, title: str, updated_at: float,
                  dropped: list[StoredMessage] = ()) -> None:
        """Take back a message the model refused (too long for the context), in one
        transaction: message ``message_id`` goes, the messages an edit dropped (``dropped``, as
        :meth:`messages` gave them, ids kept) come back, and the conversation's title and
        ``updated_at`` (seconds since the epoch: its place in the list) are as given. The conversation is then as it was before the message was sent.

        Raises:
            KeyError: message ``message_id`` is no longer the conversation's last.
        """
        with self._tx():
            row = self._db.execute("SELECT MAX(id) FROM messages WHERE conversation_id=?", (conv_id,)).fetchone()
            if row[0] != message_id:
                raise KeyError(f"message {message_id} is not the last of conversation {conv_id}")
            self._db.execute("DELETE FROM messages WHERE id=?", (message_id,))
            for m in dropped:
                self._db.execute(
                    "INSERT INTO messages(id, conversation_id, role, content, created_at, finish_reason, stats, "
                    "token_ids, token_model) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (m.id, conv_id, m.role, m.content, m.created_at, m.finish_reason,
                     json.dumps(m.stats) if m.stats else None, _pack(m.token_ids), m.token_model))
            self._db.execute("UPDATE conversations SET title=?, updated_at=? WHERE id=?", (title, updated_at, conv_id))

    def _drop_trailing(self, conv_id: int, roles: tuple[str, ...]) -> None:
        while True:
            row = self._db.execute(
                "SELECT id, role FROM messages WHERE conversation_id=? ORDER BY id DESC LIMIT 1",
                (conv_id,)).fetchone()
            if row is None or row[1] not in roles:
                return
            self._db.execute("DELETE FROM messages WHERE id=?", (row[0],))

    def _insert(self, conv_id, role, content, finish_reason, stats, token_ids=None, token_model="") -> StoredMessage:
        now = time.time()
        ids = None if token_ids is None else tuple(token_ids)
        cur = self._db.execute(
            "INSERT INTO messages(conversation_id, role, content, created_at, finish_reason, stats, token_ids, "
            "token_model) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (conv_id, role, content, now, finish_reason, json.dumps(stats) if stats else None, _pack(ids),
             token_model if ids is not None else ""))
        self._db.execute("UPDATE conversations SET updated_at=? WHERE id=?", (now, conv_id))
        return StoredMessage(cur.lastrowid, role, content, now, finish_reason, dict(stats or {}), ids,
                             token_model if ids is not None else "")

    # ---- export --------------------------------------------------------------------------
    def export_json(self, conv_id: int) -> dict:
        """The conversation as a JSON-ready dict (:func:`desktop.chat.export.conversation_json`)."""
        conv = self.conversation(conv_id)
        if conv is None:
            raise KeyError(f"no conversation {conv_id}")
        return export.conversation_json(conv, self.messages(conv_id))

    def export_markdown(self, conv_id: int) -> str:
        """The conversation as Markdown (:func:`desktop.chat.export.conversation_markdown`)."""
        conv = self.conversation(conv_id)
        if conv is None:
            raise KeyError(f"no conversation {conv_id}")
        return export.conversation_markdown(conv, self.messages(conv_id))


def _statements(script: str) -> list[str]:
    """Split a migration script into statements (``executescript`` would commit on its own)."""
    return [s.strip() for s in script.split(";") if s.strip()]


class _Transaction:
    """``BEGIN IMMEDIATE`` ... ``COMMIT`` (``ROLLBACK`` on an exception)."""

    def __init__(self, db: sqlite3.Connection):
        self._db = db

    def __enter__(self):
        self._db.execute("BEGIN IMMEDIATE")
        return self._db

    def __exit__(self, exc_type, exc, tb):
        self._db.execute("ROLLBACK" if exc_type else "COMMIT")
        return False
