"""Edit > Settings…: the controller that opens the settings dialog, resets stored values the
app cannot use (and says which), and hands the model options to the engine. Must not
import torch.
"""
from __future__ import annotations

from PySide6.QtCore import QObject, QTimer
from PySide6.QtGui import QKeySequence

from desktop.settings.checks import MODEL_OPTIONS, repair
from desktop.settings.dialog import SettingsDialog

__all__ = ["SettingsController", "install_settings"]


class SettingsController(QObject):
    """Puts Settings… in the Edit menu, opens the dialog, and hands model options to the engine.

    The engine gets ``weight_dtype`` and ``attention_backend`` at once and whenever they
    change (a weight dtype is used by the next load).
    """

    def __init__(self, window):
        super().__init__(window)
        self.window = window
        self.dialog: SettingsDialog | None = None
        self._shown: dict = {}   # the dialog's values when it opened
        # Bad stored values fall back before anything reads them. The notice is shown once the
        # event loop runs, and again when the first load ends (starting a load clears notices).
        self._startup_fixes = repair(window.settings)
        if self._startup_fixes:
            QTimer.singleShot(0, self, lambda: self._tell(self._startup_fixes))
        self.loaded_with = {k: window.settings.get(k) for k in MODEL_OPTIONS}
        menu = next((a.menu() for a in window.menuBar().actions() if a.menu() and a.text() == "&Edit"), None)
        menu = menu or window.menuBar().addMenu("&Tools")
        menu.addSeparator()
        self.action = menu.addAction("&Settings…")
        self.action.setShortcuts([QKeySequence("Ctrl+,"), QKeySequence(QKeySequence.StandardKey.Preferences)])
        self.action.triggered.connect(self.open)
        window.settings.changed.connect(self._changed)
        if hasattr(window.engine, "load_started"):
            window.engine.load_started.connect(self._loading)
        if hasattr(window.engine, "load_failed"):
            window.engine.load_failed.connect(lambda message: self._after_load([]))
        window.model_changed.connect(self._model_changed)
        self._configure()

    def _tell(self, fixed: list[str]) -> None:
        """Add the resets to the window's notice (after what it already says, e.g. the model's notices)."""
        text = f"Some saved settings could not be used and were reset to their defaults: {'; '.join(fixed)}."
        notice = self.window.notice
        current = notice.text() if not notice.isHidden() else ""
        if text not in current:
            self.window.show_note(f"{current} {text}".strip())

    def _after_load(self, fixed: list[str]) -> None:
        fixed, self._startup_fixes = self._startup_fixes + fixed, []
        if fixed:
            self._tell(fixed)

    def _model_changed(self, info: dict) -> None:
        """A new model: settings that do not fit it (context, cache limit) fall back; so does the
        device setting when the worker had to load elsewhere."""
        if info.get("device_fallback"):
            self.window.settings.set("model/device", "auto")
            self.loaded_with["model/device"] = "auto"
        self._after_load(repair(self.window.settings, info))
        self._follow_model()

    def _follow_model(self) -> None:
        """The dialog open while a model loads was built for none (or the old one): its limits,
        dtype and memory plan said "a model given as numbers". Build it again for the model,
        keeping the edits, the tab and its place on screen."""
        old, w = self.dialog, self.window
        if old is None or not old.isVisible() or old.model == w.engine.model:
            return
        # What the user changed since it opened (not what differs from the stored values: those
        # can be another model's now, with settings kept per model).
        edits = {k: v for k, v in old.values().items() if v != self._shown.get(k)}
        tab, where = old.tabs.currentIndex(), old.geometry()
        old.reject()   # its edits are carried over, not written
        new = self.open()
        for key, value in edits.items():
            new._set(key, value)
        new.revalidate()
        new.tabs.setCurrentIndex(tab)
        new.setGeometry(where)

    def _options(self) -> dict:
        s = self.window.settings
        return {"weight_dtype": s.get("model/weight_dtype"), "attention_backend": s.get("model/attention_backend"),
                "reproducible": s.get("model/reproducible") == "on"}

    def _configure(self) -> None:
        configure = getattr(self.window.engine, "configure", None)
        if configure is not None:
            configure(self._options())

    def _changed(self, key: str, value) -> None:
        if key in ("model/weight_dtype", "model/attention_backend", "model/reproducible"):
            self._configure()

    def _loading(self, source: str) -> None:
        self.loaded_with = {k: self.window.settings.get(k) for k in MODEL_OPTIONS}

    def open(self) -> SettingsDialog:
        """Open the dialog (window-modal; one at a time)."""
        if self.dialog is not None and self.dialog.isVisible():
            self.dialog.raise_()
            return self.dialog
        w = self.window
        self.dialog = SettingsDialog(w.settings, w.engine.model, loaded_with=self.loaded_with, parent=w)
        self.dialog.reload_requested.connect(lambda: w.load_model(w.settings.get("model/source")))
        self._shown = self.dialog.values()
        self.dialog.open()
        return self.dialog


def install_settings(window) -> SettingsController:
    """Give ``window`` (a MainWindow) Edit > Settings…; the controller is ``window.settings_controller``."""
    window.settings_controller = SettingsController(window)
    return window.settings_controller
