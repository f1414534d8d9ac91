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

__all__ = ["Conversation", "StoredMessage", "Snapshot", "Store", "MIGRATIONS", "DEFAULT_TITLE"]

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
    # Reply branches: every reply Regenerate wrote for a turn, in order. The message row holds
    # the chosen one (its 1-based number in ``version``; 0: a reply never regenerated, no rows
    # here), so everything that reads messages reads the chosen branch.
    """
    CREATE TABLE reply_versions (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        message_id INTEGER NOT NULL REFERENCES messages(id) ON DELETE CASCADE,
        content TEXT NOT NULL,
        created_at REAL NOT NULL,
        finish_reason TEXT,
        stats TEXT,
        token_ids BLOB,
        token_model TEXT NOT NULL DEFAULT ''
    );
    CREATE INDEX reply_versions_by_message ON reply_versions(message_id, id);
    ALTER TABLE messages ADD COLUMN version INTEGER NOT NULL DEFAULT 0;
    """,
)
_COLUMNS = "content, created_at, finish_reason, stats, token_ids, token_model"

#: The messages' full-text index (FTS5 over the content, external-content, kept by triggers):
#: what the conversation list's search reads (Store.search).
SEARCH_SCHEMA = (
    "CREATE VIRTUAL TABLE IF NOT EXISTS messages_fts USING fts5(content, content='messages', content_rowid='id')",
    "CREATE TRIGGER IF NOT EXISTS messages_fts_insert AFTER INSERT ON messages BEGIN "
    "INSERT INTO messages_fts(rowid, content) VALUES (new.id, new.content); END",
    "CREATE TRIGGER IF NOT EXISTS messages_fts_delete AFTER DELETE ON messages BEGIN "
    "INSERT INTO messages_fts(messages_fts, rowid, content) VALUES ('delete', old.id, old.content); END",
    "CREATE TRIGGER IF NOT EXISTS messages_fts_update AFTER UPDATE OF content ON messages BEGIN "
    "INSERT INTO messages_fts(messages_fts, rowid, content) VALUES ('delete', old.id, old.content); "
    "INSERT INTO messages_fts(rowid, content) VALUES (new.id, new.content); END",
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
    the model (its path) whose tokenizer they belong to. ``version`` of ``versions``: the
    branch shown of a reply that Regenerate rewrote (``< 2/3 >``).
    """

    id: int
    role: str
    content: str
    created_at: float
    finish_reason: str | None = None
    stats: dict = field(default_factory=dict)
    token_ids: tuple[int, ...] | None = field(default=None, repr=False)
    token_model: str = ""
    version: int = 0    # which of the reply's branches this is (1-based; 0: it has no other)
    versions: int = 0   # how many branches the reply has (0: none but this one)


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


@dataclass(frozen=True)
class Snapshot:
    """Rows as stored (:meth:`Store.snapshot`): each table's column names and rows."""

    messages: tuple[tuple[str, ...], list[tuple]]
    versions: tuple[tuple[str, ...], list[tuple]]


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
        self.full_text = self._ensure_search()

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

    def _ensure_search(self) -> bool:
        """The full-text index of the messages (SQLite FTS5, kept by triggers), made once and
        filled from what is stored; False where this SQLite has no FTS5 (:meth:`search` then
        scans with LIKE). Not a migration: a file stays readable by an SQLite without FTS5."""
        try:
            with self._tx():
                made = self._db.execute("SELECT 1 FROM sqlite_master WHERE name='messages_fts'").fetchone() is None
                for statement in SEARCH_SCHEMA:
                    self._db.execute(statement)
                if made:
                    self._db.execute("INSERT INTO messages_fts(messages_fts) VALUES('rebuild')")
            return True
        except sqlite3.OperationalError:   # no such module: fts5
            return False

    def search(self, text: str, limit: int = 200) -> dict[int, str]:
        """Conversations whose messages contain every word of ``text`` (the last as a prefix,
        any case): ``{conversation id: a snippet of the best match, the words in [brackets]}``."""
        words = text.split()
        if not words:
            return {}
        if self.full_text:
            query = " ".join('"' + w.replace('"', '""') + '"' for w in words) + "*"
            rows = self._db.execute(
                "SELECT m.conversation_id, snippet(messages_fts, 0, '[', ']', '…', 10) FROM messages_fts "
                "JOIN messages m ON m.id = messages_fts.rowid WHERE messages_fts MATCH ? ORDER BY rank LIMIT ?",
                (query, limit)).fetchall()
        else:
            like = " AND ".join("content LIKE ? ESCAPE '\\'" for _ in words)
            args = [f"%{w.replace('%', chr(92) + '%').replace('_', chr(92) + '_')}%" for w in words]
            rows = [(c, content[:80]) for c, content in self._db.execute(
                f"SELECT conversation_id, content FROM messages WHERE {like} LIMIT ?", (*args, limit)).fetchall()]
        found: dict[int, str] = {}
        for conv, snippet in rows:
            found.setdefault(conv, " ".join(str(snippet).split()))
        return found

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
            "SELECT id, role, content, created_at, finish_reason, stats, token_ids, token_model, version, "
            "(SELECT COUNT(*) FROM reply_versions v WHERE v.message_id=messages.id) FROM messages "
            "WHERE conversation_id=? ORDER BY id", (conv_id,)).fetchall()
        return [StoredMessage(r[0], r[1], r[2], r[3], r[4], json.loads(r[5]) if r[5] else {}, _unpack(r[6]), r[7],
                              r[8], r[9]) for r in rows]

    def add_message(self, conv_id: int, role: str, content: str, *, finish_reason: str | None = None,
                    stats: dict | None = None, token_ids=None, token_model: str = "") -> StoredMessage:
        """Append a message (one transaction) and touch the conversation."""
        with self._tx():
            return self._insert(conv_id, role, content, finish_reason, stats, token_ids, token_model)

    def add_reply_version(self, conv_id: int, content: str, *, finish_reason: str | None = None,
                          stats: dict | None = None, token_ids=None, token_model: str = "") -> StoredMessage:
        """Regenerate's save, in one transaction: a new branch of the conversation's last reply,
        shown from now on (the earlier ones are kept: :meth:`choose_version`); a new reply when
        the conversation ends with your message."""
        with self._tx():
            last = self._db.execute("SELECT id, role, version FROM messages WHERE conversation_id=? "
                                    "ORDER BY id DESC LIMIT 1", (conv_id,)).fetchone()
            if last is None or last[1] != "assistant":
                return self._insert(conv_id, "assistant", content, finish_reason, stats, token_ids, token_model)
            mid = last[0]
            if last[2] == 0:   # its first regeneration: the reply so far becomes branch 1
                self._db.execute(f"INSERT INTO reply_versions(message_id, {_COLUMNS}) SELECT id, {_COLUMNS} "
                                 "FROM messages WHERE id=?", (mid,))
            now = time.time()
            ids = None if token_ids is None else tuple(token_ids)
            row = (content, now, finish_reason, json.dumps(stats) if stats else None, _pack(ids),
                   token_model if ids is not None else "")
            self._db.execute(f"INSERT INTO reply_versions(message_id, {_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?)",
                             (mid, *row))
            return self._show_version(conv_id, mid, self._count_versions(mid), touch=now)

    def choose_version(self, conv_id: int, message_id: int, version: int) -> StoredMessage:
        """Show branch ``version`` (1-based) of reply ``message_id``: the conversation goes on
        from it (the next prompt reads it). One transaction.

        Raises:
            KeyError: no such reply in the conversation, or no such branch of it.
        """
        with self._tx():
            row = self._db.execute("SELECT role FROM messages WHERE id=? AND conversation_id=?",
                                   (message_id, conv_id)).fetchone()
            n = self._count_versions(message_id) if row else 0
            if not 1 <= version <= n:
                raise KeyError(f"reply {message_id} of conversation {conv_id} has no branch {version}")
            return self._show_version(conv_id, message_id, version)

    def _count_versions(self, message_id: int) -> int:
        return self._db.execute("SELECT COUNT(*) FROM reply_versions WHERE message_id=?", (message_id,)).fetchone()[0]

    def _show_version(self, conv_id: int, message_id: int, version: int, touch: float | None = None) -> StoredMessage:
        """Copy branch ``version`` into the message row (inside a transaction)."""
        v = self._db.execute(f"SELECT {_COLUMNS} FROM reply_versions WHERE message_id=? ORDER BY id "
                             "LIMIT 1 OFFSET ?", (message_id, version - 1)).fetchone()
        self._db.execute("UPDATE messages SET content=?, finish_reason=?, stats=?, token_ids=?, token_model=?, "
                         "version=? WHERE id=?", (v[0], v[2], v[3], v[4], v[5], version, message_id))
        if touch is not None:
            self._db.execute("UPDATE conversations SET updated_at=? WHERE id=?", (touch, conv_id))
        r = self._db.execute("SELECT created_at FROM messages WHERE id=?", (message_id,)).fetchone()
        return StoredMessage(message_id, "assistant", v[0], r[0], v[2], json.loads(v[3]) if v[3] else {},
                             _unpack(v[4]), v[5], version, self._count_versions(message_id))

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

    def snapshot(self, conv_id: int, from_id: int) -> "Snapshot":
        """Message ``from_id`` and the conversation's messages after it, with their branches, as
        stored (for :meth:`undo_send`: an edit drops them)."""
        return Snapshot(self._rows("messages", "conversation_id=? AND id>=?", (conv_id, from_id)),
                        self._rows("reply_versions", "message_id IN (SELECT id FROM messages WHERE "
                                   "conversation_id=? AND id>=?)", (conv_id, from_id)))

    def _rows(self, table: str, where: str, args: tuple) -> tuple[tuple[str, ...], list[tuple]]:
        cur = self._db.execute(f"SELECT * FROM {table} WHERE {where} ORDER BY id", args)
        return tuple(d[0] for d in cur.description), [tuple(r) for r in cur.fetchall()]

    def undo_send(self, conv_id: int, message_id: int, *, title: str, updated_at: float,
                  dropped: "Snapshot | None" = None) -> None:
        """Take back a message the model refused (too long for the context), in one
        transaction: message ``message_id`` goes, what an edit dropped (``dropped``, from
        :meth:`snapshot`: ids and branches kept) comes back, and the conversation's title and
        ``updated_at`` (seconds since the epoch: its place in the list) are as given. The
        conversation is then as it was before the message was sent.

        Raises:
            KeyError: message ``message_id`` is no longer the conversation's last.
        """
        with self._tx():
            row = self._db.execute("SELECT MAX(id) FROM messages WHERE conversation_id=?", (conv_id,)).fetchone()
            if row[0] != message_id:
                raise KeyError(f"message {message_id} is not the last of conversation {conv_id}")
            self._db.execute("DELETE FROM messages WHERE id=?", (message_id,))
            for table, (names, rows) in (("messages", dropped.messages), ("reply_versions", dropped.versions)) \
                    if dropped else ():
                marks = ", ".join("?" * len(names))
                self._db.executemany(f"INSERT INTO {table}({', '.join(names)}) VALUES ({marks})", rows)
            self._db.execute("UPDATE conversations SET title=?, updated_at=? WHERE id=?", (title, updated_at, conv_id))

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
