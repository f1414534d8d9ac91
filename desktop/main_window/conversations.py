"""The main window's conversations: open, create, delete, export, and saving replies.

:class:`ConversationActions` is a part the window owns (``window.chats``). It holds which
conversation is open, the replies the database refused and which conversations' caches the
worker holds; it reaches the window's ``store``, ``conversations`` (the list model),
``messages``, ``sidebar``, ``status`` and ``engine`` through ``self.w``, and the reply being
written through ``self.w.replies``. Must not import torch or runtime.
"""
from __future__ import annotations

import json
import logging
import sqlite3
from pathlib import Path

from desktop.chat.conversations import ConversationListModel
from desktop.file_dialogs import save_file_name
from desktop.worker import model_key

__all__ = ["ConversationActions"]

log = logging.getLogger(__name__)


class ConversationActions:
    """What the window does with whole conversations (see the module docstring).

    Attributes:
        current: the open conversation's id (0: none).
        unsaved: replies the database refused (disk full), oldest first: shown, and saved
            again before the next write.
        live: conversation id -> the cache key (:meth:`cache_key`) of the cache the worker
            holds for it now (it replied in this run with those settings).
        other_branch: conversations whose cache holds another version of the reply shown
            (‹ › switched it): said so, instead of "an earlier run, or other settings".
    """

    def __init__(self, window):
        self.w = window
        self.current = 0
        self.unsaved: list[dict] = []
        self.live: dict[int, tuple] = {}
        self.other_branch: set[int] = set()
        #: What was typed (and attached) in the message box of each conversation not open now: a
        #: draft stays with its conversation, as in other chat apps (it followed the switch and
        #: could be sent into the wrong one).
        self.drafts: dict[int, tuple[str, list]] = {}
        self._load_drafts()

    def new(self) -> int:
        if self.current and not self.w.messages.rowCount() and self.w.replies.reply is None:
            return self.current   # the open chat is still empty: use it
        conv = self.w.store.create_conversation(model=self.w.engine.model["name"] if self.w.engine.model else "")
        self.w.conversations.add(conv)
        self.open(conv.id)
        self.w.input.setFocus()
        return conv.id

    def open(self, conv_id: int) -> None:
        if self.w.replies.editing:
            self.w.replies.cancel_edit()
        if conv_id != self.current:
            self._swap_draft(conv_id)
        self.current = conv_id
        self.w.settings.set("last_conversation", conv_id)
        self.w.sidebar.select(conv_id)
        self.w.messages.set_messages(self.rows_of(conv_id))
        r = self.w.replies.reply
        if r is not None:
            r["row"] = -1
            if r["conv_id"] == conv_id:
                if r["kind"] == "regenerate":
                    last_user = self.w.messages.last_row("user")
                    self.w.messages.remove_from(last_user + 1)
                r["row"] = self.w.messages.append("assistant", r["text"], streaming=True)
        self.w.hide_notice()
        self.show_context_of(conv_id)
        self.update_title()
        self.w._sync()

    def _load_drafts(self) -> None:
        """The drafts kept at the last Quit (their text; attached files are not kept)."""
        try:
            kept = json.loads(self.w.settings.get("window/drafts") or "{}")
        except ValueError:
            kept = {}
        if isinstance(kept, dict):
            self.drafts.update({int(k): (v, []) for k, v in kept.items()
                                if str(k).isdigit() and isinstance(v, str) and v.strip()})

    def save_drafts(self) -> None:
        """Keep what was typed and not sent, in every conversation still listed, for the next
        start (it was lost at Quit). The text only: a file attached may be gone by then."""
        texts = {c: t for c, (t, _files) in self.drafts.items() if t.strip()}
        if self.current and self.w.input.toPlainText().strip() and not self.w.replies.editing:   # an edit is no draft
            texts[self.current] = self.w.input.toPlainText()
        texts = {str(c): t for c, t in texts.items() if self.w.conversations.row_of(c) >= 0}
        self.w.settings.set("window/drafts", json.dumps(texts, sort_keys=True) if texts else "")

    def _swap_draft(self, conv_id: int) -> None:
        """Keep the open conversation's draft and put ``conv_id``'s in the box (empty if none)."""
        text, files = self.w.input.toPlainText(), self.w.attachments.take()
        if self.current and (text.strip() or files):
            self.drafts[self.current] = (text, files)
        else:
            self.drafts.pop(self.current, None)
        text, files = self.drafts.pop(conv_id, ("", []))
        self.w.input.setPlainText(text)
        self.w.attachments.restore(files)

    def rows_of(self, conv_id: int) -> list[dict]:
        """The conversation's rows for the view: what is stored, then replies not saved yet."""
        rows = [vars(m) for m in self.w.store.messages(conv_id)] if conv_id else []
        for u in self.unsaved:
            if u["conv_id"] == conv_id:
                while u["kind"] == "regenerate" and rows and rows[-1]["role"] == "assistant":
                    rows.pop()
                rows.append({"role": "assistant", "content": u["text"], "finish_reason": u["reason"],
                             "stats": u["stats"]})
        return rows

    def save_reply(self, u: dict):
        """Write one finished reply; None when its conversation is gone."""
        conv = u["conv_id"]
        if self.w.store.conversation(conv) is None:
            return None
        ids = {"token_ids": u.get("token_ids"), "token_model": u.get("token_model", "")}
        if u["kind"] == "regenerate":   # a new branch; the earlier replies stay (< 2/3 >)
            return self.w.store.add_reply_version(conv, u["text"], finish_reason=u["reason"], stats=u["stats"], **ids)
        return self.w.store.add_message(conv, "assistant", u["text"], finish_reason=u["reason"], stats=u["stats"], **ids)

    def save_unsaved(self) -> None:
        """Save the replies the database refused before, oldest first.

        Raises:
            sqlite3.Error, OSError: still refused (the rest stay queued, in order).
        """
        while self.unsaved:
            self.save_reply(self.unsaved[0])
            done = self.unsaved.pop(0)
            self.w.conversations.refresh(done["conv_id"])

    def save_failed(self, error: Exception, what: str, kept: str = "it stays here and is saved with your next message") -> None:
        """One line: what could not be saved, why, where it is kept, and what to do."""
        log.warning("could not save %s", what, exc_info=True)
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        self.w.show_error(f"Could not save {what} ({reason}); {kept}. Free some disk space.")

    def update_title(self, *args) -> None:
        title = self.w.conversations.title(self.current)
        self.w.setWindowTitle(f"{title} — attnchat" if title else "attnchat")

    def show_context_of(self, conv_id: int) -> None:
        """The conversation's figures (its last reply's stats; none for a new chat) in the status
        bar and, through the window's ``conversation_stats``, in the panels: both show the same.

        Figures another model wrote do not apply to the loaded one (another tokenizer, another
        cache; its cache is empty until the next message): then both show an empty cache with
        this model's limits, and the panels are told why (``{"other_model": True}``)."""
        stats: dict = {}
        for m in reversed(self.w.store.messages(conv_id) if conv_id else []):
            if m.role == "assistant" and m.stats:
                stats = m.stats if self._by_loaded_model(m.stats) else {"other_model": True}
                break
        r = self.w.replies.reply
        if r is not None and r["conv_id"] == conv_id and r.get("stats"):
            stats = r["stats"]   # a reply being written here: its newest figures
        elif stats and not stats.get("other_model") and not (self.w.engine.model or {}).get("remote") \
                and self.live.get(conv_id) != self.cache_key():
            # No cache of it exists now (an earlier run, or other cache settings): the next
            # message reads the conversation again. Its figures are the last reply's, not the cache's.
            stats = dict(stats, stale=True)
            if conv_id in self.other_branch:
                stats["stale_why"] = "it holds another version of this reply"
        self.w.status.set_stats({} if stats.get("other_model") else stats)
        self.w.conversation_stats.emit(dict(stats))
        self.show_unseen({} if stats.get("other_model") else stats)

    def show_unseen(self, stats: dict) -> None:
        """Fade the messages the last reply's model no longer saw (rolling overflow, truncate-middle) and say so."""
        self.w.page.show_unseen(int(stats.get("unseen_messages") or 0), bool(stats.get("system_kept", True)),
                                int(stats.get("sink_tokens") or 0), stale=bool(stats.get("stale")),
                                policy=stats.get("unseen_policy") or "rolling")

    def cache_key(self) -> tuple:
        """What a conversation's cache depends on: the loaded model and the cache settings (a
        change of any makes the worker build a new cache at the next reply)."""
        gen = self.w.generation()
        return (model_key(self.w.engine.model), gen.get("context"), gen.get("cache_dtype"), gen.get("cache_limit_mib"),
                gen.get("cache_policy"), gen.get("cache_budget"), gen.get("cache_budget_unit"))

    def _by_loaded_model(self, stats: dict) -> bool:
        """Whether a stored reply's ``stats`` came from the loaded model (``stats["model"]``,
        :func:`desktop.worker.model_key`). Figures stored without it (a store older than the
        field) are taken as the first model's of this window: nothing says which model wrote them."""
        if "model" not in stats:
            return self.w._models_loaded <= 1
        return bool(self.w.engine.model) and stats["model"] == model_key(self.w.engine.model)

    def delete(self, conv_id: int) -> None:
        title = self.w.conversations.title(conv_id)
        if not self.w.confirm(f"Delete the conversation “{title}”? This cannot be undone."):
            return
        if self.w.replies.reply is not None and self.w.replies.reply["conv_id"] == conv_id:
            self.w.engine.stop()
        try:
            self.w.store.delete(conv_id)
        except (sqlite3.Error, OSError) as e:
            log.warning("could not delete conversation %s", conv_id, exc_info=True)
            self.w.show_error(f"Could not delete the conversation ({e}); try again after freeing some disk space.")
            return
        self.w.engine.forget(conv_id)
        self.unsaved = [u for u in self.unsaved if u["conv_id"] != conv_id]
        self.w.conversations.remove(conv_id)
        if conv_id == self.current:
            nxt = self.w.conversations.index(0).data(ConversationListModel.IdRole) if self.w.conversations.rowCount() else 0
            self.open(nxt)

    def export(self, conv_id: int, fmt: str, path: str | Path) -> None:
        """Write ``conv_id`` to ``path`` as ``"markdown"`` or ``"json"``."""
        if fmt == "json":
            text = json.dumps(self.w.store.export_json(conv_id), indent=2, ensure_ascii=False) + "\n"
        else:
            text = self.w.store.export_markdown(conv_id)
        Path(path).write_text(text, encoding="utf-8")

    def export_dialog(self, conv_id: int, fmt: str) -> None:
        if not conv_id:
            return
        ext, kind = (".json", "JSON (*.json)") if fmt == "json" else (".md", "Markdown (*.md)")
        name = "".join(c if c.isalnum() or c in " -_" else "_" for c in self.w.conversations.title(conv_id)).strip() or "chat"
        path = save_file_name(self.w, "Export the conversation", name + ext, kind)
        if path:
            try:
                self.export(conv_id, fmt, path)
            except OSError as e:
                self.w.show_error(f"Could not export to {path}: {e.strerror or e}")
            else:
                self.w.status.showMessage(f"Exported to {path}", 5000)
