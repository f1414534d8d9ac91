"""Server > Serve the loaded model: ``attnchat serve`` for the window's model, in its own process.

Why a process: the HTTP server (``attnchat.server``) runs its own engine over its own
copy of the weights. The window's worker keeps its model and KV caches to itself, so a
client of the API never slows or disturbs the chat in the window, the window never
blocks on the server, and stopping is ending a process. The price is memory: a second
copy of the weights (about 0.5 GiB for the default model in float32 on the CPU).

:class:`ModelServer` starts ``attnchat serve --model PATH --host 127.0.0.1 --port 0``
as a :class:`QProcess`, reads the address it prints ("... at http://127.0.0.1:PORT/v1")
and stops it with SIGINT (as Ctrl-C; killed if it has not ended within
:data:`STOP_GRACE_MS`). :class:`ServeToggle` puts it in the window: a checkable menu
action with the settings it serves with beside it (the window's context, KV-cache dtype and
weight dtype), "Serving at …" in the status bar, and a stop when the window closes.
Loopback only (nothing outside this machine can reach it), on a port chosen free once and kept
in the settings (``server/port``), with an API key when the settings ask for one
(``server/require_key``). The Server panel (:mod:`desktop.remote.server_panel`) shows all of it.

Must not import torch, runtime or attnchat (it runs the command line, never imports it).
"""
from __future__ import annotations

import html
import logging
import os
import re
import secrets
import signal
import socket
import sys

from PySide6.QtCore import QCoreApplication, QEvent, QObject, QProcess, QProcessEnvironment, Qt, QTimer, Signal
from PySide6.QtGui import QAction, QGuiApplication
from PySide6.QtWidgets import QLabel

from desktop.remote.secrets import KeyStore
from models.child import attnchat_command

__all__ = ["KEY_NAME", "ModelServer", "ServeToggle", "describe_options", "free_port", "install", "serve_command"]

#: The name the served model's API key is kept under (desktop.remote.secrets keys by a name).
KEY_NAME = "attnchat-serve://127.0.0.1"

log = logging.getLogger(__name__)

#: What ``attnchat serve`` prints once it listens.
URL_LINE = re.compile(r"serving (?P<model>\S+) on (?P<device>\S+) at (?P<url>https?://\S+/v1)")
#: How long a stopping server gets to finish its reply and close (ms); then it is killed.
STOP_GRACE_MS = 5000
#: Lines of the server's output kept to explain a failure.
KEEP_LINES = 40


def serve_command(model_path: str, device: str = "auto", *, context: int = 0, cache_dtype: str = "auto",
                  weight_dtype: str = "auto", reproducible: bool = False, cache_policy: str = "none",
                  cache_budget: str = "", port: int = 0) -> tuple[str, list[str]]:
    """``(program, arguments)`` that serve ``model_path`` on loopback ``port`` (0: a free one), with the
    window's ``context`` (tokens; 0: the model's maximum), KV ``cache_dtype``,
    ``weight_dtype`` (``"auto"``: the server's own choice, the same rule as the window's),
    ``reproducible`` greedy replies (on the CPU) and ``cache_policy`` with its ``cache_budget``
    (``"512"`` tokens or ``"24MiB"``, as ``attnchat serve --cache-budget`` reads it). An API key
    goes in the environment (:meth:`ModelServer.start`), never in the arguments (``ps`` shows them)."""
    args = ["serve", "--model", model_path, "--host", "127.0.0.1", "--port", str(int(port or 0)),
            "--device", device or "auto"]
    if context and int(context) > 0:
        args += ["--context", str(int(context))]
    if cache_dtype and cache_dtype != "auto":
        args += ["--cache-dtype", cache_dtype]
    if weight_dtype and weight_dtype != "auto":
        args += ["--dtype", weight_dtype]
    if reproducible:
        args += ["--reproducible"]
    if cache_policy and cache_policy != "none":
        args += ["--cache-policy", cache_policy, "--cache-budget", cache_budget]
    program, *rest = attnchat_command(*args)  # never imports from the current folder (models.child)
    return program, rest


class ModelServer(QObject):
    """One ``attnchat serve`` child process at a time.

    :attr:`state` is ``"stopped"``, ``"starting"``, ``"serving"`` or ``"failed"``
    (then :attr:`error` says why, in one line); :attr:`changed` fires on each change.
    """

    changed = Signal(str)

    def __init__(self, parent: QObject | None = None, command_fn=serve_command):
        super().__init__(parent)
        self.command_fn = command_fn
        self._proc: QProcess | None = None
        self._lines: list[str] = []
        self._partial = ""
        self._stopping = False
        self.state = "stopped"
        self.url = ""
        self.model_id = ""
        self.device = ""
        self.model_path = ""
        self.error = ""
        self.options: dict = {}   # what the running server was started with (serve_command's keywords)
        self.api_key = ""         # what its clients must send ("" for none)

    @property
    def running(self) -> bool:
        return self._proc is not None

    @property
    def pid(self) -> int:
        return int(self._proc.processId()) if self._proc is not None else 0

    def start(self, model_path: str, device: str = "auto", options: dict | None = None, api_key: str = "") -> None:
        """Start serving ``model_path`` (a no-op while a server runs); ``options``: the
        keyword arguments of :func:`serve_command` (context, cache_dtype, weight_dtype, port);
        ``api_key``: the key clients must send ("" for none), given to the child in its environment."""
        if self._proc is not None:
            return
        self.api_key = api_key
        program, args = self.command_fn(model_path, device, **options) if options else self.command_fn(model_path, device)
        self.options = dict(options or {})
        proc = QProcess(self)
        proc.setProcessChannelMode(QProcess.ProcessChannelMode.MergedChannels)
        env = QProcessEnvironment.systemEnvironment()
        env.remove("ATTNCHAT_API_KEY")  # the window's own key or none: never one the window would not know
        if api_key:
            env.insert("ATTNCHAT_API_KEY", api_key)
        proc.setProcessEnvironment(env)
        proc.readyReadStandardOutput.connect(self._read)
        proc.finished.connect(self._on_finished)
        proc.errorOccurred.connect(self._on_error)
        self._proc, self._lines, self._partial, self._stopping = proc, [], "", False
        self.url = self.model_id = self.device = self.error = ""
        self.model_path = model_path
        log.info("starting %s %s", program, " ".join(args))
        proc.start(program, args)
        self._set("starting")

    def stop(self) -> None:
        """Ask the server to stop (returns at once; :attr:`changed` says "stopped" when it has)."""
        proc = self._proc
        if proc is None or self._stopping:
            return
        self._stopping = True
        self._interrupt(proc)
        QTimer.singleShot(STOP_GRACE_MS, lambda p=proc: self._kill_if_running(p))

    def shutdown(self, timeout_ms: int = STOP_GRACE_MS) -> None:
        """Stop the server and wait for it (the window is closing)."""
        proc = self._proc
        if proc is None:
            return
        self._stopping = True
        self._interrupt(proc)
        if not proc.waitForFinished(timeout_ms):
            proc.kill()
            proc.waitForFinished(2000)
        if self._proc is proc:  # finished was not delivered (no event loop): clean up here
            self._on_finished(proc.exitCode(), proc.exitStatus())

    def _interrupt(self, proc: QProcess) -> None:
        pid = int(proc.processId())
        if os.name == "posix" and pid > 0:
            try:
                os.kill(pid, signal.SIGINT)  # Ctrl-C: uvicorn ends the open replies and closes
                return
            except OSError:
                pass
        proc.terminate()

    def _kill_if_running(self, proc: QProcess) -> None:
        try:
            if proc.state() != QProcess.ProcessState.NotRunning:
                log.warning("attnchat serve did not stop within %d ms; killing it", STOP_GRACE_MS)
                proc.kill()
        except RuntimeError:  # already deleted
            pass

    def _read(self) -> None:
        proc = self._proc
        if proc is None:
            return
        text = self._partial + bytes(proc.readAllStandardOutput().data()).decode("utf-8", "replace")
        *lines, self._partial = text.split("\n")
        for line in lines:
            line = line.rstrip()
            if not line:
                continue
            self._lines = (self._lines + [line])[-KEEP_LINES:]
            m = URL_LINE.search(line)
            if m and self.state == "starting":
                self.url, self.model_id, self.device = m["url"], m["model"], m["device"]
                log.info("serving at %s", self.url)
                self._set("serving")

    def _on_error(self, error: QProcess.ProcessError) -> None:
        if error == QProcess.ProcessError.FailedToStart and self._proc is not None:
            self._finish(f"could not run {self._proc.program()} ({self._proc.errorString()})")

    def _on_finished(self, code: int, status: QProcess.ExitStatus) -> None:
        if self._proc is None:
            return
        self._read()
        if self._stopping:
            self._finish("")
            return
        errors = [line.removeprefix("attnchat: error: ") for line in self._lines if line.startswith("attnchat: error:")]
        why = errors[-1] if errors else (self._lines[-1] if self._lines else f"it exited with status {code}")
        self._finish(f"the server {'stopped' if self.state == 'serving' else 'did not start'}: {why}")

    def _finish(self, error: str) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.deleteLater()
        self.error = error
        self.url = ""
        self._set("failed" if error else "stopped")

    def _set(self, state: str) -> None:
        self.state = state
        self.changed.emit(state)


class ServeToggle(QObject):
    """The window's side: Server > Serve the loaded model, Copy the address, and the status label."""

    def __init__(self, window, server: ModelServer | None = None):
        super().__init__(window)
        self.window = window
        self.server = server or ModelServer(self)
        self.keys = getattr(window, "keys", None) or KeyStore()
        self.action = QAction("&Serve the loaded model over HTTP", self)
        self.action.setObjectName("serveAction")
        self.action.setCheckable(True)
        self.action.setStatusTip("Serve the loaded model with OpenAI's API on this machine (a second copy of it, "
                                "with this window's context and KV-cache settings)")
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
        # Beside the toggle: the settings the server gets (the window's, read when it starts).
        self.settings_action = QAction("", self)
        self.settings_action.setObjectName("serveSettings")
        self.settings_action.setEnabled(False)
        menu.addAction(self.settings_action)
        menu.addAction(self.copy_action)
        menu.aboutToShow.connect(self._sync)
        self.menu = menu
        self.server.changed.connect(self._on_changed)
        window.model_changed.connect(lambda info: self._sync())
        window.engine.load_started.connect(lambda source: self._sync())
        window.settings.changed.connect(lambda *_: self._sync())
        window.installEventFilter(self)
        app = QCoreApplication.instance()
        if app is not None:
            app.aboutToQuit.connect(self.server.shutdown)
        self._sync()

    def _local_model(self) -> dict | None:
        info = self.window.engine.model
        return info if info and not info.get("remote") and info.get("path") else None

    def _toggled(self, on: bool) -> None:
        if on and not self.server.running:
            info = self._local_model()
            if info is None:
                self._set_checked(False)
                return
            options = dict(self.options(), port=self.port())
            self.server.start(info["path"], self.window.settings.get("model/device"), options, api_key=self.api_key())
        elif not on and self.server.running:
            self.server.stop()
        self._sync()

    def _on_changed(self, state: str) -> None:
        s = self.server
        name = s.model_id or os.path.basename(s.model_path)
        if state == "starting":
            self.label.setText(f"Starting the server for {html.escape(os.path.basename(s.model_path))}…")
            self.label.setToolTip("attnchat serve is loading its own copy of the model")
        elif state == "serving":
            # The dot tells "serving" apart from the figures beside it, in light and dark palettes.
            self.label.setText(f'<span style="color:#43a047">&#9679;</span> Serving at {s.url}')
            self.label.setToolTip(f"attnchat serve: {name} on {s.device}, loopback only, "
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
        self.copy_action.setEnabled(self.server.state == "serving")
        if running:
            self.settings_action.setText(f"Serving with {describe_options(self.server.options)}")
        else:
            self.settings_action.setText(f"Uses this window's settings: {describe_options(self.options())}")

    def copy_url(self) -> None:
        if self.server.url:
            QGuiApplication.clipboard().setText(self.server.url)
            self.window.status.showMessage(f"Copied {self.server.url}", 3000)

    def eventFilter(self, obj, event) -> bool:  # noqa: N802
        if obj is self.window and event.type() == QEvent.Type.Close:
            self.server.shutdown()
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


def install(window) -> ServeToggle:
    """Add the Server menu and the "Serving at …" label to ``window`` (a MainWindow)."""
    return ServeToggle(window)
