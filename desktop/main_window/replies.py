"""The main window's replies: send, regenerate, edit any of your messages, stop, and the
worker's streamed text, stats and finish.

Editing a message that is not the last drops the messages after it (the banner says how
many, and the chat shows them faded until the edit is sent or cancelled): the branch left
is not kept. The database makes the change in one transaction when the edit is sent.

:class:`ReplyActions` is a part the window owns (``window.replies``). It holds the reply being
written, the message being edited and the last message sent; it reaches the window's ``store``,
``engine``, ``messages``, ``input`` and ``status`` through ``self.w``, and the conversations
part (:class:`desktop.main_window.conversations.ConversationActions`) through ``self.w.chats``.
Must not import torch or runtime.
"""
from __future__ import annotations

import logging
import random
import sqlite3
import time

from desktop.chat.pages import notice_link
from desktop.chat.store import DEFAULT_TITLE

__all__ = ["BUSY_NOTE", "CONTEXT_FULL", "LOADING_NOTE", "ReplyActions", "TITLE_CHARS", "auto_title", "prefill_left",
           "waiting_note"]

log = logging.getLogger(__name__)

#: A new conversation's title: the first line of its first message, cut at this many characters.
TITLE_CHARS = 48


def auto_title(text: str) -> str:
    """The title a conversation gets from its first message: its first line, cut at
    :data:`TITLE_CHARS` characters (with "…")."""
    first = text.strip().splitlines()[0] if text.strip() else ""
    return first[:TITLE_CHARS] + ("…" if len(first) > TITLE_CHARS else "")


def prefill_left(reply: dict, done: int, total: int, now: float) -> float | None:
    """Seconds the prompt being read still takes, from its pace so far (``reply["prefill_from"]``
    keeps where and when the count started); None until a second's worth of it is read. Later
    chunks attend to more tokens, so this errs short on a long prompt: it is said as "about"."""
    start = reply.setdefault("prefill_from", (now, done))
    t0, d0 = start
    if done <= d0 or now - t0 < 1.0 or done >= total:
        return None
    return (now - t0) / (done - d0) * (total - done)


#: Said in the chat when Enter is pressed while a reply is written (it seemed to do nothing);
#: it goes when the reply ends.
BUSY_NOTE = "A reply is being written: wait for it, or press Stop (Esc), then send. Your message stays in the box."
#: Said in the chat when Enter is pressed while the model loads (the window is up before it);
#: it goes when the model is loaded.
LOADING_NOTE = "The model is still loading: send your message once it is loaded. It stays in the box."


def waiting_note(work: str) -> str:
    """Said in the chat when a reply is queued behind ``work`` ("Explain") on the engine's
    thread; it goes when the reply starts."""
    return (f"{work} is running on the model: this reply starts when it ends "
            f"(its Cancel is in View > Attention > Insight).")


#: Said in the chat when the "stop" overflow policy finds the context full before a reply.
CONTEXT_FULL = (f"The context is full: {notice_link('new', 'start a new chat', 'error')}, or "
                f"{notice_link('overflow', 'switch the overflow policy', 'error')} to drop the oldest turns.")


class ReplyActions:
    """What the window does to get a reply and keep it (see the module docstring).

    Attributes:
        reply: the reply being written (its request id, conversation, kind, text so far, chat
            row, cache key and settings), or None.
        editing: the id of the message being edited, or 0.
        sent: the last message sent and what taking it back restores (:meth:`_refused`), or None.
    """

    def __init__(self, window):
        self.w = window
        self.reply: dict | None = None
        self.editing = 0
        self.sent: dict | None = None

    def generation(self) -> dict:
        """Every generation setting a reply gets: the settings (with ``model_sampling`` on, the
        loaded model's own sampling values where its file gives them, ``model_sampling_from``
        naming the file part), then this window's overrides."""
        out = self.w.settings.generation_values()   # every generation/* setting (desktop.settings.values)
        own = (self.w.engine.model or {}).get("sampling") or {}
        if out.get("model_sampling") and own.get("values"):
            out.update(own["values"])
            out["model_sampling_from"] = own.get("source", "the model's file")
        out.update(self.w.generation_overrides)
        return out

    def reply_generation(self) -> dict:
        """:meth:`generation` for one reply: a random seed (``seed`` < 0) is drawn here when the
        reply samples, so the reply can say its seed and the user can reuse it."""
        gen = self.generation()
        if float(gen.get("temperature") or 0.0) > 0 and int(gen.get("seed", -1)) < 0:
            gen["seed"], gen["drawn_seed"] = random.randrange(2**31 - 1), True
        return gen

    def reply_settings(self, gen: dict | None = None) -> dict:
        """What a reply is written with (``gen``: :meth:`reply_generation`'s; default the
        settings now), as exports name it: the model, the system prompt the model sees (the
        settings', else its chat template's own; ``system_prompt_from`` says which:
        ``"settings"``, ``"template"`` or ``"none"``) and the generation settings."""
        gen = dict(gen) if gen is not None else self.generation()
        info = self.w.engine.model or {}
        own = str(gen.get("system_prompt") or "")
        builtin = "" if own else str(info.get("builtin_system_prompt") or "")
        out = {"model": info.get("name", ""), "system_prompt": own or builtin,
               "system_prompt_from": "settings" if own else "template" if builtin else "none"}
        out |= {k: v for k, v in gen.items() if k != "system_prompt"}
        if out.pop("drawn_seed", False):   # the setting says random; this reply's seed is kept beside it
            out["reply_seed"], out["seed"] = out["seed"], -1
        return out

    def _history(self, conv_id: int, before: int | None = None) -> list[tuple]:
        """``(role, content, token_ids, token_model)`` per stored message (the worker uses the ids
        when they belong to its model); with ``before``, only the messages before that id."""
        return [(m.role, m.content, m.token_ids, m.token_model) for m in self.w.store.messages(conv_id)
                if before is None or m.id < before]

    def _can_start(self) -> bool:
        if self.reply is not None:
            # Said in the chat, not only the status bar: Enter seemed to do nothing.
            self.w.show_note(BUSY_NOTE)
            self.w.status.showMessage("A reply is being written: wait for it, or press Stop", 4000)
            return False
        if not self.w.engine.model:
            if getattr(self.w.engine, "loading", False):
                self.w.show_note(LOADING_NOTE)
            self.w.status.showMessage("No model is loaded yet", 4000)
            return False
        return True

    def submit(self, text: str) -> None:
        """Send ``text`` (or, while editing, replace the edited message with it and drop the
        messages after it).

        A message the database refuses (disk full) is not sent: it stays in the input
        box, the error is shown, and sending again tries again.
        """
        typed, files = text, list(self.w.attachments.files)
        text = self.w.attachments.message(typed)   # the files' text, then what was typed
        if not text.strip() or not self._can_start():
            return
        editing = self.editing
        # The edited message's text as it was: a title made from it follows the edit.
        before = next((self.w.messages.message(r)["content"] for r in range(self.w.messages.rowCount())
                       if self.w.messages.message(r)["id"] == editing), None) if editing else None
        try:
            self.w.chats.save_unsaved()
            conv = self.w.chats.current or self.w.chats.new()
            history = self._history(conv, before=editing or None)
            # What a refusal (the message cannot fit the context) puts back: see _refused.
            was = self.w.store.conversation(conv)
            undo = {"conv": conv, "text": typed, "files": files, "title": was.title, "updated_at": was.updated_at,
                    "dropped": self.w.store.snapshot(conv, editing) if editing else None, "edited": editing}
            if editing:
                msg = self.w.store.edit_message(conv, editing, text)
            else:
                msg = self.w.store.add_message(conv, "user", text)
        except (sqlite3.Error, OSError) as e:
            self.w.chats.save_failed(e, "your message", "it is still in the message box: send it again")
            return
        except (KeyError, ValueError):   # the edited message is gone (not expected: edits end on a switch)
            log.warning("the edited message %s is gone", editing, exc_info=True)
            self._end_edit()
            self.w.show_error("The message you were editing is no longer there; your text is in the message box: "
                            "send it as a new message.")
            return
        if editing:
            self._end_edit()
            self.w.messages.set_messages(self.w.chats.rows_of(conv))
            kind = "edit"
        else:
            self.w.messages.append("user", text, id=msg.id)
            kind = "send"
        # The session is rebuilt from this history: the cache is reused up to the first changed token.
        gen = self.reply_generation()
        request = self.w.engine.send(conv, history, text, gen)
        self.sent = dict(undo, id=msg.id)
        title = self.w.conversations.title(conv)
        first_edited = editing and not any(m[0] == "user" for m in history)
        if title == DEFAULT_TITLE or (first_edited and before is not None and title == auto_title(before)):
            try:   # a new chat's first message, or an edit of it under the title made from it
                # from what was typed, not the files' text before it ("File trip.md:")
                self.w.store.rename(conv, auto_title(typed.strip() or ", ".join(f.name for f in files)))
            except (sqlite3.Error, OSError):  # a title is not worth stopping the message for
                log.warning("could not save the conversation's title", exc_info=True)
        self.w.conversations.refresh(conv)
        self.w.input.clear()
        self.w.attachments.take()
        self._begin(request, conv, kind, gen)

    def regenerate(self) -> None:
        conv = self.w.chats.current
        if not conv or not self._can_start():
            return
        if self.editing:
            self.w.status.showMessage("Send the message you are editing, or cancel the edit (Esc), first", 4000)
            return
        last_user = self.w.messages.last_row("user")
        if last_user < 0:
            return
        try:
            self.w.chats.save_unsaved()   # the reply to replace must be in the database first
        except (sqlite3.Error, OSError) as e:
            self.w.chats.save_failed(e, "the last reply")
            return
        history = self._history(conv)
        self.w.messages.remove_from(last_user + 1)
        gen = self.reply_generation()
        self._begin(self.w.engine.regenerate(conv, history, gen), conv, "regenerate", gen)

    def show_branch(self, row: int, step: int) -> None:
        """Show the previous (``step`` -1) or next (+1) branch of the reply at ``row``: the
        conversation goes on from it (the KV cache is reused up to where the branches differ)."""
        if not 0 <= row < self.w.messages.rowCount():
            return
        m = self.w.messages.message(row)
        if self.reply is not None:
            self.w.status.showMessage("A reply is being written: wait for it, or press Stop", 4000)
            return
        version = int(m.get("version") or 0) + step
        if m["id"] is None or not 1 <= version <= int(m.get("versions") or 0):
            return
        try:
            shown = self.w.store.choose_version(self.w.chats.current, m["id"], version)
        except (KeyError, sqlite3.Error, OSError) as e:
            log.warning("could not show branch %s of reply %s", version, m["id"], exc_info=True)
            self.w.show_error(f"Could not switch to that version of the reply ({e}).")
            return
        self.w.messages.finish(row, id=shown.id, finish_reason=shown.finish_reason, stats=shown.stats,
                             content=shown.content, version=shown.version, versions=shown.versions)
        self.w.status.showMessage(f"Version {shown.version} of {shown.versions} of this reply", 3000)
        conv = self.w.chats.current
        if self.w.chats.live.pop(conv, None) is not None:   # the cache holds the other branch until the next message
            self.w.chats.other_branch.add(conv)   # (with none, after a restart, it is still "an earlier run")
        self.w.chats.show_context_of(self.w.chats.current)
        self.w._sync()

    def edit_last(self) -> None:
        self.edit_message(self.w.messages.last_row("user"))

    def edit_message(self, row: int) -> None:
        """Edit your message at ``row``: its text goes to the message box; sending it replaces
        the message and drops every message after it (the banner says how many, and the chat
        shows them faded until then); Esc cancels."""
        if not 0 <= row < self.w.messages.rowCount():
            return
        if self.reply is not None:
            self.w.status.showMessage("A reply is being written: wait for it, or press Stop", 4000)
            return
        m = self.w.messages.message(row)
        if m["role"] != "user" or m["id"] is None:
            return
        self.editing = m["id"]
        self.w.input.setPlainText(m["content"])
        last = row == self.w.messages.last_row("user")
        self.w.page.show_edit_banner(self.w.messages.rowCount() - row - 1, last=last)
        self.w.chat.edit_row = row
        self.w.input.setFocus()
        self.w._sync()

    def _end_edit(self) -> None:
        self.editing = 0
        self.w.edit_banner.hide()
        self.w.chat.edit_row = -1

    def cancel_edit(self) -> None:
        self._end_edit()
        self.w.input.clear()
        self.w._sync()

    def stop(self) -> None:
        if self.reply is not None:
            self.w.engine.stop()

    def use_seed(self, seed: int) -> None:
        """Write the next replies with ``seed`` (a reply's, from its menu)."""
        self.w.settings.set("generation/seed", int(seed))
        self.w.status.showMessage(f"The next replies use seed {seed}; Settings > Generation > Seed "
                                "goes back to random", 8000)

    def _begin(self, request: int, conv: int, kind: str, gen: dict) -> None:
        self.w.hide_notice()
        row = self.w.messages.append("assistant", "", streaming=True)
        self.reply = {"request": request, "conv_id": conv, "kind": kind, "text": "", "row": row,
                       "cache_key": self.w.chats.cache_key(), "settings": self.reply_settings(gen)}
        work = getattr(self.w.engine, "holding", "")
        if work:   # queued behind it on the engine's thread: "Reading the prompt…" would not move
            self.reply["waiting"] = waiting_note(work)
            self.w.show_note(self.reply["waiting"])
        self.w._sync()

    def _started(self, r: dict) -> None:
        """The reply runs: the note that it waits goes."""
        if r.pop("waiting", None) == self.w.notice.text():
            self.w.hide_notice()

    def on_text(self, text: str) -> None:
        r = self.reply
        if r is None:
            return
        if "waiting" in r:
            self._started(r)
        r["text"] += text
        if r["row"] >= 0:
            self.w.messages.append_text(r["row"], text)

    def on_prefill(self, done: int, total: int) -> None:
        r = self.reply
        if r is None:
            return
        if "waiting" in r:
            self._started(r)
        left = prefill_left(r, done, total, time.monotonic())
        if r["row"] >= 0:
            self.w.status.set_prefill(done, total, left)
            self.w.messages.set_progress(r["row"], done, total, left)

    def on_stats(self, stats: dict) -> None:
        r = self.reply
        if r is not None:
            r["stats"] = stats
        if r is not None and r["row"] >= 0:   # only the open conversation's figures are shown
            self.w.status.set_stats(stats)
            self.w.stats_updated.emit(stats)

    def on_finished(self, result: dict) -> None:
        r = self.reply
        if r is None or result["request"] != r["request"]:
            return
        self.reply = None
        if self.w.notice.text() == BUSY_NOTE:
            self.w.hide_notice()
        if "waiting" in r:   # it ended without a token (an error, a stop): the wait is over too
            self._started(r)
        result = dict(result, kind=r["kind"])   # an edit goes to the worker as a send
        conv, text, reason, stats = r["conv_id"], result["text"], result["reason"], result["stats"]
        if stats:   # the worker holds this conversation's cache now, made with these settings
            self.w.chats.live[conv] = r["cache_key"]
            self.w.chats.other_branch.discard(conv)
            stats = dict(stats, settings=r["settings"])   # kept with the reply: exports name them
        sent, self.sent = self.sent, None
        refused = result.get("refused") or (reason == "context" and not text)
        if refused and r["kind"] in ("send", "edit") and sent and sent["conv"] == conv:
            self._refused(sent, full=reason == "context")
        saved = unsaved = None
        if text and self.w.store.conversation(conv) is not None:
            entry = {"conv_id": conv, "kind": r["kind"], "text": text, "reason": reason, "stats": stats,
                     "token_ids": result.get("token_ids"), "token_model": result.get("token_model", "")}
            try:
                self.w.chats.save_unsaved()
                saved = self.w.chats.save_reply(entry)
                self.w.conversations.refresh(conv)
            except (sqlite3.Error, OSError) as e:   # disk full: keep it, save it with the next write
                self.w.chats.unsaved.append(entry)
                unsaved = entry
                self.w.chats.save_failed(e, "the reply")
        if r["row"] >= 0:
            if saved is not None:
                self.w.messages.finish(r["row"], id=saved.id, finish_reason=reason, stats=stats, content=text,
                                     version=saved.version, versions=saved.versions)
            elif unsaved is not None:
                self.w.messages.finish(r["row"], finish_reason=reason, stats=stats, content=text)
            else:   # nothing to keep (stopped before any text, or failed): show what is stored
                self.w.messages.set_messages(self.w.chats.rows_of(conv))
            self.w.status.end_busy()
            if stats:
                self.w.status.set_stats(stats)
                self.w.chats.show_unseen(stats)
        self.w._sync()
        self.w.reply_finished.emit(result)

    def _refused(self, sent: dict, *, full: bool) -> None:
        """No reply fits (the message is too long for the context, or the "stop" policy finds
        the context full): the conversation goes back to what it was before the message (its
        title, an edit's dropped messages) and the text goes back to the box, the edit with it.
        ``full``: the context is full (the banner offers the two ways on); else the worker's
        error line is already shown."""
        conv = sent["conv"]
        try:
            self.w.store.undo_send(conv, sent["id"], title=sent["title"], updated_at=sent["updated_at"],
                                 dropped=sent["dropped"])
        except (KeyError, sqlite3.Error, OSError):
            log.warning("could not take back the message that got no reply", exc_info=True)
        self.w.conversations.refresh(conv)
        if conv == self.w.chats.current:
            self.w.messages.set_messages(self.w.chats.rows_of(conv))
            row = next((i for i in range(self.w.messages.rowCount())
                        if self.w.messages.message(i)["id"] == sent["edited"]), -1) if sent["edited"] else -1
            if row >= 0:
                self.edit_message(row)   # the edit is still open, with the text that did not fit
                self.w.input.setPlainText(sent["text"])
            elif not self.w.input.toPlainText().strip():
                self.w.input.setPlainText(sent["text"])
            self.w.attachments.restore(sent.get("files") or [])
            self.w.input.moveCursor(self.w.input.textCursor().MoveOperation.End)
        self.w.chats.update_title()
        if full:
            self.w.show_error(CONTEXT_FULL)
            self.w.status.showMessage("The context is full", 8000)
