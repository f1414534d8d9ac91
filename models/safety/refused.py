"""The error every rule of :mod:`models.safety` raises. Stdlib only."""
from __future__ import annotations


class Refused(ValueError):
    """A model file, folder, chat template or key file attnchat will not use, or a render
    it stopped. ``str()`` is one line: what was wrong, what to do.

    Attributes:
        kind: which rule: ``"pickle"``, ``"gguf"`` (metadata past the scan's limits),
            ``"custom_code"``, ``"json"`` (a JSON file that cannot be checked),
            ``"key_file"``, or a template's ``"memory"``, ``"timeout"``, ``"output"``,
            ``"template"`` (it raised), ``"unavailable"`` (the sandbox could not start).
    """

    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind
