"""The settings dialog (context and cache limits with a memory planner, generation defaults,
device and model options) and the controller that opens it and applies model options.

Values live in :class:`desktop.settings.values.Settings` (QSettings). What applies when:

- context length, cache dtype, cache memory limit, overflow policy: from the next
  message (the worker rebuilds the conversation's cache when they change);
- system prompt and sampling: from the next reply;
- attention backend: at once (from the next decode step);
- device and weight dtype: when the model is reloaded (the dialog offers it).

Invalid values are refused in the dialog, each with its reason under its field, and
OK/Apply stay disabled until they are fixed: the worker builds the runtime's
``GenerationSettings`` from the same values (a last check here), so nothing invalid
reaches the runtime. Must not import torch.
"""
from __future__ import annotations

import logging
import math
import re
from typing import Any

from PySide6.QtCore import QEvent, QObject, QTimer, Signal
from PySide6.QtGui import QKeySequence, QPalette
from PySide6.QtWidgets import (
    QComboBox, QDialog, QDialogButtonBox, QDoubleSpinBox, QFormLayout, QHBoxLayout, QLabel, QPlainTextEdit,
    QPushButton, QSpinBox, QTabWidget, QVBoxLayout, QWidget,
)

import runtime
from desktop.settings.memory_planner import MemoryPlanner, resolve_device
from desktop.settings.values import DEFAULTS, Settings
from desktop.worker import generation_settings

__all__ = ["SettingsDialog", "SettingsController", "install_settings", "validate", "repair", "MIN_CONTEXT",
           "WEIGHT_DTYPES"]

log = logging.getLogger(__name__)

MIB = 2**20
#: A chat template and one short message take ~20-40 tokens: below this a context is useless.
MIN_CONTEXT = 64
WEIGHT_DTYPES = ("auto", "float32", "bfloat16", "float16")


def _dtype_label(name: str) -> str:
    """``"float16 — 100.0 % same tokens, Paris ✓"`` from runtime's measured figures."""
    q = runtime.WEIGHT_DTYPE_QUALITY.get(name)
    if q is None:
        return name
    mark = "\u2713" if q["paris"] else "\u2717"
    return f"{name} \u2014 {q['agreement'] * 100:.1f}\u00a0% same tokens, Paris {mark}"
POLICY_TEXT = {
    "stop": "stop: end the reply when the context is full",
    "truncate-middle": "truncate-middle: drop the oldest turns, keep the system prompt",
    "rolling": "rolling: keep the first sink tokens and a window of the newest",
}
#: The keys the dialog edits (the rest of DEFAULTS is window state).
KEYS = (
    "generation/context", "generation/cache_limit_mib", "generation/cache_dtype", "generation/overflow",
    "generation/sink_tokens", "generation/system_prompt", "generation/temperature", "generation/top_k",
    "generation/top_p", "generation/min_p", "generation/repetition_penalty", "generation/max_new_tokens",
    "generation/seed", "model/device", "model/weight_dtype", "model/attention_backend",
)
MODEL_OPTIONS = ("model/device", "model/weight_dtype")
#: The numbers the dialog's editors take (a stored value outside would be silently clamped there).
RANGES = {
    "generation/context": (0, 100_000_000), "generation/cache_limit_mib": (0, 10_000_000),
    "generation/sink_tokens": (0, 1_000_000), "generation/temperature": (0, 100), "generation/top_k": (0, 1_000_000),
    "generation/top_p": (0, 1), "generation/min_p": (0, 1), "generation/repetition_penalty": (0, 10),
    "generation/max_new_tokens": (1, 1_000_000), "generation/seed": (-1, 2**31 - 1),
}
#: A device name a settings file may hold. Whether this machine has it is checked when the
#: model loads: the worker then falls back to auto and says so (desktop.worker).
DEVICE_NAME = re.compile(r"auto|cpu|mps|cuda(:\d+)?")


def has_shape(model: dict | None) -> bool:
    """A local model whose cache we can plan (a remote engine's info has no layers or heads)."""
    return bool(model) and all(model.get(k) for k in ("n_layers", "n_kv_heads", "head_dim"))


def _cache_elem(values: dict[str, Any], model: dict | None) -> int | None:
    dtype = values["generation/cache_dtype"]
    if dtype == "auto":
        dtype = values["model/weight_dtype"]
        if dtype == "auto":
            dtype = model.get("dtype") if model else None
    return runtime.element_bytes(dtype) if dtype in runtime.CACHE_DTYPES else None


def validate(values: dict[str, Any], model: dict | None, devices: list[str]) -> dict[str, str]:
    """The reasons ``values`` (settings keys -> values) cannot be used, by key (empty: all good).

    ``model`` is the loaded model's info dict (context and cache checks against its shape
    need it); ``devices`` the device names this machine has.
    """
    err: dict[str, str] = {}
    ctx = int(values["generation/context"])
    max_ctx = int(model["context_limit"]) if model else None
    if ctx and ctx < MIN_CONTEXT:
        err["generation/context"] = f"at least {MIN_CONTEXT} tokens (a chat template and a short message need that much)"
    elif ctx and max_ctx and ctx > max_ctx:
        err["generation/context"] = f"this model holds at most {max_ctx:,} tokens; use {max_ctx:,} or less"
    limit_mib = float(values["generation/cache_limit_mib"])
    elem = _cache_elem(values, model)
    if limit_mib > 0 and has_shape(model) and elem:
        per_token = 2 * int(model["n_layers"]) * int(model["n_kv_heads"]) * int(model["head_dim"]) * elem
        fits = int(limit_mib * MIB) // per_token
        if fits < MIN_CONTEXT:
            err["generation/cache_limit_mib"] = (
                f"holds only {fits} tokens at {per_token:,} bytes per token; "
                f"give at least {per_token * MIN_CONTEXT / MIB:.2f} MiB (or 0 for no limit)")
    if values["generation/cache_dtype"] not in ("auto", *runtime.CACHE_DTYPES):
        err["generation/cache_dtype"] = f"use auto or one of {', '.join(runtime.CACHE_DTYPES)}"
    if values["generation/overflow"] not in runtime.OVERFLOW_POLICIES:
        err["generation/overflow"] = f"use one of {', '.join(runtime.OVERFLOW_POLICIES)}"
    window = min(ctx, max_ctx) if ctx and max_ctx else ctx or max_ctx
    if values["generation/overflow"] == "rolling" and window and int(values["generation/sink_tokens"]) >= window:
        err["generation/sink_tokens"] = f"the sinks must leave room for a window: at most {window - 1:,} with a {window:,}-token context"
    if not float(values["generation/top_p"]) > 0:
        err["generation/top_p"] = "must be above 0 (1 turns it off)"
    if not float(values["generation/min_p"]) < 1:
        err["generation/min_p"] = "must be below 1 (0 turns it off)"
    if not float(values["generation/repetition_penalty"]) > 0:
        err["generation/repetition_penalty"] = "must be above 0 (1 turns it off)"
    if values["model/device"] not in devices:
        err["model/device"] = f"{values['model/device']} is not available on this machine; choose one of {', '.join(devices)}"
    if values["model/weight_dtype"] not in WEIGHT_DTYPES:
        err["model/weight_dtype"] = f"use one of {', '.join(WEIGHT_DTYPES)}"
    if values["model/attention_backend"] not in runtime.ATTENTION_BACKENDS:
        err["model/attention_backend"] = f"use one of {', '.join(runtime.ATTENTION_BACKENDS)}"
    if not err:  # the worker's own conversion: the runtime's checks, in case ours missed one
        try:
            generation_settings({k.split("/", 1)[1]: v for k, v in values.items() if k.startswith("generation/")}, max_ctx)
        except (ValueError, TypeError) as e:
            err["generation/max_new_tokens"] = str(e)
    return err


def repair(settings: Settings, model: dict | None = None) -> list[str]:
    """Reset every stored setting the app cannot use to its default; returns one phrase per reset.

    A settings file edited by hand, or written for another machine or model (context -5,
    device ``quantum``, a cache limit below one token, a context past the loaded model's
    maximum), must never stop the app: it falls back to the defaults and the caller says
    which ones. Each value is checked on its own (its range, the runtime's own checks),
    then all together with :func:`validate` (``model``: the loaded model's info, or None).
    """
    values = {k: settings.get(k) for k in KEYS}
    bad: dict[str, str] = {}
    gen_defaults = {k.split("/", 1)[1]: DEFAULTS[k] for k in KEYS if k.startswith("generation/")}
    for key, value in values.items():
        if not settings.readable(key):
            bad[key] = "not a number"
        elif isinstance(value, float) and not math.isfinite(value):
            bad[key] = "not a finite number"
            continue
        if key.startswith("generation/"):
            try:  # the runtime's own check of this one value
                generation_settings({**gen_defaults, key.split("/", 1)[1]: value})
            except (ValueError, TypeError) as e:
                bad[key] = str(e).strip().splitlines()[0].rstrip(".")
                continue
        if key in RANGES and not RANGES[key][0] <= value <= RANGES[key][1]:
            bad[key] = f"outside {RANGES[key][0]:,}..{RANGES[key][1]:,}"
        elif key == "model/device" and not DEVICE_NAME.fullmatch(str(value)):
            bad[key] = "use auto, cpu, cuda, cuda:N or mps"
    values.update({k: DEFAULTS[k] for k in bad})
    devices = [values["model/device"]]
    for _ in range(len(KEYS)):  # a reset can change what the others are checked against
        try:
            errors = validate(values, model, devices)
        except (ValueError, TypeError, KeyError, OverflowError):  # a model dict without the figures
            log.warning("could not check the settings against %s", model, exc_info=True)
            errors = validate(values, None, devices)
        if not errors:
            break
        for key, reason in errors.items():
            # A default that is refused: validate's last, runtime-wide check blames a combination.
            culprits = [key] if values[key] != DEFAULTS[key] else [k for k in values if k.startswith("generation/")]
            for k in culprits:
                if values[k] != DEFAULTS[k]:
                    bad.setdefault(k, reason)
                    values[k] = DEFAULTS[k]
    out = []
    for key, reason in bad.items():
        stored = settings.stored(key)
        log.warning("setting %s=%r reset to %r: %s", key, stored, DEFAULTS[key], reason)
        out.append(f"{key.split('/', 1)[1].replace('_', ' ')} {stored} ({reason})")
        settings.reset(key)
    return out


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
        dark = self.palette().color(QPalette.ColorRole.Window).lightness() < 128
        self.error.setStyleSheet(f"color: {'#ff7b72' if dark else '#b3261e'};")
        self.error.setText(reason or "")
        self.error.setVisible(bool(reason))
        self.editor.setToolTip(reason or "")


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
        self.setObjectName("settingsDialog")
        self.setWindowTitle("Settings")
        self.settings, self.model = settings, model
        self.loaded_with = dict(loaded_with or {})
        self.devices = devices if devices is not None else runtime.available_devices()
        self.fields: dict[str, _Field] = {}
        self.errors: dict[str, str] = {}
        self.tabs = QTabWidget()
        self.tabs.addTab(self._context_tab(), "Context && memory")
        self.tabs.addTab(self._generation_tab(), "Generation")
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
    def _int(lo: int, hi: int, special: str = "", suffix: str = "", step: int = 1) -> QSpinBox:
        s = QSpinBox()
        s.setRange(lo, hi)
        s.setSingleStep(step)
        s.setGroupSeparatorShown(True)
        s.setSuffix(suffix)
        if special:
            s.setSpecialValueText(special)
        return s

    @staticmethod
    def _float(lo: float, hi: float, decimals: int, step: float, special: str = "", suffix: str = "") -> QDoubleSpinBox:
        s = QDoubleSpinBox()
        s.setRange(lo, hi)
        s.setDecimals(decimals)
        s.setSingleStep(step)
        s.setSuffix(suffix)
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
                  self._int(0, 100_000_000, f"the model's maximum ({max_ctx:,})" if max_ctx else "the model's maximum",
                            " tokens", 256),
                  f"At most {max_ctx:,} tokens for this model." if max_ctx else "Capped at the model's maximum.")
        dtype = (self.model or {}).get("compute_dtype") or (self.model or {}).get("dtype")
        auto = f"auto (the compute dtype, {dtype})" if dtype else "auto (the compute dtype)"
        self._add(form, "generation/cache_dtype", "Cache dtype",
                  self._combo([("auto", auto)] + [(d, d) for d in runtime.CACHE_DTYPES]))
        self._add(form, "generation/cache_limit_mib", "KV-cache memory limit",
                  self._float(0, 10_000_000, 2, 16, "no limit", " MiB"),
                  "The cache never grows past this; the context is capped at what it holds.")
        self._add(form, "generation/overflow", "When the context is full",
                  self._combo([(p, POLICY_TEXT.get(p, p)) for p in runtime.OVERFLOW_POLICIES]))
        self._add(form, "generation/sink_tokens", "Sink tokens (rolling)", self._int(0, 1_000_000),
                  "The first tokens the rolling policy always keeps (StreamingLLM's attention sinks).")
        v.addLayout(form)
        v.addWidget(_note("Context and cache settings apply from the next message: the conversation is read "
                          "again into a new cache."))
        self.planner = MemoryPlanner(self.model if has_shape(self.model) else None)
        v.addWidget(self.planner)
        v.addStretch(1)
        return page

    def _generation_tab(self) -> QWidget:
        page = QWidget()
        v = QVBoxLayout(page)
        form = self._form(page)
        prompt = QPlainTextEdit()
        prompt.setPlaceholderText("No system prompt")
        prompt.setMinimumHeight(64)
        prompt.setMaximumHeight(120)
        self._add(form, "generation/system_prompt", "System prompt", prompt)
        self._add(form, "generation/temperature", "Temperature", self._float(0, 100, 2, 0.1, "0 (greedy)"))
        self._add(form, "generation/top_k", "Top-k", self._int(0, 1_000_000, "off"))
        self._add(form, "generation/top_p", "Top-p", self._float(0, 1, 2, 0.05), "1 turns it off.")
        self._add(form, "generation/min_p", "Min-p", self._float(0, 1, 2, 0.01, "off"))
        self._add(form, "generation/repetition_penalty", "Repetition penalty", self._float(0, 10, 2, 0.05),
                  "1 turns it off; above 1 discourages repeating the last 64 tokens.")
        self._add(form, "generation/max_new_tokens", "Max new tokens", self._int(1, 1_000_000, "", " tokens", 64))
        self._add(form, "generation/seed", "Seed", self._int(-1, 2**31 - 1, "random"),
                  "The same seed gives the same reply.")
        v.addLayout(form)
        v.addWidget(_note("Applies from the next reply."))
        v.addStretch(1)
        return page

    def _model_tab(self) -> QWidget:
        page = QWidget()
        v = QVBoxLayout(page)
        form = self._form(page)
        self._add(form, "model/device", "Device", self._combo(list(self.devices)))
        self._add(form, "model/weight_dtype", "Weight dtype",
                  self._combo([("auto", "auto (float16)")] + [(d, _dtype_label(d)) for d in WEIGHT_DTYPES[1:]]),
                  "Beside each: how often it picks the same next token as float32 weights (measured on "
                  "English text with the default model) and whether it answers the Paris question. "
                  "On the CPU float16 weights compute in float32 (twice float32's decode speed); on a GPU "
                  "in float16. bfloat16 weights always compute in float32: bfloat16 arithmetic breaks "
                  "this model.")
        self._add(form, "model/attention_backend", "Attention",
                  self._combo([("fast", "fast (torch SDPA)"), ("reference", "reference (the formula, step by step)")]),
                  "Both compute the same attention; applies at once.")
        v.addLayout(form)
        v.addWidget(_note("Device and weight dtype take effect when the model is reloaded."))
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
        self.fields["generation/sink_tokens"].setEnabled(values["generation/overflow"] == "rolling")
        self._update_plan()
        self._update_reload(values)
        return ok

    def _update_plan(self) -> None:
        v = self.values()
        limit = float(v["generation/cache_limit_mib"])
        device = resolve_device(v["model/device"], [d for d, _ in self.devices], self.planner.model)
        self.planner.update_plan(context=int(v["generation/context"]), cache_dtype=v["generation/cache_dtype"],
                                 budget_bytes=int(limit * MIB) if limit > 0 else None, device=device,
                                 weights_dtype=v["model/weight_dtype"])

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

    def changeEvent(self, event) -> None:  # noqa: N802 - re-colour the reasons for a new palette
        super().changeEvent(event)
        if event.type() == QEvent.Type.PaletteChange and self.fields:
            for key, f in self.fields.items():
                f.set_error(self.errors.get(key))


class SettingsController(QObject):
    """Puts Settings… in the Edit menu, opens the dialog, and hands model options to the engine.

    The engine gets ``weight_dtype`` and ``attention_backend`` at once and whenever they
    change (a weight dtype is used by the next load).
    """

    def __init__(self, window):
        super().__init__(window)
        self.window = window
        self.dialog: SettingsDialog | None = None
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
            self.window.show_error(f"{current} {text}".strip())

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

    def _options(self) -> dict:
        s = self.window.settings
        return {"weight_dtype": s.get("model/weight_dtype"), "attention_backend": s.get("model/attention_backend")}

    def _configure(self) -> None:
        configure = getattr(self.window.engine, "configure", None)
        if configure is not None:
            configure(self._options())

    def _changed(self, key: str, value) -> None:
        if key in ("model/weight_dtype", "model/attention_backend"):
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
        self.dialog.open()
        return self.dialog


def install_settings(window) -> SettingsController:
    """Give ``window`` (a MainWindow) Edit > Settings…; the controller is ``window.settings_controller``."""
    window.settings_controller = SettingsController(window)
    return window.settings_controller
