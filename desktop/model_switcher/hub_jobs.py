"""The Hub browser's work off the GUI thread: searching, opening a repo (its files, its model's
shape, each file's fit on this machine) and downloading, each job on its own QThread.

Results cross back as signals carrying plain data (dicts, strings, numbers). A failure is
one line and a kind (``models.HubError.kind``: ``"offline"``, ``"gated"``...). The functions
that touch the network or the planner are arguments (:class:`HubService`), so tests pass
fakes or point the real ones at a stand-in Hub. Imports Qt and :mod:`models`; the planner
(:func:`runtime.fit`) only inside the job that needs it.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from PySide6.QtCore import QObject, QThread, Signal, Slot

import models
from desktop.worker import start_thread
from models.hub.report import QUOTED_CONTEXT

__all__ = ["HubService", "Job", "JobRunner", "QUOTED_CONTEXT", "default_fit", "default_runs", "entry_block_type",
           "layer_windows", "open_repo"]

log = logging.getLogger(__name__)


def default_fit(size_bytes: int, shape: Any, context: int, device: str, block_type: str | None = None, *,
                weight_dtype: str = "auto", reproducible: bool = False, cache_dtype: str = "auto") -> dict:
    """:func:`runtime.fit` of a file of ``size_bytes`` with ``shape`` (a GGUFShape or a catalog
    entry's numbers) at ``context`` tokens on ``device``, as a dict. ``block_type``: the file's
    (``"Q4_K"``, :func:`models.hub.ref.tag_block_type`; None: from a catalog entry's file name),
    so the cache is planned in the dtype the runtime gives that file (float16 for quantized
    blocks on the CPU, where a float32 plan was twice the cache). ``weight_dtype``,
    ``reproducible``, ``cache_dtype``: the settings the next load runs with ("auto": the
    runtime's own choice), which change that dtype (a float weight dtype or reproducible
    replies run a float32 cache on the CPU)."""
    import runtime

    if block_type is None:
        block_type = entry_block_type(shape)
    return runtime.fit(size_bytes, layers=shape.n_layers, kv_heads=shape.n_kv_heads, head_dim=shape.head_dim,
                       context=context, windows=layer_windows(shape), device=device, block_type=block_type,
                       architecture=getattr(shape, "architecture", ""),
                       dtype=None if weight_dtype in ("", "auto") else weight_dtype,
                       reproducible=reproducible and device == "cpu",
                       cache_dtype=None if cache_dtype in ("", "auto") else cache_dtype).to_dict()


def entry_block_type(entry: Any) -> str:
    """The block type of a catalog entry's file from its quant tag (``"Q4_K"`` for a
    ``...-q4_k_m.gguf``), "" for anything else."""
    from models.hub.ref import quant_tag, tag_block_type

    name = getattr(entry, "filename", "")
    return tag_block_type(quant_tag(name) or getattr(entry, "hub_quant", "")) if name else ""


def default_runs(block_type: str, device: str) -> dict:
    """Whether a quant of ``block_type`` runs on ``device`` here (:func:`runtime.quant_support`), as a dict."""
    import runtime

    return runtime.quant_support(block_type, device).to_dict()


def layer_windows(shape: Any) -> list[int | None] | None:
    """Each layer's sliding window in tokens (None: it sees the whole context): a GGUF shape's
    own ``windows``, else a catalog entry's ``sliding_layers`` of ``sliding_window``. Without
    them Gemma 3 270M's fit counted a full cache on every layer (555 MB) while its card, which
    counts the windows, said 63 MiB of cache."""
    windows = getattr(shape, "windows", None)
    if windows is not None:
        return list(windows)
    window, sliding = int(getattr(shape, "sliding_window", 0) or 0), int(getattr(shape, "sliding_layers", 0) or 0)
    if not window or not sliding:
        return None
    return [window] * sliding + [None] * (int(shape.n_layers) - sliding)


def default_device(loaded: str = "") -> str:
    """The device a fit is planned for: the loaded model's, else what the runtime would pick."""
    if loaded:
        return loaded
    import runtime

    names = [name for name, _label in runtime.available_devices()]
    return next((n for prefix in ("cuda", "mps") for n in names if n.startswith(prefix)), "cpu")


@dataclass
class HubService:
    """What the browser calls (the real ones by default)."""

    search: Callable = field(default_factory=lambda: models.hub.search)
    listing: Callable = field(default_factory=lambda: models.hub.repo_listing)
    shape: Callable = field(default_factory=lambda: models.hub.remote_shape)
    fetch: Callable = field(default_factory=lambda: models.hub.fetch_hub)
    fit: Callable = default_fit
    runs: Callable = default_runs
    device: Callable[[], str] = default_device
    #: The settings the next load runs with, as :func:`default_fit`'s keywords (``{}``: the defaults).
    load_options: Callable[[], dict] = dict

    def fit_here(self, size_bytes: int, shape: Any, context: int, device: str, block_type: str | None = None) -> dict:
        """:attr:`fit` with the settings of :attr:`load_options`."""
        return self.fit(size_bytes, shape, context, device, block_type=block_type, **self.load_options())


def open_repo(service: HubService, repo_id: str) -> dict:
    """A repo's files with sizes, quants and fits on this machine (:func:`models.hub.report.files_report`).

    Raises:
        models.HubError: the listing failed (offline, not found...).
    """
    from models.hub.report import files_report

    device = service.device()
    return files_report(repo_id, listing=service.listing, shape=service.shape,
                        fit=lambda size, shape, context, block_type: service.fit_here(size, shape, context, device,
                                                                                      block_type=block_type),
                        runs=lambda block_type: service.runs(block_type, device))


class Job(QObject):
    """Runs ``fn(*args)`` once on its own thread; ``done`` carries the result, ``failed`` one
    line and a kind (``models.HubError.kind``, ``"cancelled"``, or ``"error"``)."""

    done = Signal(object)
    failed = Signal(str, str)
    progress = Signal(int, int)     # done bytes, total bytes
    ended = Signal()                # after done or failed

    def __init__(self, fn: Callable, *args: Any, wants_progress: bool = False):
        super().__init__()
        self.fn, self.args, self.wants_progress = fn, args, wants_progress
        self.cancel_event = threading.Event()

    @Slot()
    def run(self) -> None:
        try:
            if self.wants_progress:
                result = self.fn(*self.args, progress=self.progress.emit, cancel=self.cancel_event.is_set)
            else:
                result = self.fn(*self.args)
        except models.FetchCancelled as exc:
            self.failed.emit(str(exc), "cancelled")
        except models.HubError as exc:
            log.info("hub job failed: %s", exc)
            self.failed.emit(str(exc), exc.kind)
        except models.FetchError as exc:
            self.failed.emit(str(exc), "error")
        except Exception as exc:  # noqa: BLE001 - one line for the user, the traceback to the log
            log.exception("hub job failed")
            self.failed.emit(f"{type(exc).__name__}: {exc}; see the log for details", "error")
        else:
            self.done.emit(result)
        finally:
            self.ended.emit()


class JobRunner(QObject):
    """Starts jobs on their own QThreads, quits each when it ends, and waits for them all in
    :meth:`shutdown` (a dialog closing, a test ending)."""

    def __init__(self, parent: QObject | None = None):
        super().__init__(parent)
        self._running: dict[Job, QThread] = {}

    def start(self, job: Job, name: str) -> Job:
        job.ended.connect(self._reap)  # a slot of this GUI-thread object: queued, runs here
        self._running[job] = start_thread(name, job, job.run)
        return job

    @Slot()
    def _reap(self) -> None:
        thread = self._running.pop(self.sender(), None)
        if thread is not None:
            thread.quit()
            thread.wait()

    @property
    def busy(self) -> bool:
        return bool(self._running)

    def shutdown(self) -> None:
        """Cancel what can be cancelled (downloads) and wait for every job's thread."""
        for job, thread in list(self._running.items()):
            job.cancel_event.set()
            thread.quit()
            thread.wait()
        self._running.clear()
