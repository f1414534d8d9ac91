"""Server > Serve the loaded model: the window's model over OpenAI's API, from this process when it can.

When the window has a model loaded in this process and the command line handed the window a
server factory (:func:`attnchat.server.in_process.for_window`), the toggle serves that very
model (:class:`desktop.remote.local_server.LocalServer`): the chat and the server share the
weights, each with its own KV caches, so serving costs no second copy of them and no second
load. Otherwise (no factory: the desktop started without the attnchat command) it runs
``attnchat serve`` as a child process over a second copy of the weights (about 0.5 GiB for the
default model in float32 on the CPU), and the menu and the window say why. With no model
loaded, or the window connected to a remote server, there is nothing here to serve: the toggle
is disabled and the line under it says why.

:class:`ServeToggle` puts it in the window: a checkable menu action with the settings it serves
with beside it (the window's context, KV-cache dtype and cache policy; the process server also
takes the weight dtype), "Serving at …" in the status bar, and a stop when the window closes.
The child process itself is :mod:`desktop.remote.process_server`.
Loopback only (nothing outside this machine can reach it), on a port chosen free once and kept
in the settings (``server/port``), with an API key when the settings ask for one
(``server/require_key``). The Server panel (:mod:`desktop.remote.server_panel`) shows all of it.

Must not import torch, runtime or attnchat (it runs the command line or calls the factory it was given).
"""
from __future__ import annotations

import html
import logging
import os
import secrets
import socket

from PySide6.QtCore import QCoreApplication, QEvent, QObject, Qt, Signal
from PySide6.QtGui import QAction, QGuiApplication
from PySide6.QtWidgets import QLabel

from desktop.remote.local_server import LocalServer
from desktop.remote.process_server import ModelServer, serve_command
from desktop.remote.secrets import KeyStore

__all__ = ["KEY_NAME", "ModelServer", "ServeToggle", "describe_options", "free_port", "install", "serve_command"]

#: The name the served model's API key is kept under (desktop.remote.secrets keys by a name).
KEY_NAME = "attnchat-serve://127.0.0.1"

log = logging.getLogger(__name__)

#: The in-process server's parts in the window's serve settings (its weights are the loaded model's own).
LOCAL_OPTIONS = ("context", "cache_dtype", "cache_policy", "cache_budget")


class ServeToggle(QObject):
    """The window's side: Server > Serve the loaded model, Copy the address, and the status label.

    :attr:`server` is the server shown (the last started): :attr:`local` (in this process, when a
    ``factory`` was given) or :attr:`process` (``attnchat serve``); :attr:`changed` forwards its state.
    """

    changed = Signal(str)

    def __init__(self, window, server: ModelServer | None = None, factory=None):
        super().__init__(window)
        self.window = window
        self.process = server or ModelServer(self)
        self.local = LocalServer(factory, self) if factory is not None else None
        self.server: ModelServer | LocalServer = self.local or self.process
        self.fallback = ""   # why the last start ran a second process ("" when it served from here)
        self.keys = getattr(window, "keys", None) or KeyStore()
        self.action = QAction("&Serve the loaded model over HTTP", self)
        self.action.setObjectName("serveAction")
        self.action.setCheckable(True)
        self.action.setStatusTip("Serve the loaded model with OpenAI's API on this machine (with this window's "
                                 "context and KV-cache settings)")
        self.action.toggled.connect(self._toggled)
        self.copy_action = QAction("&Copy the server address", self)
        self.copy_action.triggered.connect(self.copy_url)
        self.label = QLabel()
        self.label.setObjectName("serveLabel")
        self.label.setTextFormat(Qt.TextFormat.RichText)
        self.label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.label.setContentsMargins(8, 0, 8, 0)
        self.label.hide()
        # First of the permanent fields: index 1 is after the status bar's one normal widget
        # (the prefill bar); Qt appends it when the index does not fit.
        window.status.insertPermanentWidget(1, self.label)
        menu = window.menuBar().addMenu("&Server")
        menu.setObjectName("serverMenu")
        view = window.view_menu.menuAction()
        window.menuBar().insertMenu(view, menu)
        menu.addAction(self.action)
        # Under the toggle: where it serves from (this process, or a second one and why), or why it cannot.
        self.how_action = QAction("", self)
        self.how_action.setObjectName("serveHow")
        self.how_action.setEnabled(False)
        menu.addAction(self.how_action)
        # Beside the toggle: the settings the server gets (the window's, read when it starts).
        self.settings_action = QAction("", self)
        self.settings_action.setObjectName("serveSettings")
        self.settings_action.setEnabled(False)
        menu.addAction(self.settings_action)
        menu.addAction(self.copy_action)
        menu.aboutToShow.connect(self._sync)
        self.menu = menu
        for s in filter(None, (self.local, self.process)):
            s.changed.connect(lambda state, s=s: self._on_changed(state) if s is self.server else None)
        window.model_changed.connect(lambda info: self._sync())
        window.engine.load_started.connect(lambda source: self._sync())
        window.settings.changed.connect(lambda *_: self._sync())
        window.installEventFilter(self)
        app = QCoreApplication.instance()
        if app is not None:
            app.aboutToQuit.connect(self.shutdown)
        self._sync()

    def shutdown(self) -> None:
        """Stop whichever server runs and wait for it (the window is closing)."""
        for s in filter(None, (self.local, self.process)):
            s.shutdown()

    def _local_model(self) -> dict | None:
        info = self.window.engine.model
        return info if info and not info.get("remote") and info.get("path") else None

    def why_not(self) -> str:
        """Why there is nothing to serve, in one line ("" when a model is loaded here)."""
        info = self.window.engine.model
        if info and info.get("remote"):
            return "The window chats with a remote server: there is no model in this window to serve"
        if info and info.get("path"):
            return ""
        if self.window.engine.loading:
            return "A model is loading: it can be served once it has loaded"
        return "No model is loaded: open one (File > Models…) to serve it"

    def _in_process(self):
        """``(the worker's loaded model, "")``, or ``(None, why it cannot be served from this process)``."""
        if self.local is None:
            return None, "this window was started without the attnchat command, which serves from this process"
        model = getattr(self.window.engine.worker, "model", None)
        if model is None or getattr(model, "remote", False):
            return None, "the window's engine holds no model of its own"
        return model, ""

    def _toggled(self, on: bool) -> None:
        if on and not self.server.running:
            info = self._local_model()
            if info is None:
                self._set_checked(False)
                self.window.status.showMessage(self.why_not(), 8000)
                return
            model, self.fallback = self._in_process()
            options = dict(self.options(), port=self.port())
            if model is not None:
                self.server = self.local
                options = {k: v for k, v in options.items() if k in LOCAL_OPTIONS + ("port",)}
                self.local.start(model, info["path"], str(info.get("device") or ""), options, api_key=self.api_key())
            else:
                self.server = self.process
                self.window.show_note(f"Serving from a second process with its own copy of the weights: "
                                      f"{self.fallback}")
                self.process.start(info["path"], self.window.settings.get("model/device"), options,
                                   api_key=self.api_key())
        elif not on and self.server.running:
            self.server.stop()
        self._sync()

    def _on_changed(self, state: str) -> None:
        s = self.server
        name = s.model_id or os.path.basename(s.model_path)
        where = (f"{name} on {s.device}, from this window's own model (no second copy of its weights)"
                 if s.in_process else f"attnchat serve: {name} on {s.device} (a second process with its own "
                                      f"copy of the weights: {self.fallback or 'see the log'})")
        if state == "starting":
            self.label.setText(f"Starting the server for {html.escape(os.path.basename(s.model_path))}…")
            self.label.setToolTip("The server starts on this window's model" if s.in_process
                                  else "attnchat serve is loading its own copy of the model")
        elif state == "serving":
            # The dot tells "serving" apart from the figures beside it, in light and dark palettes.
            self.label.setText(f'<span style="color:#43a047">&#9679;</span> Serving at {s.url}')
            self.label.setToolTip(f"{where}, loopback only, "
                                  f"{'API key required (View > Server panel shows it)' if s.api_key else 'no API key'}.\n"
                                  f"{describe_options(s.options)} (this window's settings when it started).\n"
                                  f"Any OpenAI client can use it: base_url={s.url}, model={name}.\n"
                                  "Server > Serve the loaded model stops it.")
        elif state == "failed":
            # The port is the window's choice (kept in the settings): say where to change it.
            error = s.error.replace("pick another --port", "choose another port in View > Server panel")
            self.window.show_error(error[:1].upper() + error[1:])
        if state in ("stopped", "failed"):
            self.label.hide()
            self._set_checked(False)
        else:
            self.label.show()
            self._set_checked(True)
        self._sync()
        self.changed.emit(state)

    def _set_checked(self, on: bool) -> None:
        self.action.blockSignals(True)
        self.action.setChecked(on)
        self.action.blockSignals(False)

    def options(self) -> dict:
        """The window's settings the server gets: the context a reply gets here (the memory
        limit's cap included), the KV-cache dtype, the weight dtype and the cache policy (with
        its budget; none adds nothing)."""
        w = self.window
        gen = w.generation()
        out = {"context": int(w.context_limit() or 0), "cache_dtype": str(gen.get("cache_dtype") or "auto"),
               "weight_dtype": str(w.settings.get("model/weight_dtype") or "auto"),
               # the window's model runs it only on the CPU (the server's would refuse it elsewhere)
               "reproducible": w.settings.get("model/reproducible") == "on"
               and str((w.engine.model or {}).get("device") or "cpu").startswith("cpu")}
        policy = str(gen.get("cache_policy") or "none")
        if policy != "none":
            budget = float(gen.get("cache_budget") or 0.0)
            in_mib = str(gen.get("cache_budget_unit") or "tokens") == "MiB"
            out.update(cache_policy=policy, cache_budget=f"{budget:g}MiB" if in_mib else str(int(budget)))
        return out

    def port(self) -> int:
        """The server's port: the one in the settings, chosen free once (:func:`free_port`) and
        kept, so a client's configuration stays right from one start to the next."""
        port = int(self.window.settings.get("server/port") or 0)
        if not port:
            port = free_port()
            self.window.settings.set("server/port", port)
        return port

    def api_key(self) -> str:
        """The key clients must send, when the settings ask for one (made once and kept in the
        system keyring where there is one, else for this run: :class:`desktop.remote.secrets.KeyStore`)."""
        if not self.window.settings.get("server/require_key"):
            return ""
        store = self.keys
        key = store.get(KEY_NAME)
        if not key:
            key = "sk-attnchat-" + secrets.token_urlsafe(24)
            store.set(KEY_NAME, key)
        return key

    def _sync(self) -> None:
        running = self.server.running
        self.action.setEnabled(running or self._local_model() is not None)
        self.how_action.setText(self._how(running))
        self.copy_action.setEnabled(self.server.state == "serving")
        if running:
            self.settings_action.setText(f"Serving with {describe_options(self.server.options)}")
        else:
            self.settings_action.setText(f"Uses this window's settings: {describe_options(self.options())}")

    def _how(self, running: bool) -> str:
        """The menu's line under the toggle: where it serves from, or why it cannot serve."""
        s = self.server
        if running and s.in_process:
            info = self.window.engine.model or {}
            if info.get("path") != s.model_path:   # the window moved on; the server keeps its model
                return f"Serves {s.model_id}, the model loaded when it started (held in memory until it stops)"
            return "From this window's model: no second copy of the weights"
        if running:
            return f"From a second process with its own copy of the weights: {self.fallback or 'see the log'}"
        why = self.why_not()
        if why:
            return why
        model, fallback = self._in_process()
        return ("From this window's model: no second copy of the weights" if model is not None
                else f"Would run a second process with its own copy of the weights: {fallback}")

    def copy_url(self) -> None:
        if self.server.url:
            QGuiApplication.clipboard().setText(self.server.url)
            self.window.status.showMessage(f"Copied {self.server.url}", 3000)

    def eventFilter(self, obj, event) -> bool:  # noqa: N802
        if obj is self.window and event.type() == QEvent.Type.Close:
            self.shutdown()
        return False


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the system's choice for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def describe_options(options: dict) -> str:
    """``"int8 KV cache, context 856 tokens"`` for :func:`serve_command`'s keywords."""
    cache = options.get("cache_dtype") or "auto"
    parts = [f"{'the default' if cache == 'auto' else cache} KV cache"]
    ctx = int(options.get("context") or 0)
    parts.append(f"context {ctx:,} tokens" if ctx else "the model's full context")
    weights = options.get("weight_dtype") or "auto"
    if weights != "auto":
        parts.append(f"{weights} weights")
    if options.get("reproducible"):
        parts.append("reproducible greedy replies")
    policy, budget = options.get("cache_policy") or "none", str(options.get("cache_budget") or "")
    if policy != "none":
        parts.append(f"{policy} cache policy ({budget.replace('MiB', ' MiB') if 'MiB' in budget else budget + ' tokens'})")
    return ", ".join(parts)


def install(window, factory=None) -> ServeToggle:
    """Add the Server menu and the "Serving at …" label to ``window`` (a MainWindow); ``factory``
    (:func:`attnchat.server.in_process.for_window`'s signature) serves its model from this process."""
    return ServeToggle(window, factory=factory)
