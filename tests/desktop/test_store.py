"""The conversation database: WAL, schema versions and migrations, atomic saves, exports, kill -9."""
from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from desktop.chat.store import MIGRATIONS, SCHEMA_VERSION, SchemaTooNewError, Store


def test_wal_and_schema_version(tmp_path):
    store = Store(tmp_path / "c.sqlite3")
    assert store._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert store.schema_version == SCHEMA_VERSION == len(MIGRATIONS)
    store.close()


def test_migrates_an_old_file(tmp_path):
    path = tmp_path / "old.sqlite3"
    db = sqlite3.connect(path)
    db.executescript(MIGRATIONS[0])  # a version-1 file, as the first release wrote it
    db.execute("PRAGMA user_version=1")
    db.execute("INSERT INTO conversations(title, created_at, updated_at) VALUES ('kept', 1, 1)")
    db.commit()
    db.close()
    store = Store(path)
    assert store.schema_version == SCHEMA_VERSION
    [conv] = store.conversations()
    assert conv.title == "kept" and conv.model == ""
    store.close()


def test_refuses_a_newer_file(tmp_path):
    path = tmp_path / "new.sqlite3"
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    db.close()
    with pytest.raises(SchemaTooNewError, match="newer attnchat"):
        Store(path)


def test_messages_regenerate_edit_and_export(tmp_path):
    store = Store(tmp_path / "c.sqlite3")
    conv = store.create_conversation("Trip")
    first = store.add_message(conv.id, "user", "Where to?")
    store.add_message(conv.id, "assistant", "Lyon.", finish_reason="stop", stats={"completion_tokens": 2})
    store.add_reply_version(conv.id, "Paris.", finish_reason="length", stats={"completion_tokens": 3})
    msgs = store.messages(conv.id)
    assert [(m.role, m.content) for m in msgs] == [("user", "Where to?"), ("assistant", "Paris.")]
    assert msgs[1].finish_reason == "length" and msgs[1].stats == {"completion_tokens": 3}
    assert (msgs[1].version, msgs[1].versions) == (2, 2)
    store.edit_message(conv.id, first.id, "Where in Italy?")
    assert [(m.role, m.content) for m in store.messages(conv.id)] == [("user", "Where in Italy?")]
    store.add_message(conv.id, "assistant", "Rome:\n\n- the Forum")
    md = store.export_markdown(conv.id)
    assert md.startswith("# Trip\n") and "## You\n\nWhere in Italy?" in md and "- the Forum" in md
    data = json.loads(json.dumps(store.export_json(conv.id)))
    assert data["title"] == "Trip" and [m["role"] for m in data["messages"]] == ["user", "assistant"]
    store.rename(conv.id, "Italy")
    store.delete(conv.id)
    assert store.conversations() == [] and store.messages(conv.id) == []
    store.close()


def test_kill_9_mid_reply_keeps_earlier_messages(tmp_path):
    """A process killed inside a write loses that write only; the file stays sound."""
    path = tmp_path / "c.sqlite3"
    child = textwrap.dedent(f"""
        import os, signal
        from desktop.chat.store import Store
        s = Store({str(path)!r})
        c = s.create_conversation("t")
        for i in range(3):
            s.add_message(c.id, "user", f"question {{i}}")
            s.add_message(c.id, "assistant", f"answer {{i}}", finish_reason="stop", stats={{"i": i}})
        s._db.execute("BEGIN IMMEDIATE")
        s._db.execute("INSERT INTO messages(conversation_id, role, content, created_at) VALUES (?, 'assistant', 'half a rep', 0)", (c.id,))
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", child], cwd=str(tmp_path.parent), capture_output=True,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    assert proc.returncode == -9, proc.stderr
    store = Store(path)
    assert store._db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    [conv] = store.conversations()
    contents = [m.content for m in store.messages(conv.id)]
    assert contents == [x for i in range(3) for x in (f"question {i}", f"answer {i}")]
    store.close()


def test_a_replys_token_ids_are_kept_and_an_older_file_gains_the_column(tmp_path):
    path = tmp_path / "v2.sqlite3"
    db = sqlite3.connect(path)
    for script in MIGRATIONS[:2]:   # a version-2 file, before token ids were kept
        db.executescript(script)
    db.execute("PRAGMA user_version=2")
    db.execute("INSERT INTO conversations(title, created_at, updated_at) VALUES ('old', 1, 1)")
    db.execute("INSERT INTO messages(conversation_id, role, content, created_at) VALUES (1, 'assistant', 'Hi.', 1)")
    db.commit()
    db.close()
    store = Store(path)
    assert store.schema_version == SCHEMA_VERSION >= 3
    [old] = store.messages(1)
    assert (old.content, old.token_ids, old.token_model) == ("Hi.", None, "")   # re-tokenized when next used
    ids = (1116, 0, 2**31 - 1, 49151)
    store.add_message(1, "assistant", "1.\n\n2.", token_ids=ids, token_model="/m/a.gguf")
    store.add_message(1, "assistant", "edited", token_ids=None, token_model="/m/a.gguf")
    store.close()
    reopened = Store(path)
    _, kept, edited = reopened.messages(1)
    assert (kept.token_ids, kept.token_model) == (ids, "/m/a.gguf")
    assert (edited.token_ids, edited.token_model) == (None, "")
    assert all("token_ids" not in m for m in reopened.export_json(1)["messages"])
    reopened.close()


def test_reply_branches_are_kept_chosen_and_survive_a_reopen(tmp_path):
    path = tmp_path / "c.sqlite3"
    store = Store(path)
    conv = store.create_conversation("Trip").id
    store.add_message(conv, "user", "Where to?")
    first = store.add_message(conv, "assistant", "Lyon.", finish_reason="stop", stats={"completion_tokens": 2},
                              token_ids=[1, 2], token_model="m.gguf")
    assert (first.version, first.versions) == (0, 0)
    second = store.add_reply_version(conv, "Paris.", finish_reason="stop", stats={"completion_tokens": 3})
    third = store.add_reply_version(conv, "Rome.", finish_reason="length", stats={"completion_tokens": 4},
                                    token_ids=[7], token_model="m.gguf")
    assert second.id == third.id == first.id and (third.version, third.versions) == (3, 3)
    store.close()
    store = Store(path)   # a restart
    reply = store.messages(conv)[1]
    assert (reply.content, reply.version, reply.versions, reply.token_ids) == ("Rome.", 3, 3, (7,))
    back = store.choose_version(conv, reply.id, 1)
    assert (back.content, back.finish_reason, back.stats, back.token_ids, back.token_model) == \
        ("Lyon.", "stop", {"completion_tokens": 2}, (1, 2), "m.gguf")
    reply = store.messages(conv)[1]
    assert (reply.content, reply.version, reply.versions) == ("Lyon.", 1, 3)
    assert "Lyon." in store.export_markdown(conv) and "Rome." not in store.export_markdown(conv)
    exported = store.export_json(conv)["messages"][1]
    assert exported["content"] == "Lyon." and (exported["version"], exported["versions"]) == (1, 3)
    with pytest.raises(KeyError):
        store.choose_version(conv, reply.id, 4)
    # A regeneration after a switch adds a fourth branch and shows it.
    assert store.add_reply_version(conv, "Nice.").version == 4
    # An edit of the question drops the reply with all its branches.
    store.edit_message(conv, store.messages(conv)[0].id, "Where in Italy?")
    assert [m.content for m in store.messages(conv)] == ["Where in Italy?"]
    assert store._db.execute("SELECT COUNT(*) FROM reply_versions").fetchone()[0] == 0
    store.close()


def test_search_finds_conversations_by_their_messages_text(tmp_path):
    path = tmp_path / "c.sqlite3"
    store = Store(path)
    trip = store.create_conversation("Trip").id
    store.add_message(trip, "user", "Where should I go in Italy?")
    store.add_message(trip, "assistant", "Florence: the Uffizi and the Duomo.")
    cook = store.create_conversation("Cooking").id
    store.add_message(cook, "user", "A recipe for risotto, please")
    assert store.full_text
    assert set(store.search("uffizi")) == {trip} and "[Uffizi]" in store.search("uffizi")[trip]
    assert set(store.search("riso")) == {cook}              # the last word as a prefix
    assert store.search("florence risotto") == {}           # every word, in one message
    assert store.search('"; DROP TABLE') == {}              # the words are words, not a query
    # Edits, regenerations and deletes keep the index.
    store.add_reply_version(trip, "Rome: the Forum.")
    assert store.search("forum").keys() == {trip} and store.search("uffizi") == {}
    store.choose_version(trip, store.messages(trip)[1].id, 1)
    assert store.search("uffizi").keys() == {trip}
    store.delete(cook)
    assert store.search("risotto") == {}
    store.close()
    # A database written before the index is indexed when opened.
    db = sqlite3.connect(path)
    db.execute("DROP TABLE messages_fts")
    for t in ("insert", "delete", "update"):
        db.execute(f"DROP TRIGGER messages_fts_{t}")
    db.commit()
    db.close()
    assert set(Store(path).search("duomo")) == {trip}
