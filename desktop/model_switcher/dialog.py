"""File > Models…: switch between models; get new ones from the Hugging Face Hub.

Tab "On this computer": every :data:`models.CATALOG` entry with its state (loaded,
installed, not downloaded), then the files downloaded from the Hub by reference. The
details of the selected one: what it is, its size in bytes on disk, its license (a link to
the text), its attention (layers, KV heads, sliding window) and what its KV cache takes,
whether it chats or continues text, and, before a download, whether it fits this machine.
**Load** loads an installed model on the engine (the window's :meth:`load_model`);
**Download…** opens the download dialog for it (it names the size and license again and
asks first), and a finished download is loaded.

Tab "Hugging Face Hub": :class:`~.hub_browser.HubBrowser` (search, quants with fit badges,
license, download with Cancel and resume). Offline, the first tab says so and is shown.
Must not import torch or runtime (the fit is computed through :mod:`.hub_jobs`).
"""
from __future__ import annotations

import html
import logging
from pathlib import Path
from typing import Callable

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QAction
from PySide6.QtWidgets import (
    QDialog, QDialogButtonBox, QHBoxLayout, QLabel, QListWidget, QListWidgetItem, QPushButton, QTabWidget,
    QVBoxLayout, QWidget,
)

import models
from desktop.chat.pages import notice_link
from desktop.download_dialog import DownloadDialog
from desktop.model_switcher.hub_browser import NOTE_STYLE, HubBrowser
from desktop.model_switcher.hub_jobs import QUOTED_CONTEXT, HubService
from desktop.model_switcher.recommend import Recommendation, recommend
from desktop.sizes import free_where, size_text

__all__ = ["ModelsDialog", "ModelSwitcher", "install", "details_html"]

MIB = 2**20
log = logging.getLogger(__name__)


def _mb(n: int) -> str:
    return size_text(n)


def attention_text(e: models.CatalogEntry) -> str:
    """``"18 layers, 1 KV head of 256 (multi-query); 15 of 18 layers slide over 512 tokens"``."""
    heads = f"{e.n_kv_heads} KV head{'s' if e.n_kv_heads != 1 else ''} of {e.head_dim}"
    kind = " (multi-query)" if e.n_kv_heads == 1 else ""
    window = (f"; {e.sliding_layers} of {e.n_layers} layers slide over {e.sliding_window:,} tokens"
              if e.sliding_window else "; every layer sees the whole context")
    return f"{e.n_layers} layers, {heads}{kind}{window}"


def _where_from(e: models.CatalogEntry) -> str:
    """``"the Python package index"`` or ``"the Hugging Face Hub (hf.co/OWNER/REPO)"``."""
    return f"the Hugging Face Hub ({html.escape(e.ref)})" if e.source == "hub" else "the Python package index"


def details_html(e: models.CatalogEntry, state: str, path: Path | None, fit: dict | None = None) -> str:
    """The details pane of entry ``e``: ``state`` is ``"loaded"``, ``"installed"`` or ``"missing"``;
    ``fit``: its :func:`runtime.fit` here (as a dict), whose KV figures (in the dtype the runtime
    gives this file on this device) the card quotes; None: float16's and float32's both."""
    lic = html.escape(e.license)
    if e.license_url:
        lic = f'<a href="{html.escape(e.license_url)}">{lic}</a>'
    ctx = min(QUOTED_CONTEXT, e.context_length)
    if fit and fit.get("kv_bytes_per_token") and fit.get("context") == ctx:
        kv = (f"{fit['kv_bytes_per_token']:,} bytes per token in {html.escape(str(fit['cache_dtype']))}; "
              f"{fit['kv_bytes'] / MIB:,.1f} MiB at {ctx:,} tokens")
    else:   # no fit to say which dtype this device gives it
        kv = (f"{e.kv_bytes_per_token(2):,} bytes per token in float16 ({e.kv_bytes_per_token(4):,} in float32); "
              f"{e.kv_bytes_at(ctx, 2) / MIB:,.1f} MiB at {ctx:,} tokens in float16")
    mode = ("chats with its own template" if e.chat_template
            else "a base model without a chat template: it continues the text you write (plain completion)")
    where = {"loaded": "Loaded now.", "installed": f"Installed: <code>{html.escape(str(path))}</code>",
             "missing": (f"Not downloaded: {_mb(e.size_bytes)} from {_where_from(e)}, checked "
                         f"against its SHA-256. By downloading it you accept its license ({lic}).")}[state]
    rows = [("Size", f"{_mb(e.size_bytes)} ({e.size_bytes:,} bytes)"), ("License", lic),
            ("Parameters", f"{e.parameters / 1e6:,.0f} M ({html.escape(e.architecture)})"),
            ("Context", f"{e.context_length:,} tokens"), ("Attention", html.escape(attention_text(e))),
            ("KV cache", kv), ("Use", html.escape(mode))]
    table = "".join(f"<tr><td><b>{k}</b>&nbsp;&nbsp;</td><td>{v}</td></tr>" for k, v in rows)
    return (f"<h3>{html.escape(e.name)}</h3><p>{html.escape(e.description)}</p>"
            f"<table>{table}</table><p>{where}</p>")


def hub_details_html(f: "models.hub.LocalHubFile", state: str) -> str:
    """The details pane of a file downloaded from the Hub by reference."""
    m = f.manifest or {}
    page = f"https://huggingface.co/{f.repo_id}"
    sha = str(m.get("sha256") or "")
    # In groups of 16 with a break allowed between them: one 64-digit word ran past the pane's edge.
    sha = "&#8203;".join(html.escape(sha[i:i + 16]) for i in range(0, len(sha), 16))
    rows = [("From", f'<a href="{html.escape(page)}">{html.escape(f.ref)}</a>'),
            ("Size", f"{_mb(f.size_bytes)} ({f.size_bytes:,} bytes)"),
            ("License", html.escape(str(m.get("license") or "not stated: read the model card"))),
            ("Architecture", html.escape(str(m.get("architecture") or ""))),
            ("Commit", html.escape(str(m.get("commit") or "")[:12])),
            ("SHA-256", f"<code>{sha}</code>" if sha else "")]
    rows = [(k, v) for k, v in rows if v]   # a "?" said nothing: what is not known is left out
    table = "".join(f"<tr><td><b>{k}</b>&nbsp;&nbsp;</td><td>{v}</td></tr>" for k, v in rows)
    where = "Loaded now." if state == "loaded" else f"Installed: <code>{html.escape(str(f.path))}</code>"
    return f"<h3>{html.escape(f.path.stem)}</h3><p>Downloaded from the Hugging Face Hub.</p><table>{table}</table><p>{where}</p>"


def fit_line(fit: dict | None) -> str:
    """``"Fits this machine: fits (1.3 GiB: the file and the KV cache at 8,192 tokens; 20.2 GiB of free
    memory)"`` (``free on cuda:0`` for a GPU's)."""
    if not fit:
        return ""
    free = (f"{size_text(fit['free_bytes'])} {free_where(fit['device'])}" if fit.get("free_bytes")
            else "free memory unknown")
    return (f"<p><b>Fits this machine:</b> {html.escape(fit['verdict'])} ({size_text(fit['total_bytes'])}: the "
            f"file and the KV cache at {fit['context']:,} tokens; {free})</p>")


class ModelsDialog(QDialog):
    """The models on this computer and the catalog's (first tab: the recommended one at the top,
    chosen when none is loaded), and the Hugging Face Hub
    (second tab, :class:`~.hub_browser.HubBrowser`); :attr:`load_requested` carries the path
    to load.

    Args:
        loaded_path: the loaded model's file ("" if none).
        installed_fn: ``(entry) -> Path | None`` (default :func:`models.installed_path`).
        fetch_fn: the download dialog's fetch (default :func:`models.fetch_model`).
        catalog: the entries to list (default :data:`models.CATALOG`).
        service: what the Hub tab and the fit lines call (default: the real Hub and planner).
        device: the loaded model's device ("": the one the runtime would pick).
    """

    load_requested = Signal(str)

    LOCAL, HUB = 0, 1

    def __init__(self, parent=None, *, loaded_path: str = "", installed_fn: Callable | None = None,
                 fetch_fn: Callable | None = None, catalog=None, service: HubService | None = None,
                 device: str = "", recommended: Recommendation | None = None):
        super().__init__(parent)
        self.setObjectName("modelsDialog")
        self.setWindowTitle("Models")
        self.setMinimumSize(820, 520)
        self.catalog = tuple(catalog or models.CATALOG)
        self.loaded_path = loaded_path
        self._installed = installed_fn or models.installed_path
        self._fetch = fetch_fn
        self.service = service or HubService()
        self._device = device
        self.recommended = recommended
        self.download: DownloadDialog | None = None
        self.rows: list[tuple[str, object]] = []   # ("catalog", CatalogEntry) or ("hub", LocalHubFile)
        self.list = QListWidget()
        self.list.setObjectName("modelsList")
        self.list.setMinimumWidth(250)
        self.list.setWordWrap(True)
        self.list.setSpacing(3)
        self.list.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.details = QLabel()
        self.details.setObjectName("modelDetails")
        self.details.setWordWrap(True)
        self.details.setTextFormat(Qt.TextFormat.RichText)
        self.details.setOpenExternalLinks(True)
        self.details.setAlignment(Qt.AlignmentFlag.AlignTop | Qt.AlignmentFlag.AlignLeft)
        self.details.setTextInteractionFlags(Qt.TextInteractionFlag.TextBrowserInteraction)
        self.banner = QLabel()
        self.banner.setObjectName("modelsBanner")
        self.banner.setWordWrap(True)
        self.banner.setStyleSheet(NOTE_STYLE)
        self.banner.hide()
        self.load_button = QPushButton("Load")
        self.download_button = QPushButton("Download…")
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        buttons.addButton(self.download_button, QDialogButtonBox.ButtonRole.ActionRole)
        buttons.addButton(self.load_button, QDialogButtonBox.ButtonRole.AcceptRole)
        buttons.rejected.connect(self.reject)
        self.load_button.clicked.connect(self._load)
        self.download_button.clicked.connect(self._download)
        self.list.currentRowChanged.connect(self._show)
        self.list.itemDoubleClicked.connect(lambda _item: self.load_button.isEnabled() and self._load())
        local = QWidget()
        body = QHBoxLayout()
        body.addWidget(self.list, 2)
        body.addWidget(self.details, 5)
        ll = QVBoxLayout(local)
        ll.addWidget(self.banner)
        ll.addLayout(body, 1)
        ll.addWidget(buttons)
        self.browser = HubBrowser(self, service=self.service)
        self.browser.load_requested.connect(self._load_path)
        self.browser.downloaded.connect(lambda _path: self.refresh())
        self.browser.offline.connect(self.show_offline)
        self.tabs = QTabWidget()
        self.tabs.setObjectName("modelsTabs")
        self.tabs.addTab(local, "On this computer")
        self.tabs.addTab(self.browser, "Hugging Face Hub")
        lay = QVBoxLayout(self)
        lay.addWidget(self.tabs)
        self.refresh()
        self.list.setCurrentRow(next((i for i in range(len(self.rows)) if self.state(i) == "loaded"), 0))
        # From the keyboard: arrows choose a model and Enter loads it (the default button);
        # on the Hub tab typing goes to the search (the focus was on the tab row).
        self.tabs.currentChanged.connect(
            lambda i: (self.browser.query if i == self.HUB else self.list).setFocus(Qt.FocusReason.TabFocusReason))
        self.list.setFocus(Qt.FocusReason.ActiveWindowFocusReason)

    # ---- states ------------------------------------------------------------------------------
    def path(self, row: int) -> Path | None:
        kind, item = self.rows[row]
        if kind == "hub":
            return item.path
        try:
            return self._installed(item)
        except OSError:   # the model folder cannot be made: nothing is installed
            return None

    def state(self, row: int) -> str:
        """``"loaded"``, ``"installed"`` or ``"missing"``."""
        p = self.path(row)
        if p is None:
            return "missing"
        return "loaded" if self.loaded_path and Path(self.loaded_path) == p else "installed"

    def _hub_downloads(self) -> list:
        """Hub downloads that are not a catalog entry's file."""
        try:
            files = models.hub.installed_files()
        except OSError:
            return []
        taken = {self.path(i) for i in range(len(self.rows))}
        return [f for f in files if f.complete and f.path not in taken]

    def refresh(self) -> None:
        """Rebuild the list's rows (after a download or a load)."""
        row = max(self.list.currentRow(), 0)
        entries = list(self.catalog)
        if self.recommended is not None:   # first, where it is seen: at its place it was below the fold
            entries.sort(key=lambda e: e.id != self.recommended.entry.id)
        self.rows = [("catalog", e) for e in entries]
        self.rows += [("hub", f) for f in self._hub_downloads()]
        self.list.blockSignals(True)
        self.list.clear()
        for i, (kind, item) in enumerate(self.rows):
            state = self.state(i)
            if kind == "catalog":
                tag = {"loaded": "loaded", "installed": "installed", "missing": f"{_mb(item.size_bytes)} to download"}
                text = f"{item.name}\n{tag[state]} · {item.license}"
                if self.recommended is not None and self.recommended.entry.id == item.id:
                    text += "\n★ recommended for this machine"
            else:
                lic = (item.manifest or {}).get("license") or "license ?"
                text = f"{item.path.stem}\n{'loaded' if state == 'loaded' else 'downloaded'} · {lic} · {item.repo_id}"
            li = QListWidgetItem(text)
            li.setData(Qt.ItemDataRole.UserRole, item.id if kind == "catalog" else item.ref)
            self.list.addItem(li)
        self.list.blockSignals(False)
        self.list.setCurrentRow(min(row, len(self.rows) - 1))
        self._show(self.list.currentRow())

    def _fit(self, e: models.CatalogEntry) -> dict | None:
        try:
            device = self._device or self.service.device()
            return self.service.fit_here(e.size_bytes, e, min(QUOTED_CONTEXT, e.context_length), device)
        except Exception:  # noqa: BLE001 - the details stay useful without it
            return None

    def _show(self, row: int) -> None:
        if not 0 <= row < len(self.rows):
            return
        state = self.state(row)
        kind, item = self.rows[row]
        if kind == "catalog":
            fit = self._fit(item)
            extra = fit_line(fit) if state == "missing" else ""
            if self.recommended is not None and self.recommended.entry.id == item.id:
                extra += f"<p><b>Recommended:</b> {html.escape(self.recommended.reason)}.</p>"
            self.details.setText(details_html(item, state, self.path(row), fit) + extra)
        else:
            self.details.setText(hub_details_html(item, state))
        self.load_button.setEnabled(state == "installed")
        self.load_button.setText("Loaded" if state == "loaded" else "Load")
        self.download_button.setVisible(state == "missing")
        self.load_button.setDefault(state == "installed")
        self.download_button.setDefault(state == "missing")

    def show_offline(self, message: str) -> None:
        """The Hub cannot be reached: say so above the models on this computer, and show them."""
        # The line's CLI hints ("attnchat models list") are for the terminal: cut them here.
        reason = message.split("; check the network connection")[0]
        self.banner.setText(f"Offline: {reason}. The models on this computer are listed below.")
        self.banner.show()
        self.tabs.setCurrentIndex(self.LOCAL)

    # ---- actions -----------------------------------------------------------------------------
    def _load(self) -> None:
        path = self.path(self.list.currentRow())
        if path is not None:
            self._load_path(str(path))

    def _load_path(self, path: str) -> None:
        self.load_requested.emit(path)
        self.accept()

    def _download(self) -> DownloadDialog:
        """Open the download dialog for the selected catalog model (it asks before fetching)."""
        entry = self.rows[self.list.currentRow()][1]
        self.download = DownloadDialog(self, fetch_fn=self._fetch, entry=entry,
                                       headline=f"Switch to {entry.name}.")
        self.download.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        self.download.downloaded.connect(self._downloaded)
        self.download.open()
        return self.download

    def _downloaded(self, path: str) -> None:
        self.refresh()
        self.load_requested.emit(path)
        self.accept()

    def done(self, result: int) -> None:  # noqa: D401 - Qt API: closing stops the Hub tab's jobs
        self.browser.shutdown()
        super().done(result)


#: The link in the window's note that downloads the recommended model.
RECOMMEND_LINK = "recommend"


class ModelSwitcher:
    """File > Models… in a window: the menu action and the dialog it opens."""

    def __init__(self, window, *, fetch_fn: Callable | None = None, installed_fn: Callable | None = None,
                 service: HubService | None = None):
        self.window, self.fetch_fn, self.installed_fn = window, fetch_fn, installed_fn
        self.service = service or HubService(load_options=lambda: load_options(window.settings))
        self.dialog: ModelsDialog | None = None
        self.action = QAction("&Models…", window)
        self.action.setObjectName("modelsAction")
        self.action.setShortcut("Ctrl+M")
        self.action.setStatusTip("Switch between the catalog's models; download one (size and license shown first)")
        self.action.triggered.connect(self.open)
        window.add_file_action(self.action)
        self.recommended: Recommendation | None = None
        window.stack.currentChanged.connect(self._first_run)
        window.empty.recommend_button.clicked.connect(lambda: self.recommended and self.download(self.recommended.entry))
        window.model_changed.connect(self._offer_after_default)
        window.notice.linkActivated.connect(
            lambda link: link == RECOMMEND_LINK and self.recommended and self.download(self.recommended.entry))

    def _first_run(self, *_args) -> None:
        """The empty state shows: recommend a usable first model beside the default one."""
        if self.window.stack.currentWidget() is not self.window.empty or self.recommended is not None:
            return
        try:
            self.recommended = recommend(fit=self.service.fit_here)
        except Exception:  # noqa: BLE001 - the first run works without it
            log.warning("could not recommend a model", exc_info=True)
            return
        r = self.recommended
        if r is not None and r.entry.id != models.DEFAULT_MODEL.id:
            self.window.empty.recommend(r.entry.name, r.entry.size_bytes, r.reason)
            self.window.settings.set("models/recommendation_offered", True)

    def _offer_after_default(self, info: dict) -> None:
        """The default model is loaded: once per user, say which model fits this machine better.

        ``make run`` fetches the default model before the first start, so the welcome page
        (which recommends one) never shows to a new user; the note does it instead, with a
        link that opens the download. Nothing when a better model is already installed, and
        not over a notice of this load (a device fallback): it waits for the next load."""
        if info.get("remote") or Path(str(info.get("path") or "")).name != models.DEFAULT_MODEL.filename \
                or self.window.settings.get("models/recommendation_offered") or not self.window.notice.isHidden():
            return
        try:
            self.recommended = self.recommended or recommend(fit=self.service.fit_here,
                                                             device=str(info.get("device") or "") or None)
        except Exception:  # noqa: BLE001 - the window works without it
            log.warning("could not recommend a model", exc_info=True)
            return
        r = self.recommended
        installed = self.installed_fn or models.installed_path
        if r is None or r.entry.id == models.DEFAULT_MODEL.id or installed(r.entry) is not None:
            return
        self.window.settings.set("models/recommendation_offered", True)
        name = html.escape(models.DEFAULT_MODEL.name)
        link = notice_link(RECOMMEND_LINK, f"Download {html.escape(r.entry.name)} ({size_text(r.entry.size_bytes)})",
                           "note")
        self.window.show_note(f"{name} is for the first minute and offline use; it often repeats itself. "
                              f"Better answers: {link}, {html.escape(r.reason)}.")

    def download(self, entry: models.CatalogEntry) -> DownloadDialog:
        """Download ``entry`` (the dialog names its size and license and asks first); then load it."""
        dialog = DownloadDialog(self.window, fetch_fn=self.fetch_fn, entry=entry, headline=f"Download {entry.name}.")
        dialog.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        dialog.downloaded.connect(self.window.load_model)
        dialog.open()
        return dialog

    def open(self) -> ModelsDialog:
        """Open the dialog (not blocking); a chosen or downloaded model is loaded."""
        info = self.window.engine.model or {}
        loaded = "" if info.get("remote") else str(info.get("path") or "")
        device = "" if info.get("remote") else str(info.get("device") or "")
        if self.recommended is None:
            try:
                self.recommended = recommend(fit=self.service.fit_here, device=device or None)
            except Exception:  # noqa: BLE001 - the dialog works without it
                log.warning("could not recommend a model", exc_info=True)
        self.dialog = ModelsDialog(self.window, loaded_path=loaded, fetch_fn=self.fetch_fn,
                                   installed_fn=self.installed_fn, service=self.service, device=device,
                                   recommended=self.recommended)
        self.dialog.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        self.dialog.load_requested.connect(self.window.load_model)
        self.dialog.open()
        return self.dialog


def load_options(settings) -> dict:
    """The window's settings that change a fit (:func:`~.hub_jobs.default_fit`'s keywords): the
    weight dtype, reproducible replies and the cache dtype the next load and reply run with."""
    return {"weight_dtype": str(settings.get("model/weight_dtype") or "auto"),
            "reproducible": settings.get("model/reproducible") == "on",
            "cache_dtype": str(settings.get("generation/cache_dtype") or "auto")}


def install(window, **kwargs) -> ModelSwitcher:
    """Add File > Models… to ``window`` (a MainWindow)."""
    return ModelSwitcher(window, **kwargs)
