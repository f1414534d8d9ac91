"""The main window's conversations: open, create, delete, export, and saving replies.

A mixin of :class:`desktop.main_window.window.MainWindow`: it uses the window's ``store``,
``conversations``, ``messages``, ``sidebar``, ``status`` and ``engine``. Must not import
torch or runtime.
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
    """What the window does with whole conversations (mixed into the window)."""

    @property
    def current_conversation(self) -> int:
        return self._conv_id

    def new_conversation(self) -> int:
        if self._conv_id and not self.messages.rowCount() and self._reply is None:
            return self._conv_id   # the open chat is still empty: use it
        conv = self.store.create_conversation(model=self.engine.model["name"] if self.engine.model else "")
        self.conversations.add(conv)
        self.open_conversation(conv.id)
        self.input.setFocus()
        return conv.id

    def open_conversation(self, conv_id: int) -> None:
        if self._editing:
            self.cancel_edit()
        self._conv_id = conv_id
        self.settings.set("last_conversation", conv_id)
        self.sidebar.select(conv_id)
        self.messages.set_messages(self._rows_of(conv_id))
        r = self._reply
        if r is not None:
            r["row"] = -1
            if r["conv_id"] == conv_id:
                if r["kind"] == "regenerate":
                    last_user = self.messages.last_row("user")
                    self.messages.remove_from(last_user + 1)
                r["row"] = self.messages.append("assistant", r["text"], streaming=True)
        self.notice.hide()
        self._show_context_of(conv_id)
        self._update_title()
        self._sync()

    def _rows_of(self, conv_id: int) -> list[dict]:
        """The conversation's rows for the view: what is stored, then replies not saved yet."""
        rows = [vars(m) for m in self.store.messages(conv_id)] if conv_id else []
        for u in self._unsaved:
            if u["conv_id"] == conv_id:
                while u["kind"] == "regenerate" and rows and rows[-1]["role"] == "assistant":
                    rows.pop()
                rows.append({"role": "assistant", "content": u["text"], "finish_reason": u["reason"],
                             "stats": u["stats"]})
        return rows

    def _save_reply(self, u: dict):
        """Write one finished reply; None when its conversation is gone."""
        conv = u["conv_id"]
        if self.store.conversation(conv) is None:
            return None
        ids = {"token_ids": u.get("token_ids"), "token_model": u.get("token_model", "")}
        if u["kind"] == "regenerate":   # a new branch; the earlier replies stay (< 2/3 >)
            return self.store.add_reply_version(conv, u["text"], finish_reason=u["reason"], stats=u["stats"], **ids)
        return self.store.add_message(conv, "assistant", u["text"], finish_reason=u["reason"], stats=u["stats"], **ids)

    def _save_unsaved(self) -> None:
        """Save the replies the database refused before, oldest first.

        Raises:
            sqlite3.Error, OSError: still refused (the rest stay queued, in order).
        """
        while self._unsaved:
            self._save_reply(self._unsaved[0])
            done = self._unsaved.pop(0)
            self.conversations.refresh(done["conv_id"])

    def _save_failed(self, error: Exception, what: str, kept: str = "it stays here and is saved with your next message") -> None:
        """One line: what could not be saved, why, where it is kept, and what to do."""
        log.warning("could not save %s", what, exc_info=True)
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        self.show_error(f"Could not save {what} ({reason}); {kept}. Free some disk space.")

    def _update_title(self, *args) -> None:
        title = self.conversations.title(self._conv_id)
        self.setWindowTitle(f"{title} — attnchat" if title else "attnchat")

    def _show_context_of(self, conv_id: int) -> None:
        """The conversation's figures (its last reply's stats; none for a new chat) in the status
        bar and, through :attr:`conversation_stats`, in the panels: both show the same.

        Figures another model wrote do not apply to the loaded one (another tokenizer, another
        cache; its cache is empty until the next message): then both show an empty cache with
        this model's limits, and the panels are told why (``{"other_model": True}``)."""
        stats: dict = {}
        for m in reversed(self.store.messages(conv_id) if conv_id else []):
            if m.role == "assistant" and m.stats:
                stats = m.stats if self._by_loaded_model(m.stats) else {"other_model": True}
                break
        r = self._reply
        if r is not None and r["conv_id"] == conv_id and r.get("stats"):
            stats = r["stats"]   # a reply being written here: its newest figures
        elif stats and not stats.get("other_model") and not (self.engine.model or {}).get("remote") \
                and self._live.get(conv_id) != self.cache_key():
            # No cache of it exists now (an earlier run, or other cache settings): the next
            # message reads the conversation again. Its figures are the last reply's, not the cache's.
            stats = dict(stats, stale=True)
        self.status.set_stats({} if stats.get("other_model") else stats)
        self.conversation_stats.emit(dict(stats))
        self._show_unseen({} if stats.get("other_model") else stats)

    def _show_unseen(self, stats: dict) -> None:
        """Fade the messages the last reply's model no longer saw (rolling overflow, truncate-middle) and say so."""
        self.page.show_unseen(int(stats.get("unseen_messages") or 0), bool(stats.get("system_kept", True)),
                              int(stats.get("sink_tokens") or 0), stale=bool(stats.get("stale")),
                              policy=stats.get("unseen_policy") or "rolling")

    def cache_key(self) -> tuple:
        """What a conversation's cache depends on: the loaded model and the cache settings (a
        change of any makes the worker build a new cache at the next reply)."""
        gen = self.generation()
        return (model_key(self.engine.model), gen.get("context"), gen.get("cache_dtype"), gen.get("cache_limit_mib"),
                gen.get("cache_policy"), gen.get("cache_budget"), gen.get("cache_budget_unit"))

    def _by_loaded_model(self, stats: dict) -> bool:
        """Whether a stored reply's ``stats`` came from the loaded model (``stats["model"]``,
        :func:`desktop.worker.model_key`). Figures stored without it (before it was recorded)
        are taken as the first model's of this window, as they were before."""
        if "model" not in stats:
            return self._models_loaded <= 1
        return bool(self.engine.model) and stats["model"] == model_key(self.engine.model)

    def delete_conversation(self, conv_id: int) -> None:
        title = self.conversations.title(conv_id)
        if not self.confirm(f"Delete the conversation “{title}”? This cannot be undone."):
            return
        if self._reply is not None and self._reply["conv_id"] == conv_id:
            self.engine.stop()
        try:
            self.store.delete(conv_id)
        except (sqlite3.Error, OSError) as e:
            log.warning("could not delete conversation %s", conv_id, exc_info=True)
            self.show_error(f"Could not delete the conversation ({e}); try again after freeing some disk space.")
            return
        self.engine.forget(conv_id)
        self._unsaved = [u for u in self._unsaved if u["conv_id"] != conv_id]
        self.conversations.remove(conv_id)
        if conv_id == self._conv_id:
            nxt = self.conversations.index(0).data(ConversationListModel.IdRole) if self.conversations.rowCount() else 0
            self.open_conversation(nxt)

    def export_conversation(self, conv_id: int, fmt: str, path: str | Path) -> None:
        """Write ``conv_id`` to ``path`` as ``"markdown"`` or ``"json"``."""
        if fmt == "json":
            text = json.dumps(self.store.export_json(conv_id), indent=2, ensure_ascii=False) + "\n"
        else:
            text = self.store.export_markdown(conv_id)
        Path(path).write_text(text, encoding="utf-8")

    def export_dialog(self, conv_id: int, fmt: str) -> None:
        if not conv_id:
            return
        ext, kind = (".json", "JSON (*.json)") if fmt == "json" else (".md", "Markdown (*.md)")
        name = "".join(c if c.isalnum() or c in " -_" else "_" for c in self.conversations.title(conv_id)).strip() or "chat"
        path = save_file_name(self, "Export the conversation", name + ext, kind)
        if path:
            try:
                self.export_conversation(conv_id, fmt, path)
            except OSError as e:
                self.show_error(f"Could not export to {path}: {e.strerror or e}")
            else:
                self.status.showMessage(f"Exported to {path}", 5000)
