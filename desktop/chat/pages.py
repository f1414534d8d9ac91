"""The two faces of the window's centre: the chat page and the first-run empty state.

Layout only; :mod:`desktop.main_window` wires the behaviour. Must not import torch or runtime.
"""
from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtGui import QPalette
from PySide6.QtWidgets import QHBoxLayout, QLabel, QPushButton, QStyle, QToolButton, QVBoxLayout, QWidget

from desktop.chat.status_bar import StatusField
from desktop.chat.view import ChatView, MessageInput
from desktop.sizes import size_text
from models import DEFAULT_MODEL

__all__ = ["ChatPage", "EmptyState", "NOTICE_LINKS", "notice_link"]

#: A link's colour in the notice line of each kind (:attr:`ChatPage.NOTICE_STYLES`). The window's
#: link colour is for the window's background: the dark palette's light blue read at 2.1:1 on the
#: note's pale yellow, a blue at 1.3:1 on the error's red. Qt's style sheets and palettes do not
#: reach a QLabel's links under a style sheet; a colour on the link itself does.
NOTICE_LINKS = {"error": "white", "note": "#0b4a9e"}


def notice_link(href: str, text: str, kind: str) -> str:
    """A link for the notice line of ``kind`` (``"error"`` or ``"note"``) that reads on its
    background; ``text`` is HTML (escape it first)."""
    return f'<a href="{href}" style="color: {NOTICE_LINKS[kind]}">{text}</a>'

ASK = "Ask anything. Enter sends, Shift+Enter adds a line."


class ChatPage(QWidget):
    """An error notice, the messages, the edit banner, the input box and the buttons."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.chat = ChatView()
        self.chat.placeholder = ASK
        self.input = MessageInput()
        self.send_button = QPushButton("Send")
        self.send_button.setDefault(True)
        self.stop_button = QPushButton("Stop")
        self.stop_button.setToolTip("Stop the reply (Esc)")
        self.regen_button = QPushButton("Regenerate")
        self.regen_button.setToolTip("Write the last reply again (Ctrl+R)")
        self.edit_button = QPushButton("Edit last")
        self.edit_button.setToolTip("Edit your last message and send it again (Ctrl+E)")
        self.notice = QLabel()
        self.notice.setObjectName("notice")
        self.notice.setWordWrap(True)
        self.notice.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.set_notice_kind("error")
        self.notice.hide()
        self.edit_banner = QLabel("Editing your last message: Enter sends it again, Esc cancels.")
        self.edit_banner.setObjectName("editBanner")
        # Wrapped: on one line its ~500 px of text set the chat's minimum width, and with the
        # panels open the window grew by that much when Edit was clicked.
        self.edit_banner.setWordWrap(True)
        self.edit_banner.hide()
        #: Rolling overflow or truncate-middle: what the model no longer sees (see show_unseen).
        self.unseen_banner = QLabel()
        self.unseen_banner.setObjectName("unseenBanner")
        self.unseen_banner.setWordWrap(True)
        self.unseen_banner.hide()

        #: Files in the next message (desktop.main_window.attach fills it): a row of chips.
        self.attachments_bar = QWidget()
        self.attachments_bar.setObjectName("attachmentsBar")
        self.attachments_bar.hide()
        # An icon beside the box, not a worded button in the row below: that row's buttons set
        # the chat's minimum width (86 px more with "Attach…"), which the side panels share.
        self.attach_button = QToolButton()
        self.attach_button.setObjectName("attachButton")
        self.attach_button.setText("Attach…")
        self.attach_button.setIcon(self.style().standardIcon(QStyle.StandardPixmap.SP_FileIcon))
        self.attach_button.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonIconOnly)
        self.attach_button.setToolTip("Attach files: their text goes into the next message (text, code, Markdown, "
                                      "PDF; or drop files on the message box)")

        buttons = QHBoxLayout()
        buttons.addWidget(self.regen_button)
        buttons.addWidget(self.edit_button)
        buttons.addStretch(1)
        #: The message's tokens and the whole prompt's against the context, while typing. It gives
        #: way (elided, whole in its tooltip): as a plain label its "too long for the context"
        #: line set the row's minimum width, and the window grew 26 px and would not shrink back.
        self.token_count = StatusField("")
        self.token_count.setObjectName("tokenCount")
        self.token_count.setForegroundRole(QPalette.ColorRole.PlaceholderText)
        buttons.addWidget(self.token_count)
        buttons.addWidget(self.stop_button)
        buttons.addWidget(self.send_button)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(6, 6, 6, 6)
        lay.addWidget(self.notice)
        lay.addWidget(self.chat, 1)
        lay.addWidget(self.unseen_banner)
        lay.addWidget(self.edit_banner)
        lay.addWidget(self.attachments_bar)
        box = QHBoxLayout()
        box.addWidget(self.attach_button, 0, Qt.AlignmentFlag.AlignBottom)
        box.addWidget(self.input, 1)
        lay.addLayout(box)
        lay.addLayout(buttons)

    #: The notice's looks: an error (white on red), or a note that is not one (dark on pale
    #: yellow: a model without a chat template, a device fallback, a reply still being written).
    #: Both read in light and dark palettes alike.
    NOTICE_STYLES = {"error": "background: #b3261e; color: white;", "note": "background: #fff4ce; color: #3d2e00;"}

    def set_notice_kind(self, kind: str) -> None:
        """``"error"`` or ``"note"`` (see :data:`NOTICE_STYLES`)."""
        self.notice.setProperty("kind", kind)
        self.notice.setStyleSheet(f"QLabel#notice {{ {self.NOTICE_STYLES[kind]} padding: 6px 10px; border-radius: 4px; }}")

    def show_edit_banner(self, after: int, *, last: bool) -> None:
        """Say what sending an edit does: ``after`` messages follow the edited one (``last``:
        it is your last message, so only its reply goes)."""
        if last:
            text = "Editing your last message: Enter sends it again" + (
                " and replaces its reply" if after else "") + ", Esc cancels."
        else:
            text = (f"Editing an earlier message: sending it drops the {after} messages after it "
                    "(shown faded). Enter sends, Esc cancels.")
        self.edit_banner.setText(text)
        self.edit_banner.show()


    def show_unseen(self, messages: int, system_kept: bool = True, sinks: int = 0, stale: bool = False,
                    policy: str = "rolling") -> None:
        """Say what the model no longer sees: the first ``messages`` (faded in the chat) and,
        unless ``system_kept``, the system prompt past the first ``sinks`` tokens. ``stale``: no
        cache of the conversation exists now (a restart, other cache settings), so this is what
        the last reply saw, and the next message reads the conversation again. ``policy``: the
        overflow policy that hid them ("rolling": evicted from the KV cache; "truncate-middle":
        left out of the prompt)."""
        self.chat.unseen_stale = stale
        self.chat.unseen_policy = policy
        self.chat.unseen = messages
        if not messages and system_kept:
            self.unseen_banner.hide()
            return
        parts = []
        if messages:
            which, them = ("first message", "it") if messages == 1 else (f"first {messages} messages", "them")
            if policy == "truncate-middle":
                why = (f"the conversation had passed the context, and truncate-middle had left {them} out of its prompt."
                       if stale else f"the conversation passed the context, and truncate-middle left {them} out of "
                       "the prompt (raise the context length in Edit > Settings to keep more).")
            else:
                why = (f"the rolling overflow policy had evicted {them} from its KV cache." if stale
                       else f"the rolling overflow policy evicted {them} from its KV cache.")
            parts.append(f"The last reply did not see the {which} (faded): {why}" if stale
                         else f"The model no longer sees the {which} (faded): {why}")
        if stale:
            parts.append("It kept the system prompt." if system_kept else
                         f"It had lost the system prompt after its first {sinks} tokens.")
            parts.append("Your next message reads the conversation again with the current settings.")
        else:
            parts.append("It keeps the system prompt." if system_kept else
                         f"It has lost the system prompt after its first {sinks} tokens: the prompt is longer than "
                         "half the context. Shorten it or raise the context length in Edit > Settings.")
        self.unseen_banner.setText(" ".join(parts))
        self.unseen_banner.show()


class EmptyState(QWidget):
    """First run: no model yet. Offers the download, File > Open model and, when one fits this
    machine, a recommended bigger model (:meth:`recommend`)."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setObjectName("emptyState")
        title = QLabel("<h2>Welcome to attnchat</h2>")
        title.setAlignment(Qt.AlignmentFlag.AlignCenter)
        text = QLabel("No model yet. attnchat runs a small language model on this computer, offline. "
                      f"Download the default model ({DEFAULT_MODEL.name}, {size_text(DEFAULT_MODEL.size_bytes)}), "
                      "or open a "
                      "<code>.gguf</code> file or a model folder you already have.")
        text.setWordWrap(True)
        text.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.download_button = QPushButton("Download the default model…")
        self.open_button = QPushButton("Open a model…")
        row = QHBoxLayout()
        row.addStretch(1)
        row.addWidget(self.download_button)
        row.addWidget(self.open_button)
        row.addStretch(1)
        #: A usable first model for this machine (desktop.model_switcher.recommend), when one fits.
        self.recommend_note = QLabel("")
        self.recommend_note.setWordWrap(True)
        self.recommend_note.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.recommend_note.hide()
        self.recommend_button = QPushButton("")
        self.recommend_button.setObjectName("recommendedModel")
        self.recommend_button.hide()
        rec = QHBoxLayout()
        rec.addStretch(1)
        rec.addWidget(self.recommend_button)
        rec.addStretch(1)
        box = QWidget()
        box.setMaximumWidth(520)
        bl = QVBoxLayout(box)
        bl.addWidget(title)
        bl.addWidget(text)
        bl.addSpacing(12)
        bl.addLayout(row)
        bl.addSpacing(12)
        bl.addWidget(self.recommend_note)
        bl.addLayout(rec)
        centre = QHBoxLayout()
        centre.addStretch(1)
        centre.addWidget(box, 4)
        centre.addStretch(1)
        lay = QVBoxLayout(self)
        lay.addStretch(1)
        lay.addLayout(centre)
        lay.addStretch(2)

    def recommend(self, name: str, size_bytes: int, reason: str) -> None:
        """Offer ``name`` (``size_bytes`` to download) as a better first model, saying why."""
        self.recommend_note.setText(f"Better answers: <b>{name}</b> is {reason}. The default model is for the "
                                    "first minute and offline use; it often repeats itself.")
        self.recommend_button.setText(f"Download {name} ({size_text(size_bytes)})…")
        self.recommend_note.show()
        self.recommend_button.show()
