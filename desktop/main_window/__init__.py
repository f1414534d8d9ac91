"""The main window: conversations (left), the chat (centre), dockable panels (right).

:mod:`.window` builds it (its menus in :mod:`.menus`) and handles models, notices and closing.
It owns its parts: :mod:`.conversations` opens, creates, deletes and exports conversations;
:mod:`.replies` sends messages and keeps the replies. Must not import torch or runtime.
"""
from desktop.main_window.window import PANEL_SLOTS, MainWindow

__all__ = ["MainWindow", "PANEL_SLOTS"]
