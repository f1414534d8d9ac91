"""The settings dialog: context and cache limits with a memory planner, generation defaults,
device and model options. :mod:`desktop.settings.controller` opens it; the checks it runs
are :mod:`desktop.settings.checks`, what its choices say :mod:`desktop.settings.labels`.

Values live in :class:`desktop.settings.values.Settings` (QSettings). What applies when:

- context length, cache dtype, cache memory limit, overflow policy: from the next
  message (the worker rebuilds the conversation's cache when they change);
- system prompt and sampling: from the next reply;
- attention backend: at once (from the next decode step);
- device and weight dtype: when the model is reloaded (the dialog offers it).

Invalid values are refused in the dialog, each with its reason under its field, and
OK/Apply stay disabled until they are fixed: the worker builds the runtime's
``GenerationSettings`` from the same values (a last check in :func:`validate`), so nothing invalid
reaches the runtime. Must not import torch.
"""
from __future__ import annotations

from typing import Any

from PySide6.QtCore import QCoreApplication, QEvent, QTimer, Signal
from PySide6.QtGui import QPalette
from PySide6.QtWidgets import (
    QComboBox, QDialog, QDialogButtonBox, QDoubleSpinBox, QFormLayout, QHBoxLayout, QLabel, QLayout, QPlainTextEdit,
    QPushButton, QScrollArea, QSpinBox, QTabWidget, QVBoxLayout, QWidget,
)

import runtime
from desktop.settings.checks import MIB, MODEL_OPTIONS, WEIGHT_DTYPES, has_shape, policy_budget, validate
from desktop.settings.generation_tab import generation_tab, sync_preset
from desktop.settings.labels import POLICY_TEXT, cache_policy_hint, cache_policy_label, weight_dtype_label
from desktop.settings.memory_planner import MemoryPlanner, resolve_device
from desktop.settings.values import DEFAULTS, Settings
from desktop.widgets.colors import error_text_color
from desktop.widgets.wheel_guard import install_wheel_guard

__all__ = ["SettingsDialog"]


class _Field(QWidget):
    """An editor with its refusal reason underneath (hidden while valid) and an optional hint."""

    def __init__(self, editor: QWidget, hint: str = ""):
        super().__init__()
        self.editor = editor
        v = QVBoxLayout(self)
        v.setContentsMargins(0, 0, 0, 0)
        v.setSpacing(2)
        v.addWidget(editor)
        self.error = QLabel()
        self.error.setWordWrap(True)
        self.error.hide()
        v.addWidget(self.error)
        self.hint = None
        if hint:
            self.hint = QLabel(hint)
            self.hint.setWordWrap(True)
            self.hint.setForegroundRole(QPalette.ColorRole.PlaceholderText)
            v.addWidget(self.hint)

    def set_error(self, reason: str | None) -> None:
        style = f"color: {error_text_color(self.palette())};"
        if self.error.styleSheet() != style:
            self.error.setStyleSheet(style)
        if self.error.text() != (reason or "") or self.error.isVisibleTo(self) != bool(reason):
            self.error.setText(reason or "")
            self.error.setVisible(bool(reason))
            self.updateGeometry()
        self.editor.setToolTip(reason or "")

    def set_hint(self, text: str) -> None:
        """A new hint (the cache policy's follows the choice)."""
        if self.hint is not None and self.hint.text() != text:
            self.hint.setText(text)
            # The form caches this row's height for its width: a longer hint overlapped the
            # rows below it until the dialog was resized.
            self.updateGeometry()


def _scrolled(page: QWidget) -> QScrollArea:
    area = QScrollArea()
    area.setWidgetResizable(True)
    area.setFrameShape(QScrollArea.Shape.NoFrame)
    area.setWidget(page)
    return area


def _note(text: str) -> QLabel:
    label = QLabel(text)
    label.setWordWrap(True)
    font = label.font()
    font.setItalic(True)
    label.setFont(font)
    return label


class SettingsDialog(QDialog):
    """Edit the settings; OK/Apply write them (only valid values), Cancel forgets edits.

    Args:
        settings: the app's settings.
        model: the loaded model's info dict (or None).
        loaded_with: ``{"model/device": ..., "model/weight_dtype": ...}`` the model was loaded with.
        devices: ``(name, description)`` pairs (default :func:`runtime.available_devices`).
    """

    applied = Signal(object)         # {key: value} that changed
    reload_requested = Signal()

    def __init__(self, settings: Settings, model: dict | None = None, *, loaded_with: dict | None = None,
                 devices: list[tuple[str, str]] | None = None, parent: QWidget | None = None):
        super().__init__(parent)
        install_wheel_guard()   # scrolling the form never changes a setting under the pointer
        self.setObjectName("settingsDialog")
        self.setWindowTitle("Settings")
        self.settings, self.model = settings, model
        self.loaded_with = dict(loaded_with or {})
        self.devices = devices if devices is not None else runtime.available_devices()
        self.fields: dict[str, _Field] = {}
        self.errors: dict[str, str] = {}
        self.tabs = QTabWidget()
        # Scrolled: the memory plan and its comparison of attention variants need the height.
        self.tabs.addTab(_scrolled(self._context_tab()), "Context && memory")
        self.tabs.addTab(generation_tab(self, _note), "Generation")
        self.tabs.addTab(self._model_tab(), "Model")
        self.buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Apply
                                        | QDialogButtonBox.StandardButton.Cancel
                                        | QDialogButtonBox.StandardButton.RestoreDefaults)
        self.ok_button = self.buttons.button(QDialogButtonBox.StandardButton.Ok)
        self.apply_button = self.buttons.button(QDialogButtonBox.StandardButton.Apply)
        self.buttons.accepted.connect(self.accept)
        self.buttons.rejected.connect(self.reject)
        self.apply_button.clicked.connect(self.apply)
        self.buttons.button(QDialogButtonBox.StandardButton.RestoreDefaults).clicked.connect(self.restore_defaults)
        layout = QVBoxLayout(self)
        layout.addWidget(self.tabs)
        layout.addWidget(self.buttons)
        self.load()
        for f in self.fields.values():
            e = f.editor
            sig = (e.valueChanged if isinstance(e, (QSpinBox, QDoubleSpinBox)) else e.currentIndexChanged
                   if isinstance(e, QComboBox) else e.textChanged)
            sig.connect(self.revalidate)
        self.planner.inputs_changed.connect(self._update_plan)
        self.revalidate()
        self.resize(640, 660)

    # ---- construction ----------------------------------------------------------------
    def _add(self, form: QFormLayout, key: str, label: str, editor: QWidget, hint: str = "") -> None:
        editor.setObjectName(key.replace("/", "_"))
        f = _Field(editor, hint)
        self.fields[key] = f
        form.addRow(label, f)

    @staticmethod
    def _form(parent: QWidget) -> QFormLayout:
        form = QFormLayout()
        form.setFieldGrowthPolicy(QFormLayout.FieldGrowthPolicy.AllNonFixedFieldsGrow)
        return form

    @staticmethod
    def _spin(lo: float, hi: float, special: str = "", suffix: str = "", step: float = 1,
              decimals: int | None = None) -> QSpinBox | QDoubleSpinBox:
        """A spin box over ``lo..hi``: integers, or ``decimals`` places when given."""
        s = QSpinBox() if decimals is None else QDoubleSpinBox()
        s.setRange(lo, hi)
        s.setSingleStep(step)
        s.setSuffix(suffix)
        if decimals is None:
            s.setGroupSeparatorShown(True)
        else:
            s.setDecimals(decimals)
        if special:
            s.setSpecialValueText(special)
        return s

    @staticmethod
    def _combo(items: list[tuple[str, str]]) -> QComboBox:
        c = QComboBox()
        for data, text in items:
            c.addItem(text, data)
        return c

    def _context_tab(self) -> QWidget:
        page = QWidget()
        v = QVBoxLayout(page)
        form = self._form(page)
        max_ctx = int(self.model["context_limit"]) if self.model else None
        self._add(form, "generation/context", "Context length",
                  self._spin(0, 100_000_000, f"the model's maximum ({max_ctx:,})" if max_ctx else "the model's maximum",
                             " tokens", step=256),
                  f"At most {max_ctx:,} tokens for this model." if max_ctx else "Capped at the model's maximum.")
        m = self.model or {}
        dtype = m.get("cache_dtype") or m.get("compute_dtype") or m.get("dtype")
        auto = f"auto ({dtype} for this model)" if dtype else "auto (the model's default)"
        self._add(form, "generation/cache_dtype", "Cache dtype",
                  self._combo([("auto", auto)] + [(d, d) for d in runtime.CACHE_DTYPES]))
        self._add(form, "generation/cache_limit_mib", "KV-cache memory limit",
                  self._spin(0, 10_000_000, "no limit", " MiB", step=16, decimals=2),
                  "The cache never grows past this; the context is capped at what it holds.")
        self._add(form, "generation/overflow", "When the context is full",
                  self._combo([(p, POLICY_TEXT.get(p, p)) for p in runtime.OVERFLOW_POLICIES]))
        self._add(form, "generation/sink_tokens", "Sink tokens (rolling)", self._spin(0, 1_000_000),
                  "The first tokens the rolling policy always keeps (StreamingLLM's attention sinks); "
                  "the system prompt is kept with them when it takes at most half the context.")
        policies = self._combo([(p, cache_policy_label(p)) for p in runtime.CACHE_POLICIES])
        # The figures make the items long: the closed box elides them (the hint below gives the
        # chosen one whole), the list opens as wide as its longest item.
        policies.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        policies.setMinimumContentsLength(24)
        fm = policies.fontMetrics()
        widest = max(fm.horizontalAdvance(policies.itemText(i)) for i in range(policies.count()))
        policies.view().setMinimumWidth(widest + 32)
        # The hint follows the chosen policy (revalidate sets it).
        self._add(form, "generation/cache_policy", "Cache policy", policies, cache_policy_hint("none"))
        self._add(form, "generation/cache_budget", "Cache budget", self._spin(0, 100_000_000, step=64, decimals=1))
        self._add(form, "generation/cache_budget_unit", "Budget in", self._combo([("tokens", "tokens"), ("MiB", "MiB")]))
        v.addLayout(form)
        v.addWidget(_note("Context and cache settings apply from the next message: the conversation is read "
                          "again into a new cache."))
        self.planner = MemoryPlanner(self.model if has_shape(self.model) else None)
        v.addWidget(self.planner)
        v.addStretch(1)
        return page

    def _model_tab(self) -> QWidget:
        page = QWidget()
        v = QVBoxLayout(page)
        form = self._form(page)
        self._add(form, "model/device", "Device", self._combo(list(self.devices)))
        self._add(form, "model/weight_dtype", "Weight dtype",
                  self._combo([("auto", "auto (a GGUF's own blocks, else float16)")] + [(d, weight_dtype_label(d)) for d in WEIGHT_DTYPES[1:]]),
                  "Beside each: how often it picks the same next token as float32 weights (measured on "
                  "English text with the default model) and whether it answers the Paris question. "
                  "On the CPU float16 weights compute in float32 (twice float32's decode speed); on a GPU "
                  "in float16. bfloat16 and int8 weights always compute in float32: bfloat16 arithmetic "
                  "breaks this model.")
        self._add(form, "model/attention_backend", "Attention",
                  self._combo([("fast", "fast (torch SDPA)"), ("reference", "reference (the formula, step by step)")]),
                  "Both compute the same attention; applies at once.")
        self._add(form, "model/reproducible", "Greedy replies",
                  self._combo([("off", "fast"), ("on", "reproducible (same reply however computed)")]),
                  "At temperature 0 Regenerate repeats a reply either way. Reproducible also gives a "
                  "conversation read again from scratch (after a restart, an edit far back) the reply it got "
                  "from the cache, on any thread count: kernels and attention that sum every row in the same "
                  "order. CPU only; slower attention, and float16 weights keep a packed copy "
                  "(docs/reproducible.md has the measurements).")
        v.addLayout(form)
        if (self.model or {}).get("reproducible_kernel"):
            kernel = _note("Reproducible replies run on this machine with: " + self.model["reproducible_kernel"]
                           + " (each kernel is checked row-invariant here first).")
            kernel.setObjectName("reproducibleKernel")
            v.addWidget(kernel)
        v.addWidget(_note("Device, weight dtype and greedy replies take effect when the model is reloaded."))
        row = QHBoxLayout()
        self.reload_note = QLabel()
        self.reload_note.setWordWrap(True)
        self.reload_button = QPushButton("Reload the model now")
        self.reload_button.setObjectName("reloadModel")
        self.reload_button.clicked.connect(self._reload)
        row.addWidget(self.reload_note, 1)
        row.addWidget(self.reload_button)
        v.addLayout(row)
        v.addStretch(1)
        return page

    # ---- values ----------------------------------------------------------------------
    def _set(self, key: str, value: Any) -> None:
        e = self.fields[key].editor
        if isinstance(e, QComboBox):
            i = e.findData(value)
            if i < 0:  # a stored value this machine does not offer (say cuda:1): show it, refused
                e.addItem(f"{value} (not available)", value)
                i = e.count() - 1
            e.setCurrentIndex(i)
        elif isinstance(e, QPlainTextEdit):
            e.setPlainText(str(value))
        else:
            e.setValue(value)

    def values(self) -> dict[str, Any]:
        """The values as edited (settings keys -> values)."""
        out = {}
        for key, f in self.fields.items():
            e = f.editor
            if isinstance(e, QComboBox):
                out[key] = e.currentData()
            elif isinstance(e, QPlainTextEdit):
                out[key] = e.toPlainText()
            else:
                out[key] = type(DEFAULTS[key])(e.value())
        return out

    def load(self) -> None:
        """Show the stored settings."""
        for key in self.fields:
            self._set(key, self.settings.get(key))

    def restore_defaults(self) -> None:
        for key in self.fields:
            self._set(key, DEFAULTS[key])

    def revalidate(self) -> bool:
        """Check every field, show each reason, enable OK/Apply only when all are valid."""
        values = self.values()
        self.errors = validate(values, self.model, [d for d, _ in self.devices])
        for key, f in self.fields.items():
            f.set_error(self.errors.get(key))
        ok = not self.errors
        self.ok_button.setEnabled(ok)
        self.apply_button.setEnabled(ok)
        for i in range(self.tabs.count()):
            bad = any(self.tabs.widget(i).isAncestorOf(self.fields[k]) for k in self.errors)
            self.tabs.setTabText(i, self.tabs.tabText(i).removesuffix(" ⚠") + (" ⚠" if bad else ""))
        sync_preset(self, values)
        self.fields["generation/sink_tokens"].setEnabled(values["generation/overflow"] == "rolling")
        policy_on = values["generation/cache_policy"] != "none"
        self.fields["generation/cache_policy"].set_hint(cache_policy_hint(values["generation/cache_policy"]))
        for key in ("generation/cache_budget", "generation/cache_budget_unit"):
            self.fields[key].setEnabled(policy_on)
        # Whole tokens ("256 tokens", not "256.0"), tenths of a MiB.
        budget, tokens = self.fields["generation/cache_budget"].editor, values["generation/cache_budget_unit"] == "tokens"
        budget.setDecimals(0 if tokens else 1)
        budget.setSuffix(" tokens" if tokens else " MiB")
        self._update_plan()
        self._update_reload(values)
        QTimer.singleShot(0, self, self._refit)
        return ok

    def _refit(self) -> None:
        """Lay the scrolled page out again from its rows. A hint or reason that changed its
        number of lines changes the page's height for its width, and the form kept its rows'
        old heights: the rows below overlapped (after a cache policy change, Restore Defaults)
        until the tab was shown again."""
        QCoreApplication.sendPostedEvents(None, QEvent.Type.LayoutRequest.value)   # the rows' own first
        for i in range(self.tabs.count()):
            area = self.tabs.widget(i)
            if isinstance(area, QScrollArea) and area.widget() is not None:
                page = area.widget()
                for layout in page.findChildren(QLayout):
                    layout.invalidate()
                page.layout().activate()
                width = area.viewport().width()
                h = max(page.heightForWidth(width), area.viewport().height())
                page.resize(width, h + 1)   # a new size makes every row take its height again
                page.resize(width, h)

    def _update_plan(self) -> None:
        v = self.values()
        limit = float(v["generation/cache_limit_mib"])
        device = resolve_device(v["model/device"], [d for d, _ in self.devices], self.planner.model)
        self.planner.update_plan(context=int(v["generation/context"]), cache_dtype=v["generation/cache_dtype"],
                                 budget_bytes=int(limit * MIB) if limit > 0 else None, device=device,
                                 weights_dtype=v["model/weight_dtype"], **policy_budget(v))

    def _update_reload(self, values: dict[str, Any]) -> None:
        pending = has_shape(self.model) and any(values[k] != self.loaded_with.get(k, values[k]) for k in MODEL_OPTIONS)
        if self.model and self.model.get("remote"):
            self.reload_note.setText("Connected to a server: it chooses its own device and dtype.")
        elif self.model:
            dtype, compute = self.model["dtype"], self.model.get("compute_dtype") or self.model["dtype"]
            what = dtype if compute == dtype else f"{dtype} (computing in {compute})"
            self.reload_note.setText(f"Loaded on {self.model['device']} in {what}."
                                     + (" Reload it to use the new device or dtype." if pending else ""))
        else:
            self.reload_note.setText("No model is loaded.")
        self.reload_button.setEnabled(pending and not self.errors)

    def apply(self) -> bool:
        """Write the valid values (unchanged ones are skipped); False if any is invalid."""
        if not self.revalidate():
            return False
        changed = {k: v for k, v in self.values().items() if self.settings.get(k) != v}
        for key, value in changed.items():
            self.settings.set(key, value)
        self.settings.sync()
        if changed:
            self.applied.emit(changed)
        self._update_reload(self.values())
        return True

    def accept(self) -> None:
        if self.apply():
            super().accept()

    def _reload(self) -> None:
        if self.apply():
            self.reload_requested.emit()
            self.loaded_with = {k: self.settings.get(k) for k in MODEL_OPTIONS}
            self._update_reload(self.values())

    def showEvent(self, event) -> None:  # noqa: N802 - Qt API
        super().showEvent(event)
        # Shown, the page is laid out at its real width (its tables fit their rows to it), and
        # the form kept a row's height from before: a help text was cut on first opening
        # ("The cache never grows past this..." to half its two lines, 1100 x 720).
        QTimer.singleShot(0, self, self._refit)

    def changeEvent(self, event) -> None:  # noqa: N802 - re-colour the reasons for a new palette
        super().changeEvent(event)
        if event.type() == QEvent.Type.PaletteChange and self.fields:
            for key, f in self.fields.items():
                f.set_error(self.errors.get(key))
