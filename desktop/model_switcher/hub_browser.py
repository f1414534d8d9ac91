"""File > Models… > Hugging Face Hub: search GGUF repos, see a repo's quants with their size
and whether each fits this machine, read the license, download with progress, Cancel and
resume, then load.

Everything that waits on the network runs as a :class:`~.hub_jobs.Job` on its own thread;
only plain data comes back. A fit badge (fits / tight / does not fit) carries the planner's
numbers in its tooltip: weights at the file's size plus the KV cache at the quoted context,
against the free memory of the device the model would run on. A failed request shows one
line in the banner, in a window's words; a search that finds no Hub at all
(:attr:`HubBrowser.offline`) lets the dialog show the models on this computer, while a failed
download keeps its tab (Resume is there). Must not import torch or runtime (the jobs do, off this thread).
"""
from __future__ import annotations

import html
from pathlib import Path

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QBrush, QColor
from PySide6.QtWidgets import (
    QAbstractItemView, QHBoxLayout, QHeaderView, QLabel, QLineEdit, QListWidget, QListWidgetItem, QProgressBar,
    QPushButton, QSplitter, QTableWidget, QTableWidgetItem, QVBoxLayout, QWidget,
)

import models
from desktop.model_switcher.hub_jobs import HubService, Job, JobRunner, open_repo
from desktop.download_words import DownloadRate, for_window
from desktop.sizes import size_text

__all__ = ["BADGE_COLOURS", "HubBrowser", "fit_tooltip", "mb", "runs_line"]

#: Badge background per fit verdict (text stays black on these).
BADGE_COLOURS = {"fits": "#b7e4c7", "tight": "#ffe08a", "does not fit": "#f4a6a6", "unknown": "#d9d9d9",
                 "not supported": "#d9d9d9", "will not run": "#d9d9d9"}
BANNER_STYLE = "color: white; background: #b3261e; padding: 6px; border-radius: 4px;"
#: A note that is not an error: dark text of its own, since the dark palette's light text on
#: this pale yellow could not be read.
NOTE_STYLE = "color: #3d2e00; background: #fff4ce; padding: 6px; border-radius: 4px;"


def mb(n: int | float | None) -> str:
    """``n`` bytes as ``"770.3 MiB"`` (``"—"`` for None)."""
    return size_text(n)


def runs_line(runs: dict | None) -> str:
    """How a quant runs here, in one line ("" when not known)."""
    if not runs:
        return ""
    if runs["runs"] == "blocks":
        return f"Runs here from its {runs['block_type']} blocks ({runs['kernel']} kernels)"
    if runs["runs"] == "widened":
        return f"Runs widened: float16 copies take {mb(runs['extra_bytes'])} more ({runs['why']})"
    return f"Will not run here: {runs['why']}"


def fit_tooltip(fit: dict) -> str:
    """The numbers behind a badge, in two lines."""
    line1 = (f"Weights {mb(fit['weights_bytes'])} (as it loads) + KV cache {mb(fit['kv_bytes'])} at "
             f"{fit['context']:,} tokens ({fit['cache_dtype']}) = {mb(fit['total_bytes'])}")
    free = fit.get("free_bytes")
    if free:
        line2 = (f"Free memory on {fit['device']}: {mb(free)}; this takes {100 * fit['total_bytes'] / free:.0f} % "
                 "of it (over 80 % is tight)")
    else:
        line2 = f"Free memory on {fit['device']}: unknown"
    return f"{line1}\n{line2}"


class HubBrowser(QWidget):
    """The Hub tab. ``load_requested`` carries a downloaded file's path; ``offline`` the line
    saying why the Hub could not be reached."""

    load_requested = Signal(str)
    offline = Signal(str)
    downloaded = Signal(str)

    COLUMNS = ("Quant", "Size", "Fits this machine", "Here")

    def __init__(self, parent: QWidget | None = None, *, service: HubService | None = None):
        super().__init__(parent)
        self.setObjectName("hubBrowser")
        self.service = service or HubService()
        self.jobs = JobRunner(self)
        self.repo: dict | None = None
        self.hits: list = []
        self._search_seq = self._open_seq = 0
        self._download: Job | None = None
        self.result_path = ""

        self.query = QLineEdit()
        self.query.setObjectName("hubQuery")
        self.query.setPlaceholderText("Search GGUF models on the Hugging Face Hub (e.g. qwen, llama, gemma)")
        self.query.returnPressed.connect(self.search)
        self.search_button = QPushButton("Search")
        self.search_button.clicked.connect(self.search)
        self.banner = QLabel()
        self.banner.setObjectName("hubBanner")
        self.banner.setWordWrap(True)
        self.banner.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.banner.hide()

        self.results = QListWidget()
        self.results.setObjectName("hubResults")
        self.results.setWordWrap(True)
        self.results.setSpacing(2)
        self.results.currentRowChanged.connect(self._repo_chosen)
        self.header = QLabel("Search, then pick a repo to see its files.")
        self.header.setObjectName("hubRepoHeader")
        self.header.setWordWrap(True)
        self.header.setTextFormat(Qt.TextFormat.RichText)
        self.header.setOpenExternalLinks(True)
        self.header.setTextInteractionFlags(Qt.TextInteractionFlag.TextBrowserInteraction)
        self.files = QTableWidget(0, len(self.COLUMNS))
        self.files.setObjectName("hubFiles")
        self.files.setHorizontalHeaderLabels(self.COLUMNS)
        self.files.verticalHeader().hide()
        self.files.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.files.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.files.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.files.horizontalHeader().setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
        for col in (1, 2, 3):
            self.files.horizontalHeader().setSectionResizeMode(col, QHeaderView.ResizeMode.ResizeToContents)
        self.files.itemSelectionChanged.connect(self._file_chosen)
        right = QWidget()
        rl = QVBoxLayout(right)
        rl.setContentsMargins(0, 0, 0, 0)
        rl.addWidget(self.header)
        rl.addWidget(self.files, 1)
        split = QSplitter()
        split.addWidget(self.results)
        split.addWidget(right)
        split.setStretchFactor(0, 2)
        split.setStretchFactor(1, 3)

        self.notice = QLabel()
        self.notice.setObjectName("hubNotice")
        self.notice.setWordWrap(True)
        self.notice.setTextFormat(Qt.TextFormat.RichText)
        self.notice.setOpenExternalLinks(True)
        self.bar = QProgressBar()
        self.bar.setObjectName("hubProgress")
        self.bar.hide()
        self.status = QLabel()
        self.status.setObjectName("hubStatus")
        self.status.setWordWrap(True)
        self.download_button = QPushButton("Download")
        self.download_button.setObjectName("hubDownload")
        self.cancel_button = QPushButton("Cancel download")
        self.load_button = QPushButton("Load")
        self.download_button.clicked.connect(self.download)
        self.cancel_button.clicked.connect(self.cancel)
        self.load_button.clicked.connect(self._load)
        for b in (self.download_button, self.cancel_button, self.load_button):
            b.setEnabled(False)

        top = QHBoxLayout()
        top.addWidget(self.query, 1)
        top.addWidget(self.search_button)
        buttons = QHBoxLayout()
        buttons.addWidget(self.status, 1)
        buttons.addWidget(self.download_button)
        buttons.addWidget(self.cancel_button)
        buttons.addWidget(self.load_button)
        lay = QVBoxLayout(self)
        lay.addLayout(top)
        lay.addWidget(self.banner)
        lay.addWidget(split, 1)
        lay.addWidget(self.notice)
        lay.addWidget(self.bar)
        lay.addLayout(buttons)

    # ---- search ------------------------------------------------------------------------------
    def search(self) -> None:
        """Search the Hub for the query (off this thread); results replace the list."""
        text = self.query.text().strip()
        self._search_seq += 1
        seq = self._search_seq
        self.show_banner("")
        self.status.setText(f"Searching the Hub for {text!r}…" if text else "Listing the most downloaded GGUF repos…")
        job = Job(self.service.search, text)
        job.tag = seq
        # Bound methods of this GUI-thread object: the results arrive queued, on this thread.
        job.done.connect(self._searched)
        job.failed.connect(self._search_failed)
        self.jobs.start(job, "attnchat-hub-search")

    def _current(self, latest: int) -> bool:
        """Whether the job that sent this is the latest of its kind (an older one answering late is not)."""
        return getattr(self.sender(), "tag", latest) == latest

    def _search_failed(self, message: str, kind: str) -> None:
        self._failed(self._current(self._search_seq), message, kind, unreachable=True)

    def _searched(self, hits: list) -> None:
        if not self._current(self._search_seq):
            return  # an older search answered late
        self.hits = list(hits)
        self.results.blockSignals(True)
        self.results.clear()
        for h in self.hits:
            gated = " · gated" if h.gated else ""
            runs = "" if h.supported is not False else f" · {h.architecture}: not supported"
            item = QListWidgetItem(f"{h.repo_id}\n{h.downloads:,} downloads · {h.license or 'license ?'}{gated}{runs}")
            item.setData(Qt.ItemDataRole.UserRole, h.repo_id)
            if h.supported is False:
                item.setForeground(QBrush(QColor("#777777")))
            self.results.addItem(item)
        self.results.blockSignals(False)
        self.status.setText(f"{len(self.hits)} GGUF repos, most downloaded first." if self.hits
                            else "No GGUF repo matches; try another name.")

    # ---- a repo ------------------------------------------------------------------------------
    def _repo_chosen(self, row: int) -> None:
        if 0 <= row < len(self.hits):
            self.open_repo(self.hits[row].repo_id)

    def open_repo(self, repo_id: str) -> None:
        """List ``repo_id``'s GGUF files with sizes and fit badges (off this thread)."""
        self._open_seq += 1
        seq = self._open_seq
        self.repo = None
        self.files.setRowCount(0)
        self.header.setText(f"<b>{html.escape(repo_id)}</b><br>Reading its files…")
        self.notice.setText("")
        self._update_buttons()
        job = Job(open_repo, self.service, repo_id)
        job.tag = seq
        job.done.connect(self._opened)
        job.failed.connect(self._open_failed)
        self.jobs.start(job, "attnchat-hub-repo")

    def _open_failed(self, message: str, kind: str) -> None:
        self._failed(self._current(self._open_seq), message, kind)

    def _opened(self, repo: dict) -> None:
        if not self._current(self._open_seq):
            return
        self.repo = repo
        page = f"https://huggingface.co/{repo['repo_id']}"
        lic = html.escape(repo["license"] or "not stated")
        lines = [f'<b><a href="{page}">{html.escape(repo["repo_id"])}</a></b>',
                 f"License: <b>{lic}</b> · architecture {html.escape(repo['architecture'] or '?')}"
                 f" · fit quoted at {repo['context']:,} tokens of context"]
        if repo["supported"] is False:
            lines.append(f"attnchat's decoder does not run {html.escape(repo['architecture'])} models.")
        if repo["shape_error"]:
            lines.append(f"Fit unknown: {html.escape(repo['shape_error'])}")
        self.header.setText("<br>".join(lines))
        self.files.setRowCount(len(repo["files"]))
        for r, f in enumerate(repo["files"]):
            name = QTableWidgetItem(f["quant"] or f["name"])
            name.setToolTip("\n".join(filter(None, (f["name"], runs_line(f.get("runs"))))))
            size = QTableWidgetItem(mb(f["size_bytes"]))
            size.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
            verdict = ("not supported" if f["split"] or repo["supported"] is False
                       else "will not run" if (f.get("runs") or {}).get("runs") == "no"
                       else (f["fit"] or {}).get("verdict", "unknown"))
            badge = QTableWidgetItem(f"split in {f['parts']} files" if f["split"] else verdict)
            badge.setBackground(QBrush(QColor(BADGE_COLOURS[verdict])))
            badge.setForeground(QBrush(QColor("black")))
            badge.setTextAlignment(Qt.AlignmentFlag.AlignCenter)
            badge.setToolTip("\n".join(filter(None, (runs_line(f.get("runs")), fit_tooltip(f["fit"]) if f["fit"] else
                             ("attnchat loads single-file GGUFs only" if f["split"] else
                              "" if verdict == "will not run" else "the model's shape is unknown")))))
            here = QTableWidgetItem("downloaded" if f["installed"] else "")
            for c, item in enumerate((name, size, badge, here)):
                self.files.setItem(r, c, item)
        self.notice.setText(self._license_notice())
        default = next((r for r, f in enumerate(repo["files"]) if f["quant"] == models.hub.DEFAULT_QUANT), 0)
        if repo["files"]:
            self.files.selectRow(default)
        self._update_buttons()

    def _license_notice(self) -> str:
        repo = self.repo or {}
        page = f"https://huggingface.co/{repo.get('repo_id', '')}"
        text = (f"License: <b>{html.escape(repo.get('license') or 'not stated: read the model card')}</b> "
                f"(<a href=\"{page}\">model card</a>). By downloading a file you accept it.")
        if repo.get("gated"):
            text += (f" <b>Gated:</b> accept its terms at <a href=\"{page}\">{html.escape(page)}</a> and log in with "
                     "<code>hf auth login</code> first; attnchat uses that saved token.")
        return text

    def selected_file(self) -> dict | None:
        rows = self.files.selectionModel().selectedRows() if self.files.selectionModel() else []
        if not rows or self.repo is None:
            return None
        return self.repo["files"][rows[0].row()]

    def _file_chosen(self) -> None:
        f = self.selected_file()
        if f is not None and self._download is None:
            kept = models.hub.partial_bytes(f.get("sha256", ""))
            if f["installed"]:
                self.status.setText(f"{f['name']} is downloaded.")
            elif kept:
                self.status.setText(f"{mb(kept)} of {mb(f['size_bytes'])} downloaded earlier are kept: "
                                    "Resume continues from there.")
            else:
                self.status.setText(f"{f['name']}: {mb(f['size_bytes'])}.")
        self._update_buttons()

    def _update_buttons(self) -> None:
        f = self.selected_file()
        running = self._download is not None
        ok = (f is not None and not f["split"] and (self.repo or {}).get("supported") is not False)
        self.download_button.setEnabled(ok and not running and not f["installed"])
        kept = models.hub.partial_bytes(f.get("sha256", "")) if f else 0
        self.download_button.setText("Resume" if kept and not running else "Download")
        self.cancel_button.setEnabled(running)
        self.load_button.setEnabled(bool(f and f["installed"]) and not running)

    # ---- download ----------------------------------------------------------------------------
    def download(self) -> None:
        """Download the selected file (resuming what an earlier try kept)."""
        f = self.selected_file()
        if f is None or self._download is not None or self.repo is None:
            return
        ref = f"hf.co/{self.repo['repo_id']}/{f['name']}"
        self.show_banner("")
        self.bar.setRange(0, 0)
        self.bar.show()
        self.status.setText(f"Downloading {f['name']} from the Hugging Face Hub…")
        self._rate = DownloadRate()
        job = Job(self.service.fetch, ref, wants_progress=True)
        job.progress.connect(self._progress)
        job.done.connect(self._downloaded)
        job.failed.connect(self._download_failed)
        self._download = self.jobs.start(job, "attnchat-hub-download")
        self._update_buttons()

    def cancel(self) -> None:
        """Stop the download; what arrived stays hidden in the model folder for a resume."""
        if self._download is not None:
            self.status.setText("Cancelling…")
            self.cancel_button.setEnabled(False)
            self._download.cancel_event.set()

    def _progress(self, done: int, total: int) -> None:
        if total <= 0:
            self.bar.setRange(0, 0)
            return
        self._rate.add(done)
        self.bar.setRange(0, 1000)
        self.bar.setValue(int(1000 * done / total))
        self.bar.setFormat(self._rate.text(done, total))

    def _downloaded(self, path) -> None:
        self._download = None
        self.bar.hide()
        self.result_path = str(path)
        f = self.selected_file()
        if f is not None:
            f["installed"] = True
            self.files.item(self.files.currentRow(), 3).setText("downloaded")
        self.status.setText(f"Downloaded and checked against its SHA-256: {Path(path).name}")
        self.status.setToolTip(str(path))
        self._update_buttons()
        self.downloaded.emit(str(path))

    def _download_failed(self, message: str, kind: str) -> None:
        self._download = None
        self.bar.hide()
        f = self.selected_file()
        kept = models.hub.partial_bytes(f.get("sha256", "")) if f else 0
        if kind == "cancelled":
            self.status.setText(f"Cancelled. {mb(kept)} downloaded are kept hidden in the model folder: Resume "
                                "continues from there." if kept else "Cancelled. Nothing was kept.")
        else:
            self._failed(True, message, kind)
        self._update_buttons()

    def _load(self) -> None:
        f = self.selected_file()
        if f is not None and f["installed"] and self.repo is not None:
            self.load_requested.emit(str(models.hub.hub_path(self.repo["repo_id"], f["name"])))

    # ---- failures ----------------------------------------------------------------------------
    def show_banner(self, message: str) -> None:
        """One line in the banner (empty: hide it)."""
        self.banner.setVisible(bool(message))
        self.banner.setStyleSheet(BANNER_STYLE)
        self.banner.setText(message)

    def _failed(self, current: bool, message: str, kind: str, *, unreachable: bool = False) -> None:
        """Say a failure in the banner, in a window's words (:func:`desktop.download_words.for_window`).
        ``unreachable``: a search found no Hub at all, so :attr:`offline` lets the dialog show
        the models here; a repo or a download that fails keeps the user on this tab, where
        Retry or Resume is."""
        if not current:
            return
        self.status.setText("")
        message = for_window(message)
        if kind == "offline":
            self.show_banner(f"Offline: {message}")
            if unreachable:
                self.offline.emit(message)
        else:
            self.show_banner(message)
        if self.repo is None and self._open_seq:
            self.header.setText("")

    def shutdown(self) -> None:
        """Cancel a download and wait for every job (the dialog is closing)."""
        self.jobs.shutdown()
        self._download = None
