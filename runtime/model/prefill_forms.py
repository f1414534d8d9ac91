"""The prefill kernels' forms of a GGUF's blocks, built in a background thread after a load.
Must not import Qt.

A prefill kernel that holds a form beside the file's blocks (int4pack's repack) needs it
made from every matrix first: 1.45 s of the default model's 3.3 s load on a quiet 2-core
AMD EPYC Zen 3, for 120 Q4_1 matrices. Nothing else waits for it: the decode kernels read
the blocks themselves. So a load hands the forms to :class:`PrefillForms`, which builds them
in a thread (torch's ops release the GIL) while each layer prefills through its type's
default copy-free kernel (:func:`runtime.kernels.quant_choice.kernel_pairs`' first pair:
``widen``, exact float32 products of the blocks); once every form is made, every layer
switches to the chosen kernel together. A prompt read before that gets the same answers
(the default-answer test asks both kernels) with other roundings in its logits.
"""
from __future__ import annotations

import atexit
import logging
import threading
from typing import Callable

import torch

from runtime.kernels import quantized as qk

__all__ = ["PrefillForms"]

log = logging.getLogger(__name__)


class PrefillForms:
    """The forms some layers' prefill kernels wait for, and the switch to those kernels.

    :meth:`add` records a layer's part whose chosen prefill kernel needs a form not made yet;
    :meth:`start` builds them all in a daemon thread, then calls each layer's ``switch``.
    A layer that got another choice since (:meth:`QuantLinear.set_choice`) ignores the switch.

    Attributes:
        ready: set once every form is made and the layers switched, or the build failed
            (:attr:`state` says which).
        state: ``"pending"`` (not started), ``"building"``, ``"ready"`` or ``"failed"``
            (the build raised, or the process is ending: prefill stays on the copy-free
            kernels, right and slower).
    """

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.ready = threading.Event()
        self.state = "pending"
        self._todo: list[tuple[object, str]] = []  # (weight, kernel)
        self._switches: list[Callable[[], None]] = []
        self._thread: threading.Thread | None = None
        self._stop = False

    def __len__(self) -> int:
        return len(self._todo)

    def add(self, weight, kernel: str) -> None:
        """Build ``kernel``'s form of ``weight`` (a :class:`QuantWeight`) in the background."""
        self._todo.append((weight, kernel))

    def on_ready(self, switch: Callable[[], None]) -> None:
        """Call ``switch()`` (from the builder's thread) once every form is made."""
        self._switches.append(switch)

    def start(self) -> "PrefillForms":
        """Build the forms in a daemon thread; with nothing to build, ready at once."""
        if not self._todo:
            self._finish("ready")
            return self
        self.state = "building"
        self._stop = False
        self._thread = threading.Thread(target=self._build, name="attnchat-prefill-forms", daemon=True)
        # a process that ends while torch runs in a thread aborts ("terminate called without an
        # active exception"): at exit the builder stops after the form it is making
        atexit.register(self._stop_now)
        self._thread.start()
        return self

    def _stop_now(self) -> None:
        self._stop = True
        self._thread.join()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until :attr:`ready` (or ``timeout`` seconds); whether the forms are in use."""
        self.ready.wait(timeout)
        return self.state == "ready"

    def _build(self) -> None:
        try:
            with torch.no_grad():   # ordinary tensors, as forms made at a load are
                for weight, kernel in self._todo:
                    if self._stop:
                        self._finish("failed")
                        return
                    qk.prepared(weight, kernel, self.device)
            for switch in self._switches:
                switch()
        except Exception:  # noqa: BLE001 - the copy-free kernels stay: replies right, prompts slower
            log.warning("the prefill kernels' forms could not be built; prompts keep the copy-free kernels",
                        exc_info=True)
            self._finish("failed")
            return
        from runtime.device import trim_heap

        trim_heap()  # the repacks' temporaries, as a load made at once trims them
        extra = sum(w.extra_bytes for w in {id(w): w for w, _ in self._todo}.values())
        log.info("prefill forms ready: %d matrices, %.0f MB beside the file's blocks", len(self._todo), extra / 1e6)
        self._finish("ready")

    def _finish(self, state: str) -> None:
        self.state = state
        self._todo, self._switches = [], []
        self.ready.set()
        if self._thread is not None:
            atexit.unregister(self._stop_now)
