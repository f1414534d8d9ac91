"""The engine worker: all model work, on one long-lived QThread, behind plain-data signals.

Why a thread and not a process: torch releases the GIL inside its kernels, so a
decode step on the worker thread leaves the GUI thread free; the model (and, later,
the attention captures and KV-cache figures the panels show) is shared without
copying or pickling; Stop is one ``threading.Event`` set from the GUI thread, seen
within one decode step; and shutdown is ``stop -> quit -> wait``. A process would
buy isolation from crashes inside torch at the price of a second copy of the
runtime in memory, IPC for every token and attention map, and a slower start.

Requests go in through :class:`Engine` (GUI side), which queues them onto the
worker's thread; results come back as signals carrying only ``str``, ``int``,
``dict`` and ``list`` (never tensors). Text is batched: at most one
:attr:`EngineWorker.text_batch` every ``batch_ms`` (30 ms), so the window repaints
at most ~33 times a second however fast tokens come.

Modules (one idea each):

- :mod:`~desktop.worker.engine`: :class:`Engine`, the GUI side (thread, queue, request ids).
- :mod:`~desktop.worker.engine_worker`: :class:`EngineWorker`, the model and sessions on the thread.
- :mod:`~desktop.worker.generation_settings`: the desktop's settings dict as runtime settings.
- :mod:`~desktop.worker.model_info`: a loaded model as plain data; which model a reply came from.
- :mod:`~desktop.worker.errors`: failures in one line; out-of-memory told apart.
- :mod:`~desktop.worker.threads`: QThreads started and remembered (tests check none is left running).

Imports runtime's public API only (no torch, no widgets).
"""
from desktop.worker.engine import Engine
from desktop.worker.engine_worker import EngineWorker
from desktop.worker.errors import first_line, is_out_of_memory
from desktop.worker.generation_settings import generation_settings
from desktop.worker.model_info import model_info, model_key
from desktop.worker.threads import live_threads, start_thread

__all__ = ["Engine", "EngineWorker", "first_line", "generation_settings", "is_out_of_memory", "live_threads",
           "model_info", "model_key", "start_thread"]
