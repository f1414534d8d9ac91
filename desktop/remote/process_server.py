"""``attnchat serve`` as a child process: Server > Serve the loaded model when the window's model
cannot be served from this process (:mod:`desktop.remote.serve_toggle` chooses).

The child runs its own engine over its own copy of the weights: a client of the API never
shares the window's worker, and stopping is ending a process; the price is a second copy of
the weights and a second load. :class:`ModelServer` starts ``attnchat serve --model PATH --host
127.0.0.1 --port PORT`` as a :class:`QProcess`, reads the address it prints ("... at
http://127.0.0.1:PORT/v1") and stops it with SIGINT (as Ctrl-C; killed if it has not ended
within :data:`STOP_GRACE_MS`).

Must not import torch, runtime or attnchat (it runs the command line, never imports it).
"""
from __future__ import annotations

import logging
import os
import re
import signal

from PySide6.QtCore import QObject, QProcess, QProcessEnvironment, QTimer, Signal

from models.child import attnchat_command

__all__ = ["ModelServer", "serve_command"]

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
    """One ``attnchat serve`` child process at a time (the fallback when the window's model cannot be
    served from this process).

    :attr:`state` is ``"stopped"``, ``"starting"``, ``"serving"`` or ``"failed"``
    (then :attr:`error` says why, in one line); :attr:`changed` fires on each change.
    """

    changed = Signal(str)
    in_process = False

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
