"""The main window's menu bar: File, Edit and View, each entry wired to the window or one of
its parts (``window.chats``, ``window.replies``). Must not import torch or runtime.
"""
from __future__ import annotations

from PySide6.QtGui import QAction, QKeySequence

__all__ = ["build_menus"]


def _action(menu, text: str, slot, shortcut=None) -> QAction:
    act = menu.addAction(text)
    act.triggered.connect(slot)
    if shortcut is not None:
        act.setShortcut(QKeySequence(shortcut))
    return act


def build_menus(w, panel_slots: dict[str, str]) -> None:
    """Fill ``w``'s (a :class:`desktop.main_window.window.MainWindow`) menu bar and set the
    window attributes other code reaches the entries by: ``file_menu``, ``open_folder_action``,
    ``export_md``, ``export_json``, ``copy_action``, ``regen_action``, ``edit_action``,
    ``stop_action``, ``view_menu`` and ``panel_actions`` (object name -> a disabled placeholder
    entry per panel in ``panel_slots``, until :meth:`MainWindow.add_panel` replaces it)."""
    chats, replies = w.chats, w.replies
    bar = w.menuBar()
    f = w.file_menu = bar.addMenu("&File")
    _action(f, "&New chat", chats.new, QKeySequence.StandardKey.New)
    _action(f, "&Open model…", w.open_model_file, QKeySequence.StandardKey.Open)
    w.open_folder_action = _action(f, "Open model &folder…", w.open_model_folder)
    _action(f, "&Download the default model…", w.download_requested.emit)
    f.addSeparator()
    w.export_md = _action(f, "Export as &Markdown…", lambda: chats.export_dialog(chats.current, "markdown"))
    w.export_json = _action(f, "Export as &JSON…", lambda: chats.export_dialog(chats.current, "json"))
    f.addSeparator()
    _action(f, "&Quit", w.close, QKeySequence.StandardKey.Quit)
    e = bar.addMenu("&Edit")
    w.copy_action = _action(e, "&Copy message", lambda: w.chat.copy_row(w.chat.selected_row()))
    w.regen_action = _action(e, "&Regenerate", replies.regenerate, "Ctrl+R")
    w.edit_action = _action(e, "&Edit last message", replies.edit_last, "Ctrl+E")
    _action(e, "&Attach files to the message…", lambda: w.attachments.choose(), "Ctrl+Shift+A")
    w.stop_action = _action(e, "&Stop", replies.stop)
    _action(e, "Re&name chat", lambda: chats.current and w.sidebar.rename(chats.current), "F2")
    v = w.view_menu = bar.addMenu("&View")
    side = _action(v, "&Conversations", lambda on: w.sidebar.setVisible(on))
    side.setCheckable(True)
    side.setChecked(True)
    v.addSeparator()
    w.panel_actions = {}
    for name, title in panel_slots.items():
        act = v.addAction(f"{title} (not available yet)")
        act.setEnabled(False)
        w.panel_actions[name] = act
